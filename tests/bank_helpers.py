"""Random expert banks for the host-kernel tests (tests/test_miss_policy.py, tests/test_cpu_native.py)."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ftjax.experts import quant


def random_banks(fmt: str, rows: int, d: int, f: int, seed: int = 0):
    """Random float32 experts [rows, D, 2F] / [rows, F, D] stored in format ``fmt`` ("float32", "bfloat16",
    or a quantized one): (gate_up, down, scales or None, format tag) as numpy arrays."""
    rng = np.random.default_rng(seed)
    gu = (rng.standard_normal((rows, d, 2 * f)) / np.sqrt(d)).astype(np.float32)
    dn = (rng.standard_normal((rows, f, d)) / np.sqrt(f)).astype(np.float32)
    if fmt in ("float32", "bfloat16"):
        dt = np.float32 if fmt == "float32" else ml_dtypes.bfloat16
        return gu.astype(dt), dn.astype(dt), None, "dense"
    qg, sg = quant.quantize(fmt, jnp.asarray(gu), 2)
    qd, sd = quant.quantize(fmt, jnp.asarray(dn), 1)
    return np.asarray(qg), np.asarray(qd), (np.asarray(sg), np.asarray(sd)), quant.bank_format(fmt)
