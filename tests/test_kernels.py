"""Pallas kernels (ftjax.kernels) against their jnp references, in Pallas interpret mode on the CPU,
plus the kernel config's choices at trace time and a check that each kernel lowers for CUDA (Triton backend) here.

Tolerances: the kernels accumulate in float32 like the references but in another order, and
round intermediate products differently (unnormalised softmax probabilities, per-column int8
scales applied after the sum), so float32 results agree to ~1e-6 and bf16 to one or two ulps of
the output (values of magnitude ~3: ulp 1/64).
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ftjax.experts import compute, formats, quant
from ftjax.kernels import decode_attention as da
from ftjax.kernels import flash_prefill as fp
from ftjax.kernels import moe_decode as md
from ftjax.kernels import registry
from ftjax.kernels.registry import KernelConfig, using
from ftjax.layers import attention as attention_lib
from ftjax.layers import common as layers_common

#: Why a float32 case holds on the CPU backend only (``cpu_only``, tests/conftest.py).
TF32 = "float32 references run as TF32 on a GPU"
CHOICE = "asserts the CPU's kernel choices (auto picks the kernels on a GPU)"


def _maxdiff(a, b) -> float:
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


# ------------------------------------------------------------------ fused MoE decode
def _pool(rng, s=10, d=256, f=128, dtype=jnp.bfloat16):
    gu = jnp.asarray(rng.standard_normal((s, d, 2 * f)) / 16, dtype)
    dn = jnp.asarray(rng.standard_normal((s, f, d)) / 11, dtype)
    return gu, dn


@pytest.mark.parametrize("fmt", md.FORMATS)  # the registered formats that claim the kernel
def test_moe_decode_matches_gather_reference(fmt):
    rng = np.random.default_rng(0)
    gu, dn = _pool(rng)
    x = jnp.asarray(rng.standard_normal((2, 256)), jnp.bfloat16)
    slots = jnp.asarray([[3, 9, 0], [3, 7, 1]], jnp.int32)
    if not formats.get(fmt).has_scales:
        pool, sc = (gu, dn), None
    else:
        qg, sg = quant.quantize(fmt, gu, 2)
        qd, sd = quant.quantize(fmt, dn, 1)
        pool, sc = (qg, qd), (sg, sd)
    ref = compute.gather_outputs(x, slots, *pool, sc, fmt)
    got = md.moe_decode_pairs(x, slots, *pool, sc, fmt, interpret=True)
    assert got.shape == (2, 3, 256) and got.dtype == jnp.bfloat16
    assert float(jnp.max(jnp.abs(ref.astype(jnp.float32)))) > 1.0  # a real signal, not zeros
    assert _maxdiff(got, ref) <= 2 / 64


@pytest.mark.parametrize("block_d,block_f,d_split", [
    (64, 64, 1), pytest.param(32, 128, 4, marks=pytest.mark.cpu_only(TF32)), (128, 32, 2)])
def test_moe_decode_float32_tiles_and_negative_slots(block_d, block_f, d_split):
    rng = np.random.default_rng(1)
    gu, dn = _pool(rng, dtype=jnp.float32)
    x = jnp.asarray(rng.standard_normal((3, 256)), jnp.float32)
    slots = jnp.asarray([[-1, 2], [5, 5], [0, 9]], jnp.int32)  # -1 wraps to slot 9, as jnp indexing does
    ref = compute.gather_outputs(x, slots, gu, dn)
    got = md.moe_decode_pairs(x, slots, gu, dn, interpret=True, block_d=block_d, block_f=block_f, d_split=d_split)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)
    wrapped = md.moe_decode_pairs(x[:1], jnp.asarray([[9]]), gu, dn, interpret=True, block_d=block_d,
                                  block_f=block_f, d_split=d_split)
    np.testing.assert_array_equal(np.asarray(got[0, 0]), np.asarray(wrapped[0, 0]))


@pytest.mark.parametrize("block_d,block_f,d_split,down", [(64, 64, 1, (0, 0)), (64, 64, 2, (0, 0)),
                                                          (64, 64, 4, (0, 0)), (32, 128, 2, (128, 32))])
def test_moe_decode_int4_d_split_matches_reference(block_d, block_f, d_split, down):
    """int4 with the gate/up stage split over D (parts of whole 64-row scale groups; D = 256 is four
    groups, so d_split 4 gives one group per part) and other tiles: bf16 within the tolerance of
    the unsplit test above, float32 to ~1e-6 (the float32 sums only change order: the partial sums
    are added in float32 before the gating, as in the other formats)."""
    rng = np.random.default_rng(6)
    gu, dn = _pool(rng, dtype=jnp.float32)
    qg, sg = quant.quantize("int4", gu, 2)
    qd, sd = quant.quantize("int4", dn, 1)
    slots = jnp.asarray([[3, 9, 0], [3, 7, 1]], jnp.int32)
    tiles = dict(block_d=block_d, block_f=block_f, d_split=d_split, down_cols=down[0], down_rows=down[1])
    for dtype, tol in ((jnp.bfloat16, 2 / 64), (jnp.float32, 1e-5)):
        x = jnp.asarray(rng.standard_normal((2, 256)), dtype)
        ref = compute.gather_outputs_reference(x, slots, qg, qd, (sg, sd), "int4")
        got = md.moe_decode_pairs(x, slots, qg, qd, (sg, sd), "int4", interpret=True, **tiles)
        assert got.shape == (2, 3, 256) and got.dtype == dtype
        assert float(jnp.max(jnp.abs(ref.astype(jnp.float32)))) > 1.0
        assert _maxdiff(got, ref) <= tol
    with pytest.raises(ValueError, match="unsupported int4"):  # parts of half a scale group
        md.moe_decode_pairs(x, slots, qg, qd, (sg, sd), "int4", interpret=True, block_d=32, d_split=8)


def test_moe_decode_supported():
    x = jnp.zeros((1, 2048), jnp.bfloat16)
    gu, dn = jnp.zeros((4, 2048, 1536), jnp.bfloat16), jnp.zeros((4, 768, 2048), jnp.bfloat16)
    assert md.supported(x, gu, dn, "dense") and md.supported(x, gu, dn, "fp8")
    assert not md.supported(x, gu, dn, "int4")  # int4 pools are packed: [S, D, F] and [S, F, D/2]
    assert md.supported(x, gu[..., :768], dn[..., :1024], "int4")
    assert md.supported(x, gu, dn, "dense", 64, 64, d_split=32) and not md.supported(x, gu, dn, "dense", 64, 64, 64)
    assert not md.supported(x, jnp.zeros((4, 2048, 1200), jnp.bfloat16), jnp.zeros((4, 600, 2048)), "dense")
    g4, d4 = gu[..., :768], dn[..., :1024]  # int4: d_split parts of whole 64-row scale groups (D = 32 groups)
    assert all(md.supported(x, g4, d4, "int4", 64, 64, d_split=s) for s in (1, 2, 4, 8, 32))
    assert not md.supported(x, g4, d4, "int4", 32, 64, d_split=64)  # 32-row parts
    assert md.supported(x, gu, dn, "dense", 32, 64, d_split=64) and not md.supported(x, gu, dn, "dense", d_split=0)
    # the down stage's own tile: columns of D per program, rows of F per step (int4: inside a scale group)
    assert md.supported(x, g4, d4, "int4", down_cols=256, down_rows=32)
    assert not md.supported(x, g4, d4, "int4", down_rows=128) and md.supported(x, gu, dn, "dense", down_rows=128)
    assert not md.supported(x, gu, dn, "dense", down_cols=96) and not md.supported(x, g4, d4, "int4", down_cols=1)


def _shape_tiles(t: dict) -> dict:
    return {k: (t[k] or 1 if k == "d_split" else t[k]) for k in ("block_d", "block_f", "d_split", "down_cols",
                                                                  "down_rows")}


def test_moe_decode_tiles_config():
    assert md.tiles("int8") == {"block_d": md.BLOCK_D, "block_f": md.BLOCK_F, "num_warps": None,
                                "d_split": md.D_SPLIT, "down_cols": 0, "down_rows": 0}
    # 16-bit pools: 128-row steps and 8 warps (measured faster on an H100), which int4's 64-row groups refuse
    assert md.tiles("dense") == dict(md.tiles("int8"), block_d=128, num_warps=8) == md.tiles()
    x, g4, d4 = jnp.zeros((1, 2048)), jnp.zeros((4, 2048, 768)), jnp.zeros((4, 768, 1024))  # int4's packed shapes
    assert md.supported(x, g4, d4, "int4", **_shape_tiles(md.tiles("int4")))
    assert not md.supported(x, g4, d4, "int4", **_shape_tiles(md.tiles("dense")))
    with using(KernelConfig(tiles={"moe_decode": (128, 32, 8, 4)})):
        assert md.tiles() == {"block_d": 128, "block_f": 32, "num_warps": 8, "d_split": 4, "down_cols": 0,
                              "down_rows": 0}
    with using(KernelConfig(tiles={"moe_decode": (64, 64, 0, 8, 128, 32)})):
        assert md.tiles() == {"block_d": 64, "block_f": 64, "num_warps": None, "d_split": 8, "down_cols": 128,
                              "down_rows": 32}
    # batch 1 of qwen3-30b-a3b: 8 pairs x 12 column tiles = 96 programs -> split D in 4 (384)
    assert md.auto_d_split(8, 2048, 768, 64, 64, "dense") == 4
    assert md.auto_d_split(32, 2048, 768, 64, 64, "dense") == 1
    assert md.auto_d_split(1, 128, 768, 64, 64, "dense") == 2  # D = 128 allows no more
    for fmt in ("int8", "fp8", "int4"):
        assert md.auto_d_split(8, 2048, 768, 64, 64, fmt) == 4 and md.auto_d_split(32, 2048, 768, 64, 64, fmt) == 1
    assert md.auto_d_split(8, 2048, 768, 32, 64, "int4") == 4
    assert md.auto_d_split(1, 2048, 768, 64, 128, "int4") == 8  # 6 column tiles: 48 programs -> 8 parts, 384
    # D = 192: 32-row steps split it in 2 (96 rows each), int4 not (parts of whole 64-row scale groups)
    assert md.auto_d_split(1, 192, 768, 32, 64, "dense") == 2 and md.auto_d_split(1, 192, 768, 32, 64, "int4") == 1
    for bad in ((128, 32), (64, 64, 4, 4, 128)):
        with pytest.raises(ValueError, match=r"block_d,block_f,num_warps,d_split\[,down_cols,down_rows\]"):
            md.parse_tiles(bad)
        with pytest.raises(ValueError, match=r"KernelConfig.tiles: .*block_d,block_f,num_warps,d_split\[,down_cols"):
            KernelConfig(tiles={"moe_decode": bad})


def test_moe_decode_tiles_config_rejects_zero_and_negative_values():
    """A zero block (or a negative field) is malformed: the kernel config refuses it when it is made (so neither
    tiles() nor maybe_pairs ever meets it), instead of a ZeroDivisionError in auto_d_split at trace time
    (block_d / block_f 0) or a silent fall back to XLA (negative d_split / down tile)."""
    for bad in ((0, 64, 0, 0), (64, 0, 0, 0), (-64, 64, 0, 1), (64, 64, -1, 0), (64, 64, 0, -2), (64, 64, 0, 1, -1, 0),
                (64, 64, 0, 1, 0, -32)):
        with pytest.raises(ValueError, match="tiles of kernel 'moe_decode'"):
            md.parse_tiles(bad)
        with pytest.raises(ValueError, match="KernelConfig.tiles: tiles of kernel 'moe_decode'"):
            KernelConfig(use="moe_decode", tiles={"moe_decode": bad})


@pytest.mark.cpu_only("asserts the interpret-mode split of the pairs")
def test_moe_decode_maybe_pairs_splits_int4(monkeypatch):
    """maybe_pairs hands int4 the tiles of ``KernelConfig.tiles`` and auto_d_split's split like the other
    formats (it used to force d_split 1); under auto it still keeps int4 on XLA (no GPU here anyway)."""
    rng = np.random.default_rng(7)
    gu, dn = _pool(rng, dtype=jnp.float32)
    qg, sg = quant.quantize("int4", gu, 2)
    qd, sd = quant.quantize("int4", dn, 1)
    x = jnp.asarray(rng.standard_normal((1, 256)), jnp.float32)
    slots = jnp.asarray([[3, 9]], jnp.int32)
    calls = []
    real = md.moe_decode_pairs

    def spy(*args, **kw):
        calls.append(kw)
        return real(*args, **kw)

    monkeypatch.setattr(md, "moe_decode_pairs", spy)
    ref = compute.gather_outputs_reference(x, slots, qg, qd, (sg, sd), "int4")
    with using(KernelConfig(use="moe_decode")):  # named: interpreted on the CPU
        got = md.maybe_pairs(x, slots, qg, qd, (sg, sd), "int4")  # 2 pairs x 2 column tiles: D = 256 in 4 parts
    assert calls[-1]["d_split"] == 4 and calls[-1]["interpret"]
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)
    with using(KernelConfig(use="moe_decode", tiles={"moe_decode": (64, 64, 0, 2, 128, 32)})):
        md.maybe_pairs(x, slots, qg, qd, (sg, sd), "int4")
    assert {k: calls[-1][k] for k in ("d_split", "down_cols", "down_rows")} == {"d_split": 2, "down_cols": 128,
                                                                               "down_rows": 32}
    # 32-row parts: not supported for int4 -> the reference
    with using(KernelConfig(use="moe_decode", tiles={"moe_decode": (32, 64, 0, 8)})):
        assert md.maybe_pairs(x, slots, qg, qd, (sg, sd), "int4") is None and len(calls) == 2
    with using(KernelConfig(use="auto")):
        assert md.maybe_pairs(x, slots, qg, qd, (sg, sd), "int4") is None and len(calls) == 2


@pytest.mark.cpu_only(CHOICE)
def test_experts_gather_uses_kernel_only_when_selected():
    rng = np.random.default_rng(2)
    gu, dn = _pool(rng, dtype=jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, 256)), jnp.float32)
    slots = jnp.asarray([[1, 2], [3, 4]], jnp.int32)
    w = jnp.asarray([[0.75, 0.25], [0.5, 0.5]], jnp.float32)
    with using(KernelConfig(use="xla")):
        ref = compute.experts_gather(x, slots, w, gu, dn)
    with using(KernelConfig(use="moe_decode")):  # a name list: interpreted on the CPU
        jax.clear_caches()
        jaxpr = str(jax.make_jaxpr(compute.experts_gather)(x, slots, w, gu, dn))
        assert "pallas_call" in jaxpr
        got = compute.experts_gather(x, slots, w, gu, dn)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)
    with using(KernelConfig(use="auto")):  # CPU default: the jnp code, no kernel
        jax.clear_caches()  # traces keep the choice made when they were traced
        assert "pallas_call" not in str(jax.make_jaxpr(compute.experts_gather)(x, slots, w, gu, dn))


# ------------------------------------------------------------------ decode attention
@pytest.mark.parametrize("dtype,tol", [pytest.param(jnp.float32, 1e-5, marks=pytest.mark.cpu_only(TF32)),
                                       (jnp.bfloat16, 2 / 256)])
@pytest.mark.parametrize("n_split", [1, 4, 16])
def test_decode_attention_matches_reference(dtype, tol, n_split):
    rng = np.random.default_rng(3)
    L, B, S, hkv, g, hd = 2, 3, 256, 2, 4, 32
    kc = jnp.asarray(rng.standard_normal((L, B, S, hkv, hd)), dtype)
    vc = jnp.asarray(rng.standard_normal((L, B, S, hkv, hd)), dtype)
    q = jnp.asarray(rng.standard_normal((B, 1, hkv * g, hd)), dtype)
    pos = jnp.asarray([[0], [77], [255]], jnp.int32)  # one filled position, a partial block, all
    ref = attention_lib.attention(q, kc[1], vc[1], pos)
    got = da.decode_attention(q, kc, vc, jnp.int32(1), pos[:, 0] + 1, interpret=True, block_k=16, n_split=n_split)
    assert got.shape == q.shape and got.dtype == dtype
    assert _maxdiff(got, ref) <= tol


def test_decode_attention_ignores_unfilled_positions():
    rng = np.random.default_rng(4)
    kc = jnp.asarray(rng.standard_normal((1, 1, 64, 1, 16)), jnp.float32)
    vc = jnp.asarray(rng.standard_normal((1, 1, 64, 1, 16)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((1, 1, 2, 16)), jnp.float32)
    a = da.decode_attention(q, kc, vc, 0, jnp.asarray([20]), interpret=True, block_k=16, n_split=2)
    stale = kc.at[:, :, 20:].set(1e4), vc.at[:, :, 20:].set(-1e4)  # finite junk, as stale rows are
    b = da.decode_attention(q, *stale, 0, jnp.asarray([20]), interpret=True, block_k=16, n_split=2)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------ flash prefill
@pytest.mark.parametrize("dtype,tol", [pytest.param(jnp.float32, 1e-5, marks=pytest.mark.cpu_only(TF32)),
                                       (jnp.bfloat16, 2 / 128)])
def test_flash_prefill_matches_reference_with_offsets(dtype, tol):
    rng = np.random.default_rng(5)
    B, T, S, hkv, g, hd = 3, 64, 128, 2, 2, 16
    k = jnp.asarray(rng.standard_normal((B, S, hkv, hd)), dtype)
    v = jnp.asarray(rng.standard_normal((B, S, hkv, hd)), dtype)
    q = jnp.asarray(rng.standard_normal((B, T, hkv * g, hd)), dtype)
    start = jnp.asarray([0, 37, 64], jnp.int32)  # fresh prefill, unaligned and aligned prefix reuse
    pos = start[:, None] + jnp.arange(T)[None]
    ref = attention_lib.attention(q, k, v, pos)
    got = fp.flash_attention(q, k, v, start, interpret=True, block_q=16, block_k=32)
    assert got.shape == q.shape and got.dtype == dtype
    assert _maxdiff(got, ref) <= tol


def test_the_mgpu_attention_wrapper_scales_its_scores_as_the_model(monkeypatch):
    """``mgpu_attention``'s contract, checked on the CPU with the shipped kernel's own reference standing in for it
    (``attention_mgpu.attention_reference``: the same unscaled causal softmax): it must give the model's attention
    (scores times hd**-0.5). The wrapper once passed q unscaled (max |diff| 5.36 on an H200)."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu
    monkeypatch.setattr(attention_mgpu, "attention",
                        lambda q, k, v, cfg: attention_mgpu.attention_reference(q, k, v, causal=cfg.causal))
    rng = np.random.default_rng(6)
    B, T, hkv, g, hd = 1, 128, 2, 2, 64
    q, k, v = (jnp.asarray(rng.standard_normal((B, T, h, hd)), jnp.bfloat16) for h in (hkv * g, hkv, hkv))
    ref = attention_lib.attention(q, k, v, jnp.arange(T)[None])
    got = fp.mgpu_attention(q, k, v)
    assert got.shape == q.shape and got.dtype == jnp.bfloat16
    assert _maxdiff(got, ref) <= 2 / 128


@pytest.mark.cpu_only(TF32)
def test_flash_prefill_takes_a_cache_row_that_is_no_multiple_of_the_key_tile():
    """S_max = T + 16 (``max_seq_len`` = prompt + 16, as bench_gated_delta's engine): the last key block runs past
    the row; its loads are masked, and the kernel (not the jnp reference) runs and matches the reference, also for
    (padding) queries past the row, which must not see the zeros read there."""
    rng = np.random.default_rng(8)
    B, T, S, hkv, g, hd = 3, 64, 80, 2, 2, 16
    k, v = (jnp.asarray(rng.standard_normal((B, S, hkv, hd)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((B, T, hkv * g, hd)), jnp.float32)
    start = jnp.asarray([0, 16, 40], jnp.int32)  # row 1's last query sees key 79; row 2's last 24 sit past S
    assert fp.supported(q, k, block_k=32)
    ref = attention_lib.attention(q, k, v, start[:, None] + jnp.arange(T)[None])
    got = fp.flash_attention(q, k, v, start, interpret=True, block_q=16, block_k=32)
    assert _maxdiff(got, ref) <= 1e-5


def test_the_mgpu_path_takes_the_reference_for_operands_beyond_float16(monkeypatch):
    """``maybe`` with ``flash_prefill="mgpu"`` (the backend stubbed to a GPU and the kernel to jax's own reference,
    which casts as the kernel does): values beyond float16's range take the jnp attention instead of overflowing,
    and in-range ones the kernel's path."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu
    calls = []

    def kernel(q, k, v, cfg):
        calls.append(1)
        return attention_mgpu.attention_reference(q, k, v, causal=cfg.causal)

    monkeypatch.setattr(attention_mgpu, "attention", kernel)
    monkeypatch.setattr(registry.jax, "default_backend", lambda: "gpu")
    rng = np.random.default_rng(9)
    B, T, hkv, g, hd = 1, 128, 2, 2, 64
    q, k, v = (jnp.asarray(rng.standard_normal((B, T, h, hd)), jnp.bfloat16) for h in (hkv * g, hkv, hkv))
    pos = jnp.arange(T)[None]
    for scale, in_range in ((1.0, True), (1e5, False)):
        calls.clear()
        vs = v * scale
        with using(KernelConfig(flash_prefill="mgpu")):
            assert bool(fp.mgpu_in_range(q, k, vs)) == in_range
            got = jax.jit(lambda q, k, v: fp.maybe(q, k, v, pos, attention_lib.attention))(q, k, vs)
        ref = attention_lib.attention(q, k, vs, pos)
        assert bool(jnp.all(jnp.isfinite(got.astype(jnp.float32))))  # the kernel's branch would be inf at 1e5
        assert _maxdiff(got, ref) <= 2 / 128 * scale and len(calls) == 1  # the stub traced (lax.cond: both branches)


def test_auto_flash_prefill_takes_the_mosaic_kernel_only_for_calls_from_0_on_a_hopper_gpu(monkeypatch):
    """``flash_prefill="auto"`` (the default) with the backend stubbed to a GPU: a call whose rows all start at 0
    takes the Mosaic kernel (stubbed to its reference negated, so the branch shows in the values), a call from
    another start the Pallas kernel (run interpreted), and on a GPU other than Hopper no call reaches the Mosaic
    kernel."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu
    calls, pallas = [], fp.flash_attention

    def kernel(q, k, v, cfg):
        calls.append(1)
        return -attention_mgpu.attention_reference(q, k, v, causal=cfg.causal)

    monkeypatch.setattr(attention_mgpu, "attention", kernel)
    monkeypatch.setattr(fp, "flash_attention", lambda q, k, v, start, interpret: pallas(q, k, v, start, interpret=True))
    monkeypatch.setattr(registry.jax, "default_backend", lambda: "gpu")
    rng = np.random.default_rng(9)
    B, T, S, hkv, g, hd = 1, 128, 256, 2, 2, 64
    q = jnp.asarray(rng.standard_normal((B, T, hkv * g, hd)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((B, S, hkv, hd)), jnp.bfloat16) for _ in range(2))
    assert KernelConfig().flash_prefill == "auto"
    def run(*args):  # a new trace per call: jit's cache keys neither the kernel config nor the stubs
        return jax.jit(lambda q, k, v, pos: fp.maybe(q, k, v, pos, attention_lib.attention))(*args)

    for is_hopper in (True, False):
        monkeypatch.setattr(fp, "hopper", lambda h=is_hopper: h)
        calls.clear()
        for start in (0, 37):
            pos = start + jnp.arange(T)[None]
            with using(KernelConfig()):
                got = run(q, k, v, pos)
            sign = -1 if is_hopper and start == 0 else 1
            assert _maxdiff(sign * got.astype(jnp.float32), attention_lib.attention(q, k, v, pos)) <= 2 / 128
        assert bool(calls) == is_hopper  # traced (mgpu_traces, the lax.cond) on Hopper only
    # on Hopper: two rows of which one starts past 0, and operands beyond float16, take the Pallas kernel
    monkeypatch.setattr(fp, "hopper", lambda: True)
    q2, k2, v2 = (jnp.concatenate([a, a]) for a in (q, k, v))
    pos2 = jnp.asarray([0, 37])[:, None] + jnp.arange(T)[None]
    pos0 = jnp.arange(T)[None]
    with using(KernelConfig()):
        mixed, big = run(q2, k2, v2, pos2), run(q, k, v * 1e5, pos0)
    assert _maxdiff(mixed, attention_lib.attention(q2, k2, v2, pos2)) <= 2 / 128
    ref_big = attention_lib.attention(q, k, v * 1e5, pos0)
    assert _maxdiff(big, ref_big) <= 2 / 128 * 1e5 < float(jnp.max(jnp.abs(ref_big)))  # negated: ~2x the max apart


def test_auto_flash_prefill_lowered_for_a_gpu_takes_the_pallas_kernel_where_the_mosaic_one_cannot_trace(monkeypatch):
    """Tracing the default prefill attention for a GPU (``registry.lowering_for``) on a machine whose jax cannot
    trace jax's Mosaic attention (no CUDA libraries here: it asserts them) raises nothing and holds the Pallas
    kernel; where it can trace, the Mosaic kernel's branch is there too."""
    seen, pallas = [], fp.flash_attention
    monkeypatch.setattr(fp, "flash_attention", lambda *a, **kw: seen.append(1) or pallas(*a, **kw))
    sd = jax.ShapeDtypeStruct
    q, kv, pos = sd((1, 128, 4, 64), jnp.bfloat16), sd((1, 256, 2, 64), jnp.bfloat16), sd((1, 128), jnp.int32)
    traces = fp.mgpu_traces(q, kv, kv, fp.mgpu_block_kv(64))
    jax.clear_caches()
    try:
        with registry.lowering_for("gpu"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the Triton backend's deprecation warning
            jax.jit(lambda q, k, v, p: fp.maybe(q, k, v, p, attention_lib.attention)).trace(q, kv, kv, pos)
    finally:
        jax.clear_caches()
    assert len(seen) == 1  # the Pallas kernel: alone, or as the lax.cond's other branch
    if jax.default_backend() == "cpu":
        assert not traces


def test_flash_prefill_supported_and_impl_choice():
    q, k = jnp.zeros((1, 8192, 32, 128), jnp.bfloat16), jnp.zeros((1, 8192, 4, 128), jnp.bfloat16)
    assert fp.supported(q, k) and fp.mgpu_supported(q, k)
    assert fp.mgpu_block_kv(128) == 128 and fp.mgpu_block_kv(256) == 64  # qwen3.5's hd 256: two K/V steps fit at 64
    assert not fp.supported(jnp.zeros((1, 24, 32, 128)), jnp.zeros((1, 8192, 4, 128)))
    with pytest.raises(ValueError, match="KernelConfig.flash_prefill: unknown value 'nope'"):
        KernelConfig(flash_prefill="nope")


# ------------------------------------------------------------------ the kernel config's choice
def test_registry_modes():
    assert registry.mode("moe_decode") == ("gpu" if jax.default_backend() == "gpu" else "xla")
    assert registry.mode("moe_decode", auto=False) == "xla"  # auto skips a kernel measured slower than XLA
    with using(KernelConfig(use="interpret")):
        assert registry.mode("decode_attention") == "interpret"
        assert registry.mode("decode_attention", supported=False) == "xla"
        assert registry.mode("moe_decode", auto=False) == "interpret"  # tests still run it
    with using(KernelConfig(use="xla")):
        assert registry.mode("flash_prefill") == "xla"
    with using(KernelConfig(use="moe_decode, flash_prefill")):
        assert registry.mode("decode_attention") == "xla" and registry.mode("flash_prefill") != "xla"
        assert registry.mode("moe_decode", auto=False) != "xla"  # named: runs even where auto would not
    with pytest.raises(ValueError, match="bogus"):
        KernelConfig(use="moe_decode,bogus")
    with pytest.raises(ValueError, match="unknown kernel"):
        registry.mode("nope")


# ------------------------------------------------------------------ lowering for the GPU, on this machine
def _lower_cuda(fn, *shapes) -> str:
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh
    dev = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=dev)
    with use_abstract_mesh(mesh), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the Triton backend's deprecation warning
        return jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()


def test_kernels_lower_for_cuda_at_real_shapes():
    """qwen3-30b-a3b shapes lower to Triton custom calls (the GPU compile itself is not run here)."""
    sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    S, D, F = 6144, 2048, 768
    txt = _lower_cuda(lambda x, s, g, d: md.moe_decode_pairs(x, s, g, d, d_split=4), sd((1, D), bf),
                      sd((1, 8), jnp.int32), sd((S, D, 2 * F), bf), sd((S, F, D), bf))
    assert txt.count("__gpu$xla.gpu.triton") == 2
    fp8 = jnp.float8_e4m3fn
    txt = _lower_cuda(lambda x, s, g, d, a, b: md.moe_decode_pairs(x, s, g, d, (a, b), "fp8"), sd((4, D), bf),
                      sd((4, 8), jnp.int32), sd((S, D, 2 * F), fp8), sd((S, F, D), fp8),
                      sd((S, D // 128, 2 * F // 128), jnp.float32), sd((S, F // 128, D // 128), jnp.float32))
    assert txt.count("__gpu$xla.gpu.triton") == 2
    u8, f32 = jnp.uint8, jnp.float32
    txt = _lower_cuda(lambda x, s, g, d, a, b: md.moe_decode_pairs(x, s, g, d, (a, b), "int4"), sd((1, D), bf),
                      sd((1, 8), jnp.int32), sd((S, D, F), u8), sd((S, F, D // 2), u8), sd((S, D // 64, 2 * F), f32),
                      sd((S, F // 64, D), f32))
    assert txt.count("__gpu$xla.gpu.triton") == 2
    for tiles in ({"d_split": 4}, {"d_split": 8, "block_f": 128, "down_cols": 128, "down_rows": 32}):
        txt = _lower_cuda(lambda x, s, g, d, a, b, t=tiles: md.moe_decode_pairs(x, s, g, d, (a, b), "int4", **t),
                          sd((1, D), bf), sd((1, 8), jnp.int32), sd((S, D, F), u8), sd((S, F, D // 2), u8),
                          sd((S, D // 64, 2 * F), f32), sd((S, F // 64, D), f32))
        assert txt.count("__gpu$xla.gpu.triton") == 2
    cache = sd((48, 1, 8192, 4, 128), bf)
    txt = _lower_cuda(lambda q, k, v, n: da.decode_attention(q, k, v, 3, n), sd((1, 1, 32, 128), bf), cache, cache,
                      sd((1,), jnp.int32))
    assert txt.count("__gpu$xla.gpu.triton") == 1
    row = sd((1, 8192, 4, 128), bf)
    txt = _lower_cuda(lambda q, k, v, s: fp.flash_attention(q, k, v, s), sd((1, 8192, 32, 128), bf), row, row,
                      sd((1,), jnp.int32))
    assert txt.count("__gpu$xla.gpu.triton") == 1
    row = sd((1, 8208, 2, 256), bf)  # qwen3.5's attention in a cache of 8192 + 16 rows: the masked last key block
    txt = _lower_cuda(lambda q, k, v, s: fp.flash_attention(q, k, v, s), sd((1, 8192, 16, 256), bf), row, row,
                      sd((1,), jnp.int32))
    assert txt.count("__gpu$xla.gpu.triton") == 1
    # the Gated DeltaNet kernels at qwen3.5-35b-a3b's layer (32 heads, dk = dv = 128, 8192 tokens in chunks of 64)
    from ftjax.kernels import gated_delta as gd
    f32, g, nc, c = jnp.float32, 32, 8192, 64
    for bits, stages in ((32, 1), (16, 2)):  # 16-bit q, k and scores: two pipeline stages fit
        txt = _lower_cuda(lambda *a, b=bits, st=stages: gd.chunk_recurrence(*a, chunk=c, chunk_states=True,
                                                                           operand_bits=b, num_stages=st),
                          sd((g, 128, 128), f32), *(sd((g, nc, 128), f32),) * 4, sd((g, nc, c), f32),
                          sd((g, nc // c), f32))
        assert txt.count("__gpu$xla.gpu.triton") == 1 and f"num_stages = {stages} : i32" in txt
    # masked: diagonal blocks merged by three-pass TF32 dots, the whole chunk row by row; blocked: row blocks of 16, 32
    for block, form in ((16, gd.MASKED), (64, gd.MASKED), (16, gd.BLOCKED), (32, gd.BLOCKED)):
        txt = _lower_cuda(lambda *a, b=block, f=form: gd.solve_chunks(*a, chunk=c, block=b, form=f),
                          *(sd((g, nc, 128), f32),) * 3,
                          sd((g, nc), f32), sd((g, nc), f32))
        assert txt.count("__gpu$xla.gpu.triton") == 1


def test_gated_deltanet_conv_and_decode_kernels_lower_for_cuda_at_real_shapes():
    """qwen3.5-35b-a3b's Gated DeltaNet layer (16 key heads, 32 value heads, dk = dv = 128, conv over
    2*16*128 + 32*128 = 8192 channels, 4 taps; bf16 activations): the conv over an 8192-token prompt and one
    decode token, the decode step and the whole decode mixer at batch 1 and 4, each lower to one Triton custom call;
    the decode step's and the mixer's state outputs alias their state operands (updated in place)."""
    from ftjax.config import preset
    from ftjax.kernels import causal_conv as cc
    from ftjax.kernels import gated_delta_step as gs
    cfg = preset("qwen3.5-35b-a3b")
    hk, hv, dk, dv, taps = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                            cfg.linear_value_head_dim, cfg.linear_conv_kernel)
    assert (hk, hv, dk, dv, taps, cfg.linear_conv_dim) == (16, 32, 128, 128, 4, 8192)
    sd, bf, f32, c = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32, cfg.linear_conv_dim
    for t in (8192, 1):
        txt = _lower_cuda(lambda *a: cc.causal_conv(*a), sd((1, t, c), bf), sd((taps, c), bf), sd((1, taps - 1, c), bf),
                          sd((1,), jnp.int32))
        assert txt.count("__gpu$xla.gpu.triton") == 1
    for b in (1, 4):
        txt = _lower_cuda(lambda *a: gs.decode_step(*a), sd((b, hk, dk), bf), sd((b, hk, dk), bf), sd((b, hv, dv), bf),
                          sd((b, hv), f32), sd((b, hv), bf), sd((b, hv, dk, dv), f32))
        assert txt.count("__gpu$xla.gpu.triton") == 1
        assert "output_operand_alias<output_tuple_indices = [1], operand_index = 5" in txt
    # the whole mixer of one decode token, over a 30-layer stacked state; the state stack aliased (updated in place)
    for b in (1, 4):
        txt = _lower_cuda(lambda *a: gs.mixer_step(*a, key_heads=hk, eps=1e-6), sd((b, c), bf), sd((b, hv * dv), bf),
                          sd((b, hv), bf), sd((b, hv), bf), sd((b,), jnp.int32), sd((30, b, taps - 1, c), bf),
                          sd((30, b, hv, dk, dv), f32), sd((), jnp.int32), sd((30, taps, c), bf), sd((30, hv), f32),
                          sd((30, hv), bf), sd((30, dv), bf), sd((4,), jnp.int32))
        assert txt.count("__gpu$xla.gpu.triton") == 1
        assert "output_operand_alias<output_tuple_indices = [2], operand_index = 11" in txt


@pytest.mark.cpu_only("asserts the CPU's registry before lowering for cuda")
def test_engine_programs_lower_for_cuda_with_the_gpus_kernel_choices():
    """``registry.lowering_for("gpu")``: kernel choices made as on a GPU, on this machine. An engine's programs,
    captured by its precompile (nothing compiled or run) and lowered for CUDA (``experiments/lower_programs.py``):
    a hybrid model with 256 experts gets the Triton grouped matmul in its prefill (auto from 256 experts) and no
    Mosaic GPU call; its decode block gets the fused MoE decode kernel."""
    from experiments import common
    from ftjax import Engine
    from ftjax.checkpoint import random_model
    from ftjax.config import EngineConfig, preset
    from ftjax.kernels import common as kernels_common
    from ftjax.kernels import grouped_matmul as gmm
    bf_rows, bf_experts = jnp.zeros((8, 128), jnp.bfloat16), jnp.zeros((4, 128, 256), jnp.bfloat16)
    assert registry.backend() == jax.default_backend() and registry.mode("flash_prefill") == "xla"
    assert kernels_common.dot_dtype_ok(jnp.float32) and not gmm.mgpu_supported(bf_rows, bf_experts)
    with registry.lowering_for("gpu"):  # every kernel choice as on a GPU
        assert registry.backend() == "gpu" and registry.mode("flash_prefill") == "gpu"
        assert not kernels_common.dot_dtype_ok(jnp.float32) and gmm.mgpu_supported(bf_rows, bf_experts)
        assert registry.active().dot_rows() == 4
    with pytest.raises(ValueError, match="'cuda'"):
        with registry.lowering_for("cuda"):
            pass
    # one block of (Gated DeltaNet, attention) with 256 experts; column blocks of 64 (the default 256 > D = 128)
    cfg = dataclasses.replace(preset("tiny-hybrid"), num_experts=256, num_layers=2, dtype="bfloat16",
                              layer_types=("linear_attention", "full_attention"))
    kernels = KernelConfig(tiles={"grouped_matmul_triton": (64, 64, 64, 4, 1)})
    eng = Engine(random_model(cfg, "bfloat16"), EngineConfig("resident", max_seq_len=80, prefill_chunk=64,
                                                             decode_block=4, kernels=kernels))
    eng.open_rows(1)
    eng.admit(list(range(1, 65)), 4)  # 64 x top-4 rows: the grouped FFN (fewer take the decode kernel)

    def precompile():
        eng.precompile(decode=False)
        eng.precompile_block(4, eos_width=1)
    progs = common.capture_programs(precompile)
    assert [fn.__name__ for fn, _, _ in progs] == ["forward_step", "decode_block"]
    fn, args, static = progs[0]
    assert common.call_tokens(fn, args) == 64
    with pytest.raises(ValueError, match="experts mode 'cached'"):  # its plan and host operands are this machine's
        common.lower_for_cuda(fn, args, {**static, "opts": dataclasses.replace(static["opts"], mode="cached")},
                              device_kind="NVIDIA H200")
    prefill = common.lower_for_cuda(fn, args, static, device_kind="NVIDIA H200")
    assert "grouped_matmul_triton" in prefill["kernels"] and "mosaic_gpu_v2" not in prefill["custom_calls"]
    assert prefill["custom_calls"]["__gpu$xla.gpu.triton"] >= 1
    decode = common.lower_for_cuda(*progs[1], device_kind="NVIDIA H200")
    assert "moe_decode" in decode["kernels"] and decode["custom_calls"]["__gpu$xla.gpu.triton"] >= 1


# ------------------------------------------------------------------ the model, every kernel interpreted
def _tiny_engine_run(mode, slots, kernels):
    from ftjax import Engine
    from ftjax.checkpoint import random_model
    from ftjax.config import EngineConfig, preset
    cfg = dataclasses.replace(preset("tiny"), num_layers=2)
    model = random_model(cfg, "float32")
    # chunks of 16: the second prefill chunk starts at position 16 (flash prefill with an offset)
    eng = Engine(model, EngineConfig(mode, num_slots=slots, max_seq_len=64, prefill_chunk=16,
                                     kernels=KernelConfig(use=kernels)))
    res = eng.generate([list(range(1, 20))], max_new_tokens=4, keep_logits=True)
    return res


def test_model_with_interpreted_kernels_matches_xla_and_cached_is_bit_identical():
    from ftjax.runtime import programs

    ref = _tiny_engine_run("resident", None, "xla")
    res = _tiny_engine_run("resident", None, "interpret")
    cached = _tiny_engine_run("cached", 16, "interpret")
    assert res.generated_ids == ref.generated_ids
    np.testing.assert_allclose(res.step_logits, ref.step_logits, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(cached.step_logits, res.step_logits)
    programs.clear()  # the interpreted programs are large: not kept for the rest of the module


@pytest.mark.parametrize("shape", [pytest.param((1, 1, 48), marks=pytest.mark.cpu_only(TF32)), (2, 1, 48), (1, 3, 48),
                                   (5, 48)])
def test_project_pads_few_rows_to_the_same_product(shape):
    """``layers.common.project``: with fewer rows than ``KernelConfig.min_dot_rows`` the rows are padded
    (behind ``pad`` ops) and sliced back: same shape and values as ``x @ w``."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    w = jnp.asarray(rng.standard_normal((48, 40)), jnp.float32)
    want = np.asarray(x @ w)

    def lowered():  # a new function each time: a jitted one keeps the trace made under the old value
        return jax.jit(lambda a, b: layers_common.project(a, b)).lower(x, w).as_text()

    with using(KernelConfig(min_dot_rows=4)):
        assert registry.active().dot_rows() == 4
        got = layers_common.project(x, w)
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-5)
        text = lowered()
    padded = np.prod(shape[:-1]) < 4
    assert ("stablehlo.pad" in text) == padded  # padded exactly when there are fewer rows than 4
    with using(KernelConfig(min_dot_rows=0)):
        assert "stablehlo.pad" not in lowered()
        np.testing.assert_array_equal(np.asarray(layers_common.project(x, w)), want)


def test_min_dot_rows_default_and_bad_value():
    assert registry.active().dot_rows() == (4 if jax.default_backend() == "gpu" else 0)
    with pytest.raises(ValueError, match="KernelConfig.min_dot_rows: .*'four'"):
        KernelConfig(min_dot_rows="four")


@pytest.mark.parametrize("driver", ["scan", "pipelined"])
def test_min_dot_rows_keys_the_engines_programs(driver):
    """``KernelConfig.min_dot_rows`` changed between two requests in one process (engines that differ only
    in it, sharing the program cache): the second compiles programs of its own (the value is in their
    static options, ``StepOptions.kernels``), padded as its config says, instead of reusing the programs
    traced under the old value; set back, the first programs are reused. The CPU's compiled HLO shows the
    padding as ``pad`` ops. The padding changes no logit."""
    from ftjax import Engine
    from ftjax.checkpoint import random_model
    from ftjax.config import EngineConfig, preset
    from ftjax.runtime import programs

    model = random_model(preset("tiny"), "float32")
    prefill_fn = "forward_step" if driver == "scan" else "layer_program"

    def request(rows: int, before=frozenset()):
        eng = Engine(model, EngineConfig("resident", max_seq_len=64, prefill_driver=driver,
                                         kernels=KernelConfig(min_dot_rows=rows)))
        res = eng.generate([list(range(1, 10))], 2, keep_logits=True)  # one prefill call (bucket 16), one decode
        return res, {k: programs._COMPILED[k].executable for k in eng.programs.keys - before}, eng

    def rows_of(key):
        opts = dict(key[1])["opts"]
        return getattr(opts, "step", opts).kernels.min_dot_rows

    plain, first, _ = request(0)
    padded, second, _ = request(32, before=frozenset(first))  # more than the prefill's 16 rows and the decode step's 1
    # the prefill's layers (and the pipelined driver's head, traced under the call's kernels) and the decode step
    head = {"head_program"} if driver == "pipelined" else set()
    assert {k[0] for k in second} == {prefill_fn, "forward_step"} | head
    for progs, rows in ((first, 0), (second, 32)):
        steps = {k: exe for k, exe in progs.items() if k[0] in (prefill_fn, "forward_step")}
        assert steps and all(rows_of(k) == rows for k in steps)
        assert all(("pad(" in exe.as_text()) == (rows == 32) for exe in steps.values())
    again, third, _ = request(0, before=frozenset(first))
    assert third == {}  # the programs of the first request
    np.testing.assert_allclose(padded.step_logits, plain.step_logits, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(again.step_logits, plain.step_logits)


@pytest.mark.parametrize("shape", [(1, 0), (2, 1, 0), (0, 0)])
def test_project_with_an_empty_contraction_is_x_at_w(shape):
    """K = 0 (x [..., 0], w [0, N]): ``x @ w`` is zeros [..., N]; ``project`` used to divide by K
    to count the rows (ZeroDivisionError), with the padding on or off."""
    x, w = jnp.zeros(shape, jnp.bfloat16), jnp.zeros((0, 5), jnp.float32)
    for rows in (4, 0):
        with using(KernelConfig(min_dot_rows=rows)):
            got = layers_common.project(x, w)
        assert got.shape == shape[:-1] + (5,) and got.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(got), np.zeros(shape[:-1] + (5,), np.float32))


@pytest.mark.cpu_only(CHOICE)
def test_causal_conv_auto_for_prefill_calls_only(monkeypatch):
    """``use="auto"`` on a GPU picks ``causal_conv`` for calls of >= AUTO_MIN_TOKENS tokens (measured faster
    than XLA over a prefill) and keeps XLA for the decode token (not measured); on the CPU auto is XLA."""
    from ftjax.kernels import causal_conv as cc
    picked = []
    monkeypatch.setattr(cc, "causal_conv", lambda *a, **k: picked.append(a[0].shape[1]) or "kernel")
    w, c = jnp.zeros((4, 8)), 8
    for t in (1, cc.AUTO_MIN_TOKENS - 1, cc.AUTO_MIN_TOKENS):
        assert cc.maybe(jnp.zeros((1, t, c)), w, jnp.zeros((1, 3, c)), jnp.full((1,), t)) is None  # CPU: XLA
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    got = [cc.maybe(jnp.zeros((1, t, c)), w, jnp.zeros((1, 3, c)), jnp.full((1,), t))
           for t in (1, cc.AUTO_MIN_TOKENS - 1, cc.AUTO_MIN_TOKENS, 8192)]
    assert got == [None, None, "kernel", "kernel"] and picked == [cc.AUTO_MIN_TOKENS, 8192]
    with using(KernelConfig(use="xla")):
        assert cc.maybe(jnp.zeros((1, 8192, c)), w, jnp.zeros((1, 3, c)), jnp.full((1,), 8192)) is None


def test_the_chunk_scan_defaults_to_16_bit_operands_on_a_gpu_at_tf32_only():
    """``gated_delta``'s tiles on a GPU at the default (TF32) precision: two pipeline stages, q, k and the scores
    stored as float16 (``gated_delta.TF32_STAGES``, ``TF32_OPERAND_BITS``); under ``highest`` (IEEE float32 dots,
    the kernel named) one stage of float32, as everywhere off a GPU; a tile override keeps what it names."""
    from ftjax.layers import gated_deltanet as gdn
    sd, f32 = jax.ShapeDtypeStruct, jnp.float32
    shapes = (sd((1, 128, 2, 32), f32),) * 3 + (sd((1, 128, 2), f32),) * 2 + (sd((1, 2, 32, 32), f32),)

    def lowered(use="auto", tiles=None, precision=None):
        fn = lambda *a: gdn.chunked_gated_delta_rule(*a, chunk_states=False)  # noqa: E731
        with registry.lowering_for("gpu"), registry.using(KernelConfig(use=use, tiles=tiles or {})), \
                jax.default_matmul_precision(precision):
            txt = _lower_cuda(fn, *shapes)
        assert 'name = "gated_delta_chunks"' in txt  # the scan kernel runs
        return txt

    txt = lowered()
    assert "num_stages = 2 : i32" in txt and "xf16>" in txt
    txt = lowered(use=("gated_delta",), precision="highest")
    assert "num_stages = 1 : i32" in txt and "xf16>" not in txt
    txt = lowered(tiles={"gated_delta": (32, 4, 1)})
    assert "num_stages = 2 : i32" not in txt and "xf16>" not in txt
