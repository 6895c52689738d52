"""The host-split driver: a decode step (or a short prefill call) run layer by layer from Python, so that the
CPU's share of a layer's misses is computed by the host kernel called directly, not through a callback inside
the step.

Source of the idea: FreeToken's CPU misses and bandwidth-adaptive split (DESIGN.md 1.2). Inside one decode
program (the layer scan) the CPU's share goes through two ``io_callback`` calls per layer; on the H200 that
round trip cost ~2.4 ms per layer whatever the kernel (docs/MISS_POLICY.md), more than a layer's misses take
over PCIe, so the calibrated split always fetched. Here each layer is two programs and one host step:

    front l:   layer l-1's MoE block finished with its merged expert outputs, layer l's token mixer, its
               router and the split of its misses (``miss_policy.plan_split``: the slot table updated)
    device l:  the fetched misses copied into their slots, the device's (token, k) expert outputs
               (``compute.gather_outputs``)
    host l:    read x and the CPU's expert ids (waits for front l only), the host kernel's FFNs
               (``cpu_experts`` "xla" / "rows" / "native" kernels), their outputs handed to front l+1 as a
               numpy argument (put on the device by that call)

The host's read of front l's outputs is started first (``copy_to_host_async``), then ``device l`` is dispatched,
then the host waits for the read: the copies run on the GPU while the CPU computes; front l+1 waits for both.
The arithmetic is the scan's: the same plan, the same device expression, the same host kernel, the same
merge (``miss_policy.merge_cpu_outputs``) -- only the program boundaries differ (in 16-bit dtypes the device's
per-pair outputs are rounded to the compute dtype where they leave ``device l``; float32 logits are
bit-identical: tests/test_host_split.py). A decode step here costs a host round trip per layer (a
device-to-host read of a few KB and a few dispatches) instead of a callback's; decode blocks (several steps
per program) do not apply.

Chosen by ``MissPolicyConfig.cpu_driver = "host"`` for calls whose split uses the CPU (``CallPlanner.plan``:
decode steps and prefill calls of at most ``GATHER_MAX_PAIRS`` pairs, without a KV hook); longer prefill calls
and fetch-only splits keep their drivers.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ftjax import model as model_lib
from ftjax.experts import miss_policy, offload
from ftjax.experts.compute import gather_outputs
from ftjax.experts.fetch import fetch_experts
from ftjax.layers import moe
from ftjax.runtime.call_programs import device_spec, embed_program, head_program, layer_idx, stack
from ftjax.runtime.step import StepOptions
from ftjax.seams import ForwardOut, LayerCarry, LayerIndex


class Handoff(NamedTuple):
    """What front l hands the host and the programs after it (device arrays).

    x: [N, D] the layer's normed MoE input; ids: int32 [N, k]; weights: [N, k]; slot_of_expert: int32 [E];
    fetch_flat, fetch_slots: int32 [E], the misses to copy and their slots (first ``n_fetch`` valid);
    n_fetch: int32 []; on_cpu: bool [E]; cpu_rank: int32 [E]; cpu_flat: int32 [C] (first ``n_cpu`` valid);
    n_cpu: int32 [].
    """

    x: jax.Array
    ids: jax.Array
    weights: jax.Array
    slot_of_expert: jax.Array
    fetch_flat: jax.Array
    fetch_slots: jax.Array
    n_fetch: jax.Array
    on_cpu: jax.Array
    cpu_rank: jax.Array
    cpu_flat: jax.Array
    n_cpu: jax.Array


class Finish(NamedTuple):
    """What finishes layer l's MoE block in front l+1: y_dev [N, k, D] (device outputs), y_cpu [C, N, D]
    (host outputs), and the routing and CPU rows of its :class:`Handoff` (ids, weights, on_cpu, cpu_rank)."""

    y_dev: jax.Array
    y_cpu: jax.Array
    ids: jax.Array
    weights: jax.Array
    on_cpu: jax.Array
    cpu_rank: jax.Array


@dataclasses.dataclass(frozen=True)
class FrontOptions:
    """Static options of a front program: step (the call's ``StepOptions``; its ``miss`` is the split), kind
    (the layer to start, None: the last layer is only finished), prev_kind (the layer to finish first, None:
    layer 0 starts from the embedding)."""

    step: StepOptions
    kind: str | None
    prev_kind: str | None


#: The host-side phases of a layer that :class:`HostSplitTimes` times, in order.
PHASES = ("front", "device", "read", "cpu")


@dataclasses.dataclass
class HostSplitTimes:
    """Where the host's time goes in the host-split driver's calls (an engine keeps one; ``Engine.expert_cache_metrics``
    reports it under ``host_split``), seconds of wall time summed over the calls' layers:

    front: dispatching front l (argument handling and the put of layer l-1's CPU outputs, a numpy argument; the
    program runs asynchronously), and the last front program, which finishes the last layer; device:
    dispatching device l; read: the device-to-host read of x and the CPU ids, which waits for front l (so for
    device l-1) to finish on the device; cpu: the host kernel. What the host does not spend here it spends
    between layers (Python) or in the embedding and head. A call that raises adds nothing.
    """

    calls: int = 0
    layers: int = 0
    seconds: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    call_s: float = 0.0

    def summary(self) -> dict:
        """calls, layers, total seconds per phase, milliseconds per layer per phase (``per_layer_ms``), the calls'
        wall seconds and the per-layer milliseconds the phases leave unaccounted (``other_per_layer_ms``)."""
        n = max(self.layers, 1)
        per = {k: 1e3 * v / n for k, v in self.seconds.items()}
        return {"calls": self.calls, "layers": self.layers, "seconds": dict(self.seconds), "per_layer_ms": per,
                "call_s": self.call_s, "other_per_layer_ms": 1e3 * self.call_s / n - sum(per.values())}


def _layer_weights(cfg, params, kind: str, idx: LayerIndex, token_shape: tuple) -> dict:
    stacked = model_lib.stacked_weights(cfg, params["layers"], token_shape)
    return model_lib.layer_params(cfg, params["layers"], kind, idx, stacked)


@functools.partial(jax.jit, static_argnames=("cfg", "opts"), donate_argnames=("cache", "state"))
def front_program(params, state, h, cache, inputs, idx, prev_idx, finish, *, cfg, opts: FrontOptions):
    """Layer ``prev_idx``'s MoE block finished with ``finish`` (a :class:`Finish`; with ``opts.prev_kind``),
    then layer ``idx``'s token mixer and MoE router up to its split (with ``opts.kind``).

    h: [B, T, D] the residual stream (layer ``prev_idx``'s after its mixer, or the embedding); idx, prev_idx:
    ``LayerIndex`` of int32 [] scalars. Returns (h [B, T, D]: layer ``idx``'s residual stream after its mixer,
    or without ``opts.kind`` the finished layer's output; the cache; the expert state, its table updated; the
    :class:`Handoff` and ``LayerStats`` of layer ``idx``, None without ``opts.kind``)."""
    step, shape = opts.step, h.shape[:2]
    e = cfg.num_experts
    with step.tracing():
        if opts.prev_kind is not None:
            merged = lambda st, layer, r: (miss_policy.merge_cpu_outputs(  # noqa: E731
                finish.y_dev, finish.ids, finish.weights, finish.on_cpu, finish.cpu_rank, finish.y_cpu, r.x.dtype),
                st, None)
            lp = _layer_weights(cfg, params, opts.prev_kind, prev_idx, shape)
            h, _, _ = moe.block(cfg, lp, h, prev_idx, merged, state, inputs)
        if opts.kind is None:
            return h, cache, state, None, None
        lp = _layer_weights(cfg, params, opts.kind, idx, shape)
        carry, _ = model_lib.token_mixer(cfg, opts.kind, lp, idx, LayerCarry(h, cache, state, None), inputs)
        captured = []

        def split(st, layer, r):
            routed, table, recency = offload.layer_routing(step.mode, st, layer, r, e)
            p = miss_policy.plan_split(step.miss, table, layer, routed, r, step.policy, st.last_routed)
            captured.append(Handoff(r.x, r.ids, r.weights, p.look.slot_of_expert, p.fetch_flat, p.look.miss_slots,
                                    p.look.n_miss, p.on_cpu, p.cpu_rank, p.cpu_flat, p.n_cpu))
            return jnp.zeros_like(r.x), st.replace(table=p.look.table, last_routed=recency), p.stats

        _, state, stats = moe.block(cfg, lp, carry.h, idx, split, carry.expert_state, inputs)
    return carry.h, carry.cache, state, captured[0], stats


@functools.partial(jax.jit, static_argnames=("opts",), donate_argnames=("state",))
def device_program(banks, state, handoff: Handoff, *, opts: StepOptions):
    """Layer l's device share: its fetched misses copied into their slots (none under the cpu policy), then the
    per-(token, k) outputs of its experts from the pool, [N, k, D] (pairs of CPU experts hold junk, replaced in
    the merge). Returns (expert state, y_dev)."""
    with opts.tracing():
        if opts.miss.policy != "cpu":
            state = fetch_experts(banks, state, handoff.fetch_flat, handoff.fetch_slots, handoff.n_fetch)
        y = gather_outputs(handoff.x, handoff.slot_of_expert[handoff.ids], state.gate_up, state.down, state.scales,
                           state.fmt)
    return state, y


class HostSplitDriver:
    """The host-split driver (module docstring): decode calls, and prefill calls short enough for the split
    (``MissConfig.fetches_all`` false), without a KV hook."""

    name = "host_split"

    @staticmethod
    def _kernel(plan):
        miss = plan.opts.miss
        if plan.opts.kv is not None or plan.opts.stream:
            raise ValueError("the host-split driver runs calls without a KV hook or streamed layers")
        if miss is None or miss.cpu is None or miss.cpu.kernel is None:
            raise ValueError("the host-split driver needs a cpu / adaptive miss policy with a host kernel "
                             "(cpu_impl one of ftjax.experts.cpu_experts.CALLBACK_IMPLS)")
        return miss.cpu.kernel

    def _steps(self, ctx, plan):
        """The (front options, layer index, previous index) of each front program of the call, in order."""
        st = model_lib.structure(ctx.cfg)
        idx = [layer_idx(st, l) for l in range(ctx.cfg.num_layers)]
        out = []
        for l in range(ctx.cfg.num_layers + 1):
            kind = st.kinds[l] if l < ctx.cfg.num_layers else None
            prev = st.kinds[l - 1] if l > 0 else None
            out.append((FrontOptions(plan.opts, kind, prev), idx[l] if kind else idx[l - 1],
                        idx[l - 1] if l else idx[0]))
        return out

    def precompile(self, ctx, plan, a) -> None:
        """Compiles the embed, front (one per pair of kinds met), device, head and stacking programs that
        :meth:`run` calls with these arguments; nothing runs, nothing is donated."""
        self._kernel(plan)
        cfg = ctx.cfg
        tokens, start, valid = (jnp.asarray(x, jnp.int32) for x in (a.tokens, a.start, a.valid))
        ctx.compile(embed_program, (ctx.params, tokens, start, valid))
        h, inputs = jax.tree.map(device_spec, jax.eval_shape(model_lib.embed_inputs, ctx.params, tokens, start, valid))
        finish, seen, stats = (), set(), None
        for opts, idx, prev_idx in self._steps(ctx, plan):
            if (opts.kind, opts.prev_kind) in seen:  # the same program and shapes as a layer before
                continue
            seen.add((opts.kind, opts.prev_kind))
            args = (ctx.params, a.state, h, a.cache, inputs, idx, prev_idx, finish)
            ctx.compile(front_program, args, compiler_options=plan.compiler_options, cfg=cfg, opts=opts)
            if opts.kind is None:
                continue
            out = jax.eval_shape(functools.partial(front_program, cfg=cfg, opts=opts), *args)
            h, handoff, stats = (jax.tree.map(device_spec, x) for x in (out[0], out[3], out[4]))
            if not finish:
                dev_args = (ctx.banks, a.state, handoff)
                ctx.compile(device_program, dev_args, compiler_options=plan.compiler_options, opts=plan.opts)
                y_dev = device_spec(jax.eval_shape(functools.partial(device_program, opts=plan.opts), *dev_args)[1])
                y_cpu = device_spec(jax.ShapeDtypeStruct(handoff.cpu_flat.shape + handoff.x.shape, handoff.x.dtype))
            finish = Finish(y_dev, y_cpu, handoff.ids, handoff.weights, handoff.on_cpu, handoff.cpu_rank)
        ctx.compile(head_program, (ctx.params, h, valid), compiler_options=plan.compiler_options, cfg=cfg,
                    opts=plan.opts)
        ctx.compile(stack, ([stats] * cfg.num_layers,))

    def run(self, ctx, plan, a) -> ForwardOut:
        """Runs one call layer by layer (module docstring); the same result as the layer scan's. The KV cache and
        expert state are consumed (donated). Returns a ``ForwardOut`` (stats stacked over layers)."""
        kernel = self._kernel(plan)
        cfg = ctx.cfg
        times = ctx.host_times if ctx.host_times is not None else HostSplitTimes()
        clock = time.perf_counter
        t_call, call_s = clock(), dict.fromkeys(PHASES, 0.0)
        tokens, start, valid = (jnp.asarray(x, jnp.int32) for x in (a.tokens, a.start, a.valid))
        h, inputs = ctx.compile(embed_program, (ctx.params, tokens, start, valid))(ctx.params, tokens, start, valid)
        state, cache, finish, stats = a.state, a.cache, (), []
        options = plan.compiler_options  # the decode programs' XLA options (plan.decode_compiler_options)
        fronts, device, zeros = {}, None, None
        for opts, idx, prev_idx in self._steps(ctx, plan):
            args = (ctx.params, state, h, cache, inputs, idx, prev_idx, finish)
            key = (opts.kind, opts.prev_kind)
            if key not in fronts:  # one program-cache lookup per pair of kinds, not per layer
                fronts[key] = ctx.compile(front_program, args, compiler_options=options, cfg=cfg, opts=opts)
            del args
            t0 = clock()
            h, cache, state, handoff, s = fronts[key](ctx.params, state, h, cache, inputs, idx, prev_idx, finish)
            front_s = clock() - t0
            if opts.kind is None:  # the last layer finished (and its CPU outputs put): no layer of its own
                call_s["front"] += front_s
                break
            stats.append(s)
            # the host's read of this layer's split starts now, ahead of device l in the device's queues (issued
            # after it, the read could wait for device l's copies); device l is dispatched before the host waits
            # for that read, so its copies run while the CPU computes
            for arr in (handoff.x, handoff.cpu_flat, handoff.n_cpu):
                arr.copy_to_host_async()
            if device is None:
                device = ctx.compile(device_program, (ctx.banks, state, handoff), compiler_options=options,
                                     opts=plan.opts)
            t1 = clock()
            state, y_dev = device(ctx.banks, state, handoff)
            t2 = clock()
            x, cpu_flat, n_cpu = jax.device_get((handoff.x, handoff.cpu_flat, handoff.n_cpu))
            t3 = t4 = clock()
            if int(n_cpu) > 0:
                # a numpy argument: the next front program's call puts it on the device in its own (C++) dispatch,
                # ~0.1 ms a layer less host time than a jax.device_put of its own. Every host kernel returns a
                # fresh array (the put may read it after the call returns; nothing writes it again).
                y_cpu = np.asarray(kernel.compute(x, cpu_flat, n_cpu))
                t4 = clock()
            else:  # no CPU expert: the merge reads none of it
                if zeros is None:
                    zeros = jnp.zeros(cpu_flat.shape + x.shape, x.dtype)
                y_cpu = zeros
            finish = Finish(y_dev, y_cpu, handoff.ids, handoff.weights, handoff.on_cpu, handoff.cpu_rank)
            for phase, dt in zip(PHASES, (front_s, t2 - t1, t3 - t2, t4 - t3)):
                call_s[phase] += dt
        logits = ctx.compile(head_program, (ctx.params, h, valid), compiler_options=plan.compiler_options, cfg=cfg,
                             opts=plan.opts)(ctx.params, h, valid)
        out = ForwardOut(logits, cache, state, ctx.compile(stack, (stats,))(stats), None)
        times.calls += 1  # a call that raised counts in no field: its layers are not added either
        times.layers += len(stats)
        for phase, dt in call_s.items():
            times.seconds[phase] += dt
        times.call_s += clock() - t_call
        return out


__all__ = ["Finish", "FrontOptions", "Handoff", "HostSplitDriver", "HostSplitTimes", "PHASES", "device_program",
           "front_program"]
