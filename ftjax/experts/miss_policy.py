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

Recency of a missing expert: a missing expert has no slot and so no ``last_use``; the state keeps
``last_routed`` int32 [L*E], the table clock at each flat id's last routing (-1 = never), updated
for every routed expert (hit, fetched or CPU) of every call. "Fetch the most recently used misses"
orders a layer's misses by it (:func:`ftjax.experts.miss_split.most_recent_misses`).

Where the CPU path applies: only to layers computed with the gather formulation (``N * k <=
GATHER_MAX_PAIRS``: decode and very short calls). A long prefill call always fetches: the CPU
costs were calibrated for a few tokens per expert, and a prompt of hundreds of tokens per expert
is compute-bound on a CPU. When the split table fetches every miss for the call's size, the CPU
machinery is left out of the program (statically), so such an adaptive run costs what fetch does.

Arithmetic: the device computes the per-(token, k) expert outputs exactly as
``ftjax.experts.compute.experts_gather`` does; outputs of CPU-computed experts replace theirs
before the same weighted sum. On the CPU backend the host kernel is XLA:CPU too, and the logits
equal the resident model's bit for bit (checked in tests/test_miss_policy.py); on a GPU the CPU's
bf16 rounding of an expert output may differ from the GPU's in the last bit.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from ftjax.experts import offload
from ftjax.experts.compute import GATHER_MAX_PAIRS, _swiglu, experts_from_pool
from ftjax.experts.cpu_experts import CALLBACK_IMPLS, CpuExperts
from ftjax.experts.miss_split import SplitModel, fixed_split_table, most_recent_misses, split_table
from ftjax.experts.slot_table import lookup_layer, reset_table
from ftjax.model import LayerRouting

POLICIES = ("fetch", "cpu", "adaptive")


@dataclasses.dataclass(frozen=True)
class MissConfig:
    """Static (hashable) description of a miss policy, a static argument of the jitted step.

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


@flax.struct.dataclass
class MissState:
    """Expert state of the cpu / adaptive policies: the offload state plus ``last_routed``.

    experts: :class:`ftjax.experts.offload.ExpertState` (slot pools + LRU table);
    last_routed: int32 [L*E], table clock of each flat id's last routing, -1 = never.
    """

    experts: offload.ExpertState
    last_routed: jax.Array


class MissLayerStats(NamedTuple):
    """Per-layer counters (stacked over layers by the scan); a superset of ``offload.LayerStats``.

    hits, misses: int32 [] distinct routed experts resident / not resident;
    routed_ids: int32 [N, k] (-1 for padding); fetched, cpu: int32 [], misses copied over PCIe /
    computed on the CPU (``fetched + cpu == misses``).
    """

    hits: jax.Array
    misses: jax.Array
    routed_ids: jax.Array
    fetched: jax.Array
    cpu: jax.Array


def init_state(experts: offload.ExpertState) -> MissState:
    """Wraps an offload state (cached / on_demand) with ``last_routed`` all -1."""
    return MissState(experts, jnp.full(experts.table.slot_of.shape, -1, jnp.int32))


def combine_gather(x: jax.Array, ids: jax.Array, weights: jax.Array, slot_of_expert: jax.Array,
                   gate_up: jax.Array, down: jax.Array, on_cpu: jax.Array, cpu_rank: jax.Array,
                   y_cpu: jax.Array) -> jax.Array:
    """``experts_gather`` with some experts' outputs supplied by the CPU.

    x: [N, D]; ids: int32 [N, k]; weights: [N, k]; slot_of_expert: int32 [E]; gate_up [S, D, 2F],
    down [S, F, D]: slot pools; on_cpu: bool [E]; cpu_rank: int32 [E], row of each CPU expert in
    ``y_cpu`` [C, N, D]. Returns [N, D] in x's dtype. The device arithmetic is the same expression
    as ``ftjax.experts.compute.experts_gather``.
    """
    slots = slot_of_expert[ids]
    h = jnp.einsum("nd,nkdf->nkf", x, gate_up[slots])
    y = jnp.einsum("nkf,nkfd->nkd", _swiglu(h), down[slots])
    n = x.shape[0]
    rows = jnp.clip(cpu_rank[ids], 0, y_cpu.shape[0] - 1)
    yc = y_cpu[rows, jnp.arange(n)[:, None]]                      # [N, k, D]
    y = jnp.where(on_cpu[ids][..., None], yc.astype(y.dtype), y)
    return jnp.einsum("nkd,nk->nd", y, weights.astype(y.dtype)).astype(x.dtype)


def fetch_and_cpu(cpu: CpuExperts, host_gate_up: jax.Array, host_down: jax.Array,
                  experts: offload.ExpertState, x: jax.Array, fetch_flat: jax.Array, fetch_slots: jax.Array,
                  n_fetch: jax.Array, cpu_flat: jax.Array, n_cpu: jax.Array, fetch: bool = True):
    """One layer's miss traffic: ``n_fetch`` copies into slots and ``n_cpu`` experts on the CPU.

    The CPU work is issued first; for ``callback_async`` optimisation barriers pin the order
    (submit -> copies -> wait) so that the CPU computes while the copies run. Also used by
    ``ftjax.calibrate`` so that calibration times exactly this code.

    fetch_flat, fetch_slots: int32 [M] (first ``n_fetch`` valid); cpu_flat: int32 [C] (first
    ``n_cpu`` valid). Returns (experts state with filled slots, y_cpu [C, N, D] on the device).
    """
    num = cpu_flat.shape[0]
    handle = cpu.launch(x, cpu_flat, n_cpu, host_gate_up, host_down)
    ordered = cpu.impl == "callback_async"
    if fetch:
        gu, dn = experts.gate_up, experts.down
        if ordered:
            handle, gu, dn = jax.lax.optimization_barrier((handle, gu, dn))
        experts = offload.fetch_experts(host_gate_up, host_down, experts.replace(gate_up=gu, down=dn),
                                        fetch_flat, fetch_slots, n_fetch)
        if ordered:
            gu, dn, handle = jax.lax.optimization_barrier((experts.gate_up, experts.down, handle))
            experts = experts.replace(gate_up=gu, down=dn)
    return experts, cpu.collect(handle, x, num)


def make_expert_fn(miss: MissConfig, mode: str, num_experts: int, host_gate_up: jax.Array,
                   host_down: jax.Array, cache_policy: str = "lru"):
    """Expert function (``ftjax.model.ExpertFn``) of the cpu / adaptive policies; ``cache_policy``
    is the slot table's eviction policy for the fetched misses.

    The state is a :class:`MissState`; stats are :class:`MissLayerStats`.

    Raises:
      ValueError: mode other than cached / on_demand, or a fetch-only config (use
        ``offload.make_expert_fn``).
    """
    if mode not in ("cached", "on_demand"):
        raise ValueError(f"miss policy {miss.policy!r} needs experts mode cached or on_demand, got {mode!r}")
    if miss.policy == "fetch":
        raise ValueError("the fetch policy is offload.make_expert_fn")
    e = num_experts
    if len(miss.table) < e + 1:
        raise ValueError(f"split table covers {len(miss.table) - 1} misses, need {e}")
    table_arr = np.asarray(miss.table[: e + 1], np.int32)

    def expert_fn(state: MissState, layer: jax.Array, r: LayerRouting):
        es = state.experts
        routed = offload.routed_mask(r.ids, r.valid, e)
        trace_ids = jnp.where(r.valid[:, None], r.ids, -1)
        table = reset_table(es.table) if mode == "on_demand" else es.table
        base = layer * e
        last = jax.lax.dynamic_slice(state.last_routed, (base,), (e,))
        last_routed = jax.lax.dynamic_update_slice(state.last_routed, jnp.where(routed, table.clock, last), (base,))

        c = min(e, r.ids.size)                     # most distinct experts one call can route
        fetch_all = all(miss.table[m] == m for m in range(c + 1))  # static: the split never uses the CPU
        if r.ids.size > GATHER_MAX_PAIRS or fetch_all:  # long call (prefill), or nothing for the CPU
            look = lookup_layer(table, layer, routed, e, cache_policy)
            es = offload.fetch_experts(host_gate_up, host_down, es.replace(table=look.table),
                                       base + look.miss_experts, look.miss_slots, look.n_miss)
            y = experts_from_pool(r.x, r.ids, r.weights, look.slot_of_expert, es.gate_up, es.down)
            stats = MissLayerStats(look.n_hit, look.n_miss, trace_ids, look.n_miss, jnp.int32(0))
            return y, MissState(es, last_routed), stats

        cur = jax.lax.dynamic_slice(table.slot_of, (base,), (e,))
        hit = routed & (cur >= 0)
        miss_mask = routed & (cur < 0)
        n_miss = miss_mask.sum(dtype=jnp.int32)
        n_fetch = jnp.asarray(table_arr)[n_miss]
        fetch_mask = most_recent_misses(miss_mask, last, n_fetch)
        on_cpu = miss_mask & ~fetch_mask
        n_cpu = on_cpu.sum(dtype=jnp.int32)
        experts = jnp.arange(e, dtype=jnp.int32)
        cpu_rank = jnp.cumsum(on_cpu.astype(jnp.int32)) - 1
        cpu_ids = jnp.full((c,), -1, jnp.int32).at[jnp.where(on_cpu, cpu_rank, c)].set(experts, mode="drop")
        cpu_flat = jnp.where(cpu_ids >= 0, base + cpu_ids, -1)

        look = lookup_layer(table, layer, hit | fetch_mask, e, cache_policy)
        es, y_cpu = fetch_and_cpu(miss.cpu, host_gate_up, host_down, es.replace(table=look.table), r.x,
                                  base + look.miss_experts, look.miss_slots, look.n_miss, cpu_flat, n_cpu,
                                  fetch=miss.policy != "cpu")
        y = combine_gather(r.x, r.ids, r.weights, look.slot_of_expert, es.gate_up, es.down, on_cpu, cpu_rank,
                           y_cpu)
        stats = MissLayerStats(look.n_hit, n_miss, trace_ids, look.n_miss, n_cpu)
        return y, MissState(es, last_routed), stats

    return expert_fn


# --------------------------------------------------------------------------------------------
# Host side: counters, metrics, the runtime handed to the engine
# --------------------------------------------------------------------------------------------
class MissCounters:
    """Host totals per layer (int64 [L]) of fetched and CPU misses, and a histogram of the split:
    ``hist[M, F]`` = number of (layer, call) with M misses of which F were fetched."""

    def __init__(self, num_layers: int, num_experts: int):
        self.fetched = np.zeros(num_layers, np.int64)
        self.cpu = np.zeros(num_layers, np.int64)
        self.hist = np.zeros((num_experts + 1, num_experts + 1), np.int64)

    def add(self, stats: Any) -> None:
        misses = np.asarray(stats.misses, np.int64)
        fetched = np.asarray(stats.fetched, np.int64) if hasattr(stats, "fetched") else misses
        self.fetched += fetched
        self.cpu += misses - fetched
        np.add.at(self.hist, (misses, fetched), 1)

    def summary(self, expert_bytes: int) -> dict:
        f, c = int(self.fetched.sum()), int(self.cpu.sum())
        ms, fs = np.nonzero(self.hist)
        return {"fetched": f, "cpu_computed": c, "bytes_h2d": f * expert_bytes,
                "fetch_fraction": f / (f + c) if f + c else None,
                "split_histogram": [{"misses": int(m), "fetched": int(x), "layers": int(self.hist[m, x])}
                                    for m, x in zip(ms, fs) if m > 0]}


class MissRuntime:
    """What the engine needs for a miss policy: the static config, the state wrapper, counters and
    metrics. Build it with :func:`build_runtime`.

    Attributes:
      config: :class:`MissConfig`; split_model: the :class:`SplitModel` behind an adaptive table
      (None otherwise); calibration: the profile entry used (dict) or None; rule: how the table
      was made ("fetch-all", "cpu-only", "fixed:<F>", "model").
    """

    def __init__(self, config: MissConfig, num_layers: int, num_experts: int, rule: str,
                 split_model: SplitModel | None = None, calibration: dict | None = None):
        self.config, self.rule, self.split_model, self.calibration = config, rule, split_model, calibration
        self.num_layers, self.num_experts = num_layers, num_experts
        self.counters = {p: MissCounters(num_layers, num_experts) for p in ("prefill", "decode")}

    @property
    def policy(self) -> str:
        return self.config.policy

    @property
    def jit_config(self) -> MissConfig | None:
        """Static argument for the jitted step; None for fetch (the unchanged offload path)."""
        return None if self.policy == "fetch" else self.config

    def init_state(self, experts_state: offload.ExpertState) -> Any:
        return experts_state if self.policy == "fetch" else init_state(experts_state)

    def add(self, phase: str, stats: Any) -> None:
        self.counters[phase].add(stats)

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

    def metrics(self, expert_cache: dict, expert_bytes: int, max_misses: int) -> dict:
        """Adds the policy's figures to an ``expert_cache`` metrics dict (returns a new dict):
        miss_policy, fetched, cpu_computed, bytes_h2d (fetched only), split rule, table and
        histogram, CPU mechanism, calibration profile; per phase too."""
        out = dict(expert_cache)
        tot = MissCounters(self.num_layers, self.num_experts)
        for c in self.counters.values():
            tot.fetched += c.fetched
            tot.cpu += c.cpu
            tot.hist += c.hist
        out.update(tot.summary(expert_bytes))
        for phase, c in self.counters.items():
            if isinstance(out.get(phase), dict):
                out[phase] = {**out[phase], **c.summary(expert_bytes)}
        out["miss_policy"] = self.policy
        out["split"] = {"rule": self.rule, "table": self.split_for(max_misses),
                        "model": self.split_model.as_dict() if self.split_model else None}
        out["cpu_expert_impl"] = self.config.cpu.describe() if self.config.cpu is not None else None
        out["calibration"] = self.calibration
        return out


def build_runtime(policy: str, num_layers: int, num_experts: int, cpu: CpuExperts | None = None,
                  split_model: SplitModel | None = None, fixed_fetch: int | None = None,
                  calibration: dict | None = None) -> MissRuntime:
    """Builds a :class:`MissRuntime`.

    Args:
      policy: "fetch" | "cpu" | "adaptive".
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
    return MissRuntime(MissConfig(policy, cpu if policy != "fetch" else None, table), num_layers, e, rule,
                       split_model, calibration)


__all__ = ["POLICIES", "CALLBACK_IMPLS", "MissConfig", "MissState", "MissLayerStats", "MissCounters",
           "MissRuntime", "init_state", "combine_gather", "fetch_and_cpu", "make_expert_fn", "build_runtime"]
