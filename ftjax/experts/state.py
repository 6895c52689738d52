"""The expert offload's data: host banks, device state, per-layer stats, host counters.

One type of each, shared by every mode, cache policy and miss policy (FreeToken-style expert
offload; DESIGN.md 1.1-1.3):

* :class:`ExpertBanks`: the routed-expert weights of all layers in host memory (the source of
  truth), banked by ``flat_id = layer * E + expert``, with room for quantization scales and a
  format tag.
* :class:`ExpertState`: what the jitted step carries through the layer scan: slot pools, the
  slot table, and the routing recency the cpu / adaptive miss policies read.
* :class:`ExpertCounters`: host totals per layer, summed over calls, and the metrics built from them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from ftjax.experts import formats
from ftjax.experts.slot_table import SlotTable, init_slot_table
from ftjax.seams import OPTIONAL_COUNTS, LayerStats

#: Storage formats of the routed-expert banks (the tags of the ``ftjax.experts.formats`` registry):
#: dense (the compute dtype, or bfloat16), and the quantized formats, whose scales sit in
#: :attr:`ExpertBanks.scales`.
BANK_FORMATS = tuple(f.name for f in formats.all_formats())


@flax.struct.dataclass
class ExpertBanks:
    """Routed-expert weights of every layer, in host memory (``pinned_host`` where it exists).

    gate_up: [L*E, D, 2F] (gate columns first, then up); down: [L*E, F, D]; for ``fmt ==
    "dense"`` in the compute dtype (or bfloat16), else in the format's storage dtype (int4: the
    last axis packed, 2F/2 and D/2 bytes). scales: None for dense, else (gate_up scales
    float32 [L*E, nbi, nbo], down scales float32 [L*E, nbi, nbo]), the block layout of
    ``ftjax.experts.quant``. fmt: one of :data:`BANK_FORMATS` (static: part of the compiled
    program's identity).
    """

    gate_up: jax.Array
    down: jax.Array
    scales: tuple | None = None
    fmt: str = flax.struct.field(pytree_node=False, default="dense")

    def __post_init__(self):
        if self.fmt not in BANK_FORMATS:
            raise ValueError(f"unknown expert bank format {self.fmt!r}; expected one of {BANK_FORMATS}")
        scaled = formats.get(self.fmt).has_scales
        if scaled == (self.scales is None):
            raise ValueError(f"expert bank format {self.fmt!r} {'needs' if scaled else 'takes no'} scales")

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert (gate, up, down and its scales) as stored: what one H2D copy moves."""
        per = lambda a: a.size // a.shape[0] * a.dtype.itemsize  # noqa: E731
        scales = sum(per(s) for s in self.scales) if self.scales else 0
        return per(self.gate_up) + per(self.down) + scales


@flax.struct.dataclass
class ExpertState:
    """Device state carried through the layer scan.

    gate_up: [S, D, 2F] and down: [S, F, D] slot pools, stored as the banks are (format
    ``fmt``). table: the slot table (None in resident mode, where the pool is the bank itself and
    slot = flat id). last_routed: int32 [L*E], the table clock at each flat id's last routing
    (-1 = never); kept only for miss policies that rank misses by recency (None otherwise).
    scales: the pools' scales of a quantized format ((gate_up [S, ...], down [S, ...]) float32,
    filled with the weights), None for dense. fmt: the banks' format (static). prefetch: a layer's started prefetch
    (``ftjax.experts.prefetch.Pending``) between its token mixer and its expert function, else None.
    """

    gate_up: jax.Array
    down: jax.Array
    table: SlotTable | None
    last_routed: jax.Array | None = None
    scales: tuple | None = None
    fmt: str = flax.struct.field(pytree_node=False, default="dense")
    prefetch: Any = None


def init_expert_state(mode: str, num_layers: int, num_experts: int, num_slots: int, banks: ExpertBanks,
                      dtype, track_recency: bool = False) -> ExpertState:
    """Allocates the device side of an experts mode.

    resident: copies the whole banks (and scales) to the device (L*E slots, no table). cached /
    on_demand: zero pools (and scale pools) of ``num_slots`` slots in the banks' storage dtype and
    format, and an empty table. ``track_recency`` adds ``last_routed`` (all -1) for the cpu /
    adaptive miss policies. ``dtype``: the compute dtype (dense banks in another dtype are stored
    as they are and cast in the expert computation).

    Raises:
      ValueError: num_slots outside [E, L*E] for the offloading modes (from init_slot_table).
    """
    del dtype  # the pools keep the banks' storage dtype; the expert computation casts
    if mode == "resident":
        dev = jax.memory.Space.Device
        put = lambda a: jax.device_put(a, dev)  # noqa: E731
        scales = None if banks.scales is None else tuple(put(s) for s in banks.scales)
        return ExpertState(put(banks.gate_up), put(banks.down), None, scales=scales, fmt=banks.fmt)
    table = init_slot_table(num_layers, num_experts, num_slots)
    pool = lambda a: jnp.zeros((num_slots,) + a.shape[1:], a.dtype)  # noqa: E731
    scales = None if banks.scales is None else tuple(pool(s) for s in banks.scales)
    last = jnp.full((num_layers * num_experts,), -1, jnp.int32) if track_recency else None
    return ExpertState(pool(banks.gate_up), pool(banks.down), table, last, scales, banks.fmt)


@dataclasses.dataclass
class ExpertCounters:
    """Host totals of expert-cache events of one phase (prefill or decode), per layer (int64 [L]).

    hits / misses / fetched / cpu as in :class:`LayerStats`; hist[M, F]: number of (layer, call)
    with M misses of which F were fetched (the miss split's histogram); extra_copies: experts
    copied outside any layer's misses (a streamed prefill's prologue and its last, wasted
    prefetch); and the optional counters of :class:`LayerStats` (``ftjax.seams.OPTIONAL_COUNTS``), 0 where a call
    did not count them: d2d, experts copied device to device (slot cache -> a streamed layer's buffer); prefetched /
    prefetch_used, the prefetch's copies (calls of at most ``prefetch.MAX_TOKENS`` tokens) and the routed ones among
    them; int64 [L].
    """

    hits: np.ndarray
    misses: np.ndarray
    fetched: np.ndarray
    cpu: np.ndarray
    hist: np.ndarray
    extra_copies: int = 0
    d2d: np.ndarray | None = None
    prefetched: np.ndarray | None = None
    prefetch_used: np.ndarray | None = None

    def __post_init__(self):
        for name in OPTIONAL_COUNTS:
            if getattr(self, name) is None:
                setattr(self, name, np.zeros_like(self.hits))

    @classmethod
    def zeros(cls, num_layers: int, num_experts: int) -> "ExpertCounters":
        z = lambda: np.zeros(num_layers, np.int64)  # noqa: E731
        return cls(z(), z(), z(), z(), np.zeros((num_experts + 1, num_experts + 1), np.int64))

    def add(self, stats: LayerStats) -> None:
        """Adds one call's stacked stats (leaves of shape [L]); device arrays are read with one wait (the routed
        ids are not read)."""
        stats = jax.device_get(stats._replace(routed_ids=None))
        misses, fetched = np.asarray(stats.misses, np.int64), np.asarray(stats.fetched, np.int64)
        self.hits += np.asarray(stats.hits, np.int64)
        self.misses += misses
        self.fetched += fetched
        self.cpu += np.asarray(stats.cpu, np.int64)
        for name in stats.optional():
            getattr(self, name)[...] += np.asarray(getattr(stats, name), np.int64)
        np.add.at(self.hist, (misses, fetched), 1)

    def _combine(self, other: "ExpertCounters", op) -> "ExpertCounters":
        arrays = {f: op(getattr(self, f), getattr(other, f))
                  for f in ("hits", "misses", "fetched", "cpu", "hist") + OPTIONAL_COUNTS}
        return ExpertCounters(**arrays, extra_copies=op(self.extra_copies, other.extra_copies))

    def __add__(self, other: "ExpertCounters") -> "ExpertCounters":
        return self._combine(other, lambda a, b: a + b)

    def __sub__(self, other: "ExpertCounters") -> "ExpertCounters":
        """What was counted since ``other`` (a :meth:`copy` taken earlier)."""
        return self._combine(other, lambda a, b: a - b)

    def copy(self) -> "ExpertCounters":
        return self._combine(self, lambda a, b: a.copy() if isinstance(a, np.ndarray) else a)

    def summary(self, expert_bytes: int) -> dict:
        """JSON-ready: hits, misses, hit_rate, hit_rate_per_layer, fetched, cpu_computed,
        fetch_fraction, bytes_h2d (every expert byte copied over PCIe; ``expert_bytes`` is one
        expert's bytes), d2d_copies (experts copied device to device from the slot cache into a
        streamed layer's buffer), bytes_d2d (their bytes, not in bytes_h2d), the prefetch's counts
        (``EngineConfig.prefetch_guesses``; 0 without it): prefetch_copies (experts it copied, right
        or wrong guesses, in misses and bytes_h2d too), prefetch_used (the routed ones among them),
        routed_hit_rate (hits / the routed experts: the routed experts that their layer did not copy,
        its prefetch's right guesses counted as misses; hit_rate's denominator also holds the wrong
        guesses), lookup_hit_rate ((hits + prefetch_used) / the routed experts: the routed experts
        already in a slot at their layer's lookup, the prefetch's right guesses counted as hits); the
        three are equal without a prefetch. Over a streamed prefill's layers, hits + misses are all E
        experts, not the routed ones; split_histogram."""
        h, m = int(self.hits.sum()), int(self.misses.sum())
        f, c = int(self.fetched.sum()), int(self.cpu.sum())
        d2d, pf, used = int(self.d2d.sum()), int(self.prefetched.sum()), int(self.prefetch_used.sum())
        seen = self.hits + self.misses
        per_layer = np.where(seen > 0, self.hits / np.maximum(seen, 1), 0.0)
        routed = h + m - pf + used  # misses hold every prefetch copy; of those, only the used ones were routed
        ms, fs = np.nonzero(self.hist)
        return {"hits": h, "misses": m, "hit_rate": h / (h + m) if h + m else 0.0,
                "hit_rate_per_layer": [round(float(x), 6) for x in per_layer],
                "routed_hit_rate": h / routed if routed else 0.0,
                "lookup_hit_rate": (h + used) / routed if routed else 0.0,
                "fetched": f, "cpu_computed": c, "fetch_fraction": f / (f + c) if f + c else None,
                "bytes_h2d": (f + self.extra_copies) * expert_bytes,
                "d2d_copies": d2d, "bytes_d2d": d2d * expert_bytes,
                "prefetch_copies": pf, "prefetch_used": used,
                "split_histogram": [{"misses": int(a), "fetched": int(b), "layers": int(self.hist[a, b])}
                                    for a, b in zip(ms, fs) if a > 0]}
