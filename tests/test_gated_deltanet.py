"""The gated delta rule's two forms and the causal conv (ftjax.layers.gated_deltanet), against a plain
numpy float64 loop of the recurrence written from the paper's update rule."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from ftjax.layers import gated_deltanet as gdn

B, H, DK, DV = 2, 3, 8, 6


def _inputs(t: int, seed: int = 0):
    r = np.random.default_rng(seed)
    q = gdn.l2_normalize(jnp.asarray(r.normal(size=(B, t, H, DK)), jnp.float32))
    k = gdn.l2_normalize(jnp.asarray(r.normal(size=(B, t, H, DK)), jnp.float32))
    v = jnp.asarray(r.normal(size=(B, t, H, DV)), jnp.float32)
    g = -jnp.asarray(r.uniform(0.0, 0.3, size=(B, t, H)), jnp.float32)
    beta = jnp.asarray(r.uniform(size=(B, t, H)), jnp.float32)
    s0 = jnp.asarray(r.normal(size=(B, H, DK, DV)), jnp.float32)
    return q, k, v, g, beta, s0


def _reference(q, k, v, g, beta, s0):
    """S_t = a S + beta k (v - a S^T k)^T with a = exp(g); o_t = S_t^T q / sqrt(dk); float64."""
    q, k, v, g, beta, s = (np.asarray(a, np.float64) for a in (q, k, v, g, beta, s0))
    out = np.zeros(v.shape)
    for t in range(q.shape[1]):
        s = s * np.exp(g[:, t])[..., None, None]
        err = v[:, t] - np.einsum("bhkv,bhk->bhv", s, k[:, t])
        s = s + np.einsum("bhk,bhv->bhkv", k[:, t], beta[:, t][..., None] * err)
        out[:, t] = np.einsum("bhkv,bhk->bhv", s, q[:, t]) / np.sqrt(q.shape[-1])
    return out, s


@pytest.mark.parametrize("t", [1, 5, 64, 150])
def test_both_forms_match_the_recurrence(t):
    args = _inputs(t)
    want_o, want_s = _reference(*args)
    o, s = gdn.recurrent_gated_delta_rule(*args)
    np.testing.assert_allclose(o, want_o, atol=2e-5)
    np.testing.assert_allclose(s, want_s, atol=2e-5)
    o, s, ends = gdn.chunked_gated_delta_rule(*args)
    np.testing.assert_allclose(o, want_o, atol=2e-5)
    np.testing.assert_allclose(s, want_s, atol=2e-5)
    assert ends.shape == (-(-t // gdn.DELTA_CHUNK), B, H, DK, DV)
    np.testing.assert_array_equal(ends[-1], s)
    if t > gdn.DELTA_CHUNK:  # the state after the first chunk is the recurrence's after 64 tokens
        _, s64 = _reference(*(a[:, :64] for a in args[:5]), args[5])
        np.testing.assert_allclose(ends[0], s64, atol=2e-5)


def test_padding_with_zero_beta_and_decay_leaves_the_state_exactly():
    """What the hybrid layer does for right padding: beta = 0, g = 0 after the real tokens."""
    q, k, v, g, beta, s0 = _inputs(128)
    valid = jnp.arange(128)[None, :, None] < 70
    _, s_padded, _ = gdn.chunked_gated_delta_rule(q, k, v, jnp.where(valid, g, 0.0), jnp.where(valid, beta, 0.0), s0)
    _, s_short, _ = gdn.chunked_gated_delta_rule(q[:, :70], k[:, :70], v[:, :70], g[:, :70], beta[:, :70], s0)
    np.testing.assert_allclose(s_padded, s_short, atol=1e-6)
    _, s_rec = gdn.recurrent_gated_delta_rule(q[:, :1], k[:, :1], v[:, :1], g[:, :1] * 0, beta[:, :1] * 0, s0)
    np.testing.assert_array_equal(s_rec, s0)  # one padding token: nothing moves


def test_causal_conv_continues_from_its_state():
    r = np.random.default_rng(1)
    x = jnp.asarray(r.normal(size=(2, 10, 5)), jnp.float32)
    w = jnp.asarray(r.normal(size=(4, 5)), jnp.float32)
    zero = jnp.zeros((2, 3, 5), jnp.float32)
    full, state_full = gdn.causal_conv(x, w, zero, jnp.array([10, 10]))
    xp = np.pad(np.asarray(x), ((0, 0), (3, 0), (0, 0)))
    want = sum(xp[:, i:i + 10] * np.asarray(w)[i] for i in range(4))
    np.testing.assert_allclose(full, want / (1 + np.exp(-want)), atol=1e-5)
    first, state = gdn.causal_conv(x[:, :6], w, zero, jnp.array([6, 4]))
    np.testing.assert_array_equal(state[0], x[0, 3:6])
    np.testing.assert_array_equal(state[1], x[1, 1:4])  # row 1: only 4 real tokens
    second, state2 = gdn.causal_conv(x[:1, 6:], w, state[:1], jnp.array([4]))
    np.testing.assert_allclose(second, full[:1, 6:], atol=1e-6)
    np.testing.assert_array_equal(state2, state_full[:1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("chunk_states", [False, True])
def test_chunked_form_memory_grows_linearly_in_t(dtype, chunk_states):
    """Pins the prefill memory of the chunked form: the CPU compiled workspace for 4T tokens is at
    most ~4x that for T (per-chunk [C, C] matrices and [C, dk] / [C, dv] blocks, the [dk, dv] state
    per chunk only when asked), and a few tensors of the inputs' size, never a [T, T] matrix or a
    per-token [dk, dv] state. At the qwen3.5-35b-a3b shape (32 value heads, dk = dv = 128) an 8192-token
    layer needs 0.87 GB (float32 and bfloat16 inputs alike, states off), 0.22 GB at 2048 tokens."""
    import jax

    h, dk, dv = 4, 32, 32

    def temp(t):
        sds = lambda *s, dt=dtype: jax.ShapeDtypeStruct(s, dt)  # noqa: E731
        args = (sds(1, t, h, dk), sds(1, t, h, dk), sds(1, t, h, dv), sds(1, t, h, dt=jnp.float32),
                sds(1, t, h), sds(1, h, dk, dv, dt=jnp.float32))
        fn = jax.jit(lambda *a: gdn.chunked_gated_delta_rule(*a, chunk_states=chunk_states))
        return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes

    t = 1024
    small, large = temp(t), temp(4 * t)
    assert large <= 4.5 * small, (small, large)
    per_token = h * (2 * dk + dv) * 4  # q, k, v of one token in float32
    # 3.4x now; one [T, T] float32 per head (or a [dk, dv] state per token) alone would be 43x
    assert small <= 12 * t * per_token, (small, t * per_token)


def _scan_kernel_inputs():
    """(q, k, v, g, beta, s0) of one row, 40 tokens (three chunks of 16, the last padded), 2 heads, dk 16, dv 32."""
    r = np.random.default_rng(1)
    t, dk, dv = 40, 16, 32
    q = gdn.l2_normalize(jnp.asarray(r.normal(size=(1, t, 2, dk)), jnp.float32))
    k = gdn.l2_normalize(jnp.asarray(r.normal(size=(1, t, 2, dk)), jnp.float32))
    v = jnp.asarray(r.normal(size=(1, t, 2, dv)), jnp.float32)
    g = -jnp.asarray(r.uniform(0.0, 0.3, size=(1, t, 2)), jnp.float32)
    beta = jnp.asarray(r.uniform(size=(1, t, 2)), jnp.float32)
    s0 = jnp.asarray(r.normal(size=(1, 2, dk, dv)), jnp.float32)
    return q, k, v, g, beta, s0


@pytest.mark.parametrize("chunk_states", [True, False])
def test_the_chunk_scan_kernel_matches_the_scan(chunk_states):
    """Both ``ftjax.kernels.gated_delta`` kernels interpreted (two column blocks of S per head, three chunks, the last
    one padded) against the reference's ``lax.scan`` over chunks: outputs, final and per-chunk states."""
    from ftjax.kernels.registry import KernelConfig, recording, using
    args = _scan_kernel_inputs()
    dk, dv = args[0].shape[-1], args[2].shape[-1]
    want = gdn.chunked_gated_delta_rule(*args, chunk=16, chunk_states=chunk_states)
    with using(KernelConfig(use="interpret", tiles={"gated_delta": (16,)})), recording() as ran:
        got = gdn.chunked_gated_delta_rule(*args, chunk=16, chunk_states=chunk_states)
    assert ran == {"gated_delta", "gated_delta_solve"}
    np.testing.assert_allclose(got[0], want[0], atol=1e-5)
    np.testing.assert_allclose(got[1], want[1], atol=1e-5)
    if chunk_states:
        assert got[2].shape == (3, 1, 2, dk, dv)
        np.testing.assert_allclose(got[2], want[2], atol=1e-5)
    else:
        assert got[2] is None and want[2] is None


def test_the_scan_kernel_with_16_bit_operands_rounds_as_a_tf32_dot_would():
    """``gated_delta=(bv, warps, stages, 16)``: q_read, k_write and the scores stored as float16 (bounded by 1, so no
    overflow). Interpreted, the dots are exact float32, so what is left is float16's rounding of the three (2^-11
    relative, a TF32 dot's own input rounding): within 1e-3 of the float32 scan, and clearly not bit-equal to it."""
    from ftjax.kernels.registry import KernelConfig, using
    args = _scan_kernel_inputs()
    want = gdn.chunked_gated_delta_rule(*args, chunk=16)
    with using(KernelConfig(use="interpret", tiles={"gated_delta": (16, 4, 2, 16)})):
        got = gdn.chunked_gated_delta_rule(*args, chunk=16)
    for x, y in zip(got, want):
        err = float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y)))
        assert 1e-6 < err < 1e-3, err


@pytest.mark.parametrize("block,form", [(8, 0), (16, 0), (32, 0), (64, 0), (16, 1), (32, 1)])
def test_the_chunk_solve_kernel_matches_the_triangular_solve(block, form):
    """``gated_delta_solve`` interpreted against ``chunk_solve``'s XLA form (batched triangular solve), on
    chunks of 64 whose decay spans several orders of magnitude: the masked form (forward substitution over
    diagonal blocks of ``block`` rows, the blocks merged by dots; 64: row by row) and the blocked form (the
    chunk as row blocks, solved block by block)."""
    from ftjax.kernels.registry import KernelConfig, recording, using
    r = np.random.default_rng(2)
    lead, c_len, dk, dv = (1, 2, 2), 64, 16, 32
    q = gdn.l2_normalize(jnp.asarray(r.normal(size=(*lead, c_len, dk)), jnp.float32)) * dk ** -0.5
    k = gdn.l2_normalize(jnp.asarray(r.normal(size=(*lead, c_len, dk)), jnp.float32))
    v = jnp.asarray(r.normal(size=(*lead, c_len, dv)), jnp.float32)
    beta = jnp.asarray(r.uniform(size=(*lead, c_len)), jnp.float32)
    c = jnp.cumsum(-jnp.asarray(r.uniform(0.0, 0.2, size=(*lead, c_len)), jnp.float32), axis=-1)
    want = gdn.chunk_solve(q, k, v, beta, c)
    with using(KernelConfig(use="interpret", tiles={"gated_delta_solve": (block, 4, form)})), recording() as ran:
        got = gdn.chunk_solve(q, k, v, beta, c)
    assert "gated_delta_solve" in ran
    for x, y in zip(got, want):
        assert x.shape == y.shape
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


def test_the_scan_kernel_takes_the_precision_and_shapes_it_was_measured_at():
    """TF32 dots by default, IEEE float32 under ``default_matmul_precision("highest")``; dk = 128 fits the
    shared-memory rule, dk = 256 does not; a malformed tile override is refused by name."""
    import jax
    from jax import lax

    from ftjax.kernels import gated_delta as gd
    from ftjax.kernels.registry import KernelConfig
    assert gd.dot_precision() == lax.Precision.DEFAULT and gd.tf32_setting()
    with jax.default_matmul_precision("highest"):
        assert gd.dot_precision() == lax.Precision.HIGHEST and not gd.tf32_setting()
    with jax.default_matmul_precision("bfloat16"):  # XLA's dots differ from the kernel's TF32: auto skips it
        assert gd.dot_precision() == lax.Precision.DEFAULT and not gd.tf32_setting()
    assert gd.supported(128, 128, 64) and not gd.supported(256, 128, 64) and not gd.supported(128, 128, 64, 24)
    assert KernelConfig(tiles={"gated_delta": (32, 4, 1)}).tile_args("gated_delta") == \
        {"block_v": 32, "num_warps": 4, "num_stages": 1, "operand_bits": 32}
    assert KernelConfig(tiles={"gated_delta": (32, 4, 2, 16)}).tile_args("gated_delta")["operand_bits"] == 16
    # two pipeline stages fit shared memory with 16-bit q, k and scores only
    assert gd.supported(128, 128, 64, 32, 2, 16) and not gd.supported(128, 128, 64, 32, 2, 32)
    for bad in ((24,), (32, 4, 1, 8)):
        with pytest.raises(ValueError, match="gated_delta"):
            KernelConfig(tiles={"gated_delta": bad})


@pytest.mark.parametrize("chunk,block,form", [(48, 16, 0), (40, 16, 0), (80, 16, 0), (48, 16, 1), (80, 16, 1),
                                              (40, 16, 1)])
def test_the_solve_kernel_merges_any_number_of_diagonal_blocks(chunk, block, form):
    """``solve_chunks`` called directly with a chunk that is not a power-of-two number of ``block``-row
    blocks (3, 3 with a short last one, 5): the block merge needs ceil(log2(blocks)) factors; with
    log2 rounded down it dropped the products that reach the last block (silently wrong rows). The blocked form
    solves 3 and 5 blocks row block by row block, and falls back to the masked form for the short last block."""
    from ftjax.kernels import gated_delta as gd
    r = np.random.default_rng(4)
    lead, dk, dv = (1, 2, 2), 16, 16
    q = gdn.l2_normalize(jnp.asarray(r.normal(size=(*lead, chunk, dk)), jnp.float32)) * dk ** -0.5
    k = gdn.l2_normalize(jnp.asarray(r.normal(size=(*lead, chunk, dk)), jnp.float32))
    v = jnp.asarray(r.normal(size=(*lead, chunk, dv)), jnp.float32)
    beta = jnp.asarray(r.uniform(size=(*lead, chunk)), jnp.float32)
    c = jnp.cumsum(-jnp.asarray(r.uniform(0.0, 0.05, size=(*lead, chunk)), jnp.float32), axis=-1)
    want = gdn.chunk_solve(q, k, v, beta, c)  # XLA's triangular solve (no power-of-two chunk: never the kernel)
    flat = lambda x: x.reshape(-1, lead[-1] * chunk, *x.shape[4:])  # noqa: E731
    got = gd.solve_chunks(*(flat(a) for a in (q, k, v, beta, c)), chunk=chunk, block=block, interpret=True,
                          form=form)
    for x, y in zip(got, want):
        np.testing.assert_allclose(x.reshape(y.shape), y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_conv_kernel_matches_the_reference(dtype):
    """``causal_conv`` interpreted (T = 37 and 40 channels: neither a multiple of the 16 x 16 tiles; rows with
    7, 2 (< K - 1) and 0 real tokens; the state read across the first tile's edge) against the XLA form:
    the output to float32 rounding, the new state exactly (it is a copy of inputs); one decode token too."""
    from ftjax.kernels.registry import KernelConfig, recording, using
    r = np.random.default_rng(5)
    b, c = 3, 40
    w = jnp.asarray(r.normal(size=(4, c)), dtype)
    state = jnp.asarray(r.normal(size=(b, 3, c)), jnp.float32)  # cast to x's dtype, as the cache may hold another
    for t, valid_len in ((37, [37, 2, 0]), (1, [1, 1, 0])):
        x = jnp.asarray(r.normal(size=(b, t, c)), dtype)
        n = jnp.asarray(valid_len, jnp.int32)
        want = gdn.causal_conv(x, w, state, n)
        with using(KernelConfig(use="causal_conv", tiles={"causal_conv": (16, 16)})), recording() as ran:
            got = gdn.causal_conv(x, w, state, n)
        assert ran == {"causal_conv"}
        assert got[0].dtype == want[0].dtype == x.dtype and got[1].dtype == want[1].dtype == x.dtype
        np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32), rtol=1e-5,
                                   atol=1e-5)
        np.testing.assert_array_equal(np.asarray(got[1], np.float32), np.asarray(want[1], np.float32))


def test_the_decode_step_kernel_matches_the_recurrence():
    """``gated_delta_step`` interpreted (2 key heads for 4 value heads, two column blocks of S per head, bf16
    q / k / v as the conv returns them) against ``gated_delta_decode``'s XLA form (the heads repeated, the
    norms, one step of ``recurrent_gated_delta_rule``); a padding row (beta = g = 0) leaves its state exactly."""
    from ftjax.kernels.registry import KernelConfig, recording, using
    r = np.random.default_rng(6)
    b, hk, hv, dk, dv = 2, 2, 4, 16, 32
    q, k = (jnp.asarray(r.normal(size=(b, hk, dk)), jnp.bfloat16) for _ in range(2))
    v = jnp.asarray(r.normal(size=(b, hv, dv)), jnp.bfloat16)
    g = -jnp.asarray(r.uniform(0.0, 0.3, size=(b, hv)), jnp.float32).at[1].set(0.0)
    beta = jnp.asarray(r.uniform(size=(b, hv)), jnp.float32).at[1].set(0.0)
    s0 = jnp.asarray(r.normal(size=(b, hv, dk, dv)), jnp.float32)
    want = gdn.gated_delta_decode(q, k, v, g, beta, s0)
    with using(KernelConfig(use="gated_delta_step", tiles={"gated_delta_step": (16,)})), recording() as ran:
        got = gdn.gated_delta_decode(q, k, v, g, beta, s0)
    assert ran == {"gated_delta_step"}
    assert got[0].shape == (b, hv, dv) and got[1].shape == s0.shape
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[1][1], s0[1])
    assert float(jnp.max(jnp.abs(got[1][0] - s0[0]))) > 0.1  # a real row moved


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_one_launch_decode_kernel_matches_the_mixer(dtype):
    """``gated_deltanet_decode`` interpreted (tiny-hybrid: 2 key heads for 4 value heads, dk = dv = 32), one decode
    token of layer 1 of a 2-layer stacked cache, one live row and one idle row, weights stacked or not: the mixer's
    output projection input, conv state and recurrent state as the XLA path makes them (float32 to rounding; bf16 to
    an ulp of its bf16 values: XLA may keep a bf16 intermediate such as beta in float32 inside a fusion, so the two
    round differently), layer 0 and the idle row's states untouched bit for bit."""
    from ftjax.config import preset
    from ftjax.kernels import gated_delta_step as gs
    from ftjax.kernels.registry import KernelConfig, recording, using
    from ftjax.layers.common import StackedWeight
    from ftjax.seams import KVCache
    cfg = preset("tiny-hybrid")
    r = np.random.default_rng(11)
    shapes = gdn.param_shapes(cfg)
    lp = {n: jnp.asarray(r.normal(size=s) * (0.05 if len(s) == 2 else 0.5), dtype) for n, s in shapes.items()}
    lp["A_log"] = lp["A_log"].astype(jnp.float32)
    (_, _, km1, cd), (_, _, hv, dk, dv) = gdn.state_shapes(cfg, 2, 2)
    cache = KVCache(None, None, jnp.asarray(r.normal(size=(2, 2, km1, cd)), dtype),
                    jnp.asarray(r.normal(size=(2, 2, hv, dk, dv)) * 0.3, jnp.float32))
    x = jnp.asarray(r.normal(size=(2, 1, cfg.hidden_size)), dtype)
    projected = [gdn.project(x, lp[n]) for n in gdn.IN_PROJECTIONS]
    valid = jnp.asarray([[True], [False]])
    y, conv, rec, _ = gdn.mixer(cfg, lp, projected, dtype, cache.conv[1], cache.rec[1], valid)
    for stacked in (False, True):
        got_lp = dict(lp)
        if stacked:  # the layer's row 1 of a 2-layer stack, as a decode step hands them
            got_lp.update({n: StackedWeight(jnp.stack([lp[n] * 2, lp[n]]), jnp.int32(1))
                           for n in ("conv", "A_log", "dt_bias", "norm")})
        with using(KernelConfig(use="gated_deltanet_decode")), recording() as ran:
            got_y, got_cache = gdn.decode_in_one_launch(cfg, got_lp, projected, dtype, cache, jnp.int32(1), valid)
        assert ran == {"gated_deltanet_decode"}
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2 ** -7, atol=2 ** -7)
        np.testing.assert_allclose(np.asarray(got_y[0], np.float32), np.asarray(y[0], np.float32), **tol)
        np.testing.assert_allclose(np.asarray(got_cache.conv[1], np.float32), np.asarray(conv, np.float32), **tol)
        np.testing.assert_allclose(got_cache.rec[1], rec, **tol)
        np.testing.assert_array_equal(np.asarray(got_cache.conv[1, 1]), np.asarray(cache.conv[1, 1]))  # idle row
        np.testing.assert_array_equal(np.asarray(got_cache.rec[1, 1]), np.asarray(cache.rec[1, 1]))
        np.testing.assert_array_equal(np.asarray(got_cache.rec[0]), np.asarray(cache.rec[0]))  # another layer
        np.testing.assert_array_equal(np.asarray(got_cache.conv[0]), np.asarray(cache.conv[0]))
    assert gdn.decode_in_one_launch(cfg, lp, [p[:, :0] for p in projected], dtype, cache, 1, valid) is None
    assert gs.mixer_supported(16, 32, 128, 128, 8192, 4) and not gs.mixer_supported(16, 32, 128, 128, 8000, 4)
    assert not gs.mixer_supported(16, 32, 128, 128, 8192, 1)  # a conv without state rows: the XLA path
    with pytest.raises(ValueError, match="gated_deltanet_decode kernel: unsupported shapes"):
        gs.mixer_step(projected[0][:, 0, :200], *(p[:, 0] for p in projected[1:]), jnp.ones(2, jnp.int32),
                      cache.conv, cache.rec, jnp.int32(0), *(lp[n][None] for n in ("conv", "A_log", "dt_bias", "norm")),
                      jnp.zeros(4, jnp.int32), key_heads=2, eps=1e-6, interpret=True)


def test_the_layer_runs_the_conv_and_decode_kernels_as_named():
    """``gated_deltanet`` at the tiny-hybrid shape with ``causal_conv`` and ``gated_delta_step`` named
    (interpreted): a 5-token prefill call (the conv kernel; the chunked rule in XLA) and then one decode
    token (both kernels) give the XLA path's outputs and states; the kernels' sizes are refused by name."""
    from ftjax.config import preset
    from ftjax.kernels import causal_conv as cc
    from ftjax.kernels import gated_delta_step as gs
    from ftjax.kernels.registry import KernelConfig, recording, using
    cfg = preset("tiny-hybrid")
    r = np.random.default_rng(7)
    lp = {n: jnp.asarray(r.normal(size=s) * (0.05 if len(s) == 2 else 0.5), jnp.float32)
          for n, s in gdn.param_shapes(cfg).items()}
    (_, _, km1, cd), (_, _, hv, dk, dv) = gdn.state_shapes(cfg, 1, 2)
    conv0, rec0 = jnp.zeros((2, km1, cd), jnp.float32), jnp.zeros((2, hv, dk, dv), jnp.float32)
    x = jnp.asarray(r.normal(size=(2, 6, cfg.hidden_size)), jnp.float32)
    valid = jnp.asarray([[True] * 5, [True] * 3 + [False] * 2])

    def run(use):
        with using(KernelConfig(use=use)), recording() as ran:
            y, conv, rec, _ = gdn.gated_deltanet(cfg, lp, x[:, :5], conv0, rec0, valid)
            y1, conv, rec, _ = gdn.gated_deltanet(cfg, lp, x[:, 5:], conv, rec, jnp.ones((2, 1), bool))
        return (y, y1, conv, rec), ran

    want, ran = run("xla")
    assert ran == set()
    got, ran = run("causal_conv,gated_delta_step")
    assert ran == {"causal_conv", "gated_delta_step"}
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert not cc.supported(1) and not cc.supported(4, block_t=2) and cc.supported(4)
    assert gs.supported(16, 32, 128, 128) and not gs.supported(16, 24, 128, 128) and not gs.supported(2, 4, 8, 32)
    with pytest.raises(ValueError, match="conv_state expected shape"):
        cc.causal_conv(x, lp["conv"][:, :cfg.hidden_size], conv0, jnp.ones(2, jnp.int32))
    qk, zeros = jnp.zeros((2, cfg.linear_num_key_heads, dk)), jnp.zeros((2, hv))
    with pytest.raises(ValueError, match="state expected float32"):
        gs.decode_step(qk, qk, jnp.zeros((2, hv, dv)), zeros, zeros, rec0.astype(jnp.bfloat16))


@pytest.mark.slow
def test_hybrid_decode_with_the_one_launch_mixer_matches_the_default_path(monkeypatch):
    """tiny-hybrid's greedy decode with ``gated_deltanet_decode`` named beside the decode projections' kernels
    (interpreted): every Gated DeltaNet decode layer runs the kernel, reading its state in the stacked cache; same
    ids, the prefill bit-identical, decode logits within float32 tolerance of the
    default path; cached bit-identical to resident with the kernel."""
    from test_dense_decode import _assert_like_default, _fresh_traces, _tiny_generate

    from ftjax.kernels import gated_delta_step as gs
    ref = _tiny_generate("xla", preset_name="tiny-hybrid")
    _fresh_traces()
    calls = []
    real = gs.mixer_step

    def spy(*a, **kw):
        calls.append((a[5].shape, kw["interpret"]))
        return real(*a, **kw)

    monkeypatch.setattr(gs, "mixer_step", spy)
    kernels = "dense_decode,norm_dense_decode,gated_deltanet_decode"
    got = _tiny_generate(kernels, preset_name="tiny-hybrid")
    assert calls and all(interp for _, interp in calls)
    _assert_like_default(kernels, ref, got, preset_name="tiny-hybrid")
