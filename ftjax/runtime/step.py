"""The one jitted step of the layer scan, its static options, and the small programs around it.

:func:`forward_step` serves every call the scan driver runs: prefill chunks, prefix-reuse prefills
(with the layerwise KV hook) and decode steps; its static :class:`StepOptions` and the argument
shapes pick the compiled program (``ftjax.runtime.programs``). The KV cache and the expert state (slot
pools + slot table) are donated, so they are updated in place rather than copied. The kernel config
in the options is made the active one while the step is traced (``ftjax.kernels.registry.using``), so
it is part of the program's key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ftjax import model as model_lib
from ftjax.experts import fetch, miss_policy, offload, parallel, tensor_parallel
from ftjax.kernels import registry
from ftjax.kernels.registry import KernelConfig
from ftjax.kv.layerwise import KVStep
from ftjax.sampling import sample, sample_rows
from ftjax.seams import LayerStats


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """Static options of one step (hashable: they key its compiled programs).

    mode: experts mode; all_logits: logits of every position; stream: full-layer streaming of
    this call's experts; overlap: prefetch layer l+1 while layer l computes (streaming);
    policy: slot eviction policy; miss: a cpu / adaptive ``MissConfig`` or None; kv: the KV
    hook's options (``ftjax.kv.layerwise.KVStep``) or None; precision: matmul precision;
    kernels: the kernel config (``EngineConfig.kernels``); cheap_conds: a ``lax.cond`` costs this
    program no host round trip (``offload.make_expert_fn``; set per call by the plan); devices: the experts
    split over this many devices (``EngineConfig.devices``), as ``expert_split`` says (``EngineConfig.expert_split``:
    ``ftjax.experts.parallel`` or ``ftjax.experts.tensor_parallel``); prefetch: guessed experts per token a cached
    layer starts copying before its token mixer (``EngineConfig.prefetch_guesses``; 0 in calls it does not apply to).
    """

    mode: str
    all_logits: bool = False
    stream: bool = False
    overlap: bool = True
    policy: str = "lru"
    miss: miss_policy.MissConfig | None = None
    kv: KVStep | None = None
    precision: str = "default"
    kernels: KernelConfig = KernelConfig()
    cheap_conds: bool = False
    devices: int = 1
    expert_split: str = "expert"
    prefetch: int = 0

    @contextlib.contextmanager
    def tracing(self):
        """Within it, a step traces under these options' matmul precision and kernel config (``miss_copy`` as
        ``fetch.miss_copy_choice`` makes it for the devices the experts are split over)."""
        kernels = dataclasses.replace(self.kernels,
                                      miss_copy=fetch.miss_copy_choice(self.kernels.miss_copy, self.devices))
        with jax.default_matmul_precision(self.precision), registry.using(kernels):
            yield


@functools.partial(jax.jit, static_argnames=("cfg", "opts"), donate_argnames=("cache", "state"))
def forward_step(params, banks, cache, state, tokens, start, valid_len, prefix, *, cfg, opts: StepOptions):
    """One forward call of the decoder on the layer scan (a prefill chunk or a decode step).
    prefix: the reused KV chunks of a prefix-reuse call (``()`` otherwise). Returns ``model.forward``'s
    ``ForwardOut``."""
    with opts.tracing():
        if opts.devices > 1 and opts.expert_split == "tensor":  # every expert split on F (tensor_parallel)
            state, expert_fn = tensor_parallel.step_expert_fn(cfg.num_layers, cfg.num_experts, opts.mode, banks,
                                                              state, opts.devices, opts.stream, opts.overlap,
                                                              opts.policy, opts.cheap_conds)
        elif opts.devices > 1:  # whole experts split over a mesh (ftjax.experts.parallel)
            state, expert_fn = parallel.step_expert_fn(cfg.num_layers, cfg.num_experts, opts.mode, banks, state,
                                                       opts.devices, opts.stream, opts.overlap, opts.policy,
                                                       opts.cheap_conds)
        else:
            state, expert_fn = offload.step_expert_fn(cfg.num_layers, cfg.num_experts, opts.mode, banks, state,
                                                      opts.stream, opts.overlap, opts.policy, opts.miss,
                                                      opts.cheap_conds, opts.prefetch)
        hook = opts.kv.hook(prefix) if opts.kv is not None else None
        return model_lib.forward(params, cfg, tokens, start, valid_len, cache, expert_fn, state, opts.all_logits,
                                 kv_hook=hook)


class RowSampling(NamedTuple):
    """Per-row sampling inside a :func:`decode_block` (the continuous-batching scheduler's draw,
    :func:`sample_rows_next`, as each step's): keys uint32 [B, 2], each row's threefry key data, split at every
    step; temperature, top_p float32 [B]; top_k int32 [B] (``ftjax.sampling.sample_rows``'s parameters)."""

    keys: Any
    temperature: Any
    top_p: Any
    top_k: Any


class DecodeBlock(NamedTuple):
    """What :func:`decode_block` returns. tokens: int32 [B, steps], the sampled tokens of the steps run (columns
    from ``n_run`` on are 0); n_run: int32 [], steps run; last: int32 [B, 1], the last token sampled (the next
    block's input; the input tokens when no step ran); pos: int32 [B], the rows' positions after the block;
    stopped: bool [B]; stats: each step's ``LayerStats``, leaves [steps, L, ...]; logits: float32
    [steps, B, V] (``keep_logits``) or None; cache, state: the updated KV cache and expert state; key: the
    next key (a :class:`RowSampling` with each row's next key, given one); logprobs: float32 [B, steps], each
    token's log-probability under the model's distribution, with a :class:`RowSampling` (else None)."""

    tokens: jax.Array
    n_run: jax.Array
    last: jax.Array
    pos: jax.Array
    stopped: jax.Array
    stats: Any
    logits: Any
    cache: Any
    state: Any
    key: Any
    logprobs: Any = None


def fixed_loop(decode_loop: str, has_eos: bool, full: bool = True, platform: str | None = None) -> bool:
    """Whether a block of a generate runs :func:`decode_block` with ``fixed`` (``KernelConfig.decode_loop``:
    "fixed": every block; "dynamic": none; "auto": on a GPU, a full block (``full``: its limit is the program's
    steps) of a generate without EOS ids). An idle iteration costs about a whole step against ~0.25 ms a step won
    (an H100, 2026-12-06, the qwen3.5-35b-a3b 16-layer cut): a last, shorter block would spend the rest of the
    block, and with EOS ids so would the block a stop falls in (half a block on average: a loss for answers
    shorter than ~70 tokens there), so "auto" keeps the dynamic loop for those. Elsewhere (``platform``, default
    ``registry.backend()``: "cpu") "auto" is dynamic: XLA:CPU evaluates a loop's predicate on the host, so there is
    no read-back to save (the tiny preset on 2 CPU cores, 2026-12-06: fixed 0.988x dynamic), and a generate whose
    last block is shorter would compile both programs.
    Raises:
      ValueError: an unknown ``decode_loop``."""
    if decode_loop not in registry.DECODE_LOOPS:
        raise ValueError(f"unknown decode_loop {decode_loop!r}; expected one of {', '.join(registry.DECODE_LOOPS)}")
    if decode_loop != "auto":
        return decode_loop == "fixed"
    return (platform or registry.backend()) == "gpu" and not has_eos and full


@functools.partial(jax.jit, static_argnames=("cfg", "opts", "steps", "temperature", "top_p", "top_k", "keep_logits",
                                             "fixed"),
                   donate_argnames=("cache", "state"))
def decode_block(params, banks, cache, state, tokens, start, valid_len, key, limit, eos, stopped, *, cfg,
                 opts: StepOptions, steps: int, temperature: float, top_p: float, top_k: int = 0,
                 keep_logits: bool = False, fixed: bool = False) -> DecodeBlock:
    """Up to ``steps`` decode steps in one program: each step is :func:`forward_step` then :func:`sample_next`'s
    key split and draw, the token fed straight back, so one dispatch serves ``steps`` tokens (the host's
    per-step work -- argument transfers, dispatch, the sampler's own program -- is paid once a block).
    The same tokens, logits and expert-state updates as that many single steps.

    Two samplers: ``key`` a PRNG key: one key for the batch and the static ``temperature``, ``top_p``,
    ``top_k`` (:func:`sample_next`'s draw, what :meth:`ftjax.Engine.generate` runs); ``key`` a
    :class:`RowSampling`: each row its own key and parameters (:func:`sample_rows_next`'s draw, what the
    continuous-batching scheduler runs; the static ones are then ignored), with each token's log-probability.

    tokens: int32 [B, 1] each row's last token; start: int32 [B] its position; valid_len: int32 [B], 1 for
    a decoding row, 0 for an idle one (it stays idle: its position, last token and, with a
    :class:`RowSampling`, its key pass through, so a later block can take it up from there); key: the
    sampler's key (above); limit: int32 [], the steps to run (<= ``steps``: one program for every block
    length); eos: int32 [N] stop ids of every row, or [B, N] each row's own (-1 pads); stopped: bool [B]
    rows already stopped. The loop ends after ``limit`` steps or once every row has stopped (an idle row
    counts as stopped; a row stops on sampling an ``eos`` id and still decodes while others run, as it
    would step by step). Returns a :class:`DecodeBlock`.

    ``fixed``: the loop always runs ``steps`` iterations, a trip count XLA knows, so no step waits on its
    predicate being read back to the host (a data-dependent loop end costs each step a device-to-host copy and
    the relaunch of the step's kernels after it: 1.11x decode tokens/s on an H100 at the qwen3.5-35b-a3b
    16-layer cut, ``experiments/bench_decode_loop.py``). An iteration past ``limit`` or after every row
    stopped runs with every row idle (valid_len 0: nothing is sampled, no position, token, key or Gated
    DeltaNet state moves on, no expert is routed or fetched; the slot table and recency are carried through
    unchanged; K/V is written only at each row's next position, never a valid one), so the block's outputs
    and the state later calls read are the data-dependent loop's, bit for bit; those iterations' compute is
    the price (``Engine.generate``'s blocks: ``KernelConfig.decode_loop``, :func:`fixed_loop`).
    """
    b = tokens.shape[0]
    per_row = isinstance(key, RowSampling)

    def one(cache, state, tok, pos, valid):
        return forward_step(params, banks, cache, state, tok, pos, valid, (), cfg=cfg, opts=opts)

    shapes = jax.eval_shape(one, cache, state, tokens, start, valid_len)
    buffer = lambda s: jnp.zeros((steps,) + s.shape, s.dtype)  # noqa: E731
    init = dict(i=jnp.int32(0), n=jnp.int32(0), tok=tokens, pos=start, stopped=stopped | (valid_len == 0),
                cache=cache, state=state, key=key, out=jnp.zeros((b, steps), jnp.int32),
                stats=buffer(jax.eval_shape(LayerStats.packed, shapes.layer_stats)),
                logits=buffer(shapes.logits) if keep_logits else None,
                logprobs=jnp.zeros((b, steps), jnp.float32) if per_row else None)

    def cond(c):
        if fixed:  # a trip count XLA knows: no predicate read back to the host between steps
            return c["i"] < steps
        return (c["i"] < limit) & ~jnp.all(c["stopped"])

    def body(c):
        i = c["i"]
        if fixed:  # past the limit or every row stopped: an idle iteration that changes no output
            live = (i < limit) & ~jnp.all(c["stopped"])
            valid = valid_len * live.astype(valid_len.dtype)
            keep = lambda new, old: jax.tree.map(lambda a, o: jnp.where(live, a, o), new, old)  # noqa: E731
        else:
            live, valid, keep = True, valid_len, lambda new, old: new  # noqa: E731
        idle = valid == 0
        out = one(c["cache"], c["state"], c["tok"], c["pos"], valid)
        logprobs = c["logprobs"]
        if per_row:
            rs = c["key"]
            tok, keys, lp = sample_rows_next(out.logits, rs.keys, rs.temperature, rs.top_p, rs.top_k)
            key, tok = rs._replace(keys=jnp.where(idle[:, None], rs.keys, keys)), tok[:, None]
            logprobs = jax.lax.dynamic_update_slice(logprobs, keep(lp[:, None], logprobs[:, i][:, None]), (0, i))
        else:
            key, sub = jax.random.split(c["key"])
            key = keep(key, c["key"])
            tok = sample(out.logits, sub, temperature, top_p, top_k)[:, None]
        tok = jnp.where(idle[:, None], c["tok"], tok)  # an idle row's token passes through
        state = out.expert_state
        if fixed and state.table is not None:
            # an idle layer call routes nothing and fills no slot, but its lookup ticks the table's clock (LFRU's
            # decay reads the ticks) and on_demand's resets the table: the small table and recency stay as they were
            state = state.replace(table=keep(state.table, c["state"].table),
                                  last_routed=keep(state.last_routed, c["state"].last_routed))

        def put(buf, x):  # an idle iteration leaves the buffer's entry as it was
            return jax.lax.dynamic_update_index_in_dim(buf, keep(x, jax.lax.dynamic_index_in_dim(buf, i, 0, False)),
                                                       i, 0)
        new_out = keep(tok, c["out"][:, i][:, None])
        return dict(i=i + 1, n=c["n"] + jnp.int32(1) * live, tok=tok, pos=c["pos"] + valid,
                    stopped=c["stopped"] | (live & jnp.any(tok == eos, axis=-1)),
                    cache=out.cache, state=state, key=key,
                    out=jax.lax.dynamic_update_slice(c["out"], new_out, (0, i)),
                    stats=put(c["stats"], out.layer_stats.packed()),  # one write a step, not one per field
                    logits=put(c["logits"], out.logits) if keep_logits else None, logprobs=logprobs)

    c = jax.lax.while_loop(cond, body, init)
    stats = LayerStats.unpacked(c["stats"], *shapes.layer_stats.layout())
    return DecodeBlock(c["out"], c["n"], c["tok"], c["pos"], c["stopped"], stats, c["logits"], c["cache"],
                       c["state"], c["key"], c["logprobs"])


@functools.partial(jax.jit, static_argnames=("temperature", "top_p", "top_k"))
def sample_next(logits, key, temperature: float, top_p: float, top_k: int = 0):
    """(int32 [B, 1] the next tokens, shaped as the decode step's input; the next key): the key split, the
    draw (``ftjax.sampling.sample`` with a subkey) and the reshape in one program, one dispatch per decode
    step instead of three."""
    key, sub = jax.random.split(key)
    return sample(logits, sub, temperature, top_p, top_k)[:, None], key


@functools.partial(jax.jit, static_argnames=("all_greedy",))
def sample_rows_next(logits, key_data, temperature, top_p, top_k, all_greedy: bool | None = None):
    """One draw per row with its own key and parameters (``ftjax.sampling.sample_rows``), in one program.

    logits: float32 [B, V]; key_data: uint32 [B, 2], each row's key (``jax.random.key_data`` of a default
    threefry key); temperature, top_p: float32 [B]; top_k: int32 [B]. Each row's key is split: the draw
    uses one half, the other is the row's next key. Returns (int32 [B] tokens, uint32 [B, 2] next keys,
    float32 [B] the log-probability of each token under the model's distribution, ``log_softmax(logits)``,
    before temperature, top-k and top-p). ``all_greedy``: ``sample_rows``' static hint (the scheduler's one-step
    draw gives it: it knows its requests' temperatures; a decode block's draw leaves it None)."""
    keys = jax.random.wrap_key_data(key_data)
    pairs = jax.vmap(jax.random.split)(keys)  # [B, 2]
    tokens = sample_rows(logits, pairs[:, 1], temperature, top_p, top_k, all_greedy)
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), tokens[:, None], axis=-1)
    return tokens, jax.random.key_data(pairs[:, 0]), logprobs[:, 0]


#: rows of ``new`` where ``mask`` [B] (numpy bool) is set, else of ``old`` ([B, V] logits)
keep_rows = jax.jit(lambda mask, new, old: jnp.where(mask[:, None], new, old))
