"""The decode attention prologue kernel (ftjax.kernels.rope_cache) against the model's jnp path
(``layers.attention.qk`` and the cache scatter of ``layers.attention.attention_inputs``) in Pallas interpret mode on the
CPU, its wiring into a tiny model's greedy decode, and its lowering for CUDA.

Tolerances: the kernel rounds every product and sum to the model dtype as the jnp ops do, but
adds the K-split parts and the norm's squares in another order, so float32 agrees to ~1e-6
relative and bf16 to one ulp.
"""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_dense_decode import _assert_like_default, _fresh_traces, _tiny_generate

from ftjax import model as model_lib
from ftjax.config import preset
from ftjax.kernels import decode_attention as da
from ftjax.kernels import dense_decode as dd
from ftjax.kernels import rope_cache as rc
from ftjax.kernels.registry import KernelConfig, using
from ftjax.layers import attention as attention_lib

L, B, S, HQ, HKV, HD = 3, 2, 64, 8, 2, 32


def _operands(dtype, parts=4, seed=0):
    rng = np.random.default_rng(seed)
    qkv = jnp.asarray(rng.standard_normal((parts, B, (HQ + 2 * HKV) * HD)), jnp.float32 if parts > 1 else dtype)
    qn = jnp.asarray(1 + 0.1 * rng.standard_normal((L, HD)), dtype)
    kn = jnp.asarray(1 + 0.1 * rng.standard_normal((L, HD)), dtype)
    ck = jnp.asarray(rng.standard_normal((L, B, S, HKV, HD)), dtype)
    cv = jnp.asarray(rng.standard_normal((L, B, S, HKV, HD)), dtype)
    return qkv, qn, kn, ck, cv


def _jnp_path(qkv, qn, kn, ck, cv, layer, pos, dtype, qk_norm):
    """What ``layers.attention.attention_inputs`` does without the kernel: the projection (the parts' sum,
    cast), ``layers.attention.qk``, the cache scatter; q grouped as the kernel lays it out."""
    y = jnp.sum(qkv.astype(jnp.float32), axis=0).astype(dtype)[:, None]
    q, k, v = jnp.split(y, [HQ * HD, (HQ + HKV) * HD], axis=-1)
    cfg = types.SimpleNamespace(head_dim=HD, qk_norm=qk_norm, num_heads=HQ, num_kv_heads=HKV, rms_norm_eps=1e-6,
                                rope_theta=1e4, norm_offset=False)
    lp = {"q_norm": qn[layer], "k_norm": kn[layer]}
    q, k, v = attention_lib.qk(cfg, lp, y, pos[:, None], [q, k, v])
    rows = jnp.arange(B)[:, None]
    ck = ck.at[layer, rows, pos[:, None]].set(k.astype(ck.dtype), mode="drop")
    cv = cv.at[layer, rows, pos[:, None]].set(v.astype(cv.dtype), mode="drop")
    return q.reshape(B, HKV, HQ // HKV, HD), ck, cv


def _close(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    g, r = np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))
    if want.dtype == jnp.bfloat16:  # one ulp (8 significant bits)
        ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(r), 2.0 ** -126))) - 7)
        assert np.all(np.abs(g - r) <= ulp), float(np.max(np.abs(g - r) / ulp))
    else:
        np.testing.assert_allclose(g, r, rtol=2e-6, atol=2e-6 * float(np.abs(r).max()))


@pytest.mark.parametrize("qk_norm", ["per_head", "none"])
@pytest.mark.parametrize("parts", [1, 4])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rope_cache_matches_the_model_path(dtype, parts, qk_norm):
    qkv, qn, kn, ck, cv = _operands(dtype, parts)
    norms = (qn, kn) if qk_norm == "per_head" else (None, None)
    for layer, pos in ((1, [5, S - 1]), (0, [0, 17])):
        pos = jnp.asarray(pos, jnp.int32)
        qg, ck2, cv2 = rc.rope_cache(qkv, *norms, ck, cv, jnp.int32(layer), pos, hq=HQ, hkv=HKV, eps=1e-6, theta=1e4,
                                     dtype=dtype, interpret=True)
        wq, wk, wv = _jnp_path(qkv, qn, kn, ck, cv, layer, pos, dtype, qk_norm)
        g = HQ // HKV
        assert qg.shape == (B, HKV, rc.query_rows(HQ, HKV), HD) and rc.query_rows(HQ, HKV) == 16
        _close(qg[:, :, :g], wq)
        np.testing.assert_array_equal(np.asarray(qg[:, :, g:], np.float32), 0.0)  # the pad rows
        _close(ck2, wk)
        _close(cv2, wv)
        untouched = np.ones((L, B, S), bool)
        untouched[layer, np.arange(B), np.asarray(pos)] = False  # only the call's rows change
        np.testing.assert_array_equal(np.asarray(ck2)[untouched], np.asarray(ck)[untouched])
        np.testing.assert_array_equal(np.asarray(cv2)[untouched], np.asarray(cv)[untouched])
        # and the attention kernel over the grouped queries is the one over the model's queries
        o = da.grouped(qg, ck2, cv2, jnp.int32(layer), pos, g=g, offset=1, interpret=True)
        want = da.decode_attention(wq.reshape(B, 1, HQ, HD), wk, wv, jnp.int32(layer), pos, offset=1, interpret=True)
        assert o.shape == (B, 1, HQ, HD)
        np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(want, np.float32),
                                   rtol=0.02 if dtype == jnp.bfloat16 else 1e-5, atol=0.02 if dtype == jnp.bfloat16
                                   else 1e-5)


def test_positions_outside_the_cache_write_nothing_and_negative_ones_wrap():
    """As the jnp scatter (``mode="drop"`` after a jnp index's wrap): position S_max writes
    nothing, -1 writes row S_max - 1; a negative layer id wraps too."""
    qkv, qn, kn, ck, cv = _operands(jnp.float32)
    pos = jnp.asarray([S, -1], jnp.int32)
    _, ck2, cv2 = rc.rope_cache(qkv, qn, kn, ck, cv, jnp.int32(-1), pos, hq=HQ, hkv=HKV, eps=1e-6, theta=1e4,
                                dtype=jnp.float32, interpret=True)
    np.testing.assert_array_equal(np.asarray(ck2[:, 0]), np.asarray(ck[:, 0]))
    np.testing.assert_array_equal(np.asarray(cv2[:, 0]), np.asarray(cv[:, 0]))
    np.testing.assert_array_equal(np.asarray(ck2[:, 1, : S - 1]), np.asarray(ck[:, 1, : S - 1]))
    assert not np.array_equal(np.asarray(ck2[L - 1, 1, S - 1]), np.asarray(ck[L - 1, 1, S - 1]))
    _, wk, wv = _jnp_path(qkv, qn, kn, ck, cv, L - 1, jnp.asarray([-1, -1], jnp.int32), jnp.float32, "per_head")
    _close(ck2[L - 1, 1, S - 1], wk[L - 1, 1, S - 1])
    _close(cv2[L - 1, 1, S - 1], wv[L - 1, 1, S - 1])


def test_supported_and_errors():
    qkv, qn, kn, ck, cv = _operands(jnp.bfloat16)
    assert rc.supported(qkv, HQ, HKV, HD, ck, jnp.bfloat16)
    assert not rc.supported(qkv, HQ, HKV, HD, ck, jnp.float16)  # decode_attention wants q and cache of one dtype
    assert not rc.supported(qkv[..., :-HD], HQ, HKV, HD, ck, jnp.bfloat16)  # columns are not q | k | v
    assert not rc.supported(qkv, HQ, 3, HD, ck, jnp.bfloat16)  # Hq % Hkv
    assert not rc.supported(qkv[:, :1], HQ, HKV, HD, ck, jnp.bfloat16)  # another batch than the cache's
    odd = jnp.zeros((L, B, S, HKV, 24), jnp.bfloat16)
    assert not rc.supported(jnp.zeros((1, B, (HQ + 2 * HKV) * 24)), HQ, HKV, 24, odd, jnp.bfloat16)  # hd / 2 = 12
    with pytest.raises(ValueError, match="both be given"):
        rc.rope_cache(qkv, qn, None, ck, cv, 0, jnp.zeros(B, jnp.int32), hq=HQ, hkv=HKV, eps=1e-6, theta=1e4,
                      dtype=jnp.bfloat16, interpret=True)
    with pytest.raises(ValueError, match="unsupported operands"):
        rc.rope_cache(qkv, qn, kn, ck, cv, 0, jnp.zeros(B, jnp.int32), hq=HQ, hkv=3, eps=1e-6, theta=1e4,
                      dtype=jnp.bfloat16, interpret=True)


def test_stacked_weights_pass_the_qk_norms_only_with_the_kernel():
    layers = {"wq": jnp.zeros((3, 128, 64), jnp.bfloat16), "attn_norm": jnp.zeros((3, 128), jnp.bfloat16),
              "q_norm": jnp.zeros((3, 32), jnp.bfloat16), "k_norm": jnp.zeros((3, 32), jnp.bfloat16)}
    per_head, full = preset("tiny"), dataclasses.replace(preset("tiny"), qk_norm="full")
    assert per_head.qk_norm == "per_head"
    with using(KernelConfig(use="norm_dense_decode,rope_cache,decode_attention")):
        assert set(model_lib.stacked_weights(per_head, layers, (1, 1))) == {"wq", "attn_norm", "q_norm", "k_norm"}
        # [L, H * hd]: the jnp path
        assert set(model_lib.stacked_weights(full, layers, (1, 1))) == {"wq", "attn_norm"}
    with using(KernelConfig(use="norm_dense_decode,decode_attention")):
        assert set(model_lib.stacked_weights(per_head, layers, (1, 1))) == {"wq", "attn_norm"}
    # the kernel runs only with decode_attention: the kernel config refuses it without
    with pytest.raises(ValueError, match="KernelConfig.use: kernel 'rope_cache' needs decode_attention"):
        KernelConfig(use="norm_dense_decode,rope_cache")


@pytest.mark.parametrize("kernels", [  # the whole prologue chain by default; its two other shapes slow
    "dense_decode,norm_dense_decode,rope_cache,decode_attention",
    pytest.param("dense_decode,rope_cache,decode_attention", marks=pytest.mark.slow),
    pytest.param("dense_decode,norm_dense_decode,rope_cache,decode_attention,merge_dense_decode",
                 marks=pytest.mark.slow)])
def test_greedy_decode_with_the_kernel_matches_the_default_path(kernels, monkeypatch):
    """A tiny model's greedy decode (float32, interpreted on the CPU) with the prologue kernel: after
    the fused norm + wq/wk/wv kernel it takes that kernel's K-split parts (two here); without it, the
    three projections as one part. Same ids and logits within float32 tolerance of the default path;
    the cached mode bit-identical to resident."""
    ref = _tiny_generate("xla")
    _fresh_traces()
    calls = []
    real = rc.rope_cache

    def spy(qkv, qn, kn, ck, cv, layer, pos, **kw):
        calls.append((qkv.shape, str(qkv.dtype), None if qn is None else qn.shape))
        return real(qkv, qn, kn, ck, cv, layer, pos, **kw)

    merges = []
    real_merge = dd.merge_dense_decode

    def spy_merge(o, m, l, w, layer, **kw):
        merges.append((o.shape, w.shape, kw["g"], kw["block_k"]))
        return real_merge(o, m, l, w, layer, **kw)

    monkeypatch.setattr(rc, "rope_cache", spy)
    monkeypatch.setattr(dd, "merge_dense_decode", spy_merge)
    got = _tiny_generate(kernels)
    parts = 2 if "norm_dense" in kernels else 1
    assert set(calls) == {((parts, 1, 256), "float32", (3, 32))}  # the q/k norms read stacked, in place
    # tiny: 2 KV heads of 2 query heads of 32; 16 key splits; K tiles capped at one head
    assert set(merges) == ({((1, 2, 16, 16, 32), (3, 128, 128), 2, 32)} if "merge" in kernels else set())
    _assert_like_default(kernels, ref, got)


def test_rope_cache_lowers_for_cuda_with_the_caches_aliased():
    """qwen3-30b-a3b's decode layer (48 layers, 32 / 4 heads of 128, K split 8) lowers to one Triton
    call whose outputs alias the two caches (no copy of the cache per layer)."""
    from test_kernels import _lower_cuda

    sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    cache = sd((48, 1, 4096, 4, 128), bf)
    txt = _lower_cuda(lambda p, qn, kn, k, v, l, pos: rc.rope_cache(p, qn, kn, k, v, l, pos, hq=32, hkv=4, eps=1e-6,
                                                                     theta=1e6, dtype=bf),
                      sd((8, 1, 5120), jnp.float32), sd((48, 128), bf), sd((48, 128), bf), cache, cache,
                      sd((), jnp.int32), sd((1,), jnp.int32))
    assert txt.count("__gpu$xla.gpu.triton") == 1
    assert "output_operand_aliases" in txt


def test_merge_dense_decode_lowers_for_cuda():
    """qwen3-30b-a3b's wo product (4096 -> 2048, 48 layers, K split 16) with the merge of 16 key
    splits of 4 KV heads x 8 query heads in its prologue: one Triton call."""
    from test_kernels import _lower_cuda

    sd, f32 = jax.ShapeDtypeStruct, jnp.float32
    txt = _lower_cuda(lambda o, m, l, w, i: dd.merge_dense_decode(o, m, l, w, i, g=8, dtype=jnp.bfloat16, k_split=16),
                      sd((1, 4, 16, 16, 128), f32), sd((1, 4, 16, 16), f32), sd((1, 4, 16, 16), f32),
                      sd((48, 4096, 2048), jnp.bfloat16), sd((), jnp.int32))
    assert txt.count("__gpu$xla.gpu.triton") == 1


def test_rope_matches_the_jitted_model_path_at_far_positions():
    """The model runs ``layers.common.rope`` inside a jitted step, where XLA computes its frequencies
    ``1 / theta ** (i / hd)`` from the constant theta (not as an eager ``pow`` does): the kernel's
    frequencies must be those, or the angle ``pos * inv_freq`` drifts with the position (float32
    K off by ~3e-4 relative at position 8000 for hd 128, theta 1e6)."""
    hq, hkv, hd, s, theta = 2, 1, 128, 64, 1e6
    rng = np.random.default_rng(7)
    qkv = jnp.asarray(rng.standard_normal((1, 2, (hq + 2 * hkv) * hd)), jnp.float32)
    ck = cv = jnp.zeros((1, 2, s, hkv, hd), jnp.float32)
    pos = jnp.asarray([8000, 32000], jnp.int32)  # q rotated at any position (K/V beyond the cache dropped)
    cfg = types.SimpleNamespace(head_dim=hd, qk_norm="none", num_heads=hq, num_kv_heads=hkv, rms_norm_eps=1e-6,
                                rope_theta=theta, norm_offset=False)

    @jax.jit
    def model_path(qkv, pos):
        y = qkv[0][:, None]
        q, k, v = jnp.split(y, [hq * hd, (hq + hkv) * hd], axis=-1)
        return attention_lib.qk(cfg, {}, y, pos[:, None], [q, k, v])

    for p in (jnp.asarray([s - 1, 5], jnp.int32), pos):
        want_q, want_k, _ = model_path(qkv, p)
        qg, ck2, _ = rc.rope_cache(qkv, None, None, ck, cv, jnp.int32(0), p, hq=hq, hkv=hkv, eps=1e-6, theta=theta,
                                   dtype=jnp.float32, interpret=True)
        _close(qg[:, :, :hq // hkv], want_q.reshape(2, hkv, hq // hkv, hd))
    # K at a far position, written into a cache that long
    big = jnp.zeros((1, 1, 8192, hkv, hd), jnp.float32)
    p = jnp.asarray([8000], jnp.int32)
    _, want_k, _ = model_path(qkv[:, :1], p)
    _, ck2, _ = rc.rope_cache(qkv[:, :1], None, None, big, big, jnp.int32(0), p, hq=hq, hkv=hkv, eps=1e-6,
                              theta=theta, dtype=jnp.float32, interpret=True)
    _close(ck2[0, 0, 8000], want_k[0, 0])


def test_norm_weights_or_caches_of_another_shape_or_dtype_are_rejected():
    """q/k norm weights other than [hd] or [L, hd] (e.g. the [H * hd] of a "full" family, or a stack
    over other layers than the cache's) or of two dtypes, and a V cache of another dtype than the K
    cache, raise instead of being read wrongly."""
    qkv, qn, kn, ck, cv = _operands(jnp.float32)
    kw = dict(hq=HQ, hkv=HKV, eps=1e-6, theta=1e4, dtype=jnp.float32, interpret=True)
    pos = jnp.zeros(B, jnp.int32)
    for bad_q, bad_k in ((jnp.ones(HQ * HD), jnp.ones(HKV * HD)), (jnp.ones((L + 2, HD)), jnp.ones((L + 2, HD))),
                         (qn, kn[0, :HD // 2]), (qn, kn.astype(jnp.bfloat16))):
        with pytest.raises(ValueError, match="rope_cache: q_norm / k_norm"):
            rc.rope_cache(qkv, bad_q, bad_k, ck, cv, jnp.int32(0), pos, **kw)
    rc.rope_cache(qkv, qn[1], kn, ck, cv, jnp.int32(1), pos, **kw)  # [hd] and [L, hd] mixed: fine
    with pytest.raises(ValueError, match="rope_cache: unsupported operands"):  # V stored in another dtype than K
        rc.rope_cache(qkv, qn, kn, ck, cv.astype(jnp.bfloat16), jnp.int32(0), pos, **kw)
