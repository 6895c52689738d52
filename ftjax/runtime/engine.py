"""The engine: the owner of a model's runtime state, with a request-level API.

An :class:`Engine` holds what outlives one call: the expert state (slot pools + slot table), the batch
rows and their KV cache, the expert-cache counters, and its view of the program cache. Every call it
makes is planned once (``ftjax.runtime.plan``) and run by a driver (``ftjax.runtime.drivers``).

Request-level API (what a scheduler drives):

* :meth:`Engine.open_rows` -- a fresh state of n batch rows, all free;
* :meth:`Engine.admit` -- a prompt into a free row (its prefill calls planned; with a prefix cache,
  its reused chunks looked up and pinned);
* :meth:`Engine.advance` -- one step: the next prefill chunk of every row still prefilling, merged into
  one call with one token of every decoding row when their last tokens are given (a *mixed* call), or
  one decode step of every decoding row (``mixed=False``: the prefilling rows idle in it; or no row
  prefills); returns the logits of the rows that have a next token;
* :meth:`Engine.advance_block` -- up to k decode steps of every decoding row in one program, each row
  sampled with its own key and parameters (``ftjax.runtime.step.decode_block``); in two halves,
  :meth:`Engine.dispatch_block` and :meth:`Engine.read_block`, so that a block can be dispatched to
  continue one not read yet, fed on the device with its last tokens, keys and positions (run-ahead);
* :meth:`Engine.release` -- frees a row (its pins too).

Continuous batching (``ftjax.serve.scheduler``) admits requests into free rows while others decode: each
step runs the prefilling rows' next chunk in a prefill call (the decoding rows idle) and the decoding rows'
token in a decode call (the prefilling rows idle), so a decoding row's logits always come from the decode
program, as when it runs alone; or, as an option, both in one mixed call (the prefill program of the chunk's
bucket; the decoding rows take one token each at their position, start = pos, valid = 1): one call fewer
per chunk, but a decoding row's logits then round as that program's shapes do (bfloat16: a near-tie can
flip). Any row can reuse a stored prefix and store its new chunks (``kv_manager``): rows prefilling
at once run their chunks in one call whether they reuse, store or neither, the layerwise KV hook loading
each reusing row's own prefix into its own cache row and emitting each storing row's own new chunks
(``ftjax.kv.layerwise.HookRow``; one program per set of hooked rows, compiled at admission).

:meth:`Engine.generate` is a short loop over them; :meth:`Engine.prefill` runs a batch of prompts'
prefill into a given cache (the oracle tests read its logits of every position).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ftjax import memory
from ftjax import model as model_lib
from ftjax.checkpoint import LoadedModel
from ftjax.config import EngineConfig
from ftjax.experts import fetch, parallel, tensor_parallel
from ftjax.experts.slot_table import reset_table
from ftjax.experts.state import ExpertCounters, ExpertState, init_expert_state
from ftjax.kv.layerwise import split_runs
from ftjax.runtime import drivers, programs, transfers
from ftjax.runtime.drivers import CallArgs, RunContext
from ftjax.runtime.host_split import HostSplitTimes
from ftjax.runtime.misses import build_miss_runtime
from ftjax.runtime.plan import CallPlan, CallPlanner, PrefillCall, chunk_calls, prompt_error
from ftjax.runtime.step import RowSampling, decode_block, fixed_loop, keep_rows, sample_next
from ftjax.seams import ForwardOut, KVCache


def _int32(x):
    """x as an int32 step argument without a dispatch of its own: an int32 device array as it is, anything else
    as a numpy array, which the compiled call copies to the device with its other arguments."""
    if isinstance(x, jax.Array) and x.dtype == jnp.int32:
        return x
    return np.asarray(x, np.int32)


@functools.partial(jax.jit, donate_argnums=(0,))
def _clear_row(cache: KVCache, row):
    """``cache`` with batch row ``row``'s recurrent states zeroed (a new sequence there; its K/V rows need no
    clearing: a sequence only reads positions it wrote)."""
    if cache.conv is None:
        return cache
    return cache._replace(conv=cache.conv.at[:, row].set(0), rec=cache.rec.at[:, row].set(0))


@dataclasses.dataclass
class Row:
    """One batch row's request.

    prompt: its token ids; pending: the prefill calls not run yet (``PrefillCall``, one row each);
    pos: tokens in the cache; kv_request: its prefix-reuse request (``ftjax.kv.prefix_cache``) until
    finished; kv_outs: the new chunks of its calls so far; stats: LayerStats of its prefill calls.
    """

    prompt: list[int]
    pending: collections.deque
    pos: int = 0
    kv_manager: Any = None
    kv_request: Any = None
    kv_outs: list = dataclasses.field(default_factory=list)

    @property
    def prefilling(self) -> bool:
        return bool(self.pending)


@dataclasses.dataclass
class Advance:
    """What one :meth:`Engine.advance` did.

    kind: "prefill", "mixed" (prefill chunks and decoding rows' tokens in one call) or "decode" (the decode
    program: one token of every row done prefilling);
    logits: float32 [B, V] on the device (all positions [B, T, V] for a prefill or mixed call with
    ``all_logits``; a decoding row's are at position 0), valid for ``rows``: the rows whose next-token
    distribution it is (rows that finished their prefill in this call, and every decoding row that took
    a token); stats: the call's LayerStats (leaves [L, ...]); tokens: real tokens of the call; failed:
    rows whose work after the call failed (storing their new KV chunks), row -> error text: their
    logits are valid but their stored prefix is incomplete; the caller decides (the scheduler fails
    the request).
    """

    kind: str
    logits: jax.Array
    rows: list[int]
    stats: Any
    tokens: int = 0
    failed: dict[int, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class BlockAdvance:
    """What one :meth:`Engine.advance_block` did, read on the host.

    tokens: int32 [B, n], each row's tokens of the n steps run (n <= the limit asked for: fewer when every row
    sampled one of its stop ids); logprobs: float32 [B, n], each token's log-probability under the model's
    distribution (``log_softmax`` of the logits); keys: uint32 [B, 2], each row's key after its n draws;
    rows: the decoding rows (the others' entries mean nothing); stats: the n steps' LayerStats (leaves
    [L, ...], one per step, as :meth:`Engine.advance` returns a decode step's).
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    keys: np.ndarray
    rows: list[int]
    stats: list

    @property
    def steps(self) -> int:
        return int(self.tokens.shape[1])


@dataclasses.dataclass(eq=False)
class PendingBlock:
    """A decode block dispatched by :meth:`Engine.dispatch_block`, not read yet.

    out: the program's ``ftjax.runtime.step.DecodeBlock`` (device arrays); rows: the rows it decodes;
    owners: each batch row's :class:`Row` when it was dispatched (None: free), so that a row released or
    taken by another request since is known; limit: the steps asked for (it runs at most that many).
    """

    out: Any
    rows: list[int]
    owners: list
    limit: int


@jax.jit
def _continue_limit(stopped, ran, limit):
    """int32 []: ``limit``, or 0 when a row that ran in the block before (``ran`` int32 [B], 1 where it ran)
    has ``stopped`` (bool [B]: sampled one of its stop ids)."""
    return jnp.where(jnp.any(stopped & (ran > 0)), 0, limit).astype(jnp.int32)


@dataclasses.dataclass
class _Call:
    """One merged call of the rows (:meth:`Engine._next_call`): plan; tokens int32 [B, T]; start, valid
    int32 [B]; prefix: the reused chunks (or their shapes), every hooked row's in ``hook_rows``' order;
    took: rows running a prefill call; done: rows whose prefill ends in it; decoding: rows taking one
    decode token; hook_rows: the ``HookRow`` of each row the KV hook serves (empty: no hook)."""

    plan: CallPlan
    tokens: np.ndarray
    start: np.ndarray
    valid: np.ndarray
    prefix: tuple
    took: list[int]
    done: list[int]
    decoding: list[int]
    hook_rows: tuple = ()


@dataclasses.dataclass
class GenerationResult:
    """Output of :meth:`Engine.generate`.

    generated_ids: int [B][n_b] (each sequence up to and including its EOS, if it stopped there);
    step_logits: float32 [n, B, V] when kept, n = max_b n_b (no step after the last EOS); ttft_s,
    decode_s: seconds; prefill_tokens_per_s, decode_tokens_per_s: tokens/s summed over the batch
    (tokens after a sequence's EOS are not counted); compile_s: seconds spent compiling in this call
    (not part of the timings); routing: int32 [n][L, N, k] when traced (the prefill's routing, then
    each of the n - 1 decode steps'); step_s: seconds of each of the n - 1 decode steps (TPOT) when
    timed step by step; stop_reasons: per sequence, "eos" or "length"; expert_cache: this call's own
    expert cache figures (hits, misses, bytes_h2d, ...; ``ExpertCounters.summary``; the same n - 1
    decode steps); kv: the prefix-reuse record of the request.
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
        kernels, miss policy); default: resident, 512 tokens, batch 1.
    Raises:
      ValueError: a config that does not fit the model (``EngineConfig.for_model``).
    """

    def __init__(self, model: LoadedModel, config: EngineConfig | None = None):
        cfg = model.cfg
        self.dtype = jnp.dtype(model.params["embed"].dtype)
        self.config = (config or EngineConfig()).for_compute_dtype(self.dtype.name).for_model(cfg)
        self.model, self.cfg = model, cfg
        # devices > 1 (``ftjax.experts.parallel``, ``ftjax.experts.tensor_parallel``): the experts split over a
        # mesh; weights, KV cache and tokens replicated on it. The resident pools are the experts' only copy the
        # steps read: they get no host banks.
        self.mesh = parallel.expert_mesh(self.config.devices) if self.config.devices > 1 else None
        self.params = self._place(model.params)
        self._step_banks = model.banks
        if self.mesh is not None and self.mode == "resident":
            self._step_banks = None
        elif self.tensor_split:  # offloading: each device's pieces of every expert in host memory
            self._step_banks = tensor_parallel.shard_host_banks(model.banks, self.config.devices)
        elif self.mesh is not None:  # offloading: each device's share of the experts in host memory
            self._step_banks = parallel.shard_host_banks(model.banks, self.cfg.num_layers, self.mesh)
        self.miss = build_miss_runtime(model, self.config.miss, self.config.batch,
                                       miss_copy=self.config.kernels.miss_copy)
        self.programs = programs.Programs()
        self.planner = CallPlanner(cfg, self.config, self.miss, self.dtype)
        self.state = self._fresh_state()
        self.counters = {p: ExpertCounters.zeros(cfg.num_layers, cfg.num_experts) for p in ("prefill", "decode")}
        self.failed_steps = 0
        # prefill calls run by each driver ("host_split" once one ran: short prompts under cpu_driver "host")
        self.prefill_driver_calls = {"scan": 0, "pipelined": 0}
        self.host_split_times = HostSplitTimes()  # the host-split driver's host time by phase (its calls only)
        self._expert_views: transfers.ExpertLayerSource | None = None  # made on the first pipelined stream
        self.rows: list[Row | None] = []
        self.cache: KVCache | None = None
        self._used_rows: set[int] = set()
        self._unread: list[PendingBlock] = []  # decode blocks dispatched and not read (their rows' pos lag)

    def _place(self, x):
        """``x`` (a pytree of arrays) replicated over the engine's mesh; as it is on one device."""
        return x if self.mesh is None else jax.device_put(x, parallel.replicated(self.mesh))

    # ---- configuration, read-only views -------------------------------------------------------
    @property
    def mode(self) -> str:
        return self.config.experts

    @property
    def num_slots(self) -> int:
        return self.config.num_slots

    @property
    def tensor_split(self) -> bool:
        """Every expert split on its FFN width over several devices, one slot table replicated on them
        (``EngineConfig.expert_split`` "tensor"; ``ftjax.experts.tensor_parallel``)."""
        return self.config.devices > 1 and self.config.expert_split == "tensor"

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

    @property
    def compile_s(self) -> float:
        """Seconds this engine spent compiling (timings exclude them)."""
        return self.programs.compile_s

    def describe(self) -> dict:
        """JSON-ready run configuration: the engine config, resolved precision, miss policy, how its misses are
        copied ("kernel" or "xla", ``fetch.miss_copy_mode``; None when every expert is resident), the XLA options
        of its decode programs, the kernels that applied to its programs."""
        copy = None if self.config.experts == "resident" else fetch.miss_copy_mode(self.config.kernels.miss_copy,
                                                                                   self.config.devices)
        return {**self.config.as_dict(), "matmul_precision_resolved": self.precision, "miss_copy_resolved": copy,
                "decode_compiler_options": dict(self.planner.decode_options(self.batch)),
                "miss_policy": self.miss.policy, "compute_dtype": self.dtype.name,
                "prefix_copy_layers_resolved": self.prefix_copy_rows(),
                "kernels_applied": sorted(self.programs.kernels_applied())}

    def kernel_notes(self) -> list[str]:
        """One line for each kernel asked for by name that applied to none of this engine's programs."""
        return self.config.kernels.check_applied(self.programs.kernels_applied())

    def prefix_copy_rows(self) -> int:
        """Layers whose reused-prefix rows one copy moves on the pipelined driver: the group of
        ``EngineConfig.prefix_copy_layers`` (``transfers.copy_group_layers``) with ``prefix_copy`` "put",
        1 with "in_program" (each layer's program copies the next one's)."""
        if self.config.prefix_copy != "put":
            return 1
        return transfers.copy_group_layers(self.cfg.num_layers, self.config.prefix_copy_layers)

    @property
    def stream_copy_path(self) -> str | None:
        """How the pipelined driver copies streamed layers: "pinned_alias" (asynchronous, overlaps
        compute), "numpy_view" (waits for queued compute; the CPU backend), None: not used yet."""
        return self._expert_views.path if self._expert_views is not None else None

    # ---- expert state ----------------------------------------------------------------------
    def _fresh_state(self) -> ExpertState:
        cfg = self.cfg
        if self.tensor_split:
            return tensor_parallel.init_state(self.mode, cfg.num_layers, cfg.num_experts, self.num_slots,
                                              self.model.banks, self.config.devices)
        if self.mesh is not None:
            return parallel.init_split_state(self.mode, cfg.num_layers, cfg.num_experts, self.num_slots,
                                             self.model.banks, self.config.devices)
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
        if self.tensor_split:  # the one table, fresh and replicated over the mesh again
            self.state = self.state.replace(table=tensor_parallel.replicated_table(
                self.cfg.num_layers, self.cfg.num_experts, self.num_slots, self.config.devices))
            return
        if self.mesh is not None:  # the per-device tables, fresh and split over the mesh again
            self.state = self.state.replace(table=parallel.split_tables(
                self.cfg.num_layers, self.cfg.num_experts, self.num_slots, self.config.devices))
            return
        recency = self.state.last_routed
        self.state = self.state.replace(table=reset_table(self.state.table),
                                        last_routed=None if recency is None else jnp.full_like(recency, -1))

    def resident_experts_per_layer(self) -> list[int]:
        """How many experts of each layer sit in the slot cache now (all E when resident)."""
        cfg = self.cfg
        if self.state.table is None:
            return [cfg.num_experts] * cfg.num_layers
        if self.mesh is not None and not self.tensor_split:
            return parallel.resident_per_layer(np.asarray(self.state.table.slot_of), cfg.num_layers, cfg.num_experts)
        slot_of = np.asarray(self.state.table.slot_of).reshape(cfg.num_layers, cfg.num_experts)
        return (slot_of >= 0).sum(axis=1).tolist()

    # ---- one call ------------------------------------------------------------------------------
    def _context(self) -> RunContext:
        return RunContext(self.programs.compile, self.cfg, self.params, self._step_banks, self.config,
                          self._expert_source, self.prefix_copy_rows(), self.host_split_times)

    def _expert_source(self) -> transfers.ExpertLayerSource:
        if self._expert_views is None:
            self._expert_views = transfers.ExpertLayerSource(self.model.banks, self.cfg.num_experts)
        return self._expert_views

    def _run(self, plan: CallPlan, tokens, start, valid, cache: KVCache, prefix=()) -> ForwardOut:
        """Runs one planned call; the expert state and ``cache`` are donated to it.

        If the call raises (a device OOM, say) after its donated expert state was consumed, the
        engine starts again from an empty expert cache (counted in ``failed_steps``) so that it
        stays usable, or, when even that fails, says so on every later call (RuntimeError) rather
        than crashing on deleted buffers; the KV cache passed in is consumed either way. The error
        is re-raised. An error that the device reports only later, when an output is read, is
        not seen here.
        """
        args = CallArgs(_int32(tokens), _int32(start), _int32(valid), cache, self.state, tuple(prefix))
        out = self._donating(lambda: drivers.driver(plan).run(self._context(), plan, args))
        self.state = out.expert_state
        return out

    def _donating(self, call):
        """``call()`` (a program given the expert state to donate); on an error, the expert state rebuilt as
        :meth:`_run` says, and the error re-raised. A KeyboardInterrupt counts too: the host-split driver runs a
        call as a Python loop over layers, where Ctrl-C lands after the state was donated."""
        if self.state is None:
            raise RuntimeError("this engine lost its expert state in a failed step and could not rebuild it "
                               "(see the earlier error); build a new Engine")
        try:
            return call()
        except BaseException as err:
            self.failed_steps += 1
            if any(x.is_deleted() for x in jax.tree.leaves(self.state)):
                self.state = None
                try:  # resident mode copies the whole bank again: that can fail too (after an OOM)
                    self.state = self._fresh_state()
                except Exception as again:
                    raise RuntimeError(f"a step failed ({err!r}) and the expert state could not be rebuilt "
                                       f"({again!r}); this engine is unusable, build a new one") from err
            raise

    def new_cache(self, batch: int) -> KVCache:
        """A fresh state (KV cache, and the linear layers' states) for ``batch`` sequences."""
        return self._place(model_lib.init_kv_cache(self.cfg, batch, self.max_seq_len, self.dtype))

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

    # ---- prefill calls of a set of rows ------------------------------------------------------------
    def _row(self, prompt: Sequence[int], kv_manager=None) -> Row:
        """A row for ``prompt``: its prefill calls (a prefix-reuse request's, or plain chunks).
        Raises:
          ValueError: prefix reuse on an engine over several devices (its KV hook is one device's)."""
        if kv_manager is not None and self.mesh is not None:
            raise ValueError(f"KV prefix reuse (kv_manager) over devices={self.config.devices} is not built yet; "
                             f"use devices=1")
        prompt = [int(t) for t in prompt]
        row = Row(prompt, collections.deque())
        if kv_manager is not None:
            row.kv_manager, row.kv_request = kv_manager, kv_manager.begin(self, [prompt])
            row.pending.extend(row.kv_request.calls)
        else:
            row.pending.extend(chunk_calls(len(prompt), self.config.prefill_chunk))
        return row

    def _next_call(self, rows: Sequence[Row | None], all_logits: bool, spec: bool = False,
                   last: np.ndarray | None = None) -> _Call:
        """The merged call of the head prefill calls of ``rows`` (one per batch row; None or done rows take no
        prefill token), the prefix's shapes instead of its chunks with ``spec``.

        The KV hook serves every row whose head call loads a reused prefix or stores new chunks, each with its
        own prefix and new chunks (``ftjax.kv.layerwise.HookRow``), when they share a prefix cache (rows of
        another one wait a call, valid 0); a prefix-reuse row's call that does neither runs as a plain one.
        last: int32 [B], each row's last token, or None; given, every row done prefilling takes that token at
        its position (start = pos, valid = 1).
        """
        heads = [r.pending[0] if r is not None and r.pending else None for r in rows]
        hooked = [h is not None and r.kv_request is not None and (h.with_prefix or h.store_chunks > 0)
                  for h, r in zip(heads, rows)]
        manager = next((rows[i].kv_manager for i, x in enumerate(hooked) if x), None)
        hook_rows = [i for i, x in enumerate(hooked) if x and rows[i].kv_manager is manager]
        heads = [None if hooked[i] and i not in hook_rows else h for i, h in enumerate(heads)]
        width = max(h.bucket for h in heads if h is not None)
        b = len(rows)
        tokens = np.zeros((b, width), np.int32)
        start = np.array([h.start if h else (r.pos if r else 0) for h, r in zip(heads, rows)], np.int32)
        valid = np.array([h.valid[0] if h else 0 for h in heads], np.int32)
        decoding = [] if last is None else [i for i, r in enumerate(rows) if r is not None and not r.pending]
        for i in decoding:
            tokens[i, 0], valid[i] = last[i], 1
        kv, prefix, parts = None, (), ()
        for i, (h, r) in enumerate(zip(heads, rows)):
            if h is not None:
                tokens[i, :valid[i]] = r.prompt[h.start:h.start + valid[i]]
        if hook_rows:
            parts = tuple(manager.hook_row(rows[i].kv_request, heads[i], i) for i in hook_rows)
            for i in hook_rows:
                if heads[i].with_prefix:
                    req = rows[i].kv_request
                    prefix += manager.prefix_spec(self, req) if spec else manager.load_prefix(req)
            kv = manager.step_options(parts)
        plan = self.planner.plan(b, width, int(valid.sum()), prefix, kv, all_logits)
        took = [i for i, h in enumerate(heads) if h is not None]
        done = [i for i in took if len(rows[i].pending) == 1]
        return _Call(plan, tokens, start, valid, prefix, took, done, decoding, parts)

    @staticmethod
    def _moved(rows: Sequence[Row | None], call: _Call) -> None:
        """Advances ``rows`` past ``call``: its prefill calls popped, positions moved on."""
        for i in call.took:
            head = rows[i].pending.popleft()
            rows[i].pos = head.start + head.valid[0]
        for i in call.decoding:
            rows[i].pos += 1

    @staticmethod
    def _row_outputs(call: _Call, kv_out) -> dict[int, tuple]:
        """Each hooked row's new chunks out of a call's ``kv_out`` (the rows' chunks one after another, in
        ``call.hook_rows``' order): row -> its ``store_chunks`` entries."""
        runs = split_runs(() if kv_out is None else kv_out, [part.store_chunks for part in call.hook_rows])
        return {part.row: run for part, run in zip(call.hook_rows, runs)}

    def _prefill_step(self, rows: Sequence[Row | None], cache: KVCache, all_logits: bool, last=None):
        """Runs the next merged call of ``rows`` (:meth:`_next_call`) on ``cache``; advances them.
        Returns (the call's ForwardOut, the :class:`_Call`)."""
        call = self._next_call(rows, all_logits, last=last)
        plan = call.plan
        out = self._run(plan, call.tokens, call.start, call.valid, cache, call.prefix)
        self.prefill_driver_calls[plan.driver] = self.prefill_driver_calls.get(plan.driver, 0) + 1
        self.counters["prefill"].add(out.layer_stats)
        self.counters["prefill"].extra_copies += plan.extra_copies
        outs = self._row_outputs(call, out.kv_out)
        for i in call.took:
            if rows[i].kv_request is not None:  # only the KV hook's new chunks outlive the call
                rows[i].kv_outs.append(outs.get(i))
        self._moved(rows, call)
        return out, call

    def _finish_kv(self, row: Row, failed: bool = False) -> None:
        """Ends a row's prefix-reuse request: stores its new chunks (none after a failure), unpins its hits."""
        if row.kv_request is None:
            return
        req, manager = row.kv_request, row.kv_manager
        row.kv_request = None
        # on the pipelined driver the new chunks' per-layer aliases are made as they are stored, not inside
        # the TTFT of a later request that reuses them
        warm = functools.partial(transfers.warm_prefix_chunks, rows=self.prefix_copy_rows())
        complete = not failed and len(row.kv_outs) == len(req.calls)
        manager.finish(req, row.kv_outs if complete else None,
                       prepare=warm if self.planner.pipelines_prefix() else None)

    def _precompile(self, rows: Sequence[Row | None], cache: KVCache, decode: bool = True,
                    mixed: bool = False) -> None:
        """Compiles every program the pending prefill calls of ``rows`` and (with ``decode``) the decode step
        after them will run, so that timings exclude compilation (nothing runs). With ``mixed``, also the
        programs of those calls when the rows that are not prefilling in them decode a token each (the
        plan can change with the call's token count: whether it streams whole layers)."""
        sim = [None if r is None else dataclasses.replace(r, pending=collections.deque(r.pending)) for r in rows]
        seen = set()
        ctx = self._context()
        b = len(rows)
        while any(r is not None and r.pending for r in sim):
            call = self._next_call(sim, False, spec=True)
            idle = b - len(call.took) if mixed else 0
            for extra in range(idle + 1):
                valid = call.valid.copy()
                valid[[i for i in range(b) if i not in call.took][:extra]] = 1
                plan = call.plan if extra == 0 else self.planner.plan(
                    b, call.tokens.shape[1], int(valid.sum()), call.prefix, call.plan.opts.kv, False)
                key = (call.tokens.shape, plan,
                       tuple(jax.tree.map(lambda x: (x.shape, x.dtype, str(x.sharding)), call.prefix)))
                if key not in seen:
                    seen.add(key)
                    args = CallArgs(call.tokens, call.start, valid, cache, self.state, call.prefix)
                    drivers.driver(plan).precompile(ctx, plan, args)
            self._moved(sim, call)
        if decode:
            plan = self.planner.plan(b, 1, b)
            args = CallArgs(np.zeros((b, 1), np.int32), np.zeros(b, np.int32), np.ones(b, np.int32), cache,
                            self.state)
            drivers.driver(plan).precompile(ctx, plan, args)

    # ---- the request-level API -----------------------------------------------------------------------
    def open_rows(self, n: int | None = None) -> None:
        """A fresh state of ``n`` batch rows (default ``EngineConfig.batch``), all free; rows of an earlier
        state are dropped (their prefix-reuse pins released).
        Raises:
          ValueError: n outside [1, EngineConfig.batch]."""
        n = self.batch if n is None else n
        if not 1 <= n <= self.batch:
            raise ValueError(f"rows must be in [1, {self.batch}] (EngineConfig.batch), got {n}")
        for i, r in enumerate(self.rows):
            if r is not None:
                self.release(i)
        self.rows = [None] * n
        self.cache = self.new_cache(n)
        self._used_rows = set()
        self._unread = []

    def admit(self, prompt: Sequence[int], max_new_tokens: int = 1, kv_manager=None) -> int:
        """Puts a request into the lowest free row; returns the row. Its prefill runs in the coming
        :meth:`advance` calls. With ``kv_manager`` (``ftjax.kv.prefix_cache.PrefixCache``) its stored prefix
        is looked up and pinned now, loaded layer by layer during its first prefill call, and its new
        chunks stored when its prefill ends (any row; rows prefilling together share their calls, see the
        module docstring). Its pins are released when its prefill ends, by :meth:`release`, or when a call fails.

        Raises:
          ValueError: a bad prompt (empty, ids outside the vocabulary, longer than the cache with
            ``max_new_tokens``); RuntimeError: no free row; no rows opened (:meth:`open_rows`)."""
        if not self.rows:
            raise RuntimeError("no batch rows: call open_rows() first")
        problem = prompt_error(prompt, self.cfg.vocab_size, max_new_tokens, self.max_seq_len, "max_seq_len")
        if problem:
            raise ValueError(problem)
        free = [i for i, r in enumerate(self.rows) if r is None]
        if not free:
            raise RuntimeError("no free batch row")
        i = free[0]
        self.rows[i] = self._row(prompt, kv_manager)
        if i in self._used_rows:  # a new sequence in a used row: its recurrent states start from zero
            self.cache = _clear_row(self.cache, i)
        self._used_rows.add(i)
        return i

    def prefilling(self) -> bool:
        """Whether any row has prefill calls left."""
        return any(r is not None and r.pending for r in self.rows)

    def precompile(self, mixed: bool = False, decode: bool = True) -> None:
        """Compiles what the admitted rows' prefill and (``decode``) the decode step after it will run (outside
        any timing; releases prefix-reuse pins if compiling fails). mixed: also the mixed calls of those prefill
        calls with the other rows decoding (:meth:`advance` with tokens)."""
        try:
            self._precompile(self.rows, self.cache, decode=decode, mixed=mixed)
        except BaseException:
            self._fail_kv_requests()
            raise

    def advance(self, tokens=None, all_logits: bool = False, mixed: bool = True) -> Advance:
        """One step of the running rows; returns the :class:`Advance` (its logits on the device).

        * Some rows still prefill, ``tokens`` None: one merged call of their next prefill calls ("prefill");
          the rows done prefilling wait (valid 0), as :meth:`generate` runs its prompts.
        * Some rows still prefill, ``tokens`` given: one *mixed* call ("mixed"): the prefilling rows take
          their next prefill chunk and every row done prefilling takes its last token at its position
          (start = pos, valid = 1); the logits of such a row are those of its one token. The call is the
          prefill program of the chunk's bucket, so a decoding row's time per token during an admission is
          one prefill-chunk call (``EngineConfig.prefill_chunk`` bounds it).
        * Some rows still prefill, ``tokens`` given, ``mixed`` False: one decode step of the rows done
          prefilling ("decode"; the decode program, :meth:`_decode_step`), the prefilling rows idle in it
          (valid 0): their state is left as it was, their prefill goes on in the next call without tokens.
          A decoding row's logits are then those of the decode program, whatever the other rows do.
        * No row prefills: one decode step of every decoding row with ``tokens`` ("decode"; the decode
          program, nothing waits for its logits).

        tokens: int32 [B, 1] (a device array or numpy), each row's last token; entries of other rows are
        ignored. A mixed call reads them on the host (it waits for a device array). Rows reusing a stored
        prefix or storing new chunks run in the same call as the others (module docstring). If the call
        raises, every row's prefix-reuse request is ended (pins released, nothing stored) and the KV cache
        was consumed: release the rows (or :meth:`open_rows` again) before going on.
        Raises:
          ValueError: a decode step without ``tokens``, or with ``mixed`` False while rows prefill and none is
            done, or tokens of another shape than [B, 1].
          RuntimeError: a decode block of a running row dispatched and not read (:meth:`read_block`).
        """
        rows = self.rows
        self._check_read(range(len(rows)))
        prefilling = self.prefilling()
        last = None
        if tokens is not None and prefilling and not mixed:
            if all(r is None or r.pending for r in rows):
                raise ValueError("a decode step needs a row done prefilling")
            return self._decode_step(tokens)
        if tokens is not None and prefilling:
            self._check_tokens(tokens)
            last = np.asarray(tokens)[:, 0].astype(np.int32)
        if prefilling:
            try:
                out, call = self._prefill_step(rows, self.cache, all_logits, last)
            except BaseException:
                self._fail_kv_requests()
                raise
            self.cache = out.cache
            failed = {}
            for i in call.done:
                try:
                    self._finish_kv(rows[i])
                except Exception as err:  # noqa: BLE001 - that row's own work: reported, the call's rows go on
                    failed[i] = f"{type(err).__name__}: {err}"[:500]
            return Advance("mixed" if call.decoding else "prefill", out.logits, sorted(call.done + call.decoding),
                           out.layer_stats, int(call.valid.sum()), failed)
        if tokens is None:
            raise ValueError("a decode step needs the rows' last tokens")
        return self._decode_step(tokens)

    def _check_tokens(self, tokens) -> None:
        """Raises ValueError unless ``tokens`` has the shape [B, 1] (each row's last token)."""
        if np.shape(tokens) != (len(self.rows), 1):
            raise ValueError(f"tokens must be int32 [{len(self.rows)}, 1] (each row's last token), got shape "
                             f"{np.shape(tokens)}")

    def _fail_kv_requests(self) -> None:
        """Ends every row's prefix-reuse request as failed (pins released, nothing stored): after a call that
        raised (it consumed the KV cache) or programs that failed to compile."""
        for r in self.rows:
            if r is not None:
                self._finish_kv(r, failed=True)

    def _decode_step(self, tokens) -> Advance:
        """One decode step (the decode program) of every row done prefilling, with ``tokens`` (int32 [B, 1]);
        free rows and rows still prefilling idle (valid 0).

        What an idle row's state gets (every layer kind, both drivers): the Gated DeltaNet layers' conv and
        recurrent states are left bit for bit (``ftjax.layers.gated_deltanet``: beta = 0 and g = 0, the conv
        window slid by 0 tokens); the expert function routes none of its token (no slot lookup, fetch, LRU
        use or stats: ``LayerRouting.valid``); its ``Row.pos`` stays. Attention writes every row's K/V at its
        position, an idle row's included: a prefilling row's is put at the start of its next prefill call,
        which writes that position again before anything reads it, so its sequence reads none of it (a free
        row's at 0, rewritten by its next request's first call)."""
        rows = self.rows
        decoding = [i for i, r in enumerate(rows) if r is not None and not r.pending]
        live = np.zeros(len(rows), np.int32)
        live[decoding] = 1
        pos = np.array([0 if r is None else r.pending[0].start if r.pending else r.pos for r in rows], np.int32)
        self._check_tokens(tokens)
        plan = self.planner.plan(len(rows), 1, len(decoding))
        try:
            out = self._run(plan, tokens, pos, live, self.cache)
        except BaseException:  # the cache was consumed: end the prefilling rows' prefix-reuse requests too
            self._fail_kv_requests()
            raise
        self.cache = out.cache
        for i in decoding:
            rows[i].pos += 1
        return Advance("decode", out.logits, decoding, out.layer_stats, len(decoding))

    def release(self, row: int) -> None:
        """Frees ``row`` (an unfinished prefix-reuse request's pins are released, nothing stored); the row is
        free even if releasing the pins raises."""
        r, self.rows[row] = self.rows[row], None
        if r is not None:
            self._finish_kv(r, failed=True)

    # ---- a batch prefill into a given cache -----------------------------------------------------------
    def prepare_prefill(self, prompts: Sequence[Sequence[int]], cache, kv_manager=None):
        """Compiles every program a prefill of ``prompts`` and the decode after it need (so that timings
        exclude compilation). With ``kv_manager``, first plans the prefix-reuse request
        (``kv_manager.begin``: lookup, pin) and returns it for :meth:`prefill`; else None."""
        rows = self._rows_for(prompts, kv_manager)
        try:
            self._precompile(rows, cache)
        except BaseException:
            self._finish_kv(rows[0], failed=True)
            raise
        return rows[0].kv_request

    def _rows_for(self, prompts, kv_manager=None, request=None) -> list[Row]:
        if kv_manager is not None and len(prompts) != 1:
            raise ValueError(f"KV prefix reuse runs one request at a time (batch 1), got {len(prompts)} prompts")
        if request is None:
            return [self._row(p, kv_manager) for p in prompts]
        row = Row([int(t) for t in prompts[0]], collections.deque(request.calls), kv_manager=kv_manager,
                  kv_request=request)
        return [row]

    def plan_prefill(self, prompts: Sequence[Sequence[int]]) -> list[PrefillCall]:
        """The merged calls of a plain prefill of ``prompts``: chunks of at most ``prefill_chunk`` tokens,
        each right-padded to a bucket (a sequence already complete has 0 valid tokens in later calls)."""
        rows = self._rows_for(prompts)
        calls = []
        while any(r.pending for r in rows):
            heads = [r.pending.popleft() if r.pending else None for r in rows]
            start = next(h.start for h in heads if h is not None)
            calls.append(PrefillCall(start, tuple(h.valid[0] if h else 0 for h in heads),
                                     max(h.bucket for h in heads if h is not None)))
        return calls

    def prefill(self, prompts: Sequence[Sequence[int]], cache, all_logits: bool = False, kv_manager=None,
                request=None):
        """Prefills a batch of prompts into ``cache`` (consumed) through merged calls of their chunks, or,
        with a prefix-reuse ``request`` of ``kv_manager`` (batch 1), through the request's calls: the reused
        prefix loads layer by layer inside the first call and new full chunks are stored at the end.

        Returns (logits, cache, lengths, stats): logits float32 [B, V] of each prompt's last token
        ([B, T, V] with all_logits: T the tokens computed, the longest prompt less any reused prefix);
        stats: one LayerStats per call.
        Raises:
          ValueError: a request without its manager (or the reverse), or prompts that differ from the
            request's.
        """
        if (kv_manager is None) != (request is None):
            raise ValueError("prefix reuse needs both kv_manager and the request that "
                             "prepare_prefill(prompts, cache, kv_manager) returned")
        if request is not None and [list(map(int, p)) for p in prompts] != [request.prompt]:
            raise ValueError("the prompts differ from the ones the prefix-reuse request was planned for")
        if request is not None and request.finished:
            raise RuntimeError("this request's prefill already ran")
        rows = self._rows_for(prompts, kv_manager, request)
        lengths = np.array([len(p) for p in prompts], np.int32)
        logits, stats, pieces = None, [], []
        try:
            while any(r.pending for r in rows):
                out, call = self._prefill_step(rows, cache, all_logits)
                cache = out.cache
                stats.append(out.layer_stats)
                if all_logits:
                    pieces.append(out.logits[:, : int(call.valid.max())])
                elif logits is None:
                    logits = out.logits
                else:  # keep each sequence's logits from the call its prompt ends in
                    ends = np.zeros(len(rows), bool)
                    ends[call.done] = True
                    logits = keep_rows(ends, out.logits, logits)
        except BaseException:
            self._finish_kv(rows[0], failed=True)
            raise
        self._finish_kv(rows[0])
        if all_logits:
            logits = jnp.concatenate(pieces, axis=1)
        return logits, cache, lengths, stats

    # ---- generation ---------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, keep_logits: bool = False,
                 trace_routing: bool = False, time_steps: bool = False, kv_manager=None,
                 eos_ids: Sequence[int] = (), top_k: int = 0) -> GenerationResult:
        """Prefill + decode up to ``max_new_tokens`` tokens for each prompt: every prompt admitted into a
        row of a fresh state, then :meth:`advance` until done.

        TTFT is measured from the prefill's dispatch to the first sampled token being ready;
        decode time from then to the last token. Compilation is excluded and reported apart.
        ``time_steps`` waits for every decode step to finish and records its duration (adds one
        host sync per step; without it steps are dispatched asynchronously).
        With ``kv_manager`` (``ftjax.kv.prefix_cache.PrefixCache``, batch 1) the prefill reuses
        stored prefix KV and stores new chunks; its key lookup time is added to TTFT.
        ``eos_ids``: a sequence stops after generating one of these ids (its stop reason is
        "eos"; what it generates after it is dropped and not counted); decoding ends when every
        sequence stopped. The check reads the token before the one just dispatched, so decode
        stays asynchronous; at most one step runs after the last sequence stopped. That step's
        token is dropped, and so are its logits, routing, step time and expert-cache counters: the
        result and the engine's counters cover the steps up to the last token emitted
        (``step_logits`` has max(len(generated_ids[b])) steps), though its copies did move the slot
        table.
        Sampling (``ftjax.sampling.sample``): ``temperature`` (0: greedy), ``top_p``, ``top_k`` (0: no
        limit), one key from ``seed`` for the batch, taken as given (a checkpoint's defaults are applied
        by the caller: ``LoadedModel.sampling_defaults.resolve``).
        """
        self.check_prompts(prompts, max_new_tokens)
        if kv_manager is not None and len(prompts) != 1:
            raise ValueError(f"KV prefix reuse runs one request at a time (batch 1), got {len(prompts)} prompts")
        b = len(prompts)
        compile_before = self.compile_s
        before = {p: c.copy() for p, c in self.counters.items()}
        self.open_rows(b)
        for p in prompts:
            self.admit(p, max_new_tokens, kv_manager)
        req = self.rows[0].kv_request
        self.precompile(decode=not self._blocks_decode(b, max_new_tokens))
        try:
            self._warm_sampling(b, temperature, top_p, top_k)
            if self._blocks_decode(b, max_new_tokens):
                eos = np.asarray(list(eos_ids), np.int64)
                args = self._block_args(np.zeros((b, 1), np.int32), jax.random.key(0), 1, eos, np.zeros(b, bool))
                for fixed in self._block_loops(max_new_tokens - 1, bool(eos.size)):
                    self._block_program(args, (temperature, top_p, top_k), keep_logits, fixed=fixed)
        except BaseException:
            self.release(0)
            raise
        key = jax.random.key(seed)
        t0 = time.perf_counter()
        logits, stats, lengths = None, [], np.array([len(p) for p in prompts])
        while self.prefilling():
            adv = self.advance()
            stats.append(adv.stats)
            ends = np.zeros(b, bool)
            ends[adv.rows] = True
            logits = adv.logits if logits is None else keep_rows(ends, adv.logits, logits)
        tok, key = sample_next(logits, key, temperature, top_p, top_k)  # int32 [B, 1]
        tok.block_until_ready()
        t_first = time.perf_counter()
        ttft = t_first - t0 + (req.lookup_s if req is not None else 0.0)
        routing = [np.concatenate([np.asarray(st.routed_ids) for st in stats], axis=1)] if trace_routing else None
        toks, all_logits, decode_stats = [tok], [logits] if keep_logits else None, []
        eos = np.asarray(list(eos_ids), np.int64)
        stopped = np.zeros(b, bool)  # sequences known (one step late) to have generated an EOS
        step_s = [] if time_steps else None
        try:
            if self._blocks_decode(b, max_new_tokens):
                self._decode_in_blocks(tok, key, max_new_tokens - 1, eos, (temperature, top_p, top_k), keep_logits,
                                       toks, decode_stats, all_logits, step_s)
            else:
                for _ in range(max_new_tokens - 1):
                    if eos.size and len(toks) >= 2:
                        # The token before the one just dispatched: its step has finished, so reading
                        # it does not stall the device queue (decode stays asynchronous).
                        stopped |= np.isin(np.asarray(toks[-2])[:, 0], eos)
                        if stopped.all():
                            break
                    ts = time.perf_counter()
                    adv = self.advance(tok)
                    tok, key = sample_next(adv.logits, key, temperature, top_p, top_k)
                    toks.append(tok)
                    decode_stats.append(adv.stats)
                    if keep_logits:
                        all_logits.append(adv.logits)
                    if time_steps:
                        tok.block_until_ready()
                        step_s.append(time.perf_counter() - ts)
            jax.block_until_ready(toks)
            gen = np.concatenate([np.asarray(t) for t in toks], axis=1)
            is_eos = np.isin(gen, eos) if eos.size else np.zeros(gen.shape, bool)
            done_at = np.where(is_eos.any(axis=1), is_eos.argmax(axis=1), -1)  # each sequence's first EOS
            ends = np.where(done_at >= 0, done_at + 1, gen.shape[1])
            # decode steps that produced an emitted token (not the one run after the last EOS)
            decode_stats = decode_stats[: int(ends.max()) - 1]
        finally:  # the steps that ran moved the slot table: count them even if a later one failed
            for s in decode_stats:
                self.counters["decode"].add(s)
            for i in range(b):
                self.release(i)
        decode_s = time.perf_counter() - t_first
        steps = int(ends.max())  # tokens of the longest sequence: one per kept step
        if trace_routing:
            routing += [np.asarray(s.routed_ids) for s in decode_stats]
        if keep_logits:
            all_logits = all_logits[:steps]
        if time_steps:
            step_s = step_s[: steps - 1]
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

    # ---- decode blocks: several steps per program ----------------------------------------------
    def _blocks_decode(self, batch: int, max_new_tokens: int) -> bool:
        """Whether :meth:`generate` decodes in blocks (``EngineConfig.decode_block`` > 1, more than one
        decode step, and decode steps on the layer scan)."""
        return self.config.decode_block > 1 and max_new_tokens > 2 and self.blocks_decode(batch)

    def blocks_decode(self, batch: int | None = None) -> bool:
        """Whether decode steps of ``batch`` rows (default: the open rows, else ``EngineConfig.batch``) can run
        in blocks (:meth:`dispatch_block`): they run on the layer scan, not on the host-split driver
        (``MissPolicyConfig.cpu_driver`` "host"), which is one program per layer and host step."""
        batch = batch or len(self.rows) or self.batch
        return self.planner.plan(batch, 1, batch).driver == "scan"

    def _block_args(self, tokens, key, limit, eos: np.ndarray, stopped, rows=None, pos=None) -> tuple:
        """The arguments of :func:`ftjax.runtime.step.decode_block` for the rows as they are now: ``rows`` decode
        (default every row held), the others idle; ``pos``: the rows' positions (default the host's)."""
        live = np.array([r is not None for r in self.rows]) if rows is None else np.isin(np.arange(len(self.rows)),
                                                                                           list(rows))
        if pos is None:
            pos = np.array([r.pos if r is not None else 0 for r in self.rows], np.int32)
        eos = np.asarray(eos if eos.size else [-1], np.int32)
        return (self.params, self._step_banks, self.cache, self.state, _int32(tokens), _int32(pos),
                live.astype(np.int32), key, _int32(limit), eos, stopped)

    def _block_program(self, args: tuple, sampling: tuple, keep_logits: bool, steps: int | None = None,
                       fixed: bool = False):
        """The compiled :func:`ftjax.runtime.step.decode_block` of ``steps`` steps at most (default
        ``EngineConfig.decode_block``) for these arguments; ``sampling``: its static (temperature, top_p, top_k);
        fixed: its loop runs ``steps`` iterations whatever the limit (``decode_block``'s ``fixed``)."""
        b = len(self.rows)
        plan = self.planner.plan(b, 1, b)
        temperature, top_p, top_k = sampling
        return self.programs.compile(decode_block, args, compiler_options=plan.compiler_options, cfg=self.cfg,
                                     opts=plan.opts, steps=steps or self.config.decode_block, temperature=temperature,
                                     top_p=top_p, top_k=top_k, keep_logits=keep_logits, fixed=fixed)

    def _block_loops(self, steps: int, has_eos: bool) -> set[bool]:
        """The loop forms (``decode_block``'s ``fixed``) of a generate's blocks over ``steps`` decode steps."""
        block, loop = self.config.decode_block, self.config.kernels.decode_loop
        return {fixed_loop(loop, has_eos, full) for full in ([True] * (steps >= block) + [False] * (steps % block > 0))}

    def _lag(self, i: int) -> int:
        """Steps row ``i``'s blocks not read yet may have moved it past its host ``pos`` (at most)."""
        return sum(p.limit for p in self._unread if i in p.rows and p.owners[i] is self.rows[i])

    def _check_read(self, rows) -> None:
        """Raises RuntimeError when a block of one of ``rows`` (still held by the request it ran for) is unread."""
        lagging = [i for i in rows if self.rows[i] is not None and self._lag(i)]
        if lagging:
            raise RuntimeError(f"rows {lagging} have a decode block dispatched and not read (read_block first)")

    def advance_block(self, tokens, sampling: RowSampling, limit: int, eos, steps: int | None = None) -> BlockAdvance:
        """Up to ``limit`` decode steps of every decoding row in one program (``ftjax.runtime.step.decode_block``:
        each step's token fed straight back, each row drawn with its own key and parameters as
        ``ftjax.runtime.step.sample_rows_next`` draws it), read on the host; the rows' positions move on by the
        steps run. The same tokens, logits and expert-state updates as that many :meth:`advance` decode steps
        with that draw after each. The program ends early once every row sampled one of its ``eos`` ids; a row
        that did still decodes while others run (its later tokens are the caller's to drop).
        :meth:`dispatch_block` then :meth:`read_block` (arguments and errors: theirs).
        """
        return self.read_block(self.dispatch_block(tokens, sampling, limit, eos, steps))

    def dispatch_block(self, tokens, sampling: RowSampling, limit: int, eos, steps: int | None = None,
                       rows: Sequence[int] | None = None, after: PendingBlock | None = None) -> PendingBlock:
        """Dispatches a decode block (:meth:`advance_block`) without reading it; :meth:`read_block` reads it.

        tokens: int32 [B, 1], each row's last token; sampling: a :class:`ftjax.runtime.step.RowSampling` of the
        B rows (free rows: any values); limit: steps to run, in [1, steps]; eos: int32 [B, N], each row's stop
        ids (-1 pads); steps: the program's most steps (default ``EngineConfig.decode_block``: one compiled
        program serves every limit up to it); rows: the rows to decode (default every row held; the others
        stay idle: their tokens, keys and positions pass through). after: a block not read yet that this one
        continues on the device: its last tokens, keys and positions feed this one (``tokens`` and
        ``sampling.keys`` are then ignored: None will do), and this block runs no step at all if a row of
        ``after`` sampled one of its stop ids there (a stop the device knows ends the run-ahead; the caller
        reads ``after`` and goes on from the host).
        Raises:
          ValueError: a row still prefilling, decode steps on the host-split driver, no row to decode or one not held,
            limit outside [1, steps], a row whose block would run past the KV cache (``max_seq_len``, counting
            blocks not read yet), eos not int32 [B, N], or (with ``after``) a row held by another request than
            when ``after`` ran.
          RuntimeError: without ``after``, a block of a row to decode dispatched and not read.
        """
        steps = steps or self.config.decode_block
        held = [i for i, r in enumerate(self.rows) if r is not None]
        rows = held if rows is None else sorted(int(i) for i in rows)
        if self.prefilling():
            raise ValueError("a decode block runs decode steps only: a row is still prefilling (use advance)")
        if not self.blocks_decode():
            raise ValueError("decode steps here run on the host-split driver (MissPolicyConfig.cpu_driver 'host'), "
                             "one host step per layer: a decode block cannot run them (use advance)")
        if not rows:
            raise ValueError("advance_block: no decoding row")
        if not set(rows) <= set(held):
            raise ValueError(f"rows {sorted(set(rows) - set(held))} hold no request")
        if isinstance(limit, bool) or not 1 <= int(limit) <= steps:
            raise ValueError(f"limit must be in [1, {steps}] (the block's steps), got {limit!r}")
        if after is None:
            self._check_read(rows)
        elif any(after.owners[i] is not self.rows[i] for i in rows):
            raise ValueError("a block continues another only for the requests that held its rows then")
        last = max(self.rows[i].pos + self._lag(i) for i in rows) + int(limit)
        if last > self.max_seq_len:
            raise ValueError(f"a block of {limit} steps runs a row to position {last}, past max_seq_len "
                             f"{self.max_seq_len}")
        eos = np.asarray(eos, np.int32)
        if eos.ndim != 2 or eos.shape[0] != len(self.rows) or eos.shape[1] < 1:
            raise ValueError(f"eos must be int32 [{len(self.rows)}, N >= 1] (each row's stop ids), got shape "
                             f"{eos.shape}")
        stopped = np.zeros(len(self.rows), bool)
        if after is None:
            args = self._block_args(tokens, sampling, np.int32(limit), eos, stopped, rows)
        else:
            ran = np.isin(np.arange(len(self.rows)), after.rows).astype(np.int32)
            gated = _continue_limit(after.out.stopped, ran, np.int32(limit))
            args = self._block_args(after.out.last, sampling._replace(keys=after.out.key.keys), gated, eos, stopped,
                                    rows, after.out.pos)
        # the data-dependent loop end: a block run ahead is gated to no step on the device when a row stopped
        # before it, which a fixed trip count would run whole with every row idle (KernelConfig.decode_loop)
        exe = self._block_program(args, (0.0, 1.0, 0), False, steps)
        out = self._donating(lambda: exe(*args))
        self.cache, self.state = out.cache, out.state
        pending = PendingBlock(out, rows, list(self.rows), int(limit))
        self._unread.append(pending)
        return pending

    def read_block(self, pending: PendingBlock) -> BlockAdvance:
        """Reads a dispatched block on the host (waiting for it): its tokens, logprobs, keys and stats
        (:class:`BlockAdvance`, ``rows``: the rows it decoded); the positions of its rows still held by the
        requests it ran for move on by the steps it ran. An error the device reports is raised here."""
        if pending in self._unread:
            self._unread.remove(pending)
        out = pending.out
        # one read of everything: every transfer is started before the first is waited for
        n_run, tokens, logprobs, keys, stats = jax.device_get((out.n_run, out.tokens, out.logprobs, out.key.keys,
                                                               out.stats))
        n = int(n_run)
        for i in pending.rows:
            if self.rows[i] is not None and self.rows[i] is pending.owners[i]:
                self.rows[i].pos += n
        return BlockAdvance(tokens[:, :n], logprobs[:, :n], keys, list(pending.rows),
                            [jax.tree.map(lambda x: x[j], stats) for j in range(n)])  # noqa: B023

    def discard_block(self, pending: PendingBlock) -> None:
        """Forgets a dispatched block without reading it (its rows' requests all ended: nothing of it is wanted).
        Raises:
          ValueError: a row it decoded is still held by the request it ran for."""
        if any(self.rows[i] is not None and self.rows[i] is pending.owners[i] for i in pending.rows):
            raise ValueError("a block of a running request is read, not discarded")
        if pending in self._unread:
            self._unread.remove(pending)

    def precompile_block(self, steps: int, eos_width: int) -> None:
        """Compiles :meth:`advance_block`'s program for the open rows, ``steps`` steps at most and ``eos_width``
        stop ids a row, and the run-ahead's limit (outside any timing; no row is decoded)."""
        b = len(self.rows)
        sampling = RowSampling(np.zeros((b, 2), np.uint32), np.zeros(b, np.float32), np.ones(b, np.float32),
                               np.zeros(b, np.int32))
        args = self._block_args(np.zeros((b, 1), np.int32), sampling, np.int32(1),
                                np.full((b, eos_width), -1, np.int32), np.zeros(b, bool))
        self._block_program(args, (0.0, 1.0, 0), False, steps)
        _continue_limit(memory.to_device(np.zeros(b, bool)), np.zeros(b, np.int32), np.int32(1)).block_until_ready()

    def _decode_in_blocks(self, tok, key, steps: int, eos: np.ndarray, sampling: tuple, keep_logits: bool,
                          toks: list, decode_stats: list, all_logits: list | None, step_s: list | None) -> None:
        """:meth:`generate`'s decode loop as blocks of ``EngineConfig.decode_block`` steps
        (``ftjax.runtime.step.decode_block``): up to ``steps`` steps after ``tok`` (int32 [B, 1] on the device).
        Blocks are dispatched back to back (two in flight; one with EOS ids under the fixed loop, below); a block's
        steps after every row sampled an EOS id run no token, and the host stops dispatching when a finished block
        says so. Appends each step's tokens ([B, 1]), stats and (with ``keep_logits``) logits to the lists, as the
        step-by-step loop does; with ``step_s`` each step of a block is given the block's time over its steps (one
        host sync a block).
        A block under the fixed loop (``KernelConfig.decode_loop``, ``ftjax.runtime.step.fixed_loop``: every block
        under "fixed", a full block without EOS ids under "auto" on a GPU) runs ``decode_block`` iterations (a shorter
        block's extra ones and those after every row stopped idle: their compute is spent, their outputs are not),
        so under "fixed" with EOS ids the host reads each block's stop flags before dispatching the next (one block
        in flight instead of two: at most one block's iterations are spent past the stop)."""
        stopped = np.isin(np.asarray(tok)[:, 0], eos) if eos.size else np.zeros(len(self.rows), bool)
        blocks, left = [], steps
        loop = self.config.kernels.decode_loop
        ahead = 1 if eos.size and fixed_loop(loop, True) else 2
        while left > 0 and not (len(blocks) >= ahead and bool(np.all(np.asarray(blocks[-ahead].stopped)))):
            n = min(self.config.decode_block, left)
            ts = time.perf_counter()
            args = self._block_args(tok, key, n, eos, stopped)
            exe = self._block_program(args, sampling, keep_logits,
                                      fixed=fixed_loop(loop, bool(eos.size), n == self.config.decode_block))
            out = self._donating(lambda: exe(*args))  # noqa: B023 - called at once
            self.cache, self.state = out.cache, out.state
            tok, key, stopped = out.last, out.key, out.stopped
            for r in self.rows:
                if r is not None:
                    r.pos += n  # a block cut short by EOS ends generation: the rows are released next
            blocks.append(out)
            left -= n
            if step_s is not None:
                run = int(out.n_run)
                step_s.extend([(time.perf_counter() - ts) / max(run, 1)] * run)
        for out in blocks:
            run = int(out.n_run)
            tokens, stats = np.asarray(out.tokens), jax.tree.map(np.asarray, out.stats)
            logits = np.asarray(out.logits) if keep_logits else None
            for j in range(run):
                toks.append(tokens[:, j:j + 1])
                decode_stats.append(jax.tree.map(lambda x: x[j], stats))  # noqa: B023
                if keep_logits:
                    all_logits.append(logits[j])

    def _warm_sampling(self, batch: int, temperature: float, top_p: float, top_k: int = 0) -> None:
        """Compiles the sampler and the key split outside the timed region. The dummy logits are
        committed to device memory like the step's output: an uncommitted argument is another
        jit cache entry, and the real call would compile again inside TTFT."""
        t0 = time.perf_counter()
        logits = self._place(memory.to_device(np.zeros((batch, self.cfg.vocab_size), np.float32)))
        key = jax.random.key(0)
        for _ in range(2):  # a fresh key (the first draw), then a key the program returned (committed: its own entry)
            tok, key = sample_next(logits, key, temperature, top_p, top_k)
        tok.block_until_ready()
        keep_rows(np.ones(batch, bool), logits, logits).block_until_ready()  # multi-chunk prefill
        self.programs.add_jit_compile("sampling", time.perf_counter() - t0)

    # ---- metrics ------------------------------------------------------------------------------
    def expert_cache_metrics(self) -> dict:
        """The ``expert_cache`` metrics object: slots, hits, misses, hit rates, fetched / CPU
        misses, H2D bytes (per phase too), what the cache holds per layer, the miss policy, and once the
        host-split driver ran, ``host_split``: its host time per layer by phase (``HostSplitTimes.summary``)."""
        eb = self.model.expert_bytes
        total = self.counters["prefill"] + self.counters["decode"]
        m = {"mode": self.mode, "slots": self.num_slots, "policy": self.cache_policy, "expert_bytes": eb,
             "expert_format": self.model.banks.fmt, "expert_storage_dtype": str(self.model.banks.gate_up.dtype),
             **total.summary(eb),
             "prefill": self.counters["prefill"].summary(eb), "decode": self.counters["decode"].summary(eb),
             "resident_per_layer": self.resident_experts_per_layer()}
        m.update(self.miss.metrics(min(self.cfg.num_experts, self.batch * self.cfg.top_k)))
        if self.host_split_times.calls:  # cpu_driver "host": where the host's time went, per layer
            m["host_split"] = self.host_split_times.summary()
        return m
