"""Next-token sampling: greedy, temperature, top-k, nucleus (top-p), safe at the parameters' edges.

Two forms: :func:`sample` takes one set of parameters as Python numbers (static under jit: one
program per value) and one key for the batch; :func:`sample_rows` takes per-row parameters as
arrays (traced: one program for every value) and one key per row, so that each row's draw depends
only on its own logits, key and parameters, whatever the rows around it (a request seeded alone
or in a batch draws the same tokens). Both apply the same rules below. A checkpoint's defaults
(``generation_config.json``) are :class:`SamplingDefaults`; :meth:`SamplingDefaults.resolve` fills
the parameters a request leaves unset.

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
* **top_k.** The ``k`` most likely tokens are kept, in the order of the logits with ties broken
  by the lowest id (the order greedy and top_p use), so exactly ``min(k, V)`` tokens are kept and
  ``top_k == 1`` is greedy at any temperature. ``top_k == 0`` (or ``k >= V``) keeps every token
  (transformers' and vLLM's "no limit"; vLLM's -1 is refused here). Masked
  (``-inf``) tokens among the k stay impossible.
* **top_p.** The nucleus is taken in the order of the logits, ties broken by the lowest id (the
  same order greedy uses), and the kept set is the *shortest prefix* of that order whose mass
  before its last token is < top_p. So ``top_p`` near 0 keeps exactly one token, the greedy one,
  and ``top_p == 1`` keeps every token (no cumulative sum is taken, so float32 rounding of the
  mass cannot drop a tail token). The mass is that of the tempered distribution restricted to the
  top-k set and renormalized (as in transformers: temperature, then top-k, then top-p).
* ``-inf`` logits (masked tokens) are never sampled, at any temperature and top_p. A row whose
  logits are all ``-inf`` returns id 0, as greedy (argmax) does. nan logits are not supported.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp

GREEDY_BELOW = 1e-6
"""Temperatures below this are greedy (see the module docstring for why 1e-6)."""


class ParamError(ValueError):
    """A refused request parameter: a ValueError that names the field it refuses (``param``: "top_k",
    "max_tokens", "prompt", ...), so that a server answers 400 naming that field (OpenAI's error ``param``)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # copy and pickle: the constructor takes the field and the message
        return type(self), (self.param, str(self))


@dataclasses.dataclass(frozen=True)
class ResolvedSampling:
    """The parameters one request samples with: temperature (0: greedy), top_p, top_k (0: no limit);
    ``from_checkpoint``: the checkpoint defaults that were applied, ``overridden``: those the request set
    itself (names in the order do_sample, temperature, top_p, top_k)."""

    temperature: float
    top_p: float
    top_k: int
    from_checkpoint: tuple[str, ...] = ()
    overridden: tuple[str, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def describe(self) -> str:
        """One line: what is sampled with, which checkpoint defaults were applied and which overridden."""
        what = "greedy" if self.greedy else f"temperature={self.temperature:g} top_p={self.top_p:g} top_k={self.top_k}"
        if not self.from_checkpoint and not self.overridden:
            return f"sampling: {what} (no sampling defaults: no checkpoint generation_config.json sets any)"
        used = ", ".join(self.from_checkpoint) or "none"
        over = f"; overridden: {', '.join(self.overridden)}" if self.overridden else ""
        return f"sampling: {what} (checkpoint generation_config.json defaults applied: {used}{over})"


@dataclasses.dataclass(frozen=True)
class SamplingDefaults:
    """A checkpoint's sampling defaults, from its ``generation_config.json``
    (``ftjax.checkpoint.sampling_defaults``); None where the file does not give the field.

    do_sample: False or absent: a request that sets no temperature is greedy (transformers' rule);
    True: it samples with ``temperature`` (1.0 when absent). top_p, top_k: used where a request sets
    none. Only the fields the file states apply (as vLLM reads them): transformers' own fallbacks
    (top_k 50 when sampling) are not added.
    Raises:
      ValueError: a value outside the ranges of :func:`check_sampling`, or a do_sample that is not a bool.
    """

    do_sample: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None

    def __post_init__(self):
        if self.do_sample is not None and not isinstance(self.do_sample, bool):
            raise ValueError(f"do_sample must be true or false, got {self.do_sample!r}")
        check_sampling(0.0 if self.temperature is None else self.temperature, 1.0 if self.top_p is None else self.top_p,
                       0 if self.top_k is None else self.top_k)

    def stated(self) -> dict:
        """The fields the checkpoint states (JSON-ready)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def resolve(self, temperature: float | None = None, top_p: float | None = None,
                top_k: int | None = None) -> ResolvedSampling:
        """A request's parameters: each one it sets (not None) as given, the others from these defaults.

        temperature unset: ``self.temperature`` (1.0 when absent) if ``do_sample`` is true, else 0
        (greedy); top_p unset: ``self.top_p`` or 1.0; top_k unset: ``self.top_k`` or 0 (no limit).
        Raises:
          ValueError: a set value outside the ranges of :func:`check_sampling`.
        """
        used = []
        over = [n for n, v in (("do_sample", temperature), ("temperature", temperature), ("top_p", top_p),
                               ("top_k", top_k)) if v is not None and getattr(self, n) is not None]
        if temperature is None:
            if self.do_sample is not None:
                used.append("do_sample")
            temperature = 0.0
            if self.do_sample:
                temperature = 1.0 if self.temperature is None else self.temperature
                if self.temperature is not None:
                    used.append("temperature")
        if top_p is None:
            top_p = 1.0 if self.top_p is None else self.top_p
            if self.top_p is not None:
                used.append("top_p")
        if top_k is None:
            top_k = 0 if self.top_k is None else self.top_k
            if self.top_k is not None:
                used.append("top_k")
        check_sampling(temperature, top_p, top_k)
        return ResolvedSampling(float(temperature), float(top_p), int(top_k), tuple(used), tuple(over))


def check_sampling(temperature: float, top_p: float, top_k: int = 0) -> None:
    """Raises :class:`ParamError` (a ValueError) unless ``temperature`` is a finite real number >= 0,
    ``top_p`` is a real number in (0, 1] and ``top_k`` an integer in [0, 2**31) (an int32 operand of the sampling
    program; any value at or above the vocabulary keeps every token); the message names the parameter and its
    value, and ``ParamError.param`` the parameter."""
    for name, v in (("temperature", temperature), ("top_p", top_p)):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise ParamError(name, f"{name} must be a real number, got {v!r}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ParamError("temperature", f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if not 0.0 < top_p <= 1.0:  # also false for nan
        raise ParamError("top_p", f"top_p must be in (0, 1], got {top_p!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or not 0 <= top_k < 2**31:
        raise ParamError("top_k", f"top_k must be an integer in [0, 2**31) (0 = no limit), got {top_k!r}")


def sample(logits: jax.Array, key: jax.Array, temperature: float, top_p: float, top_k: int = 0) -> jax.Array:
    """Picks one token per row.

    Args:
      logits: float [B, V] (computed in float32). ``-inf`` entries are never picked.
      key: a PRNG key (one for the whole batch; rows draw independent noise).
      temperature: Python float >= 0 (static under jit). Below :data:`GREEDY_BELOW` (0
        included): greedy, argmax with ties to the lowest id, as ``torch.argmax``.
      top_p: Python float in (0, 1] (static under jit): nucleus sampling (Holtzman et al. 2020),
        keep the smallest set of most likely tokens whose mass reaches top_p.
      top_k: Python int >= 0 (static under jit): keep the k most likely tokens (0: no limit).
    Returns:
      int32 [B] token ids.
    Raises:
      ValueError: temperature negative, nan or infinite, top_p outside (0, 1] or nan, or top_k not
        an integer >= 0.
    """
    check_sampling(temperature, top_p, top_k)
    logits = jnp.asarray(logits, jnp.float32)
    if temperature < GREEDY_BELOW:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = _scaled(logits, temperature)
    if 0 < top_k < logits.shape[-1] or top_p < 1.0:
        limit = top_k if 0 < top_k < logits.shape[-1] else None
        scaled = _keep(logits, scaled, None if top_p >= 1.0 else top_p, limit)
    return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)


def sample_rows(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_p: jax.Array,
                top_k: jax.Array, all_greedy: bool | None = None) -> jax.Array:
    """Picks one token per row, each row with its own parameters and key (traced: one program for
    every value).

    Each row follows the module's rules exactly as :func:`sample` with that row's parameters would,
    and its token depends only on its own logits, key and parameters: the same row drawn alone or
    in any batch gives the same token (the noise of row b is ``jax.random.categorical`` of its own
    key, vmapped).

    Args:
      logits: float [B, V] (computed in float32). ``-inf`` entries are never picked.
      keys: PRNG keys [B] (typed keys, e.g. ``jax.random.wrap_key_data`` of uint32 [B, 2]), one per row.
      temperature: float32 [B] >= 0; below :data:`GREEDY_BELOW`: that row is greedy.
      top_p: float32 [B] in (0, 1]; 1 keeps every token.
      top_k: int32 [B] >= 0; 0 (or >= V) keeps every token.
      all_greedy: static, what the caller knows of the temperatures: True, every row is greedy (the argmax alone);
        False, some row samples (the draw, greedy rows taking the argmax); None, not known: a ``lax.cond`` on
        the traced temperatures picks one. The tokens are the same either way; the draw sorts every row's V
        logits (top-p). A host that knows should say: on a GPU a ``lax.cond`` outside a command buffer copies its
        predicate to the host, which waits for the queued work (run-ahead then hides nothing).
    Returns:
      int32 [B] token ids.
    The values are traced, so they are not checked here: check each request's with
    :func:`check_sampling` first (a negative top_k acts as 0, a top_p above 1 as 1).
    """
    logits = jnp.asarray(logits, jnp.float32)
    t = jnp.asarray(temperature, jnp.float32)[:, None]
    greedy = t < GREEDY_BELOW
    best = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(_):
        scaled = _scaled_rows(logits, jnp.where(greedy, 1.0, t))
        scaled = _keep(logits, scaled, jnp.asarray(top_p, jnp.float32)[:, None],
                       jnp.asarray(top_k, jnp.int32)[:, None])
        drawn = jax.vmap(lambda k, row: jax.random.categorical(k, row))(keys, scaled)
        return jnp.where(greedy[:, 0], best, drawn).astype(jnp.int32)

    if all_greedy is not None:
        return best if all_greedy else draw(None)
    # a batch of greedy rows skips the draw (its sort of every row's V logits for top-p): same tokens
    return jax.lax.cond(jnp.all(greedy), lambda _: best, draw, None)


def _scaled_rows(logits: jax.Array, t: jax.Array) -> jax.Array:
    """:func:`_scaled` with a temperature per row (float32 [B, 1], >= :data:`GREEDY_BELOW` or inf): both
    of its formulas computed, each row taking the one its temperature selects; an infinite temperature
    (a float32 overflow) gives r = 0: every finite logit scales to 0, the uniform limit."""
    masked = logits == -jnp.inf
    low = (logits - _row_max(logits)) / t
    r = jax.lax.rsqrt(jnp.maximum(t, 1.0))
    high = jax.lax.optimization_barrier(jax.lax.optimization_barrier(logits * r) * r)
    high = jnp.where(masked, -jnp.inf, high)  # -inf * 0 = nan at T = inf
    high = high - _row_max(high)
    return jnp.where(masked, -jnp.inf, jnp.where(t < 1.0, low, high))


def _keep(logits: jax.Array, scaled: jax.Array, top_p, top_k) -> jax.Array:
    """``scaled`` with the tokens outside the top-k set, then outside the top-p set of what is left,
    set to -inf. Order: ``logits`` descending, ties to the lowest id (a stable sort). top_k: None
    (no limit) or int / int32 [B, 1] (<= 0: no limit); top_p: None (1) or float / float32 [B, 1]
    (>= 1: every token). The mass for top_p is the softmax of the top-k survivors of ``scaled``."""
    order = jnp.argsort(-logits, axis=-1, stable=True)                      # [B, V]
    rank = jnp.argsort(order, axis=-1)                                      # inverse permutation
    if top_k is not None:
        scaled = jnp.where((top_k <= 0) | (rank < top_k), scaled, -jnp.inf)
    if top_p is None:
        return scaled
    probs = jax.nn.softmax(jnp.take_along_axis(scaled, order, axis=-1), axis=-1)
    probs = jnp.where(jnp.isnan(probs), 0.0, probs)  # a row of all -inf
    cum = jnp.cumsum(probs, axis=-1)
    before = jnp.concatenate([jnp.zeros_like(cum[:, :1]), cum[:, :-1]], axis=-1)  # exclusive prefix sum
    # no cumulative sum decides a row with top_p 1; the most probable token always stays (a top_p that float32
    # flushes to 0 keeps it alone, as any tiny top_p does, instead of masking every token)
    keep_sorted = (before < top_p) | (top_p >= 1.0) | (jnp.arange(cum.shape[-1]) == 0)
    return jnp.where(jnp.take_along_axis(keep_sorted, rank, axis=-1), scaled, -jnp.inf)


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
