"""The per-call plan: how one forward call runs, decided once, in one place.

A prefill is cut into calls (:class:`PrefillCall`: chunks of at most ``EngineConfig.prefill_chunk``
tokens, right-padded to a power-of-two bucket so that few programs are compiled). For every call,
:class:`CallPlanner` decides whether its experts stream whole layers (FreeToken's full-layer double
buffering, DESIGN.md 1.3), which driver runs it (the layer scan or the layer-pipelined driver), its
static step options and its XLA options, and returns them as one :class:`CallPlan` that the engine
hands to the driver. Nothing else decides these.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax

from ftjax import memory
from ftjax import model as model_lib
from ftjax.config import EngineConfig, ModelConfig
from ftjax.kv.layerwise import KVStep
from ftjax.runtime import programs
from ftjax.runtime.step import StepOptions

MIN_BUCKET = 16

#: Whether ``prefill_driver="auto"`` runs a call that loads a reused prefix from host memory on the
#: layer-pipelined driver on a GPU: on, since the prefix rows are put a group of layers at a time
#: (``EngineConfig.prefix_copy_layers``), which hid most of the load on the H200 (docs/OVERLAP.md).
PIPELINE_PREFIX = True


def bucket(n: int) -> int:
    """Padded length for n tokens: the next power of two, at least MIN_BUCKET (bounded recompiles)."""
    b = MIN_BUCKET
    while b < n:
        b *= 2
    return b


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


@dataclasses.dataclass(frozen=True)
class PrefillCall:
    """One prefill call of one sequence (a batch row).

    start: first position (tokens already in the cache); valid: real tokens of the call, one per
    sequence it covers (a one-element tuple for a row's own call); bucket: padded T; store_chunks: new
    KV chunks the call emits (prefix reuse; static m); first_chunk: chunk index of output 0 (= start //
    C); with_prefix: the call receives the reused prefix.
    """

    start: int
    valid: tuple[int, ...]
    bucket: int
    store_chunks: int = 0
    first_chunk: int = 0
    with_prefix: bool = False

    @property
    def tokens(self) -> int:
        """Real tokens of the call, summed over the sequences it covers."""
        return sum(self.valid)


def chunk_calls(length: int, chunk: int, start: int = 0) -> list[PrefillCall]:
    """The calls of a plain prefill of one sequence's tokens [start, length): chunks of at most ``chunk``
    tokens, each right-padded to its bucket."""
    calls = []
    for c in range(start, length, chunk):
        valid = min(chunk, length - c)
        calls.append(PrefillCall(c, (valid,), bucket(valid)))
    return calls


@dataclasses.dataclass(frozen=True)
class CallPlan:
    """How one call runs: opts (the static step options; ``opts.stream``: whole layers streamed),
    driver ("scan" | "pipelined" | "host_split": ``ftjax.runtime.host_split``), compiler_options (XLA options,
    hashable pairs), d2d (a streamed call on the pipelined driver copies the cached experts device to device),
    extra_copies (experts copied outside any layer's misses: the scan's streaming prologue re-copies one layer)."""

    opts: StepOptions
    driver: str
    compiler_options: tuple = ()
    d2d: bool = False
    extra_copies: int = 0


class CallPlanner:
    """Plans the calls of one engine (see the module docstring).

    Args:
      cfg: the model; config: the engine's (resolved) config; miss: its miss runtime
        (``ftjax.experts.miss_policy.MissRuntime``); dtype: the compute dtype.
    """

    def __init__(self, cfg: ModelConfig, config: EngineConfig, miss, dtype):
        self.cfg, self.config, self.miss, self.dtype = cfg, config, miss, dtype
        st = model_lib.structure(cfg)
        # a KV hook of a pattern with Gated DeltaNet layers (their stored states) runs on the scan only
        self._hook_pipelines = st.state_layers(("conv", "rec")) == 0

    def streams(self, valid_tokens: int) -> bool:
        """Whether a prefill call with ``valid_tokens`` real tokens streams whole layers."""
        config = self.config
        if config.experts == "resident" or config.prefill == "on_demand":
            return False
        if config.prefill == "stream":
            return True
        e = self.cfg.num_experts
        # the scan borrows 2E pool slots; the pipelined driver streams through buffers of its own
        room = config.pipelines_streams() or config.num_slots >= 2 * e
        return room and valid_tokens * self.cfg.top_k >= e

    def pipelines(self, stream: bool, prefix=(), kv: KVStep | None = None) -> bool:
        """Whether a prefill call runs on the layer-pipelined driver: ``prefill_driver`` "pipelined", or
        "auto" (for 16-bit dtypes: a float32 engine resolved it to "scan", ``EngineConfig.for_compute_dtype``)
        on a GPU for a call that streams whole layers of experts or loads a reused prefix from
        host memory (:data:`PIPELINE_PREFIX`). A prefix already on the device (the load-all-first
        ablation) runs on the scan, and so does a call with a KV hook on a model with Gated DeltaNet
        layers (their stored states load on the scan), and every call over several devices."""
        on_host = bool(prefix) and memory.memory_kind(jax.tree.leaves(prefix)[0]) in ("pinned_host", "unpinned_host")
        if (prefix and not on_host) or (kv is not None and not self._hook_pipelines):
            return False
        driver = self.config.prefill_driver
        if driver == "scan" or self.config.devices > 1:  # the experts split over a mesh run on the scan
            return False
        return driver == "pipelined" or (memory.backend() == "gpu" and (stream or (on_host and PIPELINE_PREFIX)))

    def pipelines_prefix(self) -> bool:
        """Whether calls that load a reused prefix from host memory can run on the pipelined driver (the
        stored chunks are then prepared for it: ``transfers.warm_prefix_chunks``)."""
        if not self._hook_pipelines or self.config.prefill_driver == "scan":
            return False
        return self.config.prefill_driver == "pipelined" or (memory.backend() == "gpu" and PIPELINE_PREFIX)

    def host_splits(self, tokens: int) -> bool:
        """Whether a call of ``tokens`` tokens (padding included) splits its misses on the host-split driver
        (``ftjax.runtime.host_split``): ``MissPolicyConfig.cpu_driver`` "host", experts not resident, and a
        split that computes misses on the CPU at this many (token, expert) pairs (decode steps, short
        prefill calls)."""
        config = self.config
        return (config.miss.cpu_driver == "host" and config.experts != "resident" and config.devices == 1
                and not self.miss.config.fetches_all(tokens * self.cfg.top_k, self.cfg.num_experts))

    def _graphs(self, tokens_per_row: int, batch: int) -> bool:
        if tokens_per_row != 1:
            return False
        fetches_all = self.miss.config.fetches_all(batch * self.cfg.top_k, self.cfg.num_experts)
        return programs.decode_graphs_on(self.config.kernels.decode_graphs, self.config.experts, fetches_all)

    def decode_options(self, batch: int) -> tuple:
        """The XLA ``compiler_options`` of a decode step of ``batch`` rows."""
        return programs.decode_compiler_options(self.config.kernels.decode_gemm, 1, self.dtype,
                                                graphs=self._graphs(1, batch))

    def plan(self, batch: int, tokens_per_row: int, valid_tokens: int, prefix=(), kv: KVStep | None = None,
             all_logits: bool = False) -> CallPlan:
        """The plan of a call with int32 [batch, tokens_per_row] tokens of which ``valid_tokens`` are real,
        the reused ``prefix`` chunks (``()``) and KV hook options ``kv``.

        A call that would stream but runs on the scan with fewer than the 2E slots the scan borrows loads
        its experts on demand instead (``prefill="stream"``: refused).
        Raises:
          ValueError: ``prefill="stream"`` for such a call; ``prefill_driver="pipelined"`` for a prefix-reuse call
            of a model with Gated DeltaNet layers (it runs on the scan only).
        """
        config, e = self.config, self.cfg.num_experts
        if tokens_per_row > 1 and kv is not None and not self._hook_pipelines and config.prefill_driver == "pipelined":
            raise ValueError(f"prefill_driver 'pipelined' cannot run a prefix-reuse call of {self.cfg.model_type}: "
                             f"its Gated DeltaNet layers' stored states load on the layer scan; use 'auto' or 'scan'")
        stream = tokens_per_row > 1 and self.streams(valid_tokens)
        pipelined = tokens_per_row > 1 and self.pipelines(stream, prefix, kv)
        if stream and not pipelined and config.num_slots < 2 * e:
            if config.prefill == "stream":
                raise ValueError(f"this call streams on the layer scan, which borrows 2E={2 * e} slots, but the "
                                 f"engine has {config.num_slots} (a reused prefix already on the device, or a model "
                                 f"with Gated DeltaNet layers reusing a prefix, runs on the scan); use prefill='auto' "
                                 f"or more slots")
            stream, pipelined = False, self.pipelines(False, prefix, kv)
        miss = self.miss.jit_config
        host = not stream and self.host_splits(batch * tokens_per_row)  # a streamed call fetches whole layers
        if host and kv is not None:
            # a short prefix-reuse call runs on the scan; under the host driver nothing calls the CPU from a
            # program, so it fetches its misses
            miss, host = dataclasses.replace(miss, table=tuple(range(len(miss.table)))), False
        graphs = self._graphs(tokens_per_row, batch)  # the host-split programs too: under "on" only (never fetch all)
        options = programs.decode_compiler_options(config.kernels.decode_gemm, tokens_per_row, self.dtype,
                                                   graphs=graphs)
        opts = StepOptions(config.experts, all_logits, stream, config.prefill_overlap and stream, config.cache_policy,
                           miss, kv, config.precision(jax.numpy.dtype(self.dtype).name),
                           config.kernels, cheap_conds=graphs or jax.default_backend() == "cpu", devices=config.devices,
                           expert_split=config.expert_split,
                           prefetch=config.prefetch_guesses if not stream and not host and kv is None else 0)
        d2d = pipelined and stream and config.stream_d2d_hits and config.experts != "resident"
        extra = e if stream and config.prefill_overlap and not pipelined else 0
        return CallPlan(opts, "host_split" if host else "pipelined" if pipelined else "scan", options, d2d, extra)
