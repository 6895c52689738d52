"""int4 experts: groups of :data:`GROUP` = 64 inputs per output column, two values per byte.

Stored weights: uint8 [in, out / 2]; ``q = clip(round_half_even(w / scale), -7, 7)`` stored as
the nibble ``q + 8`` (so ``0x88`` is two zeros), byte ``j`` of a row holding column ``2j`` in its
low nibble and ``2j + 1`` in its high nibble; decode gives ``nibble - 8``. Scales: float32
``amax(|w| over the group) * float32(1 / 7)``, [ceil(D/64), 2F] (gate_up) and [ceil(F/64), D]
(down) per expert. Groups of 64 rather than 128: finer groups follow outliers better, for 12% more
bytes (qwen3-30b-a3b: 2,359,296 + 294,912 = 2.65 MB per expert against 2.51; docs/QUANTIZATION.md).
The fused decode kernel unpacks the nibbles in registers (``KernelConfig(use="auto")`` keeps int4 on XLA;
``ftjax.kernels.moe_decode.maybe_pairs`` says why).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ftjax.experts.formats import ExpertFormat, pack_nibbles, unpack_nibbles

#: Input rows per scale group (the fused decode kernel's loops run over these groups).
GROUP = 64


class Int4(ExpertFormat):
    name = "int4"
    storage = np.dtype(np.uint8)
    pack = 2
    qmax = 7.0
    fused_decode = True

    def block(self, in_dim: int) -> tuple[int, int]:
        return GROUP, 1

    def encode(self, r: jax.Array) -> jax.Array:
        q = jnp.clip(jnp.round(r), -self.qmax, self.qmax).astype(jnp.int8)
        return pack_nibbles((q + 8).astype(jnp.uint8))

    def decode(self, q: jax.Array) -> jax.Array:
        return (unpack_nibbles(q).astype(jnp.int8) - 8).astype(jnp.float32)


FORMAT = Int4()
