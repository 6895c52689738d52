"""Miss policies of the expert cache: fetch every miss, compute misses on the CPU, or split them.

Source of the idea: FreeToken's CPU misses and bandwidth-adaptive split (DESIGN.md 1.2).

* ``fetch``: every miss is copied host -> device into an LRU slot (``ftjax.experts.offload``).
* ``cpu``: every miss is computed on the host CPU from the host banks (``ftjax.experts.cpu_experts``):
  only the token activations cross PCIe, and the expert is *not* inserted into the slot cache.
* ``adaptive``: per layer and step, ``F = table[M]`` of the layer's ``M`` misses are fetched (the
  ``F`` most recently used ones) and the rest computed on the CPU; the table comes from the split
  rule of ``ftjax.experts.miss_split`` over calibrated costs (``ftjax.calibrate``).

How a CPU miss meets the LRU table: the layer's hits are read from ``slot_of`` first; then
:func:`ftjax.experts.slot_table.lookup_layer` is called with ``routed = hits | fetched misses``.
It refreshes the hits, gives LRU slots (never a hit's slot) to the fetched misses and advances the
clock, exactly as for a fetch-only step restricted to those experts; a CPU miss is never shown to
the table, so it gets no slot, evicts nothing and stays non-resident (``slot_of == -1``).

Recency of a missing expert: a missing expert has no slot and so no ``last_use``; the expert state
(``ftjax.experts.state.ExpertState``) keeps ``last_routed`` int32 [L*E], the table clock at each
flat id's last routing (-1 = never), updated for every routed expert (hit, fetched or CPU) of
every call. "Fetch the most recently used misses"
orders a layer's misses by it (:func:`ftjax.experts.miss_split.most_recent_misses`).

Where the CPU path applies: only to layers computed with the gather formulation (``N * k <=
GATHER_MAX_PAIRS``: decode and very short calls). A long prefill call always fetches: the CPU
costs were calibrated for a few tokens per expert, and a prompt of hundreds of tokens per expert
is compute-bound on a CPU. When the split table fetches every miss for the call's size, the CPU
machinery is left out of the program (statically), so such an adaptive run costs what fetch does.

This module is a strategy of the one expert function (``ftjax.experts.offload.make_expert_fn``):
it decides, per layer, which misses are fetched and which are computed on the CPU; the state,
stats and counters are the offload's own (``ftjax.experts.state``).

Arithmetic: the device computes the per-(token, k) expert outputs exactly as
``ftjax.experts.compute.experts_gather`` does; outputs of CPU-computed experts replace theirs
before the same weighted sum. On the CPU backend the host kernel is XLA:CPU too, and the logits
equal the resident model's bit for bit (checked in tests/test_miss_policy.py); on a GPU the CPU's
bf16 rounding of an expert output may differ from the GPU's in the last bit.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ftjax.experts.compute import GATHER_MAX_PAIRS, gather_outputs
from ftjax.experts.cpu_experts import CALLBACK_IMPLS, CpuExperts
from ftjax.experts.fetch import fetch_experts
from ftjax.experts.miss_split import SplitModel, fixed_split_table, most_recent_misses, split_table
from ftjax.experts.slot_table import SlotTable, lookup_layer
from ftjax.experts.state import ExpertBanks, ExpertState
from ftjax.seams import LayerRouting, LayerStats

POLICIES = ("fetch", "cpu", "adaptive")


@dataclasses.dataclass(frozen=True)
class MissConfig:
    """Static (hashable) description of a miss policy, part of the jitted step's static options.

    policy: one of :data:`POLICIES`; cpu: the CPU mechanism (None for ``fetch``);
    table: ``F(M)`` for ``M = 0..E``, how many of ``M`` misses a layer fetches.
    """

    policy: str
    cpu: CpuExperts | None
    table: tuple[int, ...]

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"unknown miss policy {self.policy!r}; expected one of {POLICIES}")
        if self.policy != "fetch" and self.cpu is None:
            raise ValueError(f"miss policy {self.policy!r} needs a CPU expert mechanism")
        if any(not 0 <= f <= m for m, f in enumerate(self.table)):
            raise ValueError(f"split table must have 0 <= F(M) <= M, got {self.table}")

    def fetches_all(self, pairs: int, num_experts: int) -> bool:
        """Static: a call with ``pairs`` (token, k) pairs fetches every miss: a long call
        (prefill; the CPU costs were calibrated for a few tokens), or a split that never uses the
        CPU for up to ``min(E, pairs)`` misses. Then the CPU machinery stays out of the program."""
        if self.policy == "fetch" or pairs > GATHER_MAX_PAIRS:
            return True
        return all(self.table[m] == m for m in range(min(num_experts, pairs) + 1))


def merge_cpu_outputs(y: jax.Array, ids: jax.Array, weights: jax.Array, on_cpu: jax.Array, cpu_rank: jax.Array,
                      y_cpu: jax.Array, dtype) -> jax.Array:
    """The weighted sum over k of per-pair expert outputs, with the CPU's outputs in place of the device's.

    y: [N, k, D] per-(token, k) outputs computed on the device (``ftjax.experts.compute.gather_outputs``;
    pairs of CPU experts hold junk); ids: int32 [N, k]; weights: [N, k]; on_cpu: bool [E]; cpu_rank:
    int32 [E], row of each CPU expert in ``y_cpu`` [C, N, D]. Returns [N, D] in ``dtype``: the same
    expression as ``ftjax.experts.compute.experts_gather``'s sum.
    """
    n = y.shape[0]
    rows = jnp.clip(cpu_rank[ids], 0, y_cpu.shape[0] - 1)
    yc = y_cpu[rows, jnp.arange(n)[:, None]]                      # [N, k, D]
    y = jnp.where(on_cpu[ids][..., None], yc.astype(y.dtype), y)
    return jnp.einsum("nkd,nk->nd", y, weights.astype(y.dtype)).astype(dtype)


def combine_gather(x: jax.Array, ids: jax.Array, weights: jax.Array, slot_of_expert: jax.Array,
                   gate_up: jax.Array, down: jax.Array, on_cpu: jax.Array, cpu_rank: jax.Array,
                   y_cpu: jax.Array, scales: tuple | None = None, fmt: str = "dense") -> jax.Array:
    """``experts_gather`` with some experts' outputs supplied by the CPU.

    x: [N, D]; ids: int32 [N, k]; weights: [N, k]; slot_of_expert: int32 [E]; gate_up [S, D, 2F],
    down [S, F, D]: slot pools (format ``fmt``, pool ``scales``); on_cpu: bool [E]; cpu_rank: int32 [E],
    row of each CPU expert in ``y_cpu`` [C, N, D]. Returns [N, D] in x's dtype. The device arithmetic is
    the same expression as ``ftjax.experts.compute.experts_gather``.
    """
    y = gather_outputs(x, slot_of_expert[ids], gate_up, down, scales, fmt)
    return merge_cpu_outputs(y, ids, weights, on_cpu, cpu_rank, y_cpu, x.dtype)


def fetch_and_cpu(cpu: CpuExperts, banks: ExpertBanks, state: ExpertState, x: jax.Array, fetch_flat: jax.Array,
                  fetch_slots: jax.Array, n_fetch: jax.Array, cpu_flat: jax.Array, n_cpu: jax.Array,
                  fetch: bool = True):
    """One layer's miss traffic: ``n_fetch`` copies into slots and ``n_cpu`` experts on the CPU.

    The CPU work is issued first; for an asynchronous mechanism (``callback_async``,
    ``numpy_rows_async``, ``native_async``) optimisation barriers pin the order
    (submit -> copies -> wait) so that the CPU computes while the copies run. Also used by
    ``ftjax.calibrate`` so that calibration times exactly this code.

    fetch_flat, fetch_slots: int32 [M] (first ``n_fetch`` valid); cpu_flat: int32 [C] (first
    ``n_cpu`` valid). Returns (expert state with filled slots, y_cpu [C, N, D] on the device).
    """
    num = cpu_flat.shape[0]
    with jax.named_scope("cpu_experts"):
        handle = cpu.launch(x, cpu_flat, n_cpu, banks)
    ordered = cpu.asynchronous
    if fetch:
        pools = (state.gate_up, state.down, state.scales)
        if ordered:
            handle, pools = jax.lax.optimization_barrier((handle, pools))
        state = fetch_experts(banks, state.replace(gate_up=pools[0], down=pools[1], scales=pools[2]), fetch_flat,
                              fetch_slots, n_fetch)
        if ordered:
            pools, handle = jax.lax.optimization_barrier(((state.gate_up, state.down, state.scales), handle))
            state = state.replace(gate_up=pools[0], down=pools[1], scales=pools[2])
    with jax.named_scope("cpu_experts"):
        return state, cpu.collect(handle, x, num)


class SplitPlan(NamedTuple):
    """One layer's split of its misses, decided on the device (:func:`plan_split`).

    look: the slot table's ``LayerLookup`` of the hits and fetched misses (its table is the new one);
    fetch_flat: int32 [E], flat ids of the misses to fetch (first ``look.n_miss`` valid), their slots in
    ``look.miss_slots``; on_cpu: bool [E], the misses computed on the CPU; cpu_rank: int32 [E], row of
    each CPU expert in the CPU's output; cpu_flat: int32 [C], their flat ids (-1 pads; C = min(E, N*k));
    n_cpu: int32 []; stats: the layer's ``LayerStats``.
    """

    look: Any
    fetch_flat: jax.Array
    on_cpu: jax.Array
    cpu_rank: jax.Array
    cpu_flat: jax.Array
    n_cpu: jax.Array
    stats: LayerStats


def plan_split(miss: MissConfig, table: SlotTable, layer: jax.Array, routed: jax.Array, r: LayerRouting,
               cache_policy: str, last_routed: jax.Array) -> SplitPlan:
    """Decides one layer's split under the cpu / adaptive policy: which misses are fetched (``F(M)`` of the
    ``M`` misses, the most recently routed by ``last_routed``, the recency *before* this call) and which
    are computed on the CPU; shows only hits and fetched misses to the table (``lookup_layer``).

    ``table``: the slot table to look up (already emptied for on_demand); ``routed``: bool [E].
    Returns a :class:`SplitPlan`.
    """
    e = routed.shape[0]
    c = min(e, r.ids.size)                     # most distinct experts one call can route
    base = layer * e
    last = jax.lax.dynamic_slice(last_routed, (base,), (e,))
    cur = jax.lax.dynamic_slice(table.slot_of, (base,), (e,))
    hit = routed & (cur >= 0)
    miss_mask = routed & (cur < 0)
    n_miss = miss_mask.sum(dtype=jnp.int32)
    n_fetch = jnp.asarray(np.asarray(miss.table[: e + 1], np.int32))[n_miss]
    fetch_mask = most_recent_misses(miss_mask, last, n_fetch)
    on_cpu = miss_mask & ~fetch_mask
    n_cpu = on_cpu.sum(dtype=jnp.int32)
    experts = jnp.arange(e, dtype=jnp.int32)
    cpu_rank = jnp.cumsum(on_cpu.astype(jnp.int32)) - 1
    cpu_ids = jnp.full((c,), -1, jnp.int32).at[jnp.where(on_cpu, cpu_rank, c)].set(experts, mode="drop")
    cpu_flat = jnp.where(cpu_ids >= 0, base + cpu_ids, -1)
    with jax.named_scope("slot_lookup"):
        look = lookup_layer(table, layer, hit | fetch_mask, e, cache_policy)
    stats = LayerStats(look.n_hit, n_miss, look.n_miss, n_cpu, jnp.where(r.valid[:, None], r.ids, -1))
    return SplitPlan(look, base + look.miss_experts, on_cpu, cpu_rank, cpu_flat, n_cpu, stats)


def split_layer(miss: MissConfig, banks: ExpertBanks, state: ExpertState, table: SlotTable, layer: jax.Array,
                routed: jax.Array, r: LayerRouting, cache_policy: str) -> tuple[jax.Array, ExpertState, LayerStats]:
    """One layer of a decode-sized call under the cpu / adaptive policy, inside one program: the split of
    :func:`plan_split`, the fetches and the CPU's share (:func:`fetch_and_cpu`, the CPU mechanism called
    from the program), the sum (:func:`combine_gather`). Arguments as for :func:`plan_split` (the recency
    is ``state.last_routed``). Returns (y [N, D], new state, stats).
    """
    p = plan_split(miss, table, layer, routed, r, cache_policy, state.last_routed)
    state, y_cpu = fetch_and_cpu(miss.cpu, banks, state.replace(table=p.look.table), r.x, p.fetch_flat,
                                 p.look.miss_slots, p.look.n_miss, p.cpu_flat, p.n_cpu, fetch=miss.policy != "cpu")
    y = combine_gather(r.x, r.ids, r.weights, p.look.slot_of_expert, state.gate_up, state.down, p.on_cpu,
                       p.cpu_rank, y_cpu, state.scales, state.fmt)
    return y, state, p.stats


class MissRuntime:
    """What the engine needs of a miss policy: the static config and its provenance for metrics.
    Build it with :func:`build_runtime`.

    Attributes:
      config: :class:`MissConfig`; split_model: the :class:`SplitModel` behind an adaptive table
      (None otherwise); calibration: the profile entry used (dict) or None; rule: how the table
      was made ("fetch-all", "cpu-only", "fixed:<F>", "model").
    """

    def __init__(self, config: MissConfig, rule: str, split_model: SplitModel | None = None,
                 calibration: dict | None = None):
        self.config, self.rule, self.split_model, self.calibration = config, rule, split_model, calibration

    @property
    def policy(self) -> str:
        return self.config.policy

    @property
    def jit_config(self) -> MissConfig | None:
        """Static option of the jitted step; None for fetch (the plain offload path)."""
        return None if self.policy == "fetch" else self.config

    @property
    def track_recency(self) -> bool:
        """Whether the expert state keeps ``last_routed`` (cpu / adaptive rank misses by it)."""
        return self.policy != "fetch"

    def split_for(self, max_misses: int) -> list[int]:
        """``F(M)`` for ``M = 0..max_misses``."""
        return list(self.config.table[: max_misses + 1])

    def describe(self, max_misses: int) -> str:
        lines = [f"miss policy: {self.policy} (split rule {self.rule})"]
        if self.config.cpu is not None:
            lines.append(f"  CPU experts: {self.config.cpu.describe()}")
        if self.split_model is not None:
            m = self.split_model
            lines.append(f"  split model: fetch {m.alpha_p * 1e3:.3f} ms + {m.beta_p * 1e3:.3f} ms/expert, "
                         f"CPU {m.alpha_h * 1e3:.3f} ms + {m.beta_h * 1e3:.3f} ms/expert, overlap {m.overlap:.2f}")
        t = self.split_for(max_misses)
        lines.append("  split F(M) for M misses: " + " ".join(f"{i}->{f}" for i, f in enumerate(t) if i))
        return "\n".join(lines)

    def metrics(self, max_misses: int) -> dict:
        """The policy's fields of the ``expert_cache`` metrics: miss_policy, split (rule, table,
        model), CPU mechanism, calibration profile."""
        return {"miss_policy": self.policy,
                "split": {"rule": self.rule, "table": self.split_for(max_misses),
                          "model": self.split_model.as_dict() if self.split_model else None},
                "cpu_expert_impl": self.config.cpu.describe() if self.config.cpu is not None else None,
                "calibration": self.calibration}


def build_runtime(policy: str, num_experts: int, cpu: CpuExperts | None = None,
                  split_model: SplitModel | None = None, fixed_fetch: int | None = None,
                  calibration: dict | None = None) -> MissRuntime:
    """Builds a :class:`MissRuntime`.

    Args:
      policy: "fetch" | "cpu" | "adaptive".
      num_experts: E, experts per layer (the split table covers M = 0..E misses).
      cpu: the CPU mechanism (needed by cpu and adaptive).
      split_model: adaptive: the calibrated cost model the table is computed from.
      fixed_fetch: adaptive: instead of a model, fetch ``min(fixed_fetch, M)`` (for tests / sweeps).
      calibration: the profile entry to report in the metrics.
    Raises:
      ValueError: unknown policy; adaptive without exactly one of split_model / fixed_fetch;
        cpu / adaptive without a mechanism.
    """
    e = num_experts
    if policy == "fetch":
        table, rule = tuple(range(e + 1)), "fetch-all"
    elif policy == "cpu":
        table, rule = (0,) * (e + 1), "cpu-only"
    elif policy == "adaptive":
        if (split_model is None) == (fixed_fetch is None):
            raise ValueError("the adaptive policy needs exactly one of a split model or a fixed fetch count")
        if split_model is not None:
            table, rule = split_table(split_model, e), "model"
        else:
            table, rule = fixed_split_table(fixed_fetch, e), f"fixed:{fixed_fetch}"
    else:
        raise ValueError(f"unknown miss policy {policy!r}; expected one of {POLICIES}")
    return MissRuntime(MissConfig(policy, cpu if policy != "fetch" else None, table), rule, split_model, calibration)


__all__ = ["POLICIES", "CALLBACK_IMPLS", "MissConfig", "MissRuntime", "SplitPlan", "combine_gather",
           "merge_cpu_outputs", "fetch_and_cpu", "plan_split", "split_layer", "build_runtime"]
