"""The types every layer, expert function, KV hook and driver share (the decoder's seams).

Offload plugs into the decoder at two seams, so the model's math never mentions it:

* the **expert function** (:data:`ExpertFn`): a layer hands its routing (:class:`LayerRouting`) to
  it and gets the routed experts' output back, whatever the experts mode, cache policy or miss
  policy (``ftjax.experts.offload`` builds it; FreeToken, DESIGN.md 1.1-1.3);
* the **KV hook** (:class:`KVHook`): loads a reused prefix's K/V into the cache layer by layer and
  emits the new chunks (``ftjax.kv.layerwise``; LMCache, DESIGN.md 1.4).

This module imports nothing of ftjax: every other module may import it.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Protocol

import jax
import jax.numpy as jnp


class LayerRouting(NamedTuple):
    """What one layer's router chose, handed to the expert function.

    x: normed MLP input [N, D]; ids: int32 [N, k] expert ids in [0, E); weights: [N, k];
    valid: bool [N], False for padding tokens (their output is discarded and they must not
    cause expert loads).
    """

    x: jax.Array
    ids: jax.Array
    weights: jax.Array
    valid: jax.Array


#: The optional counters of :class:`LayerStats`, in their packed order: a call counts each in every layer or in none.
OPTIONAL_COUNTS = ("d2d", "prefetched", "prefetch_used")


class LayerStats(NamedTuple):
    """Per-layer counters of one forward call (stacked over layers by the drivers).

    hits, misses: int32 [] distinct routed experts found resident / not resident. A streamed
    layer copies all E experts into its buffer: the ones copied device to device from the slot
    cache are its hits (only with ``EngineConfig.stream_d2d_hits`` on the pipelined driver, else
    0), the rest its misses (``hits + misses == E``). With a prefetch, misses are every expert
    the layer copied (wrong guesses too) and hits the routed experts it did not copy, so the
    routed experts are ``hits + misses - prefetched + prefetch_used``. fetched, cpu: int32 [],
    misses copied over PCIe / computed on the CPU (``fetched + cpu == misses``). routed_ids: int32
    [N, k] routed expert ids, -1 for padding tokens (routing traces). The optional counters
    (:data:`OPTIONAL_COUNTS`), None where a call makes no such copies: d2d: int32 [], experts
    copied device to device (a streamed layer's hits); prefetched: int32 [], experts the layer's
    prefetch copied before its lookup (``ftjax.experts.prefetch``, in calls of at most
    ``prefetch.MAX_TOKENS`` tokens: decode steps, short prefills; counted in misses and fetched too,
    so bytes_h2d stays every copy), and prefetch_used: int32 [], the routed ones among them (right
    guesses; the rest were wasted copies).
    """

    hits: jax.Array
    misses: jax.Array
    fetched: jax.Array
    cpu: jax.Array
    routed_ids: jax.Array
    d2d: jax.Array | None = None
    prefetched: jax.Array | None = None
    prefetch_used: jax.Array | None = None

    @classmethod
    def fetch_only(cls, hits: jax.Array, misses: jax.Array, routed_ids: jax.Array) -> "LayerStats":
        """Stats of a layer whose every miss was fetched."""
        return cls(hits, misses, misses, jnp.int32(0), routed_ids)

    def routed(self) -> jax.Array:
        """The distinct routed experts, int32 like hits (any leading axes): ``hits + misses``, less the prefetch's
        wrong guesses where it counted (its copies are misses; only the used ones were routed)."""
        if self.prefetched is None:
            return self.hits + self.misses
        return self.hits + self.misses - self.prefetched + self.prefetch_used

    def optional(self) -> tuple[str, ...]:
        """The names of the optional counters this call counts, in :data:`OPTIONAL_COUNTS` order."""
        return tuple(n for n in OPTIONAL_COUNTS if getattr(self, n) is not None)

    def packed(self) -> jax.Array:
        """The stats as one int32 vector per layer, [..., 4 + len(optional) + N*k]: hits, misses, fetched, cpu, the
        optional counters counted (:meth:`optional`), then ``routed_ids`` flattened; leading axes (layers, steps) as
        the counters'. A layer scan, and a decode block's step loop, stack their outputs with one write per output
        and iteration: one output per counter was one copy kernel each, counts and ids two; one vector is one.
        :meth:`unpacked` is the inverse."""
        counts = [self.hits, self.misses, self.fetched, self.cpu] + [getattr(self, n) for n in self.optional()]
        lead = self._lead()
        counts = jnp.stack([jnp.broadcast_to(jnp.asarray(c, jnp.int32), lead) for c in counts], axis=-1)
        return jnp.concatenate([counts, jnp.asarray(self.routed_ids, jnp.int32).reshape(lead + (-1,))], axis=-1)

    def layout(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """What :meth:`unpacked` needs to invert :meth:`packed`: (one layer's routed ids' shape, without the
        counters' leading axes; the optional counters counted). Works on arrays and on ``jax.eval_shape``'s
        structs."""
        return tuple(self.routed_ids.shape[len(self._lead()):]), self.optional()

    def _lead(self) -> tuple[int, ...]:
        """The counters' leading axes (layers, steps; () for one layer), of arrays or ``jax.eval_shape``'s structs."""
        return tuple(getattr(self.hits, "shape", ()))

    @classmethod
    def unpacked(cls, packed: jax.Array, ids_shape: tuple[int, ...], optional: tuple[str, ...] = ()) -> "LayerStats":
        """The inverse of :meth:`packed` over leading axes: packed int32 [..., 4 + len(optional) + prod(ids_shape)]
        -> fields [...] and routed_ids [..., *ids_shape].

        Raises:
          ValueError: the last axis is not the counts plus prod(ids_shape), or ``optional`` names a counter not in
            :data:`OPTIONAL_COUNTS` or out of its order.
        """
        if isinstance(optional, (bool, str)) or tuple(n for n in OPTIONAL_COUNTS if n in optional) != tuple(optional):
            raise ValueError(f"LayerStats.unpacked: optional counters {optional!r}, expected a subsequence of "
                             f"{OPTIONAL_COUNTS} (a tuple of names)")
        c, n = 4 + len(optional), math.prod(int(d) for d in ids_shape)
        if packed.shape[-1] != c + n:
            raise ValueError(f"LayerStats.unpacked: last axis {packed.shape[-1]}, expected {c} counts + {n} routed ids "
                             f"(ids shape {tuple(ids_shape)})")
        ids = packed[..., c:].reshape(packed.shape[:-1] + tuple(ids_shape))
        return cls(*(packed[..., i] for i in range(4)), ids, **{name: packed[..., 4 + i] for i, name in
                                                                  enumerate(optional)})


#: expert_fn(expert state, layer int32 [], routing) -> (y [N, D], new expert state, LayerStats)
ExpertFn = Callable[[Any, jax.Array, LayerRouting], tuple[jax.Array, Any, LayerStats]]


class KVCache(NamedTuple):
    """Device state of the sequences, each part stacked over the layers of the kind that owns it.

    k, v: [L_att, B, S_max, Hkv, hd] (compute dtype), the K/V cache of the attention layers
    (L_att = L outside the hybrid families). conv: [L_lin, B, K-1, conv_dim] (compute dtype) and
    rec: [L_lin, B, Hv, dk, dv] (float32), the Gated DeltaNet layers' conv and recurrent state;
    None for families without such layers.
    """

    k: jax.Array
    v: jax.Array
    conv: jax.Array | None = None
    rec: jax.Array | None = None


class LayerIndex(NamedTuple):
    """Where a layer sits: layer, its index in the whole stack (int32 []); kind, its index among the
    layers of its kind (int32 []: the leading index of its kind's weights and state)."""

    layer: jax.Array
    kind: jax.Array


class LayerInputs(NamedTuple):
    """What every layer of one forward call shares (built once per call).

    positions: int32 [B, T] absolute positions; bidx: int32 [B, 1] batch row ids; valid: bool
    [B, T], False for padding; start: int32 [B], first position of the call.
    """

    positions: jax.Array
    bidx: jax.Array
    valid: jax.Array
    start: jax.Array


class LayerCarry(NamedTuple):
    """What one layer hands the next: the residual stream h [B, T, D], the cache (:class:`KVCache`),
    the expert state and the KV hook's carry."""

    h: jax.Array
    cache: KVCache
    expert_state: Any
    hook: Any


class ForwardOut(NamedTuple):
    """One forward call's results: logits float32 [B, V] (last valid token) or [B, T, V] (all);
    cache; expert state; stats stacked over layers (leading axis L); kv_out: the KV hook's new
    chunks (None without a hook that stores)."""

    logits: jax.Array
    cache: KVCache
    expert_state: Any
    layer_stats: Any
    kv_out: Any = None


class KVHook(Protocol):
    """Optional hook of the decoder for layerwise KV offload (DESIGN.md 1.4); implemented by
    ``ftjax.kv.layerwise.LayerwiseKV``. With no hook the decoder is unchanged.

    Attention layers (``layer``: the layer's index among the attention layers, the KV cache's):
    ``scan_xs()``: pytree with leading axis L_att sliced by the layer scan (may live in host
    memory), or None. ``init_carry()``: pytree carried through the scan (e.g. the next layer's
    prefetched KV), or None. ``before_attention(ck, cv, layer, xs_l, carry) -> (ck, cv, carry)``:
    may write rows of layer ``layer`` of the cache before this call's K/V are written.
    ``layer_output(ck, cv, layer, start)``: the layer's new chunks, called after this call's K/V
    were written (start: int32 [B]); stacked over the attention layers into ``ForwardOut.kv_out``.

    ``rows``: the batch rows it serves (``ftjax.kv.layerwise.HookRow``: the row, its chunks of the prefix,
    its new chunks); several rows in one call, each loading its own prefix into its own cache row and
    emitting its own new chunks, in the rows' order.

    Gated DeltaNet layers (hybrid families): ``load_state(cache) -> cache`` writes each row's reused
    prefix's stored linear state into that batch row before the first layer; ``state_points()``: (row,
    call-relative token count) where each new chunk ends (that row's state there is stored);
    ``state_output(states)``: those states, moved down for storing.
    """

    rows: tuple

    def scan_xs(self) -> Any: ...

    def init_carry(self) -> Any: ...

    def before_attention(self, ck: jax.Array, cv: jax.Array, layer: jax.Array, xs: Any,
                         carry: Any) -> tuple[jax.Array, jax.Array, Any]: ...

    def layer_output(self, ck: jax.Array, cv: jax.Array, layer: jax.Array, start: jax.Array) -> Any: ...

    def load_state(self, cache: KVCache) -> KVCache: ...

    def state_points(self) -> tuple[tuple[int, int], ...]: ...

    def state_output(self, states: Any) -> Any: ...
