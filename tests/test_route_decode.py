"""The decode router kernel (ftjax.kernels.route_decode) against the model's jnp router
(``layers.moe.top_k_route`` on the summed logits) in Pallas interpret mode on the CPU: ids bit for bit and
weights to one rounding over random partial logits (float32 and bf16, with and without the top-k
renormalisation, ties), its errors, its wiring into a greedy decode (same ids and logits within float32
tolerance as the default path; cached bit-identical to resident), and its lowering for CUDA.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_dense_decode import _assert_like_default, _fresh_traces, _tiny_generate

from ftjax.config import preset
from ftjax.kernels import registry
from ftjax.kernels import route_decode as rd
from ftjax.kernels.registry import KernelConfig, using
from ftjax.layers import moe as moe_lib


def _reference(parts, k, norm, logits_dtype, dtype):
    cfg = dataclasses.replace(preset("tiny"), num_experts=parts.shape[-1], top_k=k, norm_topk_prob=norm)
    logits = jnp.sum(parts.astype(jnp.float32), axis=0).astype(logits_dtype)
    return moe_lib.top_k_route(cfg, logits, dtype)


@pytest.mark.parametrize("p,n,e,k,norm,logits_dtype,dtype", [
    (8, 1, 128, 8, True, jnp.bfloat16, jnp.bfloat16),   # qwen3-30b-a3b at batch 1
    (8, 4, 128, 8, True, jnp.bfloat16, jnp.bfloat16),   # batch 4
    (4, 2, 64, 8, False, jnp.float32, jnp.float32),     # olmoe: no renormalisation
    (1, 3, 8, 2, True, jnp.float32, jnp.float32),       # mixtral, one part
    (2, 1, 16, 4, True, jnp.float32, jnp.bfloat16)])
def test_route_matches_top_k_route(p, n, e, k, norm, logits_dtype, dtype):
    rng = np.random.default_rng(p * 131 + e)
    for trial in range(5):
        parts = jnp.asarray(rng.standard_normal((p, n, e)) * 2.0, jnp.float32)
        if p == 1:
            parts = parts.astype(logits_dtype)
        ids, w = rd.route_decode(parts, top_k=k, norm_topk_prob=norm, logits_dtype=logits_dtype, dtype=dtype,
                                 interpret=True)
        ref_ids, ref_w = _reference(parts, k, norm, logits_dtype, dtype)
        assert ids.dtype == jnp.int32 and ids.shape == (n, k) and w.dtype == jnp.dtype(dtype) and w.shape == (n, k)
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
        np.testing.assert_allclose(np.asarray(w, np.float32), np.asarray(ref_w, np.float32),
                                   rtol=2 * float(jnp.finfo(dtype).eps), atol=1e-7)
        if norm:  # the k weights of each row sum to 1
            np.testing.assert_allclose(np.asarray(w, np.float32).sum(-1), 1.0, rtol=k * float(jnp.finfo(dtype).eps))


def test_ties_go_to_the_lowest_expert_id_as_lax_top_k():
    """bf16 logits tie often: equal logits are taken in ascending expert id, as ``lax.top_k`` on the CPU."""
    parts = jnp.zeros((2, 2, 16), jnp.float32).at[:, 0, jnp.array([3, 9, 12])].set(1.0).at[:, 1, 5].set(-1.0)
    ids, w = rd.route_decode(parts, top_k=4, norm_topk_prob=True, logits_dtype=jnp.bfloat16, dtype=jnp.float32,
                             interpret=True)
    ref_ids, ref_w = _reference(parts, 4, True, jnp.bfloat16, jnp.float32)
    assert np.asarray(ids).tolist() == [[3, 9, 12, 0], [0, 1, 2, 3]] == np.asarray(ref_ids).tolist()
    np.testing.assert_allclose(np.asarray(w), np.asarray(ref_w), rtol=1e-6)


def test_nan_and_inf_logits_route_as_lax_top_k():
    """A row with a NaN or +inf logit (or all -inf) has NaN probabilities: ``lax.top_k`` takes NaN as the
    largest value (ties to the lowest id), so the ids stay in [0, E) as the expert computation needs them;
    the kernel's ``max`` / ``==`` search must not fall through to id E."""
    nan, inf = np.nan, np.inf
    rows = [[1, 2, 3, 4, 5, 6, 7, 8], [1, nan, 3, 4, 5, nan, 7, 8], [-inf] * 8, [1, 2, inf, 4, 5, 6, 7, 8],
            [-inf, -inf, 3, 4, 5, -inf, 7, 8]]
    parts = jnp.asarray(rows, jnp.float32)[None]
    for k in (2, 8):
        ids, w = rd.route_decode(parts, top_k=k, norm_topk_prob=True, logits_dtype=jnp.float32, dtype=jnp.float32,
                                 interpret=True)
        ref_ids, ref_w = _reference(parts, k, True, jnp.float32, jnp.float32)
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
        np.testing.assert_allclose(np.asarray(w), np.asarray(ref_w), rtol=1e-6)  # NaN where the reference has NaN


def test_supported_and_errors():
    assert rd.supported(8, 128, 8, 1) and rd.supported(1, 8, 2, 64)
    assert not rd.supported(8, 128, 8, 65)  # more rows than a decode call
    assert not rd.supported(8, 96, 8, 1)  # E not a power of two
    assert not rd.supported(8, 128, 6, 1)  # k not a power of two
    assert not rd.supported(8, 4, 8, 1)  # k > E
    assert not rd.supported(256, 128, 8, 1)  # too many parts x experts
    with pytest.raises(ValueError, match=r"parts must be \[P, N, E\]"):
        rd.route_decode(jnp.zeros((4, 128)), top_k=8, norm_topk_prob=True, logits_dtype=jnp.float32,
                        dtype=jnp.float32, interpret=True)
    with pytest.raises(ValueError, match="unsupported sizes"):
        rd.route_decode(jnp.zeros((8, 1, 96)), top_k=8, norm_topk_prob=True, logits_dtype=jnp.float32,
                        dtype=jnp.float32, interpret=True)


def test_greedy_decode_with_the_kernel_matches_the_default_path(monkeypatch):
    """A tiny model's greedy decode (float32, interpreted on the CPU) with the router kernel after the fused
    norm + router kernel: it takes that kernel's two K-split parts at each decode layer (the prefill keeps
    the jnp router). Same ids and logits within float32 tolerance of the default path; the cached mode
    bit-identical to resident."""
    ref = _tiny_generate("xla")
    _fresh_traces()
    calls = []
    real = rd.route_decode

    def spy(parts, **kw):
        calls.append((parts.shape, str(parts.dtype), kw["top_k"]))
        return real(parts, **kw)

    monkeypatch.setattr(rd, "route_decode", spy)
    kernels = "dense_decode,norm_dense_decode,route_decode"
    got = _tiny_generate(kernels)
    assert set(calls) == {((2, 1, 16), "float32", 4)}  # tiny: 16 experts, top-4
    _assert_like_default(kernels, ref, got)


def test_router_after_a_zero_centred_norm_matches_the_jnp_router():
    """tiny-hybrid's MoE norm is zero-centred (``1 + w``, the Qwen3.5 family): the decode router takes the norm +
    router launch and this kernel there too (interpreted), reading the layer's rows of the stacked norm and router,
    and routes as the jnp path does (the same experts, weights and normed input within float32 rounding). Cached =
    resident holds because both modes run this same call (on the GPU: 12/12,
    checks/check_identity_gpu_mixer-route_*)."""
    from ftjax.layers.common import StackedWeight, norm_project
    cfg = preset("tiny-hybrid")
    assert cfg.norm_offset
    rng = np.random.default_rng(0)
    d, e, layers = cfg.hidden_size, cfg.num_experts, 3
    h = jnp.asarray(rng.standard_normal((1, 1, d)), jnp.float32)
    lp = {"router": StackedWeight(jnp.asarray(rng.standard_normal((layers, d, e)) * 0.2, jnp.float32), jnp.int32(1)),
          "mlp_norm": StackedWeight(jnp.asarray(rng.standard_normal((layers, d)) * 0.1, jnp.float32), jnp.int32(1))}
    with using(KernelConfig(use="dense_decode,norm_dense_decode,route_decode")), registry.recording() as ran:
        got = moe_lib._route_decode(cfg, lp, h)
    assert got is not None and {"norm_dense_decode", "route_decode"} <= ran
    ids, w, x = got
    with using(KernelConfig(use="xla")):
        (logits,), x_ref = norm_project(h, lp["mlp_norm"], (lp["router"],), cfg.rms_norm_eps, offset=True,
                                        write_x=True)
        ids_ref, w_ref = moe_lib.top_k_route(cfg, logits.reshape(1, -1), x_ref.dtype)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ids_ref))
    np.testing.assert_allclose(np.asarray(w), np.asarray(w_ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(x), np.asarray(x_ref).reshape(1, -1), rtol=1e-5, atol=1e-6)


def test_without_the_norm_kernel_the_router_stays_jnp(monkeypatch):
    """The kernel reads norm_dense_decode's partial logits: selected without it, it could never run, so
    the kernel config refuses that choice (the registry entry ``needs`` norm_dense_decode); selected with
    it, it is; off the GPU, auto keeps the jnp router."""
    calls = []
    monkeypatch.setattr(rd, "route_decode", lambda *a, **kw: calls.append(1))
    with pytest.raises(ValueError, match="KernelConfig.use: kernel 'route_decode' needs norm_dense_decode"):
        _tiny_generate("dense_decode,route_decode")
    assert calls == []
    with using(KernelConfig(use="dense_decode,norm_dense_decode,route_decode")):
        assert rd.selected(1, 128, 8)
    with using(KernelConfig(use="auto")):  # off the GPU, auto keeps the jnp router
        assert not rd.selected(1, 128, 8)


def test_route_decode_lowers_for_cuda():
    """qwen3-30b-a3b's router at batch 1 (32 K-split parts of 128 logits, as the H200 step has them; top-8): one
    Triton call."""
    from test_kernels import _lower_cuda

    sd = jax.ShapeDtypeStruct
    txt = _lower_cuda(lambda p: rd.route_decode(p, top_k=8, norm_topk_prob=True, logits_dtype=jnp.bfloat16,
                                                dtype=jnp.bfloat16), sd((32, 1, 128), jnp.float32))
    assert txt.count("__gpu$xla.gpu.triton") == 1
