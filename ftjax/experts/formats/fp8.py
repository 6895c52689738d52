"""fp8 experts: float8_e4m3fn weights with one float32 scale per 128 x 128 block.

This is the layout of the official fp8 Qwen3 MoE checkpoints (config.json ``quantization_config =
{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}``): a tensor ``*.weight``
[out, in] in float8_e4m3fn and ``*.weight_scale_inv`` float32 [ceil(out/128), ceil(in/128)],
dequantized as ``w = w_fp8 * weight_scale_inv`` per block; in the banks' [in, out] layout both are
transposed (``ftjax.checkpoint`` loads them as they are). Quantizing: ``scale = amax(|w| over the
block) * float32(1 / 448)`` (448: the largest finite e4m3fn) and ``q = float8_e4m3fn(w / scale)``
(round to nearest even), the very ``weight_scale_inv`` a checkpoint stores, so
``scripts/make_fp8_checkpoint.py`` and ``--expert_dtype=fp8`` give the same bits. Scales: float32
[ceil(D/128), 2 ceil(F/128)] (gate_up) and [ceil(F/128), ceil(D/128)] (down) per expert.
qwen3-30b-a3b: 4,718,592 + 1,152 bytes per expert. The fused decode kernel scales each tile's
partial sum by its block's scale (tiles never straddle blocks).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ftjax.experts.formats import ExpertFormat

#: Block shape (input rows x output columns), that of the official fp8 checkpoints.
BLOCK = (128, 128)


class Fp8(ExpertFormat):
    name = "fp8"
    storage = np.dtype(ml_dtypes.float8_e4m3fn)
    qmax = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
    fused_decode = True

    def block(self, in_dim: int) -> tuple[int, int]:
        return BLOCK

    def encode(self, r: jax.Array) -> jax.Array:
        return r.astype(jnp.float8_e4m3fn)


FORMAT = Fp8()
