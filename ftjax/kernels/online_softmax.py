"""The online-softmax update shared by the attention kernels (FlashAttention, Dao et al. 2022, and
FlashDecoding): one block of keys folded into a running (output, max, sum) without materialising
the whole row of scores."""

from __future__ import annotations

import jax
import jax.numpy as jnp

#: Score of an invisible key: finite, so a fully masked block gives exp(NEG - m) = 0, never NaN.
NEG = -1e30


def fold_block(acc: jax.Array, m: jax.Array, l: jax.Array, scores: jax.Array, v: jax.Array):
    """Folds one block into the running state.

    acc: float32 [R, hd] unnormalised output; m: float32 [R] running max; l: float32 [R] running
    sum of exp(score - m); scores: float32 [R, K] (invisible keys already set to :data:`NEG`);
    v: [K, hd]. Returns the new (acc, m, l); the output is acc / l once every block is folded.
    """
    m_new = jnp.maximum(m, jnp.max(scores, axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(scores - m_new[:, None])
    l_new = alpha * l + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return acc, m_new, l_new
