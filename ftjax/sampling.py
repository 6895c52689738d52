"""Next-token sampling: greedy, temperature, nucleus (top-p)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample(logits: jax.Array, key: jax.Array, temperature: float, top_p: float) -> jax.Array:
    """Picks one token per row.

    logits: float32 [B, V]. temperature 0 means greedy (argmax, ties to the lowest id, as
    ``torch.argmax``). top_p in (0, 1]: keep the smallest set of tokens whose probability mass
    reaches top_p (Holtzman et al. 2020). Returns int32 [B].
    """
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # mass strictly before each sorted token; a token is kept if that mass is < top_p
        before = jnp.cumsum(probs, axis=-1) - probs
        kept = jnp.where(before < top_p, sorted_logits, jnp.inf)
        threshold = jnp.min(kept, axis=-1, keepdims=True)
        logits = jnp.where(logits >= threshold, logits, -jnp.inf)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
