"""The dense decode kernel (ftjax.kernels.dense_decode) against its jnp reference in Pallas
interpret mode on the CPU, its tiles in the kernel config, its wiring into ``layers.common.project`` /
``model.forward``
(a tiny model's greedy decode with the kernel selected) and its lowering for CUDA.

Tolerances: the kernel accumulates in float32 like the reference but in another order (per tile
and per K part), so float32 results agree to ~1e-6 relative; bf16 outputs are the float32 sums
cast once, so they equal the reference's or differ by one bf16 ulp where the two float32 sums
straddle a rounding boundary.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ftjax import model as model_lib
from ftjax.config import preset
from ftjax.kernels import dense_decode as dd
from ftjax.kernels import registry
from ftjax.kernels.registry import KernelConfig, using
from ftjax.layers import common as layers_common


#: The weights a decode step of the tiny model hands over stacked with dense_decode (the former
#: ``model.STACKED_NAMES``: the attention kind's projections and the router) and, with norm_dense_decode,
#: the norms too (the former ``model.STACKED_NORMS``).
STACKED_NAMES = ("wq", "wk", "wv", "wo", "router")
STACKED_NORMS = ("attn_norm", "mlp_norm")
#: Why a case holds on the CPU backend only (``cpu_only``, tests/conftest.py).
CHOICE = "asserts the CPU's kernel choices (auto picks the kernels on a GPU)"
ORDER = "bf16 sums in the GPU's order differ from the reference's by more than an ulp"


def _operands(m, k, n, dtype, layers=3, seed=0, x_dtype=None):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), x_dtype or dtype)
    w = jnp.asarray(rng.standard_normal((layers, k, n)) / np.sqrt(k), dtype)
    return x, w


def _check(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    g, r = np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))
    if want.dtype == jnp.bfloat16:  # at most one ulp of the output (8 significant bits)
        ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(r), 2.0 ** -126))) - 7)
        assert np.all(np.abs(g - r) <= ulp), float(np.max(np.abs(g - r) / ulp))
    else:
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * float(np.abs(r).max()))


def _rows_by_dtype(rows, bf16_marks=()):
    """(rows, dtype) cases: every row count in bfloat16 (the models' dtype; with ``bf16_marks``) and one row in
    float32 by default; float32 at more rows (the same kernel and tiles, another dtype) in the slow selection."""
    return [pytest.param(m, dt, marks=pytest.mark.slow) if dt == jnp.float32 and m > 1
            else pytest.param(m, dt, marks=bf16_marks) if dt == jnp.bfloat16 else (m, dt)
            for m in rows for dt in (jnp.float32, jnp.bfloat16)]


@pytest.mark.parametrize("k,n", [(128, 64), (256, 384)])
@pytest.mark.parametrize("m,dtype", _rows_by_dtype([1, 3, 16]))
def test_dense_decode_matches_reference(m, k, n, dtype):
    x, w = _operands(m, k, n, dtype)
    for k_split in (1, 2):
        for layer in (0, w.shape[0] - 1):
            got = dd.dense_decode(x, w, jnp.int32(layer), interpret=True, k_split=k_split)
            _check(got, dd.dense_decode_reference(x, w, layer))
    if dtype == jnp.float32:  # the reference is the model's slice-then-matmul at full precision
        want = np.asarray(x, np.float64) @ np.asarray(w[1], np.float64)
        got = dd.dense_decode(x, w, jnp.int32(1), interpret=True, block_k=32, block_n=64, k_split=2)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_dense_decode_mixed_dtypes_and_layer_ids():
    """bf16 rows against float32 weights give float32 (the promoted dtype, as ``x @ w[l]``);
    negative layer ids wrap and too large ones clamp, as a jnp index does."""
    x, w = _operands(2, 128, 128, jnp.float32, layers=4, x_dtype=jnp.bfloat16)
    got = dd.dense_decode(x, w, jnp.int32(-1), interpret=True, block_k=32, block_n=32, k_split=4)
    assert got.dtype == jnp.float32
    _check(got, dd.dense_decode_reference(x, w, 3))
    _check(dd.dense_decode(x, w, jnp.int32(9), interpret=True), dd.dense_decode_reference(x, w, 3))


def test_dense_decode_supported_and_errors():
    x, w = _operands(1, 128, 64, jnp.float32)
    assert dd.supported(x, w) and dd.supported(x, w, k_split=2)
    assert not dd.supported(x, w, k_split=4)  # 128 rows are not 4 parts of 64-row steps
    assert not dd.supported(x, w, block_k=48)  # tiles are powers of two
    assert not dd.supported(*_operands(1, 96, 64, jnp.float32))  # K not a multiple of its 64-row tile
    assert not dd.supported(*_operands(1, 128, 100, jnp.float32))  # N not a multiple of its tile
    assert dd.supported(*_operands(1, 32, 16, jnp.float32))  # tiles capped at K and N
    assert not dd.supported(*_operands(17, 128, 64, jnp.float32))  # more than 16 rows
    assert not dd.supported(x.astype(jnp.int32), w)
    assert not dd.supported(x, w.astype(jnp.int8))
    with pytest.raises(ValueError, match="dense_decode: unsupported"):
        dd.dense_decode(*_operands(1, 96, 64, jnp.float32), jnp.int32(0), interpret=True)


def test_auto_k_split():
    """qwen3-30b-a3b's projections at the default tiles (64-row steps, 128 columns per program)."""
    bk, bn = dd.BLOCK_K, dd.BLOCK_N
    assert dd.auto_k_split(2048, 4096, bk, bn) == 8  # wq: 32 column blocks
    assert dd.auto_k_split(4096, 2048, bk, bn) == 16  # wo
    assert dd.auto_k_split(2048, 512, bk, bn) == 32  # wk / wv: 32 parts of one step each
    assert dd.auto_k_split(2048, 128, bk, bn) == 32  # router
    assert dd.auto_k_split(128, 64, bk, bn) == 2  # K allows two parts only
    assert dd.auto_k_split(64, 1 << 16, bk, bn) == 1  # enough column blocks


def test_tiles_config():
    assert dd.tiles() == {"block_k": 64, "block_n": 128, "num_warps": None, "k_split": 0}
    with using(KernelConfig(tiles={"dense_decode": (32, 64, 8, 4)})):
        assert dd.tiles() == {"block_k": 32, "block_n": 64, "num_warps": 8, "k_split": 4}
    with using(KernelConfig(tiles={"dense_decode": (32, 64, 0, 0)})):
        assert dd.tiles() == {"block_k": 32, "block_n": 64, "num_warps": None, "k_split": 0}
    for bad, match in (((32, 64), "four integers"), (("a", "b", "c", "d"), "four integers"),
                       ((32, 64, 4, 2, 1), "four integers"), ((48, 64, 4, 2), "powers of two"),
                       ((32, 0, 4, 2), "powers of two"), ((32, 64, -1, 2), "powers of two"),
                       ((32, 64, 4, -2), "powers of two"), ((32, 64, 3, 2), "power of two or 0")):
        with pytest.raises(ValueError, match=rf"tiles of kernel 'dense_decode'.*{match}"):
            dd.parse_tiles(bad)
        ints = all(isinstance(v, int) for v in bad)  # strings are refused before the kernel's parser
        with pytest.raises(ValueError, match=rf"KernelConfig\.tiles: .*{match if ints else 'integers'}"):
            KernelConfig(tiles={"dense_decode": bad})


def test_one_row_calls_take_their_own_tiles_where_they_fit():
    """Batch-1 calls of K >= 1024 step over 128 rows with 8 warps (``ONE_ROW_TILES``); larger calls and a small K
    keep the defaults; a one-row call whose K the 128-row step does not divide keeps the defaults instead of
    leaving the kernel; an override applies to every call."""
    bf = jnp.bfloat16
    w = jax.ShapeDtypeStruct((2, 2048, 128), bf)
    with using(KernelConfig(use="dense_decode")):
        one, four = dd.plan(jnp.ones((1, 2048), bf), w)[1], dd.plan(jnp.ones((4, 2048), bf), w)[1]
        assert (one["block_k"], one["num_warps"]) == (128, 8) and (four["block_k"], four["num_warps"]) == (64, None)
        assert dd.plan(jnp.ones((1, 256), bf), jax.ShapeDtypeStruct((2, 256, 128), bf))[1]["block_k"] == 64
        how, odd = dd.plan(jnp.ones((1, 1088), bf), jax.ShapeDtypeStruct((2, 1088, 128), bf))  # 17 x 64
        assert how != "xla" and (odd["block_k"], odd["num_warps"]) == (64, None)
    with using(KernelConfig(use="dense_decode", tiles={"dense_decode": (32, 64, 0, 0)})):
        assert dd.plan(jnp.ones((1, 2048), bf), w)[1]["block_k"] == 32


def test_explicit_tiles_that_do_not_fit_raise():
    x, w = jnp.ones((1, 256)), jnp.ones((2, 256, 128))
    with using(KernelConfig(use="dense_decode", tiles={"dense_decode": (64, 128, 0, 8)})):
        # K = 256 holds 4 steps of 64, not 8 parts
        with pytest.raises(ValueError, match=r"dense_decode tiles \{'block_k': 64, 'block_n': 128, 'num_warps': None, "
                                             r"'k_split': 8\} do not fit x \(1, 256\)"):
            dd.plan(x, w)
    with using(KernelConfig(use="dense_decode", tiles={"dense_decode": (64, 128, 0, 4)})):
        assert dd.plan(x, w)[0] == "interpret" or jax.default_backend() == "gpu"
    # not selected: the tiles do not matter
    with using(KernelConfig(use="xla", tiles={"dense_decode": (64, 128, 0, 8)})):
        assert dd.plan(x, w)[0] == "xla"


@pytest.mark.cpu_only(CHOICE)
def test_registry_knows_the_kernel(monkeypatch):
    assert "dense_decode" in registry.names()
    # auto: on a GPU for 16-bit weights only (float32 programs keep XLA's GEMMs); never on the CPU
    assert dd.auto_for(jnp.bfloat16) and dd.auto_for(jnp.float16) and not dd.auto_for(jnp.float32)
    assert registry.mode("dense_decode", auto=dd.auto_for(jnp.bfloat16)) == "xla"  # this CPU
    cfg = preset("tiny")
    layers = {"wq": jnp.zeros((2, 128, 64)), "wo": jnp.zeros((2, 64, 128))}
    assert model_lib.stacked_weights(cfg, layers, (1, 1)) == {}
    bf_layers = {k: v.astype(jnp.bfloat16) for k, v in layers.items()}
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # what auto decides on a GPU
    assert set(model_lib.stacked_weights(cfg, bf_layers, (1, 1))) == {"wq", "wo"}
    assert model_lib.stacked_weights(cfg, layers, (1, 1)) == {}  # float32
    monkeypatch.undo()
    with using(KernelConfig(use="dense_decode")):
        assert set(model_lib.stacked_weights(cfg, layers, (1, 1))) == {"wq", "wo"}
        assert model_lib.stacked_weights(cfg, layers, (1, 4)) == {}  # prefill chunks keep the sliced weights


# ------------------------------------------------------------------ model.project / model.forward
def _spy(monkeypatch):
    calls = []
    real = dd.dense_decode

    def spy(x, w, layer, **kw):
        calls.append((x.shape, w.shape, kw))
        return real(x, w, layer, **kw)

    monkeypatch.setattr(dd, "dense_decode", spy)
    return calls


@pytest.mark.parametrize("shape", [pytest.param(sh, marks=pytest.mark.cpu_only(CHOICE))
                                   for sh in [(1, 1, 128), (3, 128), (16, 128)]] + [(17, 128)])
def test_project_stacked_weight(shape, monkeypatch):
    """``project(x, StackedWeight(w, l))``: default (CPU) exactly ``project(x, w[l])``; with the
    kernel selected it runs for at most 16 rows (tiles from the kernel config) and falls back to the
    slice beyond, or for shapes it does not take."""
    calls = _spy(monkeypatch)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 128, 64)), jnp.float32)
    sw = layers_common.StackedWeight(w, jnp.int32(2))
    want = layers_common.project(x, w[2])
    np.testing.assert_array_equal(np.asarray(layers_common.project(x, sw)), np.asarray(want))
    assert not calls
    selected = KernelConfig(use="dense_decode", tiles={"dense_decode": (32, 32, 0, 2)})
    with using(selected):
        got = layers_common.project(x, sw)
    assert got.shape == want.shape and got.dtype == want.dtype
    rows = int(np.prod(shape[:-1]))
    if rows <= 16:
        assert calls == [((rows, 128), (3, 128, 64), {"interpret": True, "block_k": 32, "block_n": 32,
                                                      "num_warps": None, "k_split": 2})]
        _check(got, want)
    else:
        assert not calls
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    odd = layers_common.StackedWeight(jnp.ones((2, 96, 64), jnp.float32), jnp.int32(0))  # K 96: the slice
    with using(selected):
        np.testing.assert_array_equal(np.asarray(layers_common.project(x[..., :96], odd)),
                                      np.asarray(x[..., :96] @ odd.w[0]))
    assert len(calls) == (1 if rows <= 16 else 0)


def test_stacked_weights_only_for_decode_calls():
    from ftjax import layers as layers_lib
    from ftjax.checkpoint import random_model

    cfg = preset("tiny")
    layers = random_model(cfg, "float32").params["layers"]
    assert set(STACKED_NAMES) == set(layers_lib.get("attention").projections) | {"router"}
    assert model_lib.stacked_weights(cfg, layers, (1, 1)) == {}  # CPU default: the scan of before
    with using(KernelConfig(use="dense_decode")):
        assert set(model_lib.stacked_weights(cfg, layers, (1, 1))) == set(STACKED_NAMES)
        assert set(model_lib.stacked_weights(cfg, layers, (16, 1))) == set(STACKED_NAMES)
        assert model_lib.stacked_weights(cfg, layers, (17, 1)) == {}  # more rows than the kernel takes
        assert model_lib.stacked_weights(cfg, layers, (1, 4)) == {}  # a prefill chunk, however small
    with using(KernelConfig(use="dense_decode,norm_dense_decode")):  # the norms too, [L, K]
        got = model_lib.stacked_weights(cfg, layers, (1, 1))
    assert set(got) == set(STACKED_NAMES + STACKED_NORMS)
    assert got["attn_norm"].shape == (layers["attn_norm"].shape[0], 128)
    with using(KernelConfig(use="moe_decode")):
        assert model_lib.stacked_weights(cfg, layers, (1, 1)) == {}


def _tiny_generate(kernels, mode="resident", slots=None, preset_name="tiny"):
    """A tiny model's greedy decode under ``KernelConfig(use=kernels)`` (its own programs: the kernel
    config is part of every program's key); ``tiny`` cut to 3 layers, or the whole ``preset_name``."""
    from ftjax import Engine
    from ftjax.checkpoint import random_model
    from ftjax.config import EngineConfig

    cfg = dataclasses.replace(preset("tiny"), num_layers=3) if preset_name == "tiny" else preset(preset_name)
    eng = Engine(random_model(cfg, "float32"), EngineConfig(mode, num_slots=slots, max_seq_len=64, prefill_chunk=16,
                                                            kernels=KernelConfig(use=kernels)))
    return eng.generate([list(range(1, 20))], max_new_tokens=5, keep_logits=True)


def _fresh_traces():
    """Drops every compiled program and trace, so that a spy on a kernel sees the next run's calls."""
    from ftjax.runtime import programs
    programs.clear()


def _assert_like_default(kernels, ref, got, preset_name="tiny"):
    """``got`` (a greedy decode under ``kernels``) against ``ref`` (the default path): same ids, the
    prefill bit-identical (no kernel runs there), decode logits within float32 tolerance; and the
    cached mode under ``kernels`` bit-identical to ``got``."""
    assert got.generated_ids == ref.generated_ids
    np.testing.assert_array_equal(got.step_logits[0], ref.step_logits[0])  # the prefill
    np.testing.assert_allclose(got.step_logits, ref.step_logits, rtol=1e-5,
                               atol=1e-5 * float(np.abs(ref.step_logits).max()))
    cached = _tiny_generate(kernels, "cached", 16, preset_name)
    assert cached.generated_ids == ref.generated_ids
    np.testing.assert_array_equal(cached.step_logits, got.step_logits)


# slow: under auto GPUs run it beside norm_dense_decode (wo only), as test_greedy_decode_with_the_norm_kernel_...
# below and tests/test_rope_cache.py do by default; wq/wk/wv and the router through it alone (auto-norm_dense_decode)
# are checked here only
@pytest.mark.slow
def test_greedy_decode_with_the_kernel_matches_the_default_path(monkeypatch):
    """A tiny model's greedy decode with ``KernelConfig(use="dense_decode")`` (interpreted on the CPU):
    the decode steps' five dense projections per layer run in the kernel, reading the stacked
    weights (the prefill keeps the sliced ones, so its logits are bit-identical); same ids, logits
    within float32 tolerance of the default path. The expert cache mode too."""
    ref = _tiny_generate("xla")
    _fresh_traces()
    calls = _spy(monkeypatch)
    got = _tiny_generate("dense_decode")
    shapes = {w for _, w, _ in calls}
    assert shapes == {(3, 128, 128), (3, 128, 64), (3, 128, 16)}  # wq and wo, wk and wv, router
    assert len(calls) % 5 == 0 and all(x == (1, 128) for x, _, _ in calls)
    _assert_like_default("dense_decode", ref, got)


def test_dense_decode_lowers_for_cuda():
    """qwen3-30b-a3b's stacked projections (48 layers) lower to one Triton custom call each."""
    from test_kernels import _lower_cuda

    sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    for m, (k, n), k_split in ((1, (2048, 4096), 8), (1, (4096, 2048), 16), (1, (2048, 128), 32),
                               (16, (2048, 512), 1)):
        txt = _lower_cuda(lambda x, w, l, s=k_split: dd.dense_decode(x, w, l, k_split=s), sd((m, k), bf),
                          sd((48, k, n), bf), sd((), jnp.int32))
        assert txt.count("__gpu$xla.gpu.triton") == 1


# ---------------------------------------------------------------------------------------------
# norm_dense_decode: the RMSNorm and several weights' products in one launch
# ---------------------------------------------------------------------------------------------
def _norm_operands(m, k, ns, dtype, layers=3, seed=1):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(3.0 * rng.standard_normal((m, k)), dtype)
    g = jnp.asarray(1.0 + 0.1 * rng.standard_normal(k), dtype)
    ws = tuple(jnp.asarray(rng.standard_normal((layers, k, n)) / np.sqrt(k), dtype) for n in ns)
    return x, g, ws


@pytest.mark.parametrize("m,dtype", _rows_by_dtype([1, 3], bf16_marks=pytest.mark.cpu_only(ORDER)))
def test_norm_dense_decode_matches_reference(m, dtype):
    """Three weights of different widths (wq, wk, wv's shape) in one launch, with and without the
    K split and the normalised rows written: each product within the tolerance of
    ``dense_decode_reference`` of the model's ``rms_norm``, the rows within one bf16 ulp of it."""
    x, g, ws = _norm_operands(m, 256, (128, 64, 64), dtype)
    want_ys, want_x = dd.norm_dense_decode_reference(x, g, ws, 2, 1e-6)
    np.testing.assert_array_equal(np.asarray(want_x), np.asarray(layers_common.rms_norm(x, g, 1e-6)))
    stacked_g = jnp.stack([g * 0.5, g * 2.0, g])  # [L, K]: the kernel reads row ``layer`` (2)
    for k_split, write_x, norm_w in ((1, False, g), (1, True, stacked_g), (4, False, stacked_g), (4, True, g)):
        ys, xn = dd.norm_dense_decode(x, norm_w, ws, jnp.int32(2), eps=1e-6, write_x=write_x, interpret=True,
                                      block_k=32, k_split=k_split)
        assert [y.shape for y in ys] == [(m, 128), (m, 64), (m, 64)]
        for got, want in zip(ys, want_ys):
            _check(got, want)
        assert (xn is None) == (not write_x)
        if write_x:
            _check(xn, want_x)


@pytest.mark.parametrize("m,dtype", _rows_by_dtype([1, 3], bf16_marks=pytest.mark.cpu_only(ORDER)))
def test_norm_dense_decode_zero_centred_matches_reference(m, dtype):
    """``offset=True``, the Qwen3.5 family's norm (``rms_norm_offset``: times ``1 + w``), over the Gated DeltaNet
    layer's four input projections (w_qkv, w_z, w_b, w_a: widths 256, 128, 4, 4, each its own column tile):
    each product within tolerance of the reference, whose rows equal ``rms_norm_offset``'s; a kernel that
    multiplied by w instead of 1 + w, or shrank every tile to the narrowest weight's, would miss."""
    x, g, ws = _norm_operands(m, 128, (256, 128, 4, 4), dtype)
    g = g - 1.0  # zero-centred weights, near 0
    want_ys, want_x = dd.norm_dense_decode_reference(x, g, ws, 1, 1e-6, offset=True)
    np.testing.assert_array_equal(np.asarray(want_x), np.asarray(layers_common.rms_norm_offset(x, g, 1e-6)))
    plain, _ = dd.norm_dense_decode_reference(x, g, ws, 1, 1e-6)
    assert float(jnp.max(jnp.abs(plain[0].astype(jnp.float32) - want_ys[0].astype(jnp.float32)))) > 0.1
    for k_split, write_x, norm_w in ((1, True, g), (2, False, jnp.stack([g * 3.0, g, g]))):
        ys, xn = dd.norm_dense_decode(x, norm_w, ws, jnp.int32(1), eps=1e-6, write_x=write_x, interpret=True,
                                      block_k=32, block_n=64, k_split=k_split, offset=True)
        assert [y.shape for y in ys] == [(m, 256), (m, 128), (m, 4), (m, 4)]
        for got, want in zip(ys, want_ys):
            _check(got, want)
        if write_x:
            assert xn.dtype == x.dtype
            _check(xn, want_x)


def test_norm_dense_decode_one_weight_differs_from_unnormed():
    """The router's shape ([K, E], one weight): the rows are normalised before the product (a
    kernel that skipped the norm would give x @ w, far from the reference)."""
    x, g, ws = _norm_operands(1, 128, (16,), jnp.float32)
    (y,), xn = dd.norm_dense_decode(x, g, ws, jnp.int32(0), eps=1e-5, write_x=True, interpret=True, block_k=32)
    (want,), want_x = dd.norm_dense_decode_reference(x, g, ws, 0, 1e-5)
    _check(y, want)
    _check(xn, want_x)
    assert float(jnp.max(jnp.abs(y - x @ ws[0][0]))) > 0.1


def test_norm_dense_decode_errors():
    x, g, ws = _norm_operands(1, 128, (64, 32), jnp.float32)
    with pytest.raises(ValueError, match="norm_dense_decode: unsupported"):  # norm weight of another width
        dd.norm_dense_decode(x, g[:64], ws, jnp.int32(0), eps=1e-6, interpret=True)
    with pytest.raises(ValueError, match="norm_dense_decode: unsupported"):  # stacked over another layer count
        dd.norm_dense_decode(x, jnp.stack([g, g]), ws, jnp.int32(0), eps=1e-6, interpret=True)
    with pytest.raises(ValueError, match="norm_dense_decode: unsupported"):  # weights of two dtypes
        dd.norm_dense_decode(x, g, (ws[0], ws[1].astype(jnp.bfloat16)), jnp.int32(0), eps=1e-6, interpret=True)
    assert not dd.supported_all(x, ())
    assert not dd.supported_all(x, (ws[0], ws[1][:2]))  # another layer count
    assert dd.supported_all(x, ws, block_n=128)  # the column tile is capped at the narrowest weight (32)


def test_greedy_decode_with_the_norm_kernel_matches_the_default_path(monkeypatch):
    """``KernelConfig(use="dense_decode,norm_dense_decode")`` (interpreted on the CPU): each decode layer
    runs its attention input norm + wq/wk/wv and its MoE norm + router as two launches of the fused
    kernel; same ids and logits within float32 tolerance of the default path; cached mode with
    the kernel bit-identical to resident with it."""
    ref = _tiny_generate("xla")
    _fresh_traces()
    calls = []
    real = dd.norm_dense_decode

    def spy(x, g, ws, layer, **kw):
        calls.append((x.shape, g.shape, tuple(w.shape for w in ws), kw["write_x"]))
        return real(x, g, ws, layer, **kw)

    monkeypatch.setattr(dd, "norm_dense_decode", spy)
    got = _tiny_generate("dense_decode,norm_dense_decode")
    assert set(calls) == {((1, 128), (3, 128), ((3, 128, 128), (3, 128, 64), (3, 128, 64)), False),
                          ((1, 128), (3, 128), ((3, 128, 16),), True)}  # the norms read stacked, in place
    _assert_like_default("dense_decode,norm_dense_decode", ref, got)


@pytest.mark.slow
def test_hybrid_decode_with_the_zero_centred_norm_kernel_matches_the_default_path(monkeypatch):
    """tiny-hybrid (Qwen3.5's layer kinds, zero-centred norms) with ``norm_dense_decode`` named (interpreted):
    each decode layer's input norm and projections are one launch (a Gated DeltaNet layer's four, the gated
    attention's three, the router), the norms read stacked; same ids and logits within float32 tolerance of the
    default path, the prefill bit-identical; cached with the kernel bit-identical to resident with it. Under
    ``auto`` on a GPU a zero-centred norm picks the kernel too (``dense_decode.OFFSET_AUTO``): the norms are
    stacked with the projections."""
    from ftjax.checkpoint import random_model

    cfg = dataclasses.replace(preset("tiny-hybrid"))
    layers = random_model(cfg, "bfloat16").params["layers"]
    with registry.lowering_for("gpu"):  # auto on a GPU, 16-bit weights: projections and norms stacked
        got = model_lib.stacked_weights(cfg, layers, (1, 1))
    assert "w_qkv" in got and "attn_norm" in got and dd.OFFSET_AUTO
    monkeypatch.setattr(dd, "OFFSET_AUTO", False)  # the switch is what decides
    with registry.lowering_for("gpu"):
        assert "attn_norm" not in model_lib.stacked_weights(cfg, layers, (1, 1))
    monkeypatch.undo()
    kernels = "dense_decode,norm_dense_decode"
    ref = _tiny_generate("xla", preset_name="tiny-hybrid")
    _fresh_traces()
    calls = []
    real = dd.norm_dense_decode

    def spy(x, g, ws, layer, **kw):
        calls.append((tuple(w.shape[-1] for w in ws), len(g.shape), kw["offset"]))
        return real(x, g, ws, layer, **kw)

    monkeypatch.setattr(dd, "norm_dense_decode", spy)
    got = _tiny_generate(kernels, preset_name="tiny-hybrid")
    hv, cd = cfg.linear_num_value_heads, cfg.linear_conv_dim
    vd = hv * cfg.linear_value_head_dim
    qd, kd = 2 * cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    assert set(calls) == {((cd, vd, hv, hv), 2, True), ((qd, kd, kd), 2, True), ((cfg.num_experts,), 2, True)}
    _assert_like_default(kernels, ref, got, preset_name="tiny-hybrid")


def test_norm_dense_decode_lowers_for_cuda():
    """qwen3-30b-a3b's attention input (wq, wk, wv) and router launches lower to one Triton call each."""
    from test_kernels import _lower_cuda

    sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    for shapes, k_split, write_x, g in ((((2048, 4096), (2048, 512), (2048, 512)), 8, False, (48, 2048)),
                                        (((2048, 128),), 32, True, (2048,))):
        txt = _lower_cuda(lambda x, g, l, *w, s=k_split, wx=write_x: dd.norm_dense_decode(
            x, g, tuple(w), l, eps=1e-6, write_x=wx, k_split=s), sd((1, 2048), bf), sd(g, bf),
            sd((), jnp.int32), *[sd((48, *s), bf) for s in shapes])
        assert txt.count("__gpu$xla.gpu.triton") == 1
    # qwen3.5-35b-a3b's Gated DeltaNet layer: the zero-centred norm stacked over all 40 layers, read at its own
    # row, and the four input projections stacked over the 30 Gated DeltaNet layers, each its own column tile
    shapes = ((2048, 8192), (2048, 4096), (2048, 32), (2048, 32))
    txt = _lower_cuda(lambda x, g, l, nl, *w: dd.norm_dense_decode(
        x, g, tuple(w), l, eps=1e-6, k_split=4, offset=True, norm_layer=nl), sd((1, 2048), bf), sd((40, 2048), bf),
        sd((), jnp.int32), sd((), jnp.int32), *[sd((30, *s), bf) for s in shapes])
    assert txt.count("__gpu$xla.gpu.triton") == 1


def test_norm_reference_reads_a_stacked_norm_at_the_layer():
    """``norm_dense_decode_reference`` with the norm weight stacked [L, K] uses row ``layer``, as
    the kernel does (M == L must not broadcast one layer's norm per row)."""
    x, g, ws = _norm_operands(3, 128, (64,), jnp.float32)
    stacked = jnp.stack([g * 0.5, g, g * 3.0])
    (want,), want_x = dd.norm_dense_decode_reference(x, g * 3.0, ws, 2, 1e-6)
    (got,), got_x = dd.norm_dense_decode_reference(x, stacked, ws, 2, 1e-6)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(got_x), np.asarray(want_x))
    (y,), _ = dd.norm_dense_decode(x, stacked, ws, jnp.int32(2), eps=1e-6, interpret=True, block_k=32)
    _check(y, want)


# ---------------------------------------------------------------------------------------------
# merge_dense_decode: decode attention's split merge in the prologue of the wo product
# ---------------------------------------------------------------------------------------------
def _splits(b, hkv=2, ns=4, rows=16, hd=32, seed=2):
    rng = np.random.default_rng(seed)
    o = rng.standard_normal((b, hkv, ns, rows, hd)).astype(np.float32)
    m = (3.0 * rng.standard_normal((b, hkv, ns, rows))).astype(np.float32)
    l = rng.uniform(0.5, 4.0, (b, hkv, ns, rows)).astype(np.float32)
    o[:, :, -1], m[:, :, -1], l[:, :, -1] = 0.0, -1e30, 0.0  # a split with no keys, as the attention kernel leaves it
    return jnp.asarray(o), jnp.asarray(m), jnp.asarray(l)


@pytest.mark.parametrize("b,dtype", _rows_by_dtype([1, 3]))
def test_merge_dense_decode_matches_merge_then_product(b, dtype):
    """The fused kernel against ``decode_attention.merge_splits`` then the reference product; g = 3
    query heads per KV head of 16 rows (the pad rows hold junk the kernel must not read)."""
    from ftjax.kernels import decode_attention as da

    o, m, l = _splits(b)
    g, k = 3, 2 * 3 * 32
    o = o.at[:, :, :, g:].set(jnp.nan)  # pad rows
    w = jnp.asarray(np.random.default_rng(3).standard_normal((3, k, 64)) / np.sqrt(k), dtype)
    for layer, k_split in ((0, 1), (2, 2), (-1, 3)):
        want = dd.dense_decode_reference(da.merge_splits(o, m, l, g, dtype).reshape(b, k), w, layer)
        got = dd.merge_dense_decode(o, m, l, w, jnp.int32(layer), g=g, dtype=dtype, interpret=True, block_k=32,
                                    k_split=k_split)
        assert got.shape == (b, 64) and got.dtype == want.dtype and bool(jnp.all(jnp.isfinite(got)))
        tol = 1e-5 if dtype == jnp.float32 else 2e-2  # bf16: a merged row may round to the next bf16
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol,
                                   atol=tol * float(np.abs(np.asarray(want, np.float32)).max()))


def test_merge_dense_decode_supported_and_errors():
    o, m, l = _splits(1)
    w = jnp.zeros((3, 192, 64), jnp.bfloat16)
    assert dd.supported_merge(o, m, l, w, 3, jnp.bfloat16, block_k=32)
    assert not dd.supported_merge(o, m, l, w, 3, jnp.bfloat16, block_k=64)  # a K tile over two heads of 32
    assert not dd.supported_merge(o, m, l, w, 17, jnp.bfloat16, block_k=32)  # more heads than rows
    assert not dd.supported_merge(o, m[:, :, :2], l, w, 3, jnp.bfloat16, block_k=32)  # m of other splits
    assert not dd.supported_merge(o.astype(jnp.bfloat16), m, l, w, 3, jnp.bfloat16, block_k=32)  # o not float32
    assert not dd.supported_merge(o[:, :, :3], m[:, :, :3], l[:, :, :3], w, 3, jnp.bfloat16, block_k=32)  # 3 splits
    assert not dd.supported_merge(o, m, l, w, 2, jnp.bfloat16, block_k=32)  # K 128 is not w's 192
    with pytest.raises(ValueError, match="merge_dense_decode: unsupported"):
        dd.merge_dense_decode(o, m, l, w, jnp.int32(0), g=3, dtype=jnp.bfloat16, interpret=True)  # block_k 64


def test_auto_takes_the_merge_kernel_for_one_row_calls_of_16_bit_weights():
    """Under ``auto`` on a GPU, the wo projection of a one-row call (batch-1 decode) of bf16 weights takes
    :func:`merge_dense_decode` (one Triton launch; 1.018-1.036x at batch 1 on an H100, 2026-12-07); four rows
    (0.985x), float32 weights, and ``auto-merge_dense_decode`` keep the merge and the product apart (None)."""
    from test_kernels import _lower_cuda

    sd, bf, g, k = jax.ShapeDtypeStruct, jnp.bfloat16, 3, 2 * 3 * 32
    o, m, l = _splits(4)

    def merge(b, w_dtype, use="auto"):
        with registry.lowering_for("gpu"), using(KernelConfig(use=use)):
            if b == 1 and w_dtype == bf and use == "auto":  # the kernel: lower it for CUDA (nothing runs here)
                return _lower_cuda(lambda o, m, l, w: dd.maybe_merge(o, m, l, g, bf, w, jnp.int32(0)),
                                   sd((1,) + o.shape[1:], jnp.float32), sd((1,) + m.shape[1:], jnp.float32),
                                   sd((1,) + l.shape[1:], jnp.float32), sd((3, k, 64), bf))
            return dd.maybe_merge(o[:b], m[:b], l[:b], g, bf, jnp.zeros((3, k, 64), w_dtype), jnp.int32(0))

    assert dd.merge_auto(bf, 1) and not dd.merge_auto(bf, 4) and not dd.merge_auto(jnp.float32, 1)
    try:
        assert merge(1, bf).count("__gpu$xla.gpu.triton") == 1
        assert merge(4, bf) is None and merge(1, jnp.float32) is None
        assert merge(1, bf, "auto-merge_dense_decode") is None
    finally:
        jax.clear_caches()  # traced as on a GPU above (registry.lowering_for): not for the tests after this one
