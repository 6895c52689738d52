"""The two drivers that run a call's layers: the layer scan and the layer-pipelined driver.

Both run the same decoder layer (``ftjax.model.decoder_layer``) for any layer pattern, and each offers
the same two operations on a :class:`ftjax.runtime.plan.CallPlan`: ``precompile`` (every program the
call will run, compiled through the engine's program cache, nothing run) and ``run`` (the call, its
cache and expert state donated). :func:`driver` picks one by the plan.

* :class:`ScanDriver`: one program (``ftjax.runtime.step.forward_step``), a ``jax.lax.scan`` over the
  blocks of the layer pattern. Decode steps and every call on the CPU run here.
* :class:`PipelinedDriver`: one program per layer, dispatched from Python, with the next layer's
  host copies issued before the current layer's program so that they run on the copy engine while it
  computes (docs/OVERLAP.md has the measurements that chose it):

      embed program -> [layer program l, issued after layer l+1's host copies] x L -> head program

  The host copies are whole contiguous slices of the host arrays (``ftjax.runtime.transfers``): a
  streamed layer's E experts (FreeToken's full-layer double buffering, DESIGN.md 1.3: the buffer layer
  l reads and the one being filled for l+1 are this driver's state), and a reused prefix's rows of
  layer l in every stored KV chunk. Streamed layers compute from their buffer directly: no slot of the
  pool is borrowed and the slot cache is left as it was. With ``EngineConfig.stream_d2d_hits`` a
  layer's experts that sit in the slot cache are gathered device to device and only the others cross
  PCIe (``transfers.ExpertCopies``). With ``EngineConfig.prefix_copy="in_program"`` layer l's program
  copies layer l+1's prefix slices itself.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from ftjax import memory
from ftjax import model as model_lib
from ftjax.experts import offload
from ftjax.kv.layerwise import LayerwiseKV
from ftjax.runtime import transfers
from ftjax.runtime.plan import CallPlan
from ftjax.runtime.step import StepOptions, forward_step
from ftjax.runtime.call_programs import device_spec, embed_program, head_program, layer_idx, stack
from ftjax.runtime.host_split import HostSplitDriver
from ftjax.runtime.transfers import _UINT, ExpertCopies, ExpertLayerSource, PrefixLayerSource
from ftjax.seams import ForwardOut, KVCache, LayerCarry, LayerIndex


@dataclasses.dataclass
class CallArgs:
    """The arguments of one call: tokens int32 [B, T], start and valid int32 [B] (numpy or device),
    the KV cache and expert state (donated to the call), and the reused prefix's chunks (``()``)."""

    tokens: Any
    start: Any
    valid: Any
    cache: KVCache
    state: Any
    prefix: tuple = ()


@dataclasses.dataclass
class RunContext:
    """What the drivers read of an engine: its program cache (``compile(fn, args, compiler_options=(),
    **static)``), the model's config, params and host banks, the engine config, the banks' per-layer
    pieces (made on first use), the layers per prefix copy group, and where the host-split driver adds up its
    host time (``host_split.HostSplitTimes``; None: not kept)."""

    compile: Callable
    cfg: Any
    params: Any
    banks: Any
    config: Any
    expert_source: Callable[[], ExpertLayerSource]
    prefix_rows: int
    host_times: Any = None


class ScanDriver:
    """The layer scan: the call as one program (``forward_step``)."""

    name = "scan"

    def _args(self, ctx: RunContext, a: CallArgs) -> tuple:
        return (ctx.params, ctx.banks, a.cache, a.state, a.tokens, a.start, a.valid, tuple(a.prefix))

    def precompile(self, ctx: RunContext, plan: CallPlan, a: CallArgs) -> None:
        ctx.compile(forward_step, self._args(ctx, a), compiler_options=plan.compiler_options, cfg=ctx.cfg,
                    opts=plan.opts)

    def run(self, ctx: RunContext, plan: CallPlan, a: CallArgs) -> ForwardOut:
        args = self._args(ctx, a)
        exe = ctx.compile(forward_step, args, compiler_options=plan.compiler_options, cfg=ctx.cfg, opts=plan.opts)
        return exe(*args)


# ---- the layer-pipelined driver -----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LayerOptions:
    """Static options of one layer program (hashable). step: the call's ``StepOptions`` (its ``stream``
    means: experts from the given buffer); kind: the layer's kind (``ftjax.layers``); has_prefix: the
    call hands the layer its slices of a reused prefix; d2d: the buffer's experts that the slot table
    maps were copied device to device (the stats count them); prefix_next: the program also copies the
    next layer's prefix slices from host memory (``EngineConfig.prefix_copy`` "in_program")."""

    step: StepOptions
    kind: str = "attention"
    has_prefix: bool = False
    d2d: bool = False
    prefix_next: bool = False


def _hook(opts: LayerOptions) -> LayerwiseKV | None:
    kv = opts.step.kv
    if kv is None:
        return None
    # prefix slices arrive as the layer's xs (already on the device); new chunks stay on the device
    # and the driver moves them to host memory after stacking them over layers
    return kv.hook((), variant="xs", store_to_host=False)


def _group_row(x: jax.Array, layer: jax.Array) -> jax.Array:
    """Layer ``layer``'s row of a prefix copy group ``x`` [G, ...] (groups start at multiples of G)."""
    if x.shape[0] == 1:
        return x[0]
    return jax.lax.dynamic_index_in_dim(x, layer % x.shape[0], 0, keepdims=False)


@functools.partial(jax.jit, static_argnames=("cfg", "opts"), donate_argnames=("cache", "state"))
def layer_program(params, banks, state, h, cache, inputs, idx, expert_buffer, prefix_slices, next_prefix=(),
                  *, cfg, opts: LayerOptions):
    """One decoder layer as its own program: ``model.decoder_layer`` of kind ``opts.kind`` on layer
    ``idx`` (``LayerIndex`` of int32 [] scalars) of ``params["layers"]``. expert_buffer: the layer's E
    experts on the device (streamed calls) or ``()``; prefix_slices: the reused-prefix rows of each chunk
    for the layer's copy group ([G, 2, C, Hkv, hd] each, on the device; the layer's row is ``layer % G``)
    or ``()``; next_prefix: the next layer's rows in host memory (``opts.prefix_next``) or ``()``, copied
    to the device by this program. Returns (h, cache, state, stats, kv_out) as one layer of the scan
    would, then the device copies of ``next_prefix`` (a tuple, empty without it)."""
    # whole host arrays moved inside one program get asynchronous copies (copy-start / copy-done)
    # that XLA overlaps with the layer's compute (DESIGN.md section 3)
    next_prefix = tuple(jax.device_put(x, jax.memory.Space.Device) for x in next_prefix)
    step = opts.step
    # copies of pinned_alias arrays arrive as unsigned integers of the same width: bitcast back (free)
    expert_buffer = transfers._as_dtypes(expert_buffer, (banks.gate_up.dtype, banks.down.dtype)
                                         + tuple(x.dtype for x in banks.scales or ()))
    prefix_slices = tuple(_group_row(x, idx.layer) for x in
                          transfers._as_dtypes(prefix_slices, [cache.k.dtype] * len(prefix_slices)))
    with step.tracing():
        if step.stream:
            expert_fn = offload.make_layer_buffer_expert_fn(cfg.num_experts, expert_buffer, banks.fmt, opts.d2d)
        else:
            expert_fn = offload.make_expert_fn(step.mode, cfg.num_experts, banks, step.policy, step.miss)
        lp = model_lib.layer_params(cfg, params["layers"], opts.kind, idx)
        carry = LayerCarry(h, cache, state, None)
        carry, (stats, kv_out) = model_lib.decoder_layer(cfg, opts.kind, lp, idx, carry, inputs, expert_fn,
                                                         _hook(opts), prefix_slices or None)
    return carry.h, carry.cache, carry.expert_state, stats, kv_out, next_prefix


class PipelinedDriver:
    """The layer-pipelined driver (module docstring)."""

    name = "pipelined"

    def _opts(self, ctx: RunContext, plan: CallPlan, a: CallArgs, kind: str) -> LayerOptions:
        has_prefix = bool(a.prefix)
        in_program = has_prefix and ctx.config.prefill_overlap and ctx.config.prefix_copy == "in_program"
        return LayerOptions(plan.opts, kind, has_prefix, plan.d2d and a.state.table is not None, in_program)

    def precompile(self, ctx: RunContext, plan: CallPlan, a: CallArgs) -> None:
        """Compiles the embed, layer (one per kind) and head programs that :meth:`run` will call with these
        arguments (nothing runs, nothing is donated); with D2D hits also the device-to-device programs,
        and the block pieces of the slot table as it is now (one small device-to-host read of the table)."""
        cfg, st = ctx.cfg, model_lib.structure(ctx.cfg)
        tokens, start, valid = (jnp.asarray(x, jnp.int32) for x in (a.tokens, a.start, a.valid))
        ctx.compile(embed_program, (ctx.params, tokens, start, valid))
        h, inputs = jax.tree.map(device_spec, jax.eval_shape(model_lib.embed_inputs, ctx.params, tokens, start, valid))
        experts = ctx.expert_source() if plan.opts.stream else None
        buffer = experts.spec() if experts is not None else ()
        alias = memory.backend() == "gpu"  # host prefix chunks arrive as pinned aliases there (uint dtypes)
        opts = None
        for kind in dict.fromkeys(st.pattern):
            opts = self._opts(ctx, plan, a, kind)
            rows = 1 if opts.prefix_next else ctx.prefix_rows
            slices = tuple(jax.ShapeDtypeStruct((rows,) + tuple(c.shape[1:]), _UINT[jnp.dtype(c.dtype).itemsize]
                                                if alias else c.dtype, sharding=memory.device_sharding())
                           for c in a.prefix)
            index = jax.ShapeDtypeStruct((), jnp.int32, sharding=memory.device_sharding())
            args = (ctx.params, ctx.banks, a.state, h, a.cache, inputs, LayerIndex(index, index), buffer, slices, ())
            ctx.compile(layer_program, args, cfg=cfg, opts=opts)  # without a next layer: the last one
            if opts.prefix_next:  # the others also copy the next layer's slices, from host memory
                host = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=memory.host_sharding()) for x in slices)
                ctx.compile(layer_program, args[:-1] + (host,), cfg=cfg, opts=opts)
            out = jax.tree.map(device_spec, jax.eval_shape(functools.partial(layer_program, cfg=cfg, opts=opts),
                                                            *args))
            stats, kv_out = out[3], out[4]
        ctx.compile(head_program, (ctx.params, h, valid), cfg=cfg, opts=plan.opts)
        # what run() does after the layers, and the layer-index scalars, made here, outside any timing
        ctx.compile(stack, ([stats] * cfg.num_layers,))
        if kv_out is not None:
            ctx.compile(stack, ([kv_out] * cfg.num_layers,))
        for l in range(cfg.num_layers):
            layer_idx(st, l)
        if opts.d2d:
            ExpertCopies(ctx.compile, experts, experts.host_slots(a.state.table.slot_of)).precompile(a.state)

    def run(self, ctx: RunContext, plan: CallPlan, a: CallArgs) -> ForwardOut:
        """Runs one prefill call layer by layer; the same result as the scan's. With ``EngineConfig.
        prefill_overlap`` layer l+1's copies are issued before layer l's program, so they run while layer l
        computes (off: each layer's copies just before its own program, the serial ablation). The KV cache
        and expert state are consumed (donated). Returns a ``ForwardOut`` (stats stacked over layers; kv_out:
        the new chunks, each [L, 2, C, Hkv, hd], in host memory when ``plan.opts.kv.store_to_host``)."""
        cfg, st, config = ctx.cfg, model_lib.structure(ctx.cfg), ctx.config
        step, overlap = plan.opts, config.prefill_overlap
        experts = ctx.expert_source() if step.stream else None
        prefix = PrefixLayerSource(a.prefix, ctx.prefix_rows, overlap) if a.prefix else None
        state, cache = a.state, a.cache
        opts_of = {kind: self._opts(ctx, plan, a, kind) for kind in dict.fromkeys(st.pattern)}
        d2d = opts_of[st.kinds[0]].d2d
        in_program = opts_of[st.kinds[0]].prefix_next
        slot_of = experts.host_slots(state.table.slot_of) if d2d else None
        expert_copies = ExpertCopies(ctx.compile, experts, slot_of) if experts is not None else None
        tokens, start, valid = (jnp.asarray(x, jnp.int32) for x in (a.tokens, a.start, a.valid))
        h, inputs = ctx.compile(embed_program, (ctx.params, tokens, start, valid))(ctx.params, tokens, start, valid)

        def copies(l):
            # in_program: layer 0's slices are put here, layer l's (l > 0) come from layer l-1's program
            pre = () if prefix is None or (in_program and l > 0) else prefix.put(l)
            return (expert_copies.issue(l) if experts is not None else (), pre)

        def ready(part, l, state, spare=None):  # a layer with device-to-device hits is assembled on the compute stream
            return (expert_copies.ready(part[0], l, state, spare) if experts is not None else part[0], part[1])

        programs = {}

        def layer_exe(kind, args):
            # The layers of one call differ only in their kind and in which argument groups are empty (layer
            # 0's prefix slices, the last layer's next ones): look each up once, not the program cache (its
            # key walks every argument) per layer, which is Python time the GPU waits for.
            structure = (kind,) + tuple(len(x) for x in args[7:])
            if structure not in programs:
                programs[structure] = ctx.compile(layer_program, args, cfg=cfg, opts=opts_of[kind])
            return programs[structure]

        stats, kv_outs = [], []
        nxt = ready(copies(0), 0, state) if overlap else None
        spare = None  # the expert buffer of the layer dispatched last: a layer with hits is gathered into it
        copied = ()  # in_program: the previous program's copies of this layer's prefix slices
        for l in range(cfg.num_layers):
            kind = st.kinds[l]
            cur = nxt if overlap else ready(copies(l), l, state, spare)
            if in_program and l > 0:
                cur = (cur[0], copied)
            next_host = prefix.host_pieces(l + 1) if in_program and l + 1 < cfg.num_layers else ()
            spare = None
            if overlap and l + 1 < cfg.num_layers:
                # Issued *before* layer l's program: a host-to-device copy starts once the compute already
                # queued is done (here layer l-1), so it runs while layer l computes. Issued after layer l,
                # it would wait for layer l and hide nothing (measured: docs/OVERLAP.md).
                nxt = copies(l + 1)
            args = (ctx.params, ctx.banks, state, h, cache, inputs, layer_idx(st, l), *cur, next_host)
            try:
                out = layer_exe(kind, args)(*args)
            except TypeError:
                # The argument types differ from the structure's program: a piece whose pinned alias
                # could not be made (path "mixed") arrives in its real dtype, not the unsigned one.
                # The check fails before anything runs or is donated: take the program of these types.
                out = ctx.compile(layer_program, args, cfg=cfg, opts=opts_of[kind])(*args)
            h, cache, state, s, kv, copied = out
            stats.append(s)
            kv_outs.append(kv)
            spare = cur[0] if experts is not None else None
            del cur, args
            if overlap and l + 1 < cfg.num_layers:
                # Dispatched *after* layer l: assembling layer l+1's buffer waits for its PCIe blocks on
                # the compute stream, which must not hold layer l up (an identity for whole-layer copies),
                # and can write over layer l's buffer once layer l has read it.
                nxt = ready(nxt, l + 1, state, spare)
                spare = None
        if d2d:  # the streamed layers left the table as it was: the output state's is known on the host too
            experts.remember_slots(state.table.slot_of, slot_of)
        logits = ctx.compile(head_program, (ctx.params, h, valid), cfg=cfg, opts=step)(ctx.params, h, valid)
        kv_out = None
        if step.kv is not None and step.kv.store_chunks:
            kv_out = ctx.compile(stack, (kv_outs,))(kv_outs)
            if step.kv.store_to_host:
                kv_out = jax.device_put(kv_out, memory.host_sharding())
        return ForwardOut(logits, cache, state, ctx.compile(stack, (stats,))(stats), kv_out)


_DRIVERS = {"scan": ScanDriver(), "pipelined": PipelinedDriver(), "host_split": HostSplitDriver()}


def driver(plan: CallPlan) -> ScanDriver | PipelinedDriver | HostSplitDriver:
    """The driver that runs ``plan``'s call (the host-split driver: ``ftjax.runtime.host_split``)."""
    return _DRIVERS[plan.driver]
