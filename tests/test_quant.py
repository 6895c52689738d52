"""Quantized experts (ftjax.experts.quant): formats vs numpy references, exact offload within a
format, accuracy vs the unquantized model, byte counts, and fp8 block-wise checkpoints.

Every format-wise test is parametrized over the registry (``ftjax.experts.formats``), so a new
format file is tested without editing this one: its round trip (nearest representable value at
the block's scale), FFN, bytes, offload exactness, CPU misses and accuracy (against the loosest
built-in bounds until it gets its own). The numpy references of the built-in schemes, written
independently of the code, check those formats' exact bits; a format without one skips that test.

Accuracy figures are printed (run with ``-s`` to see them); the asserted bounds are loose sanity
bounds that round-to-nearest quantization meets on these models.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from conftest import fixture_path, load_fixture
from ftjax.checkpoint import CheckpointError, dequantize_fp8_block, load_checkpoint
from ftjax import Engine
from ftjax.config import EngineConfig, MissPolicyConfig
from ftjax.experts import cpu_experts, formats, quant
from ftjax.experts.compute import experts_gather, experts_grouped
from ftjax.runtime.planner import plan_memory
from ftjax.experts.state import ExpertBanks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import make_fp8_checkpoint  # noqa: E402

#: every registered format with scales, and every --expert_dtype value (the registry's, in its order)
QFMTS = tuple(f.name for f in formats.all_formats() if f.has_scales)
ALL = quant.FORMATS
#: the independent numpy references of the built-in schemes (docs/QUANTIZATION.md): block, qmax
BLOCKS = {"int8": None, "int4": (64, 1), "fp8": (128, 128)}
QMAX = {"int8": 127, "int4": 7, "fp8": 448}


# ---------------------------------------------------------------------------------------------
# numpy reference of the schemes (docs/QUANTIZATION.md), written independently of quant.py
# ---------------------------------------------------------------------------------------------
def np_quant(fmt: str, w: np.ndarray, parts: int = 1):
    """(values q as float32 before scaling [..., in, out], scales [..., nbi, nbo], each weight's
    scale [..., in, out], dequantized float32) of w [..., in, out] float32."""
    n_in, n_out = w.shape[-2:]
    bi, bo = BLOCKS[fmt] or (n_in, 1)
    per = n_out // parts
    nbi, nbo = -(-n_in // bi), -(-per // bo)
    s = np.zeros(w.shape[:-2] + (nbi, parts * nbo), np.float32)
    full = np.zeros_like(w)
    for p in range(parts):
        for a in range(nbi):
            for b in range(nbo):
                rows = slice(a * bi, min((a + 1) * bi, n_in))
                cols = slice(p * per + b * bo, p * per + min((b + 1) * bo, per))
                sc = np.abs(w[..., rows, cols]).max(axis=(-2, -1)) * np.float32(1.0 / QMAX[fmt])
                s[..., a, p * nbo + b] = sc
                full[..., rows, cols] = sc[..., None, None]
    r = w / np.where(full > 0, full, np.float32(1))
    if fmt == "fp8":
        q = r.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    else:
        q = np.clip(np.round(r), -QMAX[fmt], QMAX[fmt]).astype(np.float32)
    return q, s, full, q * full


def _weights(shape, seed=0):
    w = np.random.default_rng(seed).normal(size=shape).astype(np.float32)
    w[..., 0, :] *= 9.0  # an outlier row: scales differ across blocks
    return w


SHAPES = [((3, 64, 64), 2), ((3, 32, 64), 1), ((2, 200, 300), 2), ((2, 130, 256), 1)]


@pytest.mark.parametrize("fmt", QFMTS)
@pytest.mark.parametrize("shape,parts", SHAPES)
def test_quantize_dequantize_matches_numpy_reference(fmt, shape, parts):
    if fmt not in BLOCKS:
        pytest.skip(f"no independent numpy reference of {fmt} here (the round-trip test covers it)")
    w = _weights(shape)
    q, s = quant.quantize(fmt, jnp.asarray(w), parts)
    ref_q, ref_s, full, ref_deq = np_quant(fmt, w, parts)
    np.testing.assert_array_equal(np.asarray(s), ref_s)
    assert s.shape == w.shape[:-2] + quant.scale_shape(fmt, shape[-2], shape[-1], parts)
    assert q.dtype == quant.STORAGE[fmt] and q.shape == w.shape[:-2] + quant.stored_shape(fmt, *shape[-2:])
    if fmt == "int4":  # two per byte, low nibble = even column, each as q + 8
        packed = np.asarray(q).astype(np.int32)
        u = (ref_q + 8).astype(np.int32)
        np.testing.assert_array_equal(packed, u[..., 0::2] | (u[..., 1::2] << 4))
    np.testing.assert_array_equal(np.asarray(quant.decode(fmt, q)), ref_q)
    deq = np.asarray(quant.dequantize(fmt, q, s, jnp.float32, parts))
    np.testing.assert_allclose(deq, ref_deq, rtol=2 ** -23, atol=0)  # exact up to float32 rounding
    err = np.abs(deq - w)
    if fmt == "fp8":  # 3 mantissa bits: half an ulp of the value, or of the smallest subnormal
        assert (err <= np.maximum(np.abs(w) * 2 ** -4, full * 2 ** -10) * 1.0001 + 1e-30).all()
    else:  # round to nearest: at most half a step
        assert (err <= full * 0.5 * 1.0001 + 1e-30).all()
    # a block of zeros has scale 0 and decodes to zeros
    z = np.zeros((1, 64, 64), np.float32)
    qz, sz = quant.quantize(fmt, jnp.asarray(z), 2)
    assert not np.asarray(sz).any() and not np.asarray(quant.dequantize(fmt, qz, sz, jnp.float32, 2)).any()


def _grid(fmt) -> np.ndarray:
    """Every finite value ``fmt.decode`` gives (float64, sorted, unique): all 256 byte patterns."""
    assert fmt.storage.itemsize == 1, "a quantized format stores at most 8 bits per element"
    codes = np.arange(256, dtype=np.uint8).view(fmt.storage)[None, :]
    v = np.asarray(fmt.decode(jnp.asarray(codes)), np.float64).ravel()
    return np.unique(v[np.isfinite(v)])


def _nearest_distance(r: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """|r - the grid value nearest to r| (grid sorted)."""
    i = np.clip(np.searchsorted(grid, r), 1, grid.size - 1)
    return np.minimum(np.abs(r - grid[i - 1]), np.abs(r - grid[i]))


@pytest.mark.parametrize("fmt", QFMTS)
@pytest.mark.parametrize("shape,parts", SHAPES)
def test_round_trip_is_the_nearest_representable_value_at_the_block_scale(fmt, shape, parts):
    """Any registered format: each weight decodes to the value of the format's grid nearest to
    w / scale (so its error is at most half a grid step, or the clipping past the largest value),
    scales use the grid's range (block max / scale within [max/2, 2 max]), dequantize is exactly
    decode * scale in float32, bf16 inputs quantize as their float32 values, zeros stay zeros."""
    f = formats.get(fmt)
    w = _weights(shape)
    n_in, n_out = shape[-2:]
    q, s = f.quantize(jnp.asarray(w), parts)
    assert q.dtype == f.storage and q.shape == shape[:-2] + f.stored_shape(n_in, n_out)
    assert s.dtype == f.scale_dtype and s.shape == shape[:-2] + f.scale_shape(n_in, n_out, parts)
    bi, bo = f.block(n_in)
    full = np.asarray(formats.expand_scales(f.scale_values(s), n_in, n_out, bi, bo, parts))
    assert full.dtype == np.float32 and (full > 0).all()
    v = np.asarray(f.decode(q))
    r = w.astype(np.float64) / full
    grid = _grid(f)
    err = np.abs(v - r)
    assert (err <= _nearest_distance(r, grid) + 1e-6 * np.maximum(1.0, np.abs(r))).all()
    fit = np.asarray(formats.block_amax(jnp.asarray(np.abs(r), jnp.float32), bi, bo, parts))
    assert (fit >= grid.max() / 2).all() and (fit <= 2 * grid.max()).all(), (fit.min(), fit.max(), grid.max())
    deq = np.asarray(f.dequantize(q, s, jnp.float32, parts))
    np.testing.assert_array_equal(deq, v * full)
    qb, sb = f.quantize(jnp.asarray(w, jnp.bfloat16), parts)
    qf, sf = f.quantize(jnp.asarray(jnp.asarray(w, jnp.bfloat16), jnp.float32), parts)
    np.testing.assert_array_equal(np.asarray(qb).view(np.uint8), np.asarray(qf).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(sb), np.asarray(sf))
    z = np.zeros((1, 64, 64), np.float32)
    qz, sz = f.quantize(jnp.asarray(z), 2)
    assert not np.asarray(f.scale_values(sz)).any() and not np.asarray(f.dequantize(qz, sz, jnp.float32, 2)).any()


def _np_ffn(x, gu, dn):
    h = x.astype(np.float64) @ gu.astype(np.float64)
    f = h.shape[-1] // 2
    a = h[..., :f] / (1 + np.exp(-h[..., :f])) * h[..., f:]
    return a @ dn.astype(np.float64)


@pytest.mark.parametrize("fmt", ALL)
def test_expert_ffn_of_quantized_weights_vs_numpy_dequantize_then_matmul(fmt):
    s_pool, d, f, n, k = 5, 64, 32, 3, 2
    gu = _weights((s_pool, d, 2 * f), 1) * 0.2
    dn = _weights((s_pool, f, d), 2) * 0.2
    banks = quant.quantize_banks(ExpertBanks(jnp.asarray(gu), jnp.asarray(dn)), fmt)
    gq, dq = quant.dequantize_banks_np(banks)
    if not formats.get(fmt).has_scales:
        ref_gu = gu.astype(ml_dtypes.bfloat16).astype(np.float32)
        ref_dn = dn.astype(ml_dtypes.bfloat16).astype(np.float32)
    elif fmt in BLOCKS:
        ref_gu, ref_dn = np_quant(fmt, gu, 2)[3], np_quant(fmt, dn, 1)[3]
    else:  # no numpy reference of the scheme: the format's own dequantization, then numpy matmuls
        ref_gu, ref_dn = gq, dq
    np.testing.assert_allclose(gq, ref_gu, rtol=2 ** -23, atol=0)
    np.testing.assert_allclose(dq, ref_dn, rtol=2 ** -23, atol=0)
    x = np.random.default_rng(3).normal(size=(n, d)).astype(np.float32)
    slots = np.array([[4, 0], [2, 2], [1, 3]], np.int32)
    w = np.array([[0.7, 0.3], [0.5, 0.5], [0.9, 0.1]], np.float32)
    want = sum(w[:, j:j + 1] * np.stack([_np_ffn(x[i], ref_gu[slots[i, j]], ref_dn[slots[i, j]]) for i in range(n)])
               for j in range(k))
    dev = lambda a: jnp.asarray(np.asarray(a))  # noqa: E731  (a device copy of a host bank)
    pool = (dev(banks.gate_up), dev(banks.down), None if banks.scales is None else tuple(map(dev, banks.scales)),
            banks.fmt)
    got = experts_gather(jnp.asarray(x), jnp.asarray(slots), jnp.asarray(w), *pool)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    got_g = experts_grouped(jnp.asarray(x), jnp.asarray(slots), jnp.asarray(w), *pool)
    np.testing.assert_allclose(np.asarray(got_g), want, rtol=1e-5, atol=1e-5)
    # the CPU miss path's host FFN dequantizes the same way
    sg, sd = banks.scales or (None, None)
    for e in range(s_pool):
        y = cpu_experts._ffn(x, np.asarray(banks.gate_up)[e], np.asarray(banks.down)[e],
                             None if sg is None else np.asarray(sg)[e], None if sd is None else np.asarray(sd)[e],
                             fmt=banks.fmt)
        np.testing.assert_allclose(np.asarray(y), _np_ffn(x, ref_gu[e], ref_dn[e]), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Bytes
# ---------------------------------------------------------------------------------------------
def _formula(fmt: str, d: int, f: int) -> int | None:
    """Bytes per expert of the built-in formats, written out (fp32 dense banks: 4 bytes per weight)."""
    return {"dense": 3 * d * f * 4, "bfloat16": 3 * d * f * 2,
            "int8": 3 * d * f + 4 * (2 * f + d),                                # per output channel
            "int4": 3 * d * f // 2 + 4 * (math.ceil(d / 64) * 2 * f + math.ceil(f / 64) * d),
            "fp8": 3 * d * f + 4 * (math.ceil(d / 128) * 2 * math.ceil(f / 128)
                                    + math.ceil(f / 128) * math.ceil(d / 128))}.get(fmt)


@pytest.mark.parametrize("fmt", ALL)
def test_expert_bytes_of_each_format_equal_the_stored_arrays(fmt):
    model, _ = load_fixture("qwen3_moe_fp32")
    d, f = model.cfg.hidden_size, model.cfg.expert_ffn  # 64, 32: smaller than one fp8 block
    assert model.expert_bytes == _formula("dense", d, f)
    b = quant.quantize_banks(model.banks, fmt)
    assert b.expert_bytes == quant.expert_bytes(b.fmt, d, f, b.gate_up.dtype.itemsize) < model.expert_bytes
    assert _formula(fmt, d, f) in (None, b.expert_bytes)
    assert b.gate_up.sharding.memory_kind == model.banks.gate_up.sharding.memory_kind
    assert cpu_experts.is_host_typed(b.gate_up)


#: bytes per qwen3-30b-a3b expert (D 2048, F 768) of the built-in formats, as docs/QUANTIZATION.md states:
#: bf16 9.44 MB; int8 4.73; int4 2.65 (groups of 64); fp8 4.72
DOC_BYTES = {"bfloat16": 9437184, "int8": 4718592 + 14336, "int4": 2359296 + 294912, "fp8": 4718592 + 1152}


def test_expert_bytes_of_qwen3_30b_a3b_and_the_slots_they_buy():
    got = {fmt: quant.expert_bytes(quant.bank_format(fmt), 2048, 768, 2) for fmt in ALL}
    assert {k: got[k] for k in DOC_BYTES} == DOC_BYTES
    # the planner buys slots with the stored size
    from ftjax.config import preset
    cfg = preset("qwen3-30b-a3b")
    slots = {fmt: plan_memory(cfg, 2, budget_bytes=int(8e9), expert_bytes=eb).slots for fmt, eb in got.items()}
    print("\nslots bought by 8 GB (qwen3-30b-a3b, stated workspace):", slots)
    assert slots["bfloat16"] < slots["int8"] < slots["int4"] and slots["fp8"] >= slots["int8"]
    assert slots["int8"] > 1.5 * slots["bfloat16"] and slots["int4"] > 2.5 * slots["bfloat16"]
    assert all(slots[a] >= slots[b] for a in ALL for b in ALL if got[a] <= got[b])  # fewer bytes, more slots


# ---------------------------------------------------------------------------------------------
# Offload stays exact within a format
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qmodels():
    """The fp32 fixture with its banks in each format (memoised)."""
    model, exp = load_fixture("qwen3_moe_fp32")
    return model, exp, {fmt: dataclasses.replace(model, banks=quant.quantize_banks(model.banks, fmt))
                        for fmt in ALL}


def _gen(model, config, prompt, steps):
    eng = Engine(model, config)
    return eng.generate([prompt], steps, keep_logits=True), eng


# int4 (packed nibbles and per-group scales: the most the offload path must carry) by default; every
# other registered format in the slow selection
@pytest.mark.parametrize("fmt", [f if f == "int4" else pytest.param(f, marks=pytest.mark.slow) for f in ALL])
def test_cached_and_streamed_bit_identical_to_resident_in_every_format(qmodels, fmt):
    _, exp, models = qmodels
    model = models[fmt]
    e = model.cfg.num_experts
    prompt = exp["short_prompt_ids"].tolist()
    want, _ = _gen(model, EngineConfig("resident", max_seq_len=64), prompt, 40)
    got, eng = _gen(model, EngineConfig("cached", num_slots=e, max_seq_len=64), prompt, 40)
    assert got.generated_ids == want.generated_ids
    np.testing.assert_array_equal(got.step_logits, want.step_logits)
    m = eng.expert_cache_metrics()
    assert m["misses"] > model.cfg.num_layers * e  # the smallest cache evicts and refetches
    assert m["expert_format"] == model.banks.fmt and m["expert_bytes"] == model.expert_bytes
    assert m["bytes_h2d"] == m["fetched"] * model.expert_bytes
    # the grouped path (a 300-token prompt) with whole layers streamed through two buffers
    long = exp["long_prompt_ids"].tolist()
    want, _ = _gen(model, EngineConfig("resident", max_seq_len=320), long, 4)
    got, eng = _gen(model, EngineConfig("cached", num_slots=2 * e, max_seq_len=320, prefill="stream"), long, 4)
    np.testing.assert_array_equal(got.step_logits, want.step_logits)
    assert eng.expert_cache_metrics()["prefill"]["misses"] > 0


@pytest.mark.parametrize("fmt", [f if f == "int4" else pytest.param(f, marks=pytest.mark.slow) for f in QFMTS])
def test_cpu_misses_dequantize_on_the_host_bit_identical(qmodels, fmt):
    _, exp, models = qmodels
    model = models[fmt]
    prompt = exp["short_prompt_ids"].tolist()
    want, _ = _gen(model, EngineConfig("resident", max_seq_len=64), prompt, 12)
    # the engine builds the CPU mechanism; compute_on reads the model's quantized host banks (scales, format)
    miss = MissPolicyConfig("adaptive", cpu_impl="compute_on", fixed_fetch=1)
    got, eng = _gen(model, EngineConfig("cached", num_slots=model.cfg.num_experts, max_seq_len=64, miss=miss),
                    prompt, 12)
    assert eng.miss.config.cpu.impl == "compute_on"
    np.testing.assert_array_equal(got.step_logits, want.step_logits)
    m = eng.expert_cache_metrics()
    assert m["cpu_computed"] > 0 and m["fetched"] > 0


# ---------------------------------------------------------------------------------------------
# Accuracy vs the unquantized model
# ---------------------------------------------------------------------------------------------
def _perplexity(logits: np.ndarray, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of ids[1:] under logits[:len(ids) - 1] ([T, V])."""
    x = logits[: len(ids) - 1].astype(np.float64)
    top = x.max(-1, keepdims=True)
    lse = (top + np.log(np.exp(x - top).sum(-1, keepdims=True)))[:, 0]
    return float(np.exp(-np.mean(x[np.arange(len(ids) - 1), ids[1:]] - lse)))


def accuracy(dense, quantized, prompt, steps):
    """Figures of ``quantized`` vs ``dense`` (resident engines, greedy):

    free: greedy agreement of the two free-running decodes (fraction of equal tokens, and the
    first step where they differ); forced: both models read the dense model's tokens (prompt +
    its greedy continuation) in one prefill, and their logits at the continuation positions are
    compared: max / mean abs diff and top-1 agreement; ppl: perplexity of the prompt's own tokens
    (dense, quantized).
    """
    n = len(prompt) + steps
    cfg = EngineConfig("resident", max_seq_len=-(-n // 128) * 128)
    a = Engine(dense, cfg).generate([prompt], steps)
    b = Engine(quantized, cfg).generate([prompt], steps)
    ga, gb = np.array(a.generated_ids[0]), np.array(b.generated_ids[0])
    diff = np.nonzero(ga != gb)[0]
    seq = list(prompt) + a.generated_ids[0]
    out = {"free_agreement": float(np.mean(ga == gb)), "first_divergence": int(diff[0]) if diff.size else steps}
    logits = []
    for m in (dense, quantized):
        eng = Engine(m, cfg)
        lg = np.asarray(eng.prefill([seq], eng.new_cache(1), all_logits=True)[0])[0]
        logits.append(lg)
    la, lb = (x[len(prompt) - 1: n - 1] for x in logits)
    d = np.abs(la - lb)
    out.update(max_abs=float(d.max()), mean_abs=float(d.mean()),
               forced_agreement=float(np.mean(la.argmax(-1) == lb.argmax(-1))))
    for name, lg in zip(("ppl_dense", "ppl"), logits):
        out[name] = _perplexity(lg, prompt)
    return out


# sanity bounds (forced top-1 agreement at least, mean abs logit diff at most), met with margin by
# round-to-nearest quantization of these models
# round-to-nearest quantization of these models; a format without its own bound gets the loosest (int4's)
FIXTURE_BOUNDS = {"bfloat16": (0.9, 0.05), "int8": (0.75, 0.2), "fp8": (0.6, 0.5), "int4": (0.3, 2.0)}


# int8 and int4 (per-column and per-group scales: the lossiest) by default; bfloat16 and fp8 in the slow selection
# (docs/QUANTIZATION.md's table: `pytest tests/test_quant.py -k accuracy -m "" -s -n 0`)
@pytest.mark.parametrize("fmt", [f if f in ("int8", "int4") else pytest.param(f, marks=pytest.mark.slow) for f in ALL])
def test_accuracy_of_each_format_vs_unquantized_fixture(qmodels, fmt):
    model, exp, models = qmodels
    r = accuracy(model, models[fmt], exp["short_prompt_ids"].tolist(), 32)
    print(f"\nqwen3_moe_fp32 {fmt}: " + json.dumps({k: round(v, 4) for k, v in r.items()}))
    lo, hi = FIXTURE_BOUNDS.get(fmt, FIXTURE_BOUNDS["int4"])
    assert r["forced_agreement"] >= lo
    assert r["mean_abs"] <= hi


TRAINED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ftjax", "assets", "stdlib_moe")
TRAINED_BOUNDS = {"bfloat16": 0.95, "int8": 0.95, "fp8": 0.9, "int4": 0.75}  # forced top-1 agreement
TRAINED_PPL = {"int4": 1.25}  # perplexity at most this times the dense one (others: 1.05)


@pytest.mark.slow  # trains a model first
@pytest.mark.parametrize("fmt", ALL)
def test_accuracy_of_each_format_vs_unquantized_trained_model(fmt):
    dense = load_checkpoint(TRAINED, "float32", progress=False)
    q = dataclasses.replace(dense, banks=quant.quantize_banks(dense.banks, fmt))
    with np.load(os.path.join(TRAINED, "expected.npz")) as z:
        prompt = z["prompt_ids"].tolist()
    r = accuracy(dense, q, prompt, 200)
    print(f"\nstdlib_moe {fmt}: " + json.dumps({k: round(v, 4) for k, v in r.items()}))
    assert r["forced_agreement"] >= TRAINED_BOUNDS.get(fmt, TRAINED_BOUNDS["int4"])
    assert r["ppl"] <= r["ppl_dense"] * TRAINED_PPL.get(fmt, 1.05 if fmt in TRAINED_BOUNDS else TRAINED_PPL["int4"])


# ---------------------------------------------------------------------------------------------
# fp8 block-wise checkpoints
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["qwen3_moe_fp32", "mixtral_fp32"])
def test_fp8_checkpoint_loads_as_is_and_equals_load_time_fp8(tmp_path, name):
    src = fixture_path(name)
    make_fp8_checkpoint.main([src, str(tmp_path)])
    with open(tmp_path / "config.json") as f:
        qc = json.load(f)["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), framework="np") as f:
        names = list(f.keys())
        g = next(n for n in names if n.endswith("experts.0.w1.weight" if name == "mixtral_fp32"
                                                 else "experts.0.gate_proj.weight"))
        assert f.get_slice(g).get_dtype() == "F8_E4M3"
        assert f.get_slice(g + "_scale_inv").get_shape() == [1, 1]  # ceil(32/128), ceil(64/128): partial blocks
        assert f.get_slice(g + "_scale_inv").get_dtype() == "F32"
    fp8 = load_checkpoint(str(tmp_path), "float32", progress=False)
    twin = load_checkpoint(src, "float32", progress=False, expert_dtype="fp8")
    assert fp8.banks.fmt == twin.banks.fmt == "fp8"
    for a, b in zip(jax.tree.leaves(fp8.banks), jax.tree.leaves(twin.banks)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    for a, b in zip(jax.tree.leaves(fp8.params), jax.tree.leaves(twin.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with np.load(os.path.join(src, "expected.npz")) as z:
        prompt = z["short_prompt_ids"].tolist()
    cfg = EngineConfig("cached", num_slots=fp8.cfg.num_experts, max_seq_len=64)
    ra, rb = (Engine(m, cfg).generate([prompt], 16, keep_logits=True) for m in (fp8, twin))
    assert ra.generated_ids == rb.generated_ids
    np.testing.assert_array_equal(ra.step_logits, rb.step_logits)
    # its dequantized twin: dense fp32 banks holding exactly w_fp8 * scale_inv give the same tokens
    gu, dn = quant.dequantize_banks_np(fp8.banks)
    from ftjax import memory
    deq = dataclasses.replace(fp8, banks=ExpertBanks(memory.to_host(gu), memory.to_host(dn)))
    rd = Engine(deq, cfg).generate([prompt], 16, keep_logits=True)
    assert rd.generated_ids == ra.generated_ids
    np.testing.assert_array_equal(rd.step_logits, ra.step_logits)  # the same arithmetic


def test_fp8_script_converts_a_bf16_checkpoint_in_a_fresh_process(tmp_path):
    """The script as a user runs it (its own interpreter, where nothing imported ml_dtypes before
    safetensors reads bf16 tensors) on a bf16 checkpoint: the fp8 banks equal the bf16 source's
    quantized at load."""
    import subprocess
    import sys

    src = fixture_path("qwen3_moe_bf16")
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts",
                          "make_fp8_checkpoint.py")
    out = subprocess.run([sys.executable, script, src, str(tmp_path)], capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "tensors in fp8" in out.stdout
    fp8 = load_checkpoint(str(tmp_path), "bfloat16", progress=False)
    twin = load_checkpoint(src, "bfloat16", progress=False, expert_dtype="fp8")
    for a, b in zip(jax.tree.leaves(fp8.banks), jax.tree.leaves(twin.banks)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    for a, b in zip(jax.tree.leaves(fp8.params), jax.tree.leaves(twin.params)):  # bf16 tensors kept as they were
        assert a.dtype == b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fp8_checkpoint_with_quantized_attention_and_errors(tmp_path):
    src = fixture_path("qwen3_moe_fp32")
    make_fp8_checkpoint.main([src, str(tmp_path), "--attention"])
    model = load_checkpoint(str(tmp_path), "float32", progress=False)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), framework="np") as f:
        assert f.get_slice("model.layers.1.self_attn.q_proj.weight").get_dtype() == "F8_E4M3"
        assert "model.layers.1.mlp.gate.weight_scale_inv" not in f.keys()  # routers stay as they were
    from ftjax.checkpoint import _TensorIndex
    idx = _TensorIndex(str(tmp_path))
    w = idx.get("model.layers.1.self_attn.q_proj.weight", (64, 64))
    s = idx.get("model.layers.1.self_attn.q_proj.weight_scale_inv", (1, 1))
    want = dequantize_fp8_block(w, s).T  # non-expert weights: dequantized to the compute dtype at load
    np.testing.assert_array_equal(np.asarray(model.params["layers"]["wq"][1]), want)
    assert model.params["layers"]["wq"].dtype == jnp.float32
    # a plain reference: the blockwise product by hand
    np.testing.assert_array_equal(want.T, w.astype(np.float32) * s[0, 0])
    res = Engine(model, EngineConfig("resident", max_seq_len=64)).generate([[1, 5, 9, 13]], 8)
    assert len(res.generated_ids[0]) == 8
    with pytest.raises(CheckpointError, match="expert_dtype"):
        load_checkpoint(str(tmp_path), "float32", progress=False, expert_dtype="int8")
    cfgd = json.loads((tmp_path / "config.json").read_text())
    cfgd["quantization_config"]["weight_block_size"] = [64, 64]
    (tmp_path / "config.json").write_text(json.dumps(cfgd))
    with pytest.raises(CheckpointError, match="weight_block_size"):
        load_checkpoint(str(tmp_path), "float32", progress=False)


def test_kv_prefix_identity_includes_the_expert_format(qmodels):
    """Quantized experts change the KV of a prefix: a stored prefix must not be reused across formats."""
    from ftjax.config import KVOffloadConfig
    from ftjax.kv.host_store import HostKVStore
    from ftjax.kv.prefix_cache import PrefixCache
    model, _, models = qmodels
    mgr = PrefixCache(HostKVStore(1 << 20), KVOffloadConfig(chunk_tokens=32, prefill_chunk=256))
    ids = {name: mgr.identity(Engine(m, EngineConfig("resident", max_seq_len=64)))
           for name, m in [("dense", model), *models.items()]}
    assert len(set(ids.values())) == len(ids)
