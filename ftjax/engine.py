"""Prefill/decode orchestration: the one jitted step, sampling, expert-cache accounting, timings.

One jitted step function (:func:`_forward_step`) serves every call: prefill chunks, prefix-reuse
prefills (with the layerwise KV hook) and decode steps; its static :class:`StepOptions` and the
argument shapes pick the compiled program. The KV cache and the expert state (slot pools + slot
table) are donated to each step, so they are updated in place rather than copied.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ftjax import layer_pipeline, memory
from ftjax import model as model_lib
from ftjax.checkpoint import LoadedModel
from ftjax.config import DECODE_GEMMS, DECODE_GRAPHS, EngineConfig
from ftjax.experts import miss_policy, offload
from ftjax.experts.slot_table import reset_table
from ftjax.experts.state import ExpertCounters, ExpertState, init_expert_state
from ftjax.kv.layerwise import KVStep
from ftjax.sampling import sample

MIN_BUCKET = 16


def prompt_error(ids: Sequence[int], vocab_size: int, new_tokens: int, max_len: int, max_len_name: str) -> str | None:
    """What is wrong with one prompt of token ids, or None: empty, an id outside [0, vocab_size),
    or prompt + ``new_tokens`` longer than ``max_len`` (named ``max_len_name`` in the message)."""
    if len(ids) == 0:
        return "empty prompt"
    bad = [t for t in ids if not 0 <= int(t) < vocab_size]
    if bad:
        return f"token id {bad[0]} outside the vocabulary [0, {vocab_size})"
    if len(ids) + new_tokens > max_len:
        return f"prompt of {len(ids)} tokens + {new_tokens} new exceeds {max_len_name} {max_len}"
    return None


def bucket(n: int) -> int:
    """Padded length for n tokens: the next power of two, at least MIN_BUCKET (bounded recompiles)."""
    b = MIN_BUCKET
    while b < n:
        b *= 2
    return b


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """Static options of the one jitted step (hashable: they key its compiled programs).

    mode: experts mode; all_logits: logits of every position; stream: full-layer streaming of
    this call's experts; overlap: prefetch layer l+1 while layer l computes (streaming);
    policy: slot eviction policy; miss: a cpu / adaptive ``MissConfig`` or None; kv: the KV
    hook's options (``ftjax.kv.layerwise.KVStep``) or None; precision: matmul precision;
    min_dot_rows: rows the dense projections pad a smaller matmul to (``model.dot_rows``; the
    engine resolves ``FTJAX_MIN_DOT_ROWS`` into it for each call, so a changed variable compiles
    new programs instead of reusing those traced under the old value), None: read the variable
    at trace time; cheap_conds: a ``lax.cond`` costs this program no host round trip
    (``offload.make_expert_fn``; the engine sets it per call: :meth:`Engine.call_options`).
    """

    mode: str
    all_logits: bool = False
    stream: bool = False
    overlap: bool = True
    policy: str = "lru"
    miss: miss_policy.MissConfig | None = None
    kv: KVStep | None = None
    precision: str = "default"
    min_dot_rows: int | None = None
    cheap_conds: bool = False


@functools.partial(jax.jit, static_argnames=("cfg", "opts"), donate_argnames=("cache", "state"))
def _forward_step(params, banks, cache, state, tokens, start, valid_len, prefix, *, cfg, opts: StepOptions):
    """One forward call of the decoder (prefill chunk or decode step): the engine's only jitted
    step. prefix: the reused KV chunks of a prefix-reuse call (``()`` otherwise)."""
    with jax.default_matmul_precision(opts.precision), model_lib.dot_rows(opts.min_dot_rows):
        state, expert_fn = offload.step_expert_fn(cfg.num_layers, cfg.num_experts, opts.mode, banks, state,
                                                  opts.stream, opts.overlap, opts.policy, opts.miss, opts.cheap_conds)
        hook = opts.kv.hook(prefix) if opts.kv is not None else None
        return model_lib.forward(params, cfg, tokens, start, valid_len, cache, expert_fn, state, opts.all_logits,
                                 kv_hook=hook)


@dataclasses.dataclass(frozen=True)
class PrefillCall:
    """One jitted prefill call.

    start: first position (tokens already in the cache); valid: real tokens of each sequence
    in this call; bucket: padded T; store_chunks: new KV chunks the call emits (prefix reuse;
    static m); first_chunk: chunk index of output 0 (= start // C); with_prefix: the call
    receives the reused prefix.
    """

    start: int
    valid: tuple[int, ...]
    bucket: int
    store_chunks: int = 0
    first_chunk: int = 0
    with_prefix: bool = False

    @property
    def tokens(self) -> int:
        """Real tokens of the call, summed over the batch."""
        return sum(self.valid)


@functools.partial(jax.jit, static_argnames=("temperature", "top_p"))
def _sample_next(logits, key, temperature: float, top_p: float):
    """(int32 [B, 1] the next tokens, shaped as the decode step's input; the next key): the key split, the draw
    (``ftjax.sampling.sample`` with a subkey) and the reshape in one program, one dispatch per decode step
    instead of three (the reshape alone was a jitted broadcast with a device copy: ~0.2 ms of host time in an
    H200 trace of a timed step, issue 13)."""
    key, sub = jax.random.split(key)
    return sample(logits, sub, temperature, top_p)[:, None], key


# rows of ``new`` where ``mask`` [B] (numpy bool) is set, else of ``old`` ([B, V] logits)
_keep_rows = jax.jit(lambda mask, new, old: jnp.where(mask[:, None], new, old))

# Compiled steps shared by all engines, keyed by step function, static options and argument
# shapes/dtypes/memory kinds.
_COMPILED: dict[tuple, Any] = {}

#: Whether ``prefill_driver="auto"`` runs a call that loads a reused prefix from host memory on the
#: layer-pipelined driver on a GPU. On since the prefix rows are put a group of layers at a time
#: (``EngineConfig.prefix_copy_layers`` 4): on the H200 (resident, 15,872 reused + 256 new tokens)
#: TTFT 97 ms against 122 ms for load-all-first and ~140 ms for the scan's in-program copies, 80% of
#: the load hidden (docs/OVERLAP.md, "The layerwise KV load"); a put per layer was Python-bound (236 ms).
PIPELINE_PREFIX = True


#: The XLA options of a decode program under ``EngineConfig.decode_gemm`` "cublas" (issue 13): no
#: Triton GEMM fusions (their operands are copies of each layer's weight slices), no dot merger (it
#: fuses the q/k/v products by concatenating their weight slices every step).
CUBLAS_DECODE_OPTIONS = (("xla_disable_hlo_passes", "dot-merger"), ("xla_gpu_enable_triton_gemm", False))


#: XLA's default command buffer kinds (jax 0.11's XLA) plus WHILE and CONDITIONAL: what a decode program
#: compiles with under ``EngineConfig.decode_graphs`` (the option replaces the list, so the defaults
#: are repeated).
GRAPH_DECODE_OPTIONS = (("xla_gpu_enable_command_buffer",
                         "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"),)


def decode_graphs_on(decode_graphs: str, experts: str, fetches_all: bool, backend: str | None = None) -> bool:
    """Whether a decode program compiles with :data:`GRAPH_DECODE_OPTIONS`.

    decode_graphs: ``EngineConfig.decode_graphs`` (``config.DECODE_GRAPHS``); experts: the experts
    mode; fetches_all: the program fetches every miss (the fetch miss policy, or a cpu / adaptive split
    that uses no CPU for this call's (token, expert) pairs: ``MissConfig.fetches_all``, the same program);
    backend: the jax backend (default: ``jax.default_backend()``). "on" and "auto" apply on a GPU only
    (command buffers are XLA:GPU's); "auto" only to the cached and on_demand modes when the program fetches
    every miss: their steps copy misses in a loop of data-dependent trip count, which XLA otherwise drives
    from the host (a predicate copied back and a drained stream per iteration); steps with CPU experts
    (host compute inside) were not measured under command buffers. Measured on the H200 (qwen3-30b-a3b,
    bf16, batch 1, 24 GB cached, 99.6% hits; docs/PROFILE.md, session 10): 10.74 / 14.05 ms per step
    without, 9.84 / 9.69 ms with (two device calls); a resident step was not faster (7.71 ms against
    7.53-7.82 ms).
    Raises:
      ValueError: ``decode_graphs`` is not one of ``config.DECODE_GRAPHS``."""
    if decode_graphs not in DECODE_GRAPHS:
        raise ValueError(f"unknown decode_graphs {decode_graphs!r}; expected one of {', '.join(DECODE_GRAPHS)}")
    if decode_graphs == "off" or (backend or jax.default_backend()) != "gpu":
        return False
    return decode_graphs == "on" or (experts != "resident" and fetches_all)


def decode_compiler_options(decode_gemm: str, tokens_per_row: int, compute_dtype="bfloat16",
                            backend: str | None = None, graphs: bool = False) -> tuple:
    """XLA compiler options (sorted ``(name, value)`` pairs, hashable) of one call of the step.

    decode_gemm: ``EngineConfig.decode_gemm`` (``config.DECODE_GEMMS``); tokens_per_row: T of the
    call's int32 [B, T] tokens (1: a decode step, the only call given options); compute_dtype: the
    engine's; backend: the jax backend (default: ``jax.default_backend()``); graphs: add
    :data:`GRAPH_DECODE_OPTIONS` (:func:`decode_graphs_on`, resolved by the caller). "auto" gives
    :data:`CUBLAS_DECODE_OPTIONS` to a decode step in a 16-bit dtype on a GPU (float32 runs are the
    oracle runs: they keep XLA's GEMMs, which pass the GPU oracle check, while cuBLAS's float32 products
    put the hybrid fixture's long prompt 7.1e-4 off against a tolerance of 3.7e-4; docs/PROFILE.md,
    session 10); "cublas" gives them to a decode step in any dtype on any backend (XLA:CPU compiles the
    same program with them: the CPU tests check the plumbing, not cuBLAS's numerics, which only a GPU
    run checks: ``experiments/check_oracle_gpu.py --decode_gemm``); "xla": none.
    Measured on the H200 (resident qwen3-30b-a3b, bf16, batch 1, GEMM autotuning off, one call):
    9.61 ms per step with XLA's defaults, 7.53 ms with these options.
    Raises:
      ValueError: ``decode_gemm`` is not one of ``config.DECODE_GEMMS``."""
    if decode_gemm not in DECODE_GEMMS:
        raise ValueError(f"unknown decode_gemm {decode_gemm!r}; expected one of {', '.join(DECODE_GEMMS)}")
    if tokens_per_row != 1:
        return ()
    auto_ok = (backend or jax.default_backend()) == "gpu" and jnp.dtype(compute_dtype).itemsize == 2
    gemm = () if decode_gemm == "xla" or (decode_gemm == "auto" and not auto_ok) else CUBLAS_DECODE_OPTIONS
    return tuple(sorted(gemm + (GRAPH_DECODE_OPTIONS if graphs else ())))


def compiled_programs(fn_name: str | None = None):
    """Yields (step name, static options dict, argument signatures, compiled executable) of every
    compiled step (e.g. to read its HLO with ``exe.as_text()``); ``fn_name`` filters by step. The
    options dict also holds the XLA ``compiler_options`` (a dict; empty for XLA's defaults), so that
    two programs of one step that differ only in them (``EngineConfig.decode_gemm``) can be told apart."""
    for key, exe in _COMPILED.items():
        if fn_name is None or key[0] == fn_name:
            yield key[0], {**dict(key[1]), "compiler_options": dict(key[3])}, key[2], exe


def _int32(x):
    """x as an int32 step argument without a dispatch of its own: an int32 device array as it is, anything else
    as a numpy array, which the compiled call copies to the device with its other arguments (a ``jnp.asarray``
    per argument cost ~80 us of host time each, three per decode step)."""
    if isinstance(x, jax.Array) and x.dtype == jnp.int32:
        return x
    return np.asarray(x, np.int32)


def _compile_key(args, **static) -> tuple:
    # numpy dtypes hash as they are: str(dtype) cost ~15 us a leaf, ~2 ms for a layer program with a
    # 62-chunk prefix, looked up once per layer (issue 12: more than the layer's GPU time)
    leaves = jax.tree.leaves(args)
    # a numpy argument is put in device memory by the call: the same program as a device array's
    return (tuple(sorted(static.items())),
            tuple((x.shape, x.dtype, getattr(getattr(x, "sharding", None), "memory_kind", "device"))
                  for x in leaves))


@dataclasses.dataclass
class GenerationResult:
    """Output of :meth:`Engine.generate`.

    generated_ids: int [B][n_b] (each sequence up to and including its EOS, if it stopped there);
    step_logits: float32 [n, B, V] (when kept); ttft_s, decode_s: seconds; prefill_tokens_per_s,
    decode_tokens_per_s: tokens/s summed over the batch (tokens after a sequence's EOS are not
    counted); compile_s: seconds spent compiling in this call (not part of the timings); routing:
    int32 [steps][L, N, k] when traced; step_s: seconds of each decode step (TPOT) when timed step
    by step; stop_reasons: per sequence, "eos" or "length"; expert_cache: this call's own expert
    cache figures (hits, misses, bytes_h2d, ...; ``ExpertCounters.summary``); kv: the prefix-reuse
    record of the request.
    """

    prompt_ids: list[list[int]]
    generated_ids: list[list[int]]
    step_logits: np.ndarray | None
    ttft_s: float
    decode_s: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    compile_s: float
    routing: list[np.ndarray] | None = None
    step_s: list[float] | None = None
    stop_reasons: list[str] | None = None
    expert_cache: dict | None = None
    kv: dict | None = None


class Engine:
    """Runs a :class:`LoadedModel` as an :class:`EngineConfig` says.

    Args:
      model: weights (device params + host expert banks).
      config: how to run it (experts mode, slots, cache length, batch, prefill, cache policy,
        matmul precision); default: resident, 512 tokens, batch 1.
      miss: a ``miss_policy.MissRuntime`` (fetch / cpu / adaptive misses); None = fetch.
    Raises:
      ValueError: a config that does not fit the model (``EngineConfig.for_model``), or a cpu /
        adaptive miss policy with resident experts.
    """

    def __init__(self, model: LoadedModel, config: EngineConfig | None = None, *,
                 miss: miss_policy.MissRuntime | None = None):
        cfg = model.cfg
        self.config = (config or EngineConfig()).for_model(cfg)
        if miss is not None and miss.policy != "fetch" and self.config.experts == "resident":
            raise ValueError(f"miss policy {miss.policy!r} needs experts mode cached or on_demand")
        self.model, self.cfg = model, cfg
        self.dtype = jnp.dtype(model.params["embed"].dtype)
        self.miss = miss or miss_policy.build_runtime("fetch", cfg.num_experts)
        self.state = self._fresh_state()
        self.counters = {p: ExpertCounters.zeros(cfg.num_layers, cfg.num_experts) for p in ("prefill", "decode")}
        self.compile_s = 0.0
        self.failed_steps = 0
        self._programs: set[tuple] = set()  # keys into _COMPILED of the programs this engine ran or compiled
        self._expert_views: layer_pipeline.ExpertLayerSource | None = None  # built on the first pipelined stream
        self.prefill_driver_calls = {"scan": 0, "pipelined": 0}  # prefill calls run by each driver

    # ---- configuration, read-only views -------------------------------------------------------
    @property
    def mode(self) -> str:
        return self.config.experts

    @property
    def num_slots(self) -> int:
        return self.config.num_slots

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    @property
    def batch(self) -> int:
        return self.config.batch

    @property
    def cache_policy(self) -> str:
        return self.config.cache_policy

    @property
    def precision(self) -> str:
        """Matmul precision of every step (``EngineConfig.precision`` for the compute dtype)."""
        return self.config.precision(self.dtype.name)

    def _decode_graphs(self, tokens_per_row: int, batch: int | None) -> bool:
        """Whether a call with int32 [batch, tokens_per_row] tokens (batch default ``EngineConfig.batch``)
        compiles as a command buffer with WHILE and CONDITIONAL (:func:`decode_graphs_on`; decode calls only)."""
        if tokens_per_row != 1:
            return False
        pairs = (self.config.batch if batch is None else batch) * tokens_per_row * self.cfg.top_k
        fetches_all = self.miss.config.fetches_all(pairs, self.cfg.num_experts)
        return decode_graphs_on(self.config.decode_graphs, self.mode, fetches_all)

    def decode_options(self, tokens_per_row: int, batch: int | None = None) -> tuple:
        """The XLA ``compiler_options`` of a call with int32 [batch, tokens_per_row] tokens (batch
        default ``EngineConfig.batch``): :func:`decode_compiler_options` under ``EngineConfig.decode_gemm``
        and ``decode_graphs``."""
        graphs = self._decode_graphs(tokens_per_row, batch)
        return decode_compiler_options(self.config.decode_gemm, tokens_per_row, self.dtype, graphs=graphs)

    def describe(self) -> dict:
        """JSON-ready run configuration: the engine config, resolved precision, miss policy, the XLA
        options of its decode programs."""
        return {**self.config.as_dict(), "matmul_precision_resolved": self.precision,
                "decode_compiler_options": dict(self.decode_options(1)),
                "miss_policy": self.miss.policy, "compute_dtype": self.dtype.name,
                "prefix_copy_layers_resolved": self.prefix_copy_rows()}

    # ---- expert state ----------------------------------------------------------------------
    def _fresh_state(self) -> ExpertState:
        cfg = self.cfg
        return init_expert_state(self.mode, cfg.num_layers, cfg.num_experts, self.num_slots, self.model.banks,
                                 self.dtype, track_recency=self.miss.track_recency)

    def reset_expert_cache(self) -> None:
        """Empties the expert cache: every slot freed (nothing resident), as in a new engine.

        For cold-start measurements (each timed request from the same state) without rebuilding
        the engine or recompiling. The slot pools keep their bytes (no copy, no reallocation);
        routing recency starts over; the counters keep counting. No-op in resident mode (no table).
        """
        if self.state.table is None:
            return
        recency = self.state.last_routed
        self.state = self.state.replace(table=reset_table(self.state.table),
                                        last_routed=None if recency is None else jnp.full_like(recency, -1))

    def resident_experts_per_layer(self) -> list[int]:
        """How many experts of each layer sit in the slot cache now (all E when resident)."""
        cfg = self.cfg
        if self.state.table is None:
            return [cfg.num_experts] * cfg.num_layers
        slot_of = np.asarray(self.state.table.slot_of).reshape(cfg.num_layers, cfg.num_experts)
        return (slot_of >= 0).sum(axis=1).tolist()

    # ---- one forward call --------------------------------------------------------------------
    def _options(self, all_logits: bool = False, stream: bool = False, kv: KVStep | None = None) -> StepOptions:
        """The static options of one step. ``FTJAX_MIN_DOT_ROWS`` is read here, at every call,
        so that its value keys the compiled programs (``StepOptions.min_dot_rows``).
        Raises:
          ValueError: ``FTJAX_MIN_DOT_ROWS`` is not a non-negative integer."""
        return StepOptions(self.mode, all_logits, stream, self.config.prefill_overlap and stream, self.cache_policy,
                           self.miss.jit_config, kv, self.precision, model_lib.min_dot_rows())

    def _args(self, tokens, start, valid_len, cache, prefix=()):
        m = self.model
        return (m.params, m.banks, cache, self.state, _int32(tokens), _int32(start), _int32(valid_len), tuple(prefix))

    def _step(self, tokens: np.ndarray, start: np.ndarray, valid_len: np.ndarray, cache, opts: StepOptions,
              prefix=(), pipelined: bool = False) -> model_lib.ForwardOut:
        """Runs the step (with the layer-pipelined driver when ``pipelined``); the expert state and
        ``cache`` are donated to it.

        If the step raises (a device OOM, say) after its donated expert state was consumed, the
        engine starts again from an empty expert cache (counted in ``failed_steps``) so that it
        stays usable, or, when even that fails, says so on every later call (RuntimeError) rather
        than crashing on deleted buffers; the KV cache passed in is consumed either way. The error
        is re-raised. An error that the device reports only later, when an output is read, is
        not seen here.
        """
        if self.state is None:
            raise RuntimeError("this engine lost its expert state in a failed step and could not rebuild it "
                               "(see the earlier error); build a new Engine")
        try:
            if pipelined:
                out = self._run_pipelined(tokens, start, valid_len, cache, opts, prefix)
            else:
                args = self._args(tokens, start, valid_len, cache, prefix)
                out = self._executable(args, opts)(*args)
        except Exception as err:
            self.failed_steps += 1
            if any(x.is_deleted() for x in jax.tree.leaves(self.state)):
                self.state = None
                try:  # resident mode copies the whole bank again: that can fail too (after an OOM)
                    self.state = self._fresh_state()
                except Exception as again:
                    raise RuntimeError(f"a step failed ({err!r}) and the expert state could not be rebuilt "
                                       f"({again!r}); this engine is unusable, build a new one") from err
            raise
        self.state = out.expert_state
        return out

    def streams(self, valid_tokens: int) -> bool:
        """Whether a prefill call with ``valid_tokens`` real tokens streams whole layers."""
        if self.mode == "resident" or self.config.prefill == "on_demand":
            return False
        if self.config.prefill == "stream":
            return True
        e = self.cfg.num_experts
        # the scan borrows 2E pool slots; the pipelined driver streams through buffers of its own
        room = self.config.pipelines_streams(self.cfg) or self.num_slots >= 2 * e
        return room and valid_tokens * self.cfg.top_k >= e

    def pipelines(self, stream: bool, prefix=()) -> bool:
        """Whether a prefill call runs on the layer-pipelined driver (``ftjax.layer_pipeline``):
        ``prefill_driver`` "pipelined", or "auto" on a GPU for a call that streams whole layers of
        experts. A call that only reuses a prefix stays on the scan under "auto" (see
        :data:`PIPELINE_PREFIX` for the measurement). A prefix already on the device (the
        load-all-first ablation) always runs on the scan."""
        if self.cfg.is_hybrid:  # its block scan is the only driver (refused with "pipelined" by the config)
            return False
        on_host = bool(prefix) and memory.memory_kind(prefix[0]) in ("pinned_host", "unpinned_host")
        return not (prefix and not on_host) and self._driver_pipelines(stream, on_host)

    def _driver_pipelines(self, stream: bool, host_prefix: bool) -> bool:
        driver = self.config.prefill_driver
        if self.cfg.is_hybrid or driver == "scan":
            return False
        return driver == "pipelined" or (memory.backend() == "gpu" and (stream or (host_prefix and PIPELINE_PREFIX)))

    def pipelines_prefix(self) -> bool:
        """Whether a call that loads a reused prefix from host memory can run on the pipelined driver:
        a prefix-only call (see :data:`PIPELINE_PREFIX`), or, where this engine streams prefill
        calls, one that also streams its experts (under "auto" on a GPU those pipeline whatever
        their prefix). The stored chunks are then prepared for it (``warm_prefix_chunks``)."""
        can_stream = self.mode != "resident" and self.config.prefill != "on_demand"
        return self._driver_pipelines(can_stream, True)

    def _expert_source(self):
        if self._expert_views is None:
            self._expert_views = layer_pipeline.ExpertLayerSource(self.model.banks, self.cfg.num_experts)
        return self._expert_views

    def call_drivers(self, valid_tokens: int, prefix=()) -> tuple[bool, bool]:
        """(streams, pipelined) of one prefill call. A call that would stream but runs on the scan
        (a prefix already on the device: the load-all-first ablation) with fewer than the 2E slots
        the scan borrows loads its experts on demand instead (``prefill="stream"``: refused).

        Raises:
          ValueError: ``prefill="stream"`` for such a call.
        """
        stream = self.streams(valid_tokens)
        pipelined = self.pipelines(stream, prefix)
        if stream and not pipelined and self.num_slots < 2 * self.cfg.num_experts:
            if self.config.prefill == "stream":
                raise ValueError(f"this call streams on the layer scan, which borrows 2E={2 * self.cfg.num_experts} "
                                 f"slots, but the engine has {self.num_slots} (a reused prefix already on the "
                                 f"device runs on the scan); use prefill='auto' or more slots")
            stream, pipelined = False, self.pipelines(False, prefix)
        return stream, pipelined

    @property
    def stream_copy_path(self) -> str | None:
        """How the pipelined driver copies streamed layers: "pinned_alias" (asynchronous, overlaps
        compute), "numpy_view" (waits for queued compute; the CPU backend), None: not used yet."""
        return self._expert_views.path if self._expert_views is not None else None

    def _run_pipelined(self, tokens, start, valid_len, cache, opts: StepOptions, prefix=()) -> model_lib.ForwardOut:
        m = self.model
        return layer_pipeline.run(
            self.compiled, m.params, m.banks, self.state, cache, jnp.asarray(tokens, jnp.int32),
            jnp.asarray(start, jnp.int32), jnp.asarray(valid_len, jnp.int32), cfg=self.cfg, step=opts,
            all_logits=opts.all_logits, experts=self._expert_source() if opts.stream else None,
            prefix=layer_pipeline.PrefixLayerSource(prefix, self.prefix_copy_rows(), self.config.prefill_overlap)
            if prefix else None,
            overlap=self.config.prefill_overlap, d2d=self._d2d(opts), prefix_copy=self.config.prefix_copy)

    def prefix_copy_rows(self) -> int:
        """Layers whose reused-prefix rows one copy moves on the pipelined driver: the group of
        ``EngineConfig.prefix_copy_layers`` (:func:`layer_pipeline.copy_group_layers`) with
        ``prefix_copy`` "put", 1 with "in_program" (each layer's program copies the next one's)."""
        if self.config.prefix_copy != "put":
            return 1
        return layer_pipeline.copy_group_layers(self.cfg.num_layers, self.config.prefix_copy_layers)

    def _d2d(self, opts: StepOptions) -> bool:
        """Whether a pipelined call copies its streamed layers' cached experts device to device
        (``EngineConfig.stream_d2d_hits``; needs a slot table: not resident mode)."""
        return opts.stream and self.config.stream_d2d_hits and self.state.table is not None

    def new_cache(self, batch: int) -> model_lib.KVCache:
        return model_lib.init_kv_cache(self.cfg, batch, self.max_seq_len, self.dtype)

    def check_prompts(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
        """Raises ValueError for no new tokens, more prompts than the config's batch, empty prompts,
        ids outside [0, V) or sequences longer than the cache."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if len(prompts) > self.batch:
            raise ValueError(f"{len(prompts)} prompts exceed the engine's batch {self.batch} (EngineConfig.batch "
                             f"sizes the KV cache plan)")
        for i, p in enumerate(prompts):
            problem = prompt_error(p, self.cfg.vocab_size, max_new_tokens, self.max_seq_len, "max_seq_len")
            if problem:
                raise ValueError(f"prompt {i}: {problem}")

    # ---- prefill ------------------------------------------------------------------------------
    def prepare_prefill(self, prompts: Sequence[Sequence[int]], cache, kv_manager=None):
        """Compiles every program a prefill of ``prompts`` and the decode after it need (so that
        timings exclude compilation). With ``kv_manager``, first plans the prefix-reuse request
        (``kv_manager.begin``: lookup, pin) and returns it for :meth:`prefill`; else None."""
        req = kv_manager.begin(self, prompts) if kv_manager is not None else None
        try:
            self._ensure_compiled(req.calls if req is not None else self.plan_prefill(prompts), len(prompts),
                                  cache, kv_manager, req)
        except BaseException:
            if req is not None:
                kv_manager.finish(req, None)  # unpins the hit chunks
            raise
        return req

    def plan_prefill(self, prompts: Sequence[Sequence[int]]) -> list[PrefillCall]:
        """The calls of a plain prefill: chunks of at most ``prefill_chunk`` tokens, each
        right-padded to a bucket (a sequence already complete has 0 valid tokens in later chunks)."""
        lengths = np.array([len(p) for p in prompts])
        longest = int(lengths.max())
        chunk = min(self.config.prefill_chunk, longest)
        calls = []
        for c in range(0, longest, chunk):
            valid = tuple(int(v) for v in np.clip(lengths - c, 0, chunk))
            calls.append(PrefillCall(c, valid, bucket(max(valid))))
        return calls

    def prefill(self, prompts: Sequence[Sequence[int]], cache, all_logits: bool = False, kv_manager=None,
                request=None):
        """Prefills a batch of prompts through the calls of :meth:`plan_prefill`, or, with a
        prefix-reuse ``request`` of ``kv_manager`` (``ftjax.kv.prefix_cache``, batch 1), through
        the request's calls: the reused prefix loads layer by layer inside the first call and new
        full chunks leave as outputs, which the manager stores. Every call picks streaming or
        on-demand expert loading by :meth:`streams`, whichever path planned it.

        Returns (logits, cache, lengths, stats): logits float32 [B, V] of each prompt's last token
        ([B, T, V] with all_logits: T the tokens computed, the longest prompt less any reused prefix);
        stats: one LayerStats per call.
        """
        if (kv_manager is None) != (request is None):
            raise ValueError("prefix reuse needs both kv_manager and the request that "
                             "prepare_prefill(prompts, cache, kv_manager) returned")
        if request is not None and [list(map(int, p)) for p in prompts] != [request.prompt]:
            raise ValueError("the prompts differ from the ones the prefix-reuse request was planned for")
        b = len(prompts)
        lengths = np.array([len(p) for p in prompts], np.int32)
        calls = request.calls if request is not None else self.plan_prefill(prompts)
        logits, stats, pieces, kv_outs = None, [], [], []
        try:
            prefix = kv_manager.load_prefix(request) if request is not None else ()
            for call in calls:
                tokens = np.zeros((b, call.bucket), np.int32)
                for i, p in enumerate(prompts):
                    tokens[i, : call.valid[i]] = p[call.start: call.start + call.valid[i]]
                kv = kv_manager.step_options(call) if request is not None else None
                pfx = prefix if call.with_prefix else ()
                stream, pipelined = self.call_drivers(call.tokens, pfx)
                out = self._step(tokens, np.full(b, call.start, np.int32), np.asarray(call.valid, np.int32), cache,
                                 self._options(all_logits, stream, kv), pfx, pipelined)
                cache = out.cache
                self.prefill_driver_calls["pipelined" if pipelined else "scan"] += 1
                kv_outs.append(out.kv_out)  # only the KV hook's new chunks outlive the call
                self.counters["prefill"].add(out.layer_stats)
                if stream and self.config.prefill_overlap and not pipelined:
                    # the scan's prefetch of the last layer is clamped to L-1: one layer copied twice
                    self.counters["prefill"].extra_copies += self.cfg.num_experts
                stats.append(out.layer_stats)
                if all_logits:
                    pieces.append(out.logits[:, : max(call.valid)])
                elif logits is None:
                    logits = out.logits
                else:  # keep each sequence's logits from the call its prompt ends in
                    ends = (lengths > call.start) & (lengths <= call.start + np.asarray(call.valid))
                    logits = _keep_rows(ends, out.logits, logits)
        finally:
            if request is not None:
                # on the pipelined driver the new chunks' per-layer aliases are made as they are stored,
                # not inside the TTFT of a later request that reuses them
                warm = functools.partial(layer_pipeline.warm_prefix_chunks, rows=self.prefix_copy_rows())
                kv_manager.finish(request, kv_outs if len(kv_outs) == len(calls) else None,
                                  prepare=warm if self.pipelines_prefix() else None)
        if all_logits:
            logits = jnp.concatenate(pieces, axis=1)
        return logits, cache, lengths, stats

    # ---- generation ---------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, keep_logits: bool = False,
                 trace_routing: bool = False, time_steps: bool = False, kv_manager=None,
                 eos_ids: Sequence[int] = ()) -> GenerationResult:
        """Prefill + decode up to ``max_new_tokens`` tokens for each prompt.

        TTFT is measured from the prefill's dispatch to the first sampled token being ready;
        decode time from then to the last token. Compilation is excluded and reported apart.
        ``time_steps`` waits for every decode step to finish and records its duration (adds one
        host sync per step; without it steps are dispatched asynchronously).
        With ``kv_manager`` (``ftjax.kv.prefix_cache.PrefixCache``, batch 1) the prefill reuses
        stored prefix KV and stores new chunks; its key lookup time is added to TTFT.
        ``eos_ids``: a sequence stops after generating one of these ids (its stop reason is
        "eos"; what it generates after it is dropped and not counted); decoding ends when every
        sequence stopped. The check reads the token before the one just dispatched, so decode
        stays asynchronous; at most one step runs after the last sequence stopped.
        """
        self.check_prompts(prompts, max_new_tokens)
        b = len(prompts)
        compile_before = self.compile_s
        before = {p: c.copy() for p, c in self.counters.items()}
        cache = self.new_cache(b)
        key = jax.random.key(seed)
        req = self.prepare_prefill(prompts, cache, kv_manager)  # compile before the clock starts
        try:
            self._warm_sampling(b, temperature, top_p)
        except BaseException:
            if req is not None:
                kv_manager.finish(req, None)  # unpins the hit chunks
            raise
        t0 = time.perf_counter()
        logits, cache, lengths, stats = self.prefill(prompts, cache, kv_manager=kv_manager, request=req)
        tok, key = _sample_next(logits, key, temperature, top_p)  # int32 [B, 1]
        tok.block_until_ready()
        t_first = time.perf_counter()
        ttft = t_first - t0 + (req.lookup_s if req is not None else 0.0)
        routing = [np.concatenate([np.asarray(st.routed_ids) for st in stats], axis=1)] if trace_routing else None
        toks, all_logits, decode_stats = [tok], [logits] if keep_logits else None, []
        eos = np.asarray(list(eos_ids), np.int64)
        stopped = np.zeros(b, bool)  # sequences known (one step late) to have generated an EOS
        pos, ones = lengths.astype(np.int32), np.ones(b, np.int32)
        step_s = [] if time_steps else None
        decode_opts = self._options()
        try:
            for _ in range(max_new_tokens - 1):
                if eos.size and len(toks) >= 2:
                    # The token before the one just dispatched: its step has finished, so reading
                    # it does not stall the device queue (decode stays asynchronous).
                    stopped |= np.isin(np.asarray(toks[-2])[:, 0], eos)
                    if stopped.all():
                        break
                ts = time.perf_counter()
                out = self._step(tok, pos, ones, cache, decode_opts)
                cache = out.cache
                tok, key = _sample_next(out.logits, key, temperature, top_p)
                toks.append(tok)
                decode_stats.append(out.layer_stats)
                if keep_logits:
                    all_logits.append(out.logits)
                if time_steps:
                    tok.block_until_ready()
                    step_s.append(time.perf_counter() - ts)
                pos = pos + 1
            jax.block_until_ready(toks)
        finally:  # the steps that ran moved the slot table: count them even if a later one failed
            for s in decode_stats:
                self.counters["decode"].add(s)
        decode_s = time.perf_counter() - t_first
        if trace_routing:
            routing += [np.asarray(s.routed_ids) for s in decode_stats]
        gen = np.concatenate([np.asarray(t) for t in toks], axis=1)
        is_eos = np.isin(gen, eos) if eos.size else np.zeros(gen.shape, bool)
        done_at = np.where(is_eos.any(axis=1), is_eos.argmax(axis=1), -1)  # each sequence's first EOS
        ends = np.where(done_at >= 0, done_at + 1, gen.shape[1])
        generated = [gen[i, : ends[i]].tolist() for i in range(b)]
        n_dec = int(sum(max(e - 1, 0) for e in ends))
        eb = self.model.expert_bytes
        own = sum((self.counters[p] - before[p] for p in self.counters), ExpertCounters.zeros(
            self.cfg.num_layers, self.cfg.num_experts))
        return GenerationResult(
            prompt_ids=[list(map(int, p)) for p in prompts], generated_ids=generated,
            step_logits=np.stack([np.asarray(x) for x in all_logits]) if keep_logits else None,
            ttft_s=ttft, decode_s=decode_s, prefill_tokens_per_s=float(lengths.sum()) / ttft,
            decode_tokens_per_s=n_dec / decode_s if n_dec and decode_s > 0 else 0.0,
            compile_s=self.compile_s - compile_before, routing=routing, step_s=step_s,
            stop_reasons=["eos" if d >= 0 else "length" for d in done_at], expert_cache=own.summary(eb),
            kv=req.record() if req is not None else None)

    # ---- compilation --------------------------------------------------------------------------
    def compiled(self, fn, args, compiler_options: tuple | dict = (), **static):
        """``fn`` (a jitted step) compiled for these arguments and static options, from the shared
        cache (compiled once per fn, shapes, dtypes, memory kinds, options and XLA
        ``compiler_options``, ``(name, value)`` pairs); compile seconds are added to ``compile_s``
        so timings can exclude them."""
        options = tuple(sorted(dict(compiler_options).items()))  # pairs or a dict; one key per set of values
        key = (fn.__name__,) + _compile_key(args, **static) + (options,)
        if key not in _COMPILED:
            t0 = time.perf_counter()
            _COMPILED[key] = fn.lower(*args, **static).compile(compiler_options=dict(options) or None)
            self.compile_s += time.perf_counter() - t0
        self._programs.add(key)
        return _COMPILED[key]

    def workspace_bytes(self) -> int:
        """The largest temporary-buffer size (bytes, XLA's ``memory_analysis``) of the programs this
        engine compiled: the device memory a step needs beyond its arguments and outputs."""
        sizes = [_COMPILED[k].memory_analysis().temp_size_in_bytes for k in self._programs]
        return int(max(sizes, default=0))

    def call_options(self, opts: StepOptions, tokens_per_row: int, batch: int | None = None
                     ) -> tuple[StepOptions, tuple]:
        """(step options, XLA ``compiler_options``) of a call with int32 [batch, tokens_per_row] tokens:
        :meth:`decode_options`, and ``opts`` with ``cheap_conds`` set where a cond costs no host round
        trip (on the CPU, or in a program compiled as a command buffer with CONDITIONAL)."""
        graphs = self._decode_graphs(tokens_per_row, batch)
        options = decode_compiler_options(self.config.decode_gemm, tokens_per_row, self.dtype, graphs=graphs)
        return dataclasses.replace(opts, cheap_conds=graphs or jax.default_backend() == "cpu"), options

    def _executable(self, args, opts: StepOptions):
        tokens = args[4]  # int32 [B, T]
        opts, options = self.call_options(opts, tokens.shape[1], tokens.shape[0])
        return self.compiled(_forward_step, args, compiler_options=options, cfg=self.cfg, opts=opts)

    def _ensure_compiled(self, calls: Sequence[PrefillCall], batch: int, cache, kv_manager=None,
                         request=None) -> None:
        """Compiles every prefill call's program and the decode step before timing starts."""
        shapes = {((batch, 1), self._options(), (), False)}
        for call in calls:
            kv = kv_manager.step_options(call) if request is not None else None
            prefix = kv_manager.prefix_spec(self, request) if request is not None and call.with_prefix else ()
            stream, pipelined = self.call_drivers(call.tokens, prefix)
            shapes.add(((batch, call.bucket), self._options(stream=stream, kv=kv), prefix, pipelined))
        for shape, opts, prefix, pipelined in shapes:
            args = self._args(np.zeros(shape, np.int32), np.zeros(batch, np.int32), np.ones(batch, np.int32), cache,
                              prefix)
            if not pipelined:
                self._executable(args, opts)
                continue
            m = self.model
            layer_pipeline.precompile(self.compiled, m.params, m.banks, self.state, cache, *args[4:7], cfg=self.cfg,
                                      step=opts, all_logits=opts.all_logits,
                                      experts=self._expert_source() if opts.stream else None, prefix_spec=prefix,
                                      d2d=self._d2d(opts), overlap=self.config.prefill_overlap,
                                      prefix_copy=self.config.prefix_copy, prefix_rows=self.prefix_copy_rows())

    def _warm_sampling(self, batch: int, temperature: float, top_p: float) -> None:
        """Compiles the sampler and the key split outside the timed region. The dummy logits are
        committed to device memory like the step's output: an uncommitted argument is another
        jit cache entry, and the real call would compile again inside TTFT."""
        t0 = time.perf_counter()
        logits = memory.to_device(np.zeros((batch, self.cfg.vocab_size), np.float32))
        key = jax.random.key(0)
        for _ in range(2):  # a fresh key (the first draw), then a key the program returned (committed: its own entry)
            tok, key = _sample_next(logits, key, temperature, top_p)
        tok.block_until_ready()
        _keep_rows(np.ones(batch, bool), logits, logits).block_until_ready()  # multi-chunk prefill
        self.compile_s += time.perf_counter() - t0

    # ---- metrics ------------------------------------------------------------------------------
    def expert_cache_metrics(self) -> dict:
        """The ``expert_cache`` metrics object: slots, hits, misses, hit rates, fetched / CPU
        misses, H2D bytes (per phase too), what the cache holds per layer, the miss policy."""
        eb = self.model.expert_bytes
        total = self.counters["prefill"] + self.counters["decode"]
        m = {"mode": self.mode, "slots": self.num_slots, "policy": self.cache_policy, "expert_bytes": eb,
             "expert_format": self.model.banks.fmt, "expert_storage_dtype": str(self.model.banks.gate_up.dtype),
             **total.summary(eb),
             "prefill": self.counters["prefill"].summary(eb), "decode": self.counters["decode"].summary(eb),
             "resident_per_layer": self.resident_experts_per_layer()}
        m.update(self.miss.metrics(min(self.cfg.num_experts, self.batch * self.cfg.top_k)))
        return m



def plan_engine(model: LoadedModel, budget_bytes: int, prompts: Sequence[Sequence[int]], config: EngineConfig,
                mode: str = "auto", miss: miss_policy.MissRuntime | None = None):
    """The slot count (and, for ``mode="auto"``, the experts mode) that fit ``budget_bytes`` of
    device memory for a run of ``prompts`` with ``config`` (whose mode and slots are replaced),
    with the workspace *measured*: a probe engine at min(2E, L*E) slots (so that the streamed
    prefill programs are compiled where streaming can happen) compiles every prefill call and the
    decode step, and the largest temporary buffer of those programs is the plan's workspace
    (``ftjax.experts.planner``). ``mode``: "auto" (resident when the whole pool fits, else
    cached) or an experts mode to keep. Returns (EngineConfig for the run, MemoryPlan).

    Raises:
      ValueError: the budget leaves fewer than E slots (the message gives the minimum budget),
        fewer than the 2E that ``prefill="stream"`` needs, or, with ``mode="resident"``, fewer
        than the whole pool (the message gives the budget it needs).
    """
    from ftjax.checkpoint import DTYPES
    from ftjax.experts.planner import plan_memory
    cfg = model.cfg
    itemsize = np.dtype(DTYPES[model.dtype]).itemsize
    probe_slots = min(2 * cfg.num_experts, cfg.num_layers * cfg.num_experts)
    probe = Engine(model, dataclasses.replace(config, experts="cached", num_slots=probe_slots), miss=miss)
    probe.prepare_prefill(prompts, probe.new_cache(len(prompts)))
    workspace = probe.workspace_bytes()
    del probe
    plan = plan_memory(cfg, itemsize, budget_bytes=budget_bytes, batch=config.batch, max_seq_len=config.max_seq_len,
                       workspace_bytes=workspace, expert_bytes=model.expert_bytes,
                       pipelined=config.pipelines_streams(cfg) and config.prefill != "on_demand")
    if mode == "auto":
        mode = "resident" if plan.fits_resident else "cached"
    if mode == "resident" and not plan.fits_resident:
        need = plan.planned_bytes - plan.layer_gather_bytes + (plan.pool_slots - plan.slots) * plan.expert_bytes
        raise ValueError(f"experts mode 'resident' keeps all {plan.pool_slots} experts "
                         f"({plan.pool_slots * plan.expert_bytes / 1e9:.3f} GB) on the device, but a budget of "
                         f"{budget_bytes / 1e9:.3f} GB leaves room for {plan.slots}; give at least "
                         f"{need / 1e9:.3f} GB, or experts mode 'cached' or 'auto'")
    if mode == "resident":  # every expert on the device: nothing to stream
        return dataclasses.replace(config, experts=mode, num_slots=None,
                                   prefill="auto" if config.prefill == "stream" else config.prefill), plan
    # validated against the model here: e.g. prefill=stream with fewer than 2E slots is refused
    return dataclasses.replace(config, experts=mode, num_slots=plan.slots).for_model(cfg), plan
