"""How many of a layer's cache misses to fetch over PCIe, and which ones (DESIGN.md 1.2).

Source of the idea: FreeToken's bandwidth-adaptive split ("q*"). A miss can be copied from the
host bank to a device slot (time ``b / B_P`` per expert of ``b`` bytes over a link of ``B_P``
bytes/s) or computed on the CPU where its weights already are (``b / B_H``, with ``B_H`` the
CPU's expert throughput in weight bytes consumed per second). The two run side by side, so the
balanced split of ``M`` misses fetches the integer ``F`` that minimises

    max(F * b / B_P, (M - F) * b / B_H)            (DESIGN.md 1.2; the "q* rule")

whose real-valued optimum is ``F* = M * B_P / (B_P + B_H)``.

:class:`SplitModel` generalises this with what the calibration (``ftjax.calibrate``) measures on
the real mechanism, because on a GPU neither side is a pure bandwidth:

* a fixed cost per layer that does any fetch (``alpha_p``: launching the copy loop) and per layer
  that computes any miss on the CPU (``alpha_h``: the host round trip), paid only when that side
  has work;
* an ``overlap`` in [0, 1]: 1 when the copy and the CPU work run fully side by side (cost is the
  max of the two), 0 when they serialise (cost is the sum). Contention for host DRAM between the
  two shows up as a lower measured overlap.

    a(F) = [F > 0] * (alpha_p + F * beta_p)          beta_p = b / B_P   (s per expert fetched)
    c(C) = [C > 0] * (alpha_h + C * beta_h)          beta_h = b / B_H   (s per expert on the CPU)
    cost(F) = max(a, c) + (1 - overlap) * min(a, c),  with C = M - F

With ``alpha_p = alpha_h = 0`` and ``overlap = 1`` this is exactly the q* rule above.

Closed form (:func:`best_fetch_count`): for ``1 <= F <= M - 1`` both indicators are 1, ``a`` rises
and ``c`` falls linearly in ``F``, so ``cost`` is piecewise linear with a single breakpoint where
``a = c``, at ``F* = (alpha_h - alpha_p + M * beta_h) / (beta_p + beta_h)``. A piecewise linear
function on an integer range takes its minimum at an end of a linear piece, so the minimiser is
one of ``{0, M, 1, M - 1, floor(F*), ceil(F*)}`` (clipped to ``[0, M]``); the rule evaluates those
six. Ties (costs within a relative ``TIE_RTOL`` of the minimum) go to the larger ``F`` (a fetched
expert also becomes a future hit).
:func:`brute_force_fetch_count` tries every ``F`` with the same cost and tie rule. The tests check
that the closed form always reaches the brute-force minimum cost, and picks the same ``F`` when
the costs are exact in floating point or the minimiser is unique by a clear margin; on a linear
piece flatter than ``TIE_RTOL`` the two may pick different, equally cheap ``F``.

Which misses: the ``F`` most recently used ones (:func:`most_recent_misses`), by a per-flat-id
``last_routed`` clock kept in the expert state (``ftjax.experts.miss_policy``); a recently used
expert is the likeliest to be routed again, so it is the one worth a slot. The rest are computed on
the CPU and not cached.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

__all__ = ["SplitModel", "split_cost", "best_fetch_count", "brute_force_fetch_count", "qstar",
           "split_table", "fixed_split_table", "most_recent_misses", "with_link", "split_gain"]


@dataclasses.dataclass(frozen=True)
class SplitModel:
    """Cost model of one layer's misses (all times in seconds; see the module docstring).

    Attributes:
      beta_p: seconds per expert copied host -> device (``expert_bytes / B_P``), > 0.
      beta_h: seconds per expert computed on the CPU (``expert_bytes / B_H``), > 0.
      alpha_p: fixed seconds of a layer that fetches at least one expert, >= 0.
      alpha_h: fixed seconds of a layer that computes at least one expert on the CPU, >= 0.
      overlap: 1 = the two sides run fully in parallel (the q* rule), 0 = they serialise.
    Raises:
      ValueError: a value that is not a finite number, a non-positive beta, a negative alpha or
        an overlap outside [0, 1].
    """

    beta_p: float
    beta_h: float
    alpha_p: float = 0.0
    alpha_h: float = 0.0
    overlap: float = 1.0

    def __post_init__(self):
        for name in ("beta_p", "beta_h", "alpha_p", "alpha_h", "overlap"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number of seconds, got {v!r}")
        if not (self.beta_p > 0 and self.beta_h > 0):
            raise ValueError(f"beta_p and beta_h must be > 0, got {self.beta_p}, {self.beta_h}")
        if self.alpha_p < 0 or self.alpha_h < 0:
            raise ValueError(f"alpha_p and alpha_h must be >= 0, got {self.alpha_p}, {self.alpha_h}")
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"overlap must be in [0, 1], got {self.overlap}")

    @classmethod
    def from_bandwidths(cls, expert_bytes: int, b_p: float, b_h: float, alpha_p: float = 0.0,
                        alpha_h: float = 0.0, overlap: float = 1.0) -> "SplitModel":
        """From bandwidths in bytes/s (``B_P`` host->device, ``B_H`` CPU expert throughput)."""
        if not (b_p > 0 and b_h > 0):
            raise ValueError(f"bandwidths must be > 0, got B_P={b_p}, B_H={b_h}")
        return cls(expert_bytes / b_p, expert_bytes / b_h, alpha_p, alpha_h, overlap)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def split_cost(f: int, m: int, model: SplitModel) -> float:
    """Predicted seconds for one layer that fetches ``f`` of its ``m`` misses (0 <= f <= m)."""
    c = m - f
    a = (model.alpha_p + f * model.beta_p) if f > 0 else 0.0
    h = (model.alpha_h + c * model.beta_h) if c > 0 else 0.0
    return max(a, h) + (1.0 - model.overlap) * min(a, h)


# Costs within this relative margin are ties (float rounding of equal real costs).
TIE_RTOL = 1e-9


def _argmin(candidates, m: int, model: SplitModel) -> int:
    """The largest candidate F whose cost is within TIE_RTOL of the smallest cost (ties are
    measured against the minimum itself, so a chain of near-equal costs cannot drift)."""
    costs = {f: split_cost(f, m, model) for f in set(candidates)}
    least = min(costs.values())
    return max(f for f, c in costs.items() if c <= least + TIE_RTOL * abs(least))


def best_fetch_count(m: int, model: SplitModel) -> int:
    """Closed-form integer ``F`` in [0, m] minimising :func:`split_cost` (ties: larger F).

    Raises:
      ValueError: m < 0.
    """
    if m < 0:
        raise ValueError(f"number of misses must be >= 0, got {m}")
    if m == 0:
        return 0
    fstar = (model.alpha_h - model.alpha_p + m * model.beta_h) / (model.beta_p + model.beta_h)
    fstar = min(max(fstar, 0.0), float(m))
    cands = {0, m, 1, m - 1, math.floor(fstar), math.ceil(fstar)}
    return _argmin((f for f in cands if 0 <= f <= m), m, model)


def brute_force_fetch_count(m: int, model: SplitModel) -> int:
    """Reference for :func:`best_fetch_count`: evaluates every F in [0, m] (ties: larger F)."""
    return _argmin(range(m + 1), m, model)


def qstar(m: int, b_p: float, b_h: float) -> int:
    """The plain q* rule of DESIGN.md 1.2: integer F minimising max(F / B_P, (m - F) / B_H)."""
    return best_fetch_count(m, SplitModel(1.0 / b_p, 1.0 / b_h))


def split_table(model: SplitModel, max_misses: int) -> tuple[int, ...]:
    """``F(M)`` for ``M = 0..max_misses`` (a static lookup table indexed inside the jitted step)."""
    return tuple(best_fetch_count(m, model) for m in range(max_misses + 1))


def fixed_split_table(fetch: int, max_misses: int) -> tuple[int, ...]:
    """``F(M) = min(fetch, M)``: fetch at most ``fetch`` misses per layer (0 = CPU only)."""
    if fetch < 0:
        raise ValueError(f"fixed fetch count must be >= 0, got {fetch}")
    return tuple(min(fetch, m) for m in range(max_misses + 1))


def with_link(model: SplitModel, expert_bytes: int, link_bytes_per_s: float) -> SplitModel:
    """The same layer over another host -> device link: ``beta_p = expert_bytes / link_bytes_per_s``.

    The copy's fixed cost, the CPU side and the overlap are kept, so this models a slower link (PCIe
    4.0 x16 ~25e9, x8 ~12e9 bytes/s) from the costs measured on a fast one. Its split table
    ``F(M)`` is then the cap on each layer's fetches that the slower link affords.

    Raises:
      ValueError: expert_bytes or the link rate not > 0.
    """
    if not (expert_bytes > 0 and link_bytes_per_s > 0):
        raise ValueError(f"expert_bytes and the link rate must be > 0, got {expert_bytes}, {link_bytes_per_s}")
    return dataclasses.replace(model, beta_p=expert_bytes / link_bytes_per_s)


def split_gain(m: int, model: SplitModel) -> dict:
    """Predicted seconds of one layer's ``m`` misses, fetched, on the CPU, and split by the model.

    Returns {"misses": m, "fetch": F of the split, "fetch_only_s", "cpu_only_s", "split_s", "gain":
    fetch_only_s / split_s (>= 1 up to float rounding: fetching all is one of the splits; 1.0 for
    m = 0)}.

    Raises:
      ValueError: m < 0.
    """
    f = best_fetch_count(m, model)
    fetch_s, cpu_s, split_s = split_cost(m, m, model), split_cost(0, m, model), split_cost(f, m, model)
    return {"misses": m, "fetch": f, "fetch_only_s": fetch_s, "cpu_only_s": cpu_s, "split_s": split_s,
            "gain": fetch_s / split_s if split_s > 0 else 1.0}


def most_recent_misses(miss: jax.Array, last_routed: jax.Array, n_fetch: jax.Array) -> jax.Array:
    """The ``n_fetch`` most recently used misses of one layer (jittable, fixed shapes).

    Args:
      miss: bool [E], routed experts not resident.
      last_routed: int32 [E], clock of each expert's last routing (-1 = never).
      n_fetch: int32 [], how many to pick (<= miss.sum()).
    Returns:
      bool [E], a subset of ``miss`` with ``n_fetch`` entries: largest ``last_routed`` first, ties
      to the lower expert id.
    """
    key = jnp.where(miss, last_routed, -2)           # non-misses sort last
    order = jnp.argsort(-key, stable=True)           # descending clock, ties ascending id
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    return miss & (rank < n_fetch)
