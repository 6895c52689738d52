"""Prefill with full-layer streaming, on-demand loading and chunking leaves the math unchanged
(DESIGN.md 1.3): logits bit-identical to the resident model run with the same chunking, and
within the oracle tolerance of transformers."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from conftest import load_fixture
from ftjax import Engine
from ftjax.config import EngineConfig

FAMILIES = ["qwen3_moe_fp32", "olmoe_fp32", "mixtral_fp32", "qwen3_moe_bf16"]


def _prefill_logits(model, prompt, mode="resident", slots=None, **kw):
    engine = Engine(model, EngineConfig(mode, num_slots=slots, max_seq_len=384, **kw))
    logits, _, _, stats = engine.prefill([prompt], engine.new_cache(1), all_logits=True)
    return np.asarray(logits)[0, : len(prompt)], engine, stats


def _mode_cases():
    """Every fixture with a chunked prompt, and qwen3_moe_fp32 whole, by default; the other pairs slow."""
    for which, chunk in (("short", 8192), ("long", 8192), ("long", 64)):
        for name in FAMILIES:
            default = chunk == 64 or name == "qwen3_moe_fp32"
            yield pytest.param(name, which, chunk, id=f"{which}-{chunk}-{name}",
                               marks=() if default else pytest.mark.slow)


@pytest.mark.parametrize("name,which,chunk", list(_mode_cases()))
def test_prefill_modes_bit_identical(name, which, chunk):
    model, exp = load_fixture(name)
    e = model.cfg.num_experts
    prompt = exp[f"{which}_prompt_ids"].tolist()
    want, _, _ = _prefill_logits(model, prompt, prefill_chunk=chunk)
    for prefill, overlap in [("stream", True), ("stream", False), ("on_demand", True), ("auto", True)]:
        got, engine, stats = _prefill_logits(model, prompt, "cached", 2 * e, prefill=prefill,
                                             prefill_chunk=chunk, prefill_overlap=overlap)
        np.testing.assert_array_equal(got, want, err_msg=f"{prefill} overlap={overlap}")
        assert len(stats) == -(-len(prompt) // chunk)
        m = engine.expert_cache_metrics()["prefill"]
        n_chunks = len(stats)
        if prefill == "stream":  # every layer's E experts once per chunk (+ the prologue's with overlap)
            copies = n_chunks * model.cfg.num_layers * e + (n_chunks * e if overlap else 0)
            assert m["bytes_h2d"] == copies * model.expert_bytes
            assert m["hits"] == 0


def test_chunked_prefill_matches_transformers():
    model, exp = load_fixture("qwen3_moe_fp32")
    prompt = exp["long_prompt_ids"].tolist()
    got, _, _ = _prefill_logits(model, prompt, "cached", 16, prefill="stream", prefill_chunk=64)
    want = exp["long_step_logits"][0]
    assert np.abs(got[-1] - want).max() < 2e-5 * np.abs(want).max() + 1e-5


@pytest.mark.parametrize("name", ["olmoe_fp32", pytest.param("mixtral_fp32", marks=pytest.mark.slow)])
def test_streamed_prefill_then_decode_same_tokens(name):
    model, exp = load_fixture(name)
    prompt = exp["long_prompt_ids"].tolist()
    e = model.cfg.num_experts
    res = Engine(model, EngineConfig("resident", max_seq_len=384, prefill_chunk=128)).generate([prompt], 40,
                                                                                               keep_logits=True)
    eng = Engine(model, EngineConfig("cached", num_slots=2 * e, max_seq_len=384, prefill="stream", prefill_chunk=128))
    got = eng.generate([prompt], 40, keep_logits=True)
    assert got.generated_ids == res.generated_ids
    assert got.generated_ids[0][:16] == exp["long_generated_ids"].tolist()
    np.testing.assert_array_equal(got.step_logits, res.step_logits)
    # decode after streaming starts from a coherent table: it really used the cache
    assert eng.expert_cache_metrics()["decode"]["misses"] > 0


def test_auto_picks_stream_only_with_room_and_enough_tokens():
    model, _ = load_fixture("qwen3_moe_fp32")
    e, k = model.cfg.num_experts, model.cfg.top_k
    eng = Engine(model, EngineConfig("cached", num_slots=2 * e))
    assert eng.planner.streams(e // k) and not eng.planner.streams(e // k - 1)
    assert not Engine(model, EngineConfig("cached", num_slots=2 * e - 1)).planner.streams(1000)
    assert not Engine(model, EngineConfig("resident")).planner.streams(1000)
    with pytest.raises(ValueError, match="2E"):
        Engine(model, EngineConfig("cached", num_slots=2 * e - 1, prefill="stream"))


def test_finished_sequence_padding_is_not_routed_in_later_chunks():
    """A batch whose short prompt ends in chunk 0: in later chunks its row is all padding, and
    padding must not be routed, counted or loaded (DESIGN.md 1.1)."""
    model, exp = load_fixture("qwen3_moe_fp32")
    base = exp["long_prompt_ids"].tolist()
    prompts = [base[:5], base[:40]]
    eng = Engine(model, EngineConfig("cached", num_slots=8, max_seq_len=64, batch=2, prefill_chunk=16))
    res = eng.generate(prompts, 2, trace_routing=True)
    first = res.routing[0]  # [L, B*T over chunks, k]; chunk buckets are 16 tokens
    chunks = first.reshape(first.shape[0], 3, 2, 16, -1)  # [L, chunk, B, T, k]
    assert (chunks[:, 1:, 0] == -1).all()  # sequence 0 has nothing after chunk 0
    distinct = sum(len(set(first[l][first[l] >= 0].tolist())) for l in range(first.shape[0]))
    routed_per_chunk = [sum(len(set(chunks[l, c][chunks[l, c] >= 0].tolist())) for l in range(first.shape[0]))
                        for c in range(3)]
    m = eng.expert_cache_metrics()["prefill"]
    assert m["hits"] + m["misses"] == sum(routed_per_chunk) >= distinct


def test_total_bytes_include_streaming_prologue():
    model, exp = load_fixture("qwen3_moe_fp32")
    eng = Engine(model, EngineConfig("cached", num_slots=16, max_seq_len=384, prefill="stream", prefill_chunk=128))
    eng.generate([exp["long_prompt_ids"].tolist()], 3)
    m = eng.expert_cache_metrics()
    assert m["bytes_h2d"] == m["prefill"]["bytes_h2d"] + m["decode"]["bytes_h2d"]


def test_engine_rejects_unknown_mode():
    model, _ = load_fixture("qwen3_moe_fp32")
    with pytest.raises(ValueError, match="unknown experts mode"):
        Engine(model, EngineConfig("cahced", num_slots=8))


def test_batch_prefill_chunks_with_different_lengths():
    model, exp = load_fixture("qwen3_moe_fp32")
    base = exp["long_prompt_ids"].tolist()
    prompts = [base[:30], base[:150], base[50:120]]
    whole = Engine(model, EngineConfig("resident", max_seq_len=384, batch=3)).generate(prompts, 8)
    chunked = Engine(model, EngineConfig("cached", num_slots=16, max_seq_len=384, batch=3, prefill="stream",
                                         prefill_chunk=32)).generate(prompts, 8)
    assert chunked.generated_ids == whole.generated_ids


@pytest.mark.parametrize("mode,prefill", [("cached", "stream"), ("cached", "on_demand"), ("resident", "auto")])
def test_grouped_kernel_sees_the_layers_experts_not_the_pool(monkeypatch, mode, prefill):
    """The grouped matmul gets E groups whatever the pool size (L*E slots here): the Mosaic GPU
    kernel unrolls a loop over its groups, so a pool-sized G made compiles take minutes."""
    from ftjax.experts import compute
    from ftjax.runtime import programs

    model, exp = load_fixture("olmoe_fp32")
    cfg = model.cfg
    groups = []
    real = compute.grouped_matmul

    def spy(lhs, rhs, group_sizes, impl=None, group_slot=None, row_dest=None):
        groups.append((rhs.shape[0], group_sizes.shape[0]))
        return real(lhs, rhs, group_sizes, impl, group_slot, row_dest)

    monkeypatch.setattr(compute, "grouped_matmul", spy)
    programs.clear()  # trace afresh, so the spy sees every call
    prompt = exp["long_prompt_ids"].tolist()
    slots = None if mode == "resident" else cfg.num_layers * cfg.num_experts
    got, _, _ = _prefill_logits(model, prompt, mode, slots, prefill=prefill)
    assert groups and set(groups) == {(cfg.num_experts, cfg.num_experts)}
    assert cfg.num_layers * cfg.num_experts > cfg.num_experts  # the pool is larger than a layer
    want, _, _ = _prefill_logits(model, prompt)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("n,k,e", [(37, 2, 5), (64, 8, 16), (9, 4, 64)])
def test_grouped_experts_unpermute_by_gather_equals_row_scatter(n, k, e):
    """experts_grouped returns the grouped matmul's rows to pair order (gathering with the inverse permutation
    off the Triton kernel, which stores them there itself); the values are those of the scatter it replaced, bit
    for bit."""
    import jax.numpy as jnp
    from ftjax.experts import compute
    rng = np.random.default_rng(n * k + e)
    d, f = 16, 8
    x = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, e, (n, k)), jnp.int32)  # repeats and empty groups
    w = jnp.asarray(rng.random((n, k)), jnp.float32)
    gu = jnp.asarray(rng.standard_normal((e, d, 2 * f)), jnp.float32)
    dn = jnp.asarray(rng.standard_normal((e, f, d)), jnp.float32)
    got = compute.experts_grouped(x, ids, w, gu, dn)

    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    h = compute.grouped_matmul(x[order // k], gu, sizes)
    y = compute.grouped_matmul(compute._swiglu(h), dn, sizes)
    y = jnp.zeros_like(y).at[order].set(y).reshape(n, k, -1)  # the former row scatter
    want = jnp.einsum("nkd,nk->nd", y, w)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    ref = np.asarray(compute.experts_gather(x, ids, w, gu, dn))  # other products, other summation order
    np.testing.assert_allclose(np.asarray(got), ref, rtol=0, atol=2e-6 * float(np.abs(ref).max()) + 1e-6)


def _sorted_groups(rng, m, g):
    """int32 [g] sizes of m rows sorted into g groups, some empty (the grouped matmul's operand)."""
    import jax.numpy as jnp
    ids = np.sort(rng.choice(g, m, p=rng.dirichlet(np.full(g, 0.3))))
    return jnp.asarray(np.bincount(ids, minlength=g), jnp.int32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("m,k,n,g,rows", [(300, 64, 96, 8, 64), (1000, 128, 64, 16, 192), (520, 32, 128, 5, 256),
                                          (4096, 256, 128, 32, 512)])
def test_ragged_dot_tiled_is_bit_identical(dtype, m, k, n, g, rows):
    """ragged_dot's dense expansion run on tiles of rows (a multiple of 64; the last tile padded,
    groups cut by the tile edges, empty groups) equals the whole ragged_dot bit for bit on the CPU."""
    import jax.numpy as jnp
    from ftjax.kernels import grouped_matmul as gm
    rng = np.random.default_rng(m + g)
    lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
    rhs = jnp.asarray(rng.standard_normal((g, k, n)) / k ** 0.5, dtype)
    sizes = _sorted_groups(rng, m, g)
    want = jax.jit(jax.lax.ragged_dot)(lhs, rhs, sizes)
    got = jax.jit(gm.ragged_dot_tiled, static_argnames="rows")(lhs, rhs, sizes, rows=rows)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))


def test_tile_rows():
    from ftjax.kernels import grouped_matmul as gm
    assert gm.tile_rows(1000, 16, 128, 4, max_bytes=1000 * 16 * 128 * 4) is None  # fits: no tiles
    assert gm.tile_rows(1000, 16, 128, 4, max_bytes=1 << 20) == 128  # 1 MiB / 8 KiB a row, a multiple of 64
    assert gm.tile_rows(1000, 16, 128, 4, max_bytes=1) == gm.TILE_ROW_MULTIPLE  # at least one multiple
    # qwen3.5-35b-a3b, one 8192-token prefill layer in float32 (top-8): gate_up and down
    assert gm.tile_rows(65536, 256, 2048, 4) == gm.XLA_EXPAND_BYTES // (256 * 2048 * 4)
    assert gm.tile_rows(65536, 256, 512, 4) == gm.XLA_EXPAND_BYTES // (256 * 512 * 4)


def test_grouped_matmul_workspace_does_not_grow_with_groups_times_rows(monkeypatch):
    """Pins the memory of the XLA grouped matmul (the CPU, and float32 on a GPU): the compiled
    workspace of an expert layer is one tile's expansion plus terms linear in the rows, not the
    [G, M, K] expansion of the whole ragged_dot (qwen3.5-35b-a3b, 8192 tokens, float32: 137 GB, the
    H200's RESOURCE_EXHAUSTED). M and 4M rows: the workspace grows at most ~linearly in M."""
    import jax.numpy as jnp
    from ftjax.experts import compute
    from ftjax.kernels import grouped_matmul as gm
    g, d, f, k = 64, 256, 128, 8
    budget = 1 << 20
    monkeypatch.setattr(gm, "XLA_EXPAND_BYTES", budget)

    def temp(n):
        sds = jax.ShapeDtypeStruct
        args = (sds((n, d), jnp.float32), sds((n, k), jnp.int32), sds((n, k), jnp.float32),
                sds((g, d, 2 * f), jnp.float32), sds((g, f, d), jnp.float32))
        exe = jax.jit(functools.partial(compute.experts_grouped, fmt="dense")).lower(*args).compile()
        return exe.memory_analysis().temp_size_in_bytes

    n = 1024
    whole = n * k * g * d * 4  # the untiled gate_up expansion alone: 512 MiB
    small, large = temp(n), temp(4 * n)
    linear = n * k * (d + 2 * f) * 4  # one [M, D] + [M, 2F] float32 per pair row: 16 MiB
    assert small < 4 * budget + 4 * linear < whole / 4, (small, whole)
    assert large <= 4.5 * small, (small, large)


def test_mgpu_tiles_by_operand_shape():
    """The Mosaic GPU grouped matmul's tiles by operand shape: the measured 64x256 tiles for a short K (the down
    projection, K = F) where N is a multiple of 256; 128x128 for the gate-up matmul (K = D), walked 4 column blocks
    at a time where 512 divides N; plain 128x128 elsewhere."""
    from ftjax.kernels import grouped_matmul as gm
    wide = {"block_m": 64, "block_n": 256, "block_k": 64, "max_concurrent_steps": 4, "grid_block_n": 1}
    default = {**wide, "block_m": 128, "block_n": 128}
    assert gm.mgpu_tiles(512, 2048) == wide and gm.mgpu_tiles(768, 2048) == wide  # qwen3.5 / qwen3 down
    snake = {**default, "grid_block_n": 4}
    assert gm.mgpu_tiles(2048, 1024) == snake and gm.mgpu_tiles(2048, 1536) == snake  # their gate-up
    assert gm.mgpu_tiles(768, 1152) == default  # 1152 = 9 x 128: not a multiple of 256
    assert gm.mgpu_tiles(2048, 1152) == default  # nor of 4 x 128
