"""Dense experts: ``--expert_dtype=bfloat16`` (bank tag ``dense``), the format without scales.

Stored weights: bfloat16 when quantized from fp32 banks with ``--expert_dtype=bfloat16``; banks
loaded without an ``expert_dtype`` keep the compute dtype (fp32 / bf16 / fp16) under the same tag.
No blocks, no scales; dequantization is a cast to the compute dtype (a no-op when the banks are
already in it), so the dense and quantized experts share one code path. Bytes per expert:
``3 * D * F * itemsize`` (qwen3-30b-a3b in bf16: 9,437,184). The fused decode kernel reads it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ftjax.experts.formats import ExpertFormat


class Dense(ExpertFormat):
    name = "dense"
    expert_dtype = "bfloat16"
    storage = np.dtype(jnp.bfloat16)
    fused_decode = True

    def dequantize(self, q: jax.Array, s: jax.Array | None, dtype, parts: int = 1) -> jax.Array:
        """``q`` [..., in, out] cast to ``dtype`` (the identity when it is already in it); ``s`` is None."""
        return q.astype(dtype)


FORMAT = Dense()
