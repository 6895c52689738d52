"""Next-token sampling: greedy, temperature, nucleus (top-p), safe at the parameters' edges.

How the edges are handled (``--temperature=1e-38`` once sampled ids unrelated
to greedy, because ``logits / 1e-38`` overflowed to inf and the softmax to nan):

* **No overflow at any temperature.** Each row is shifted by its largest finite logit, so the
  scaled logits ``(l - max) / T`` are <= 0: they can only underflow towards ``-inf``, which is the
  right limit (probability 0), never overflow to ``+inf`` / nan (for T >= 1 the division comes
  before the subtraction, so logits spread beyond float32's range stay finite too; see ``_scaled``).
  A very large ``T`` gives scaled logits near 0: a near-uniform distribution over the kept set.
* **Greedy below** :data:`GREEDY_BELOW` **(1e-6).** Sampling is ``argmax(scaled + g)`` with
  Gumbel noise ``g``; in float32 jax draws ``g`` from ``-log(-log(u))``, ``u`` in
  ``[tiny, 1)``, so ``g`` lies in [-4.5, 15.9], a span of about 20.4. A token whose logit is more
  than ``20.4 * T`` below the maximum can therefore never be sampled. At ``T < 1e-6`` the only
  tokens that could still differ from greedy lie within 2.1e-5 of the maximum: ties within the
  float32 precision of the logits themselves (the oracle's tolerance is 2e-5 * max|logit| +
  1e-5). So such temperatures are treated as 0: argmax, ties to the lowest id, the limit of
  sampling as T -> 0 made deterministic. It also keeps ``T`` away from float32's subnormal
  range, where devices that flush subnormals to zero would divide by 0.
  (Above the threshold, exactly tied maxima are sampled uniformly, which is the T -> 0 limit of
  the distribution.)
* **top_p.** The nucleus is taken in the order of the logits, ties broken by the lowest id (the
  same order greedy uses), and the kept set is the *shortest prefix* of that order whose mass
  before its last token is < top_p. So ``top_p`` near 0 keeps exactly one token, the greedy one,
  and ``top_p == 1`` keeps every token (no cumulative sum is taken, so float32 rounding of the
  mass cannot drop a tail token). The mass is that of the tempered distribution (as in
  transformers: temperature first, then top-p).
* ``-inf`` logits (masked tokens) are never sampled, at any temperature and top_p. A row whose
  logits are all ``-inf`` returns id 0, as greedy (argmax) does. nan logits are not supported.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp

GREEDY_BELOW = 1e-6
"""Temperatures below this are greedy (see the module docstring for why 1e-6)."""


def check_sampling(temperature: float, top_p: float) -> None:
    """Raises ValueError unless ``temperature`` is a finite real number >= 0 and ``top_p`` is a
    real number in (0, 1]; the message names the parameter and its value."""
    for name, v in (("temperature", temperature), ("top_p", top_p)):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise ValueError(f"{name} must be a real number, got {v!r}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if not 0.0 < top_p <= 1.0:  # also false for nan
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")


def sample(logits: jax.Array, key: jax.Array, temperature: float, top_p: float) -> jax.Array:
    """Picks one token per row.

    Args:
      logits: float [B, V] (computed in float32). ``-inf`` entries are never picked.
      key: a PRNG key (one for the whole batch; rows draw independent noise).
      temperature: Python float >= 0 (static under jit). Below :data:`GREEDY_BELOW` (0
        included): greedy, argmax with ties to the lowest id, as ``torch.argmax``.
      top_p: Python float in (0, 1] (static under jit): nucleus sampling (Holtzman et al. 2020),
        keep the smallest set of most likely tokens whose mass reaches top_p.
    Returns:
      int32 [B] token ids.
    Raises:
      ValueError: temperature negative, nan or infinite, or top_p outside (0, 1] or nan.
    """
    check_sampling(temperature, top_p)
    logits = jnp.asarray(logits, jnp.float32)
    if temperature < GREEDY_BELOW:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = _scaled(logits, temperature)
    if top_p < 1.0:
        scaled = jnp.where(_nucleus(logits, scaled, top_p), scaled, -jnp.inf)
    return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)


def _row_max(x: jax.Array) -> jax.Array:
    """float32 [B, 1]: the largest finite entry of each row (0 for a row with none)."""
    top = jnp.max(jnp.where(jnp.isfinite(x), x, -jnp.inf), axis=-1, keepdims=True)
    return jnp.where(jnp.isfinite(top), top, 0.0)


def _scaled(logits: jax.Array, temperature: float) -> jax.Array:
    """float32 [B, V]: the tempered logits shifted so that each row's largest is exactly 0; every
    entry is <= 0 or -inf, never +inf or nan (-inf where the logit is -inf).

    T < 1: ``(l - max) / T``: the difference is <= 0, and dividing can only push an underflowing
    value further down to -inf (probability 0, the right limit).
    T >= 1: ``l * r * r`` with ``r = 1 / sqrt(T)``, then minus its row max: dividing first keeps a
    spread beyond float32's range (logits near +-3e38) finite, and ``r`` stays a normal float32
    (XLA turns a division by a constant into a multiplication by its reciprocal, and 1/T for T
    near 1e38 is subnormal, which the CPU and GPU backends flush to zero: measured, T = 1e38 gave
    a uniform distribution instead of softmax(l / T)). T beyond float32's
    range is the limit T = inf: every finite logit scales to 0, a uniform distribution.
    """
    masked = logits == -jnp.inf
    if temperature < 1.0:
        scaled = (logits - _row_max(logits)) / jnp.float32(temperature)
    elif temperature > float(jnp.finfo(jnp.float32).max):
        scaled = jnp.zeros_like(logits)
    else:
        r = jnp.float32(1.0 / math.sqrt(temperature))
        # barriers: XLA must neither fold r * r into one subnormal constant nor recompute the
        # product inside the max's fusion with another rounding (the max entry must be exactly 0)
        scaled = jax.lax.optimization_barrier(jax.lax.optimization_barrier(logits * r) * r)
        scaled = scaled - _row_max(scaled)
    return jnp.where(masked, -jnp.inf, scaled)


def _nucleus(logits: jax.Array, scaled: jax.Array, top_p: float) -> jax.Array:
    """bool [B, V]: the top-p set. Tokens in order of ``logits`` (descending, ties to the lowest id:
    a stable sort), probabilities from ``scaled``; token i of that order is kept when the mass of
    tokens 0..i-1 is < top_p (so the first is always kept)."""
    order = jnp.argsort(-logits, axis=-1, stable=True)                       # [B, V]
    probs = jax.nn.softmax(jnp.take_along_axis(scaled, order, axis=-1), axis=-1)
    probs = jnp.where(jnp.isnan(probs), 0.0, probs)  # a row of all -inf
    cum = jnp.cumsum(probs, axis=-1)
    before = jnp.concatenate([jnp.zeros_like(cum[:, :1]), cum[:, :-1]], axis=-1)  # exclusive prefix sum
    keep_sorted = before < top_p
    rank = jnp.argsort(order, axis=-1)                                       # inverse permutation
    return jnp.take_along_axis(keep_sorted, rank, axis=-1)
