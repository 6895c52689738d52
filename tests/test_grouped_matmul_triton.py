"""The Pallas Triton grouped matmul (``ftjax.kernels.grouped_matmul_triton``): its tile schedule, the kernel in
interpret mode against ``jax.lax.ragged_dot``, its wiring into ``grouped_matmul`` through the kernel config, its
refusals, and its lowering for CUDA at qwen3.5-35b-a3b's expert shapes (on this machine, no GPU needed).

Tolerances: the kernel sums each row over K in float32 in block_k steps, the reference in one dot: float32
agrees to ~1e-6 of the output's scale; bf16 outputs to one or two ulps (values of magnitude ~10: ulp 1/16).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ftjax.kernels import grouped_matmul as gm
from ftjax.kernels import grouped_matmul_triton as gt
from ftjax.kernels import registry
from ftjax.kernels.registry import KernelConfig, using

#: Uneven groups: empty ones (first, middle, last), one smaller than any block_m, one of many tiles.
SIZES = (0, 5, 70, 1, 0, 33, 0)


_schedule = jax.jit(gt.tile_schedule, static_argnums=(1, 2))  # one compile per shape, not one per op and shape


def _covered(sizes, m, block_m):
    """Checks the schedule's invariants; returns the group of each of the m rows (len(sizes): past the sum)."""
    group, row, rows = (np.asarray(a) for a in _schedule(jnp.asarray(sizes, jnp.int32), m, block_m))
    g = len(sizes)
    assert group.shape == row.shape == rows.shape == (-(-m // block_m) + min(g, m),) and group.dtype == np.int32
    ends = np.minimum(np.cumsum(sizes), m)
    want = np.full(m, g)
    for i, (lo, hi) in enumerate(zip(np.concatenate([[0], ends[:-1]]), ends)):
        want[lo:hi] = i
    seen = np.zeros(m, int)
    used = rows > 0
    assert np.all(rows[~used] == 0) and np.all(used[:used.sum()])  # the unused tiles trail
    for gi, r0, n in zip(group[used], row[used], rows[used]):
        assert 0 < n <= block_m and np.all(want[r0:r0 + n] == gi)  # inside one group (or the tail past the sum)
        seen[r0:r0 + n] += 1
    assert np.all(seen == 1)  # every row exactly once
    assert set(group[used].tolist()) == set(want.tolist())  # the groups with rows (and G for rows past the sum)
    for gi in range(g + 1):  # ceil(rows / block_m) tiles per group (rows cut at M), the first at its first row
        starts, mine = row[used][group[used] == gi], np.flatnonzero(want == gi)
        assert len(starts) == -(-len(mine) // block_m) and (not len(mine) or starts.min() == mine[0])
    return want


@pytest.mark.parametrize("block_m", [16, 64])
def test_schedule_covers_every_row_once_with_tiles_inside_one_group(block_m):
    _covered(SIZES, sum(SIZES), block_m)
    _covered((0, 0, 40, 0), 40, block_m)  # all rows in one group
    _covered((1,) * 20, 20, block_m)  # groups of one row: the most partial tiles (the + min(G, M) in T)
    _covered((0, 0, 0), 0 + 1, block_m)  # no group has rows: one row past the sum
    _covered((0,) * 30 + (1, 0, 2) + (0,) * 40, 3, block_m)  # G far above the rows: T = cdiv(m) + m
    _covered((1,) * 4 + (0,) * 20, 5, block_m)  # 4 groups of one row and 1 past the sum: 5 of the 6 tiles used
    rng, m, sums = np.random.default_rng(0), 4 * block_m, set()
    for i in range(9):  # one shape (9 groups, m rows): sums below m (rows past the sum), at m and above (cut)
        sizes = tuple(int(v) for v in rng.integers(0, block_m, 9) * rng.integers(0, 2, 9))
        sizes = sizes[:-1] + (max(0, m - sum(sizes[:-1]) + (-5, 0, 5)[i % 3]),)
        sums.add(int(np.sign(sum(sizes) - m)))
        _covered(sizes, m, block_m)
    assert sums == {-1, 0, 1}


def _operands(dtype, sizes=SIZES, k=128, n=256, m=None, seed=0):
    rng = np.random.default_rng(seed)
    m = sum(sizes) if m is None else m
    lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
    rhs = jnp.asarray(rng.standard_normal((len(sizes), k, n)) / 4, dtype)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32)


def _close(got, ref, dtype):
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    scale = float(np.max(np.abs(ref)))
    assert scale > 1.0  # a real signal
    if dtype == jnp.float32:
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * scale)
    else:
        np.testing.assert_allclose(got, ref, rtol=2 ** -7, atol=2 * 2 ** -8 * scale)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("tiles", [dict(block_m=16, block_n=128, block_k=64), dict(block_m=64, block_n=64, block_k=32)])
def test_kernel_matches_ragged_dot(dtype, tiles):
    lhs, rhs, sizes = _operands(dtype)
    got = gt.grouped_matmul_triton(lhs, rhs, sizes, interpret=True, **tiles)
    assert got.shape == (lhs.shape[0], rhs.shape[2]) and got.dtype == dtype
    _close(got, jax.lax.ragged_dot(lhs, rhs, sizes), dtype)


def test_output_does_not_depend_on_the_order_programs_run_in():
    """Interpret mode runs the tiles in order, so a tile's block spilling into the next group's rows (a missing
    row mask) would be overwritten by the right values; on a GPU the programs run in any order. Run the schedule
    backwards (the spilling tiles last), and shuffled: the same output."""
    lhs, rhs, sizes = _operands(jnp.float32, m=sum(SIZES) + 9)  # and rows past the sum
    tiles = dict(block_m=16, block_n=128, block_k=64, num_warps=None, num_stages=None)
    sched = gt.tile_schedule(sizes, lhs.shape[0], 16)
    ref = np.asarray(jax.lax.ragged_dot(lhs, rhs, sizes))
    perm = np.random.default_rng(0).permutation(sched[0].shape[0])
    for order in (slice(None, None, -1), perm):
        got = gt._scheduled(tuple(a[order] for a in sched), lhs, rhs, interpret=True, **tiles)
        _close(got, ref, jnp.float32)


def test_program_order_covers_every_tile_once():
    """group_m (the grouped program order) hands each program of the 1-D grid one (row tile, column block), every
    pair exactly once, bands of group_m row tiles column-major (the last band narrower); the output is the same
    bits as the two-axis grid's, for the matmul and the fused gate-up alike."""
    for num_tiles, num_cols, group_m in ((7, 3, 2), (8, 4, 4), (5, 2, 8), (6, 1, 1)):
        pids = jnp.arange(num_tiles * num_cols)
        t, j = jax.vmap(lambda p: _program_tile_at(p, num_tiles, num_cols, group_m))(pids)
        pairs = sorted(zip(np.asarray(t).tolist(), np.asarray(j).tolist()))
        assert pairs == [(a, b) for a in range(num_tiles) for b in range(num_cols)]
        if group_m < num_tiles:  # the first band walks its group_m row tiles before the next column
            assert np.asarray(t)[:group_m].tolist() == list(range(group_m)) and np.asarray(j)[:group_m].max() == 0
    lhs, rhs, sizes = _operands(jnp.float32, m=sum(SIZES) + 9)
    tiles = dict(block_m=16, block_n=64, block_k=64, num_warps=None, num_stages=None)
    ref = np.asarray(gt.grouped_matmul_triton(lhs, rhs, sizes, interpret=True, group_m=None, **tiles))
    for group_m in (1, 3, 2 ** 31):  # a band wider than the grid is the grid (no int32 overflow)
        got = gt.grouped_matmul_triton(lhs, rhs, sizes, interpret=True, group_m=group_m, **tiles)
        np.testing.assert_array_equal(np.asarray(got), ref)


def _program_tile_at(pid, num_tiles, num_cols, group_m):
    """:func:`gt.program_tile` at program id ``pid`` (program_id patched to it, outside a kernel)."""
    from unittest import mock
    with mock.patch.object(gt.pl, "program_id", lambda axis: pid):
        return gt.program_tile(num_tiles, num_cols, group_m)


def test_rows_past_the_sum_are_zeros_and_groups_are_cut_at_m():
    """As ragged_dot: rows past sum(group_sizes) come out as zeros, and group rows past M are dropped."""
    lhs, rhs, sizes = _operands(jnp.float32, m=sum(SIZES) + 20)
    got = gt.grouped_matmul_triton(lhs, rhs, sizes, interpret=True, block_m=16)
    np.testing.assert_array_equal(np.asarray(got[sum(SIZES):]), 0)
    _close(got, jax.lax.ragged_dot(lhs, rhs, sizes), jnp.float32)
    lhs, rhs, sizes = _operands(jnp.float32, m=sum(SIZES) - 30)
    _close(gt.grouped_matmul_triton(lhs, rhs, sizes, interpret=True, block_m=16),
           jax.lax.ragged_dot(lhs, rhs, sizes), jnp.float32)


def test_row_dest_stores_each_row_where_asked():
    """With ``row_dest`` (a permutation) the kernel's rows come out at their destinations, bit for bit the rows it
    stores without one: rows of partial tiles (dead rows go to the trash row) and rows past the sum (zeros) too."""
    lhs, rhs, sizes = _operands(jnp.float32, m=sum(SIZES) + 20)
    perm = jnp.asarray(np.random.default_rng(7).permutation(lhs.shape[0]), jnp.int32)
    plain = gt.grouped_matmul_triton(lhs, rhs, sizes, interpret=True, block_m=16)
    got = gt.grouped_matmul_triton(lhs, rhs, sizes, interpret=True, block_m=16, row_dest=perm)
    assert got.shape == plain.shape
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.zeros_like(plain).at[perm].set(plain)))
    with pytest.raises(ValueError, match="row_dest expected shape"):
        gt.grouped_matmul_triton(lhs, rhs, sizes, interpret=True, row_dest=perm[:-1])


def test_grouped_matmul_runs_the_kernel_where_named():
    lhs, rhs, sizes = _operands(jnp.float32)
    ref = jax.lax.ragged_dot(lhs, rhs, sizes)
    traced = lambda: jax.jit(lambda *a: gm.grouped_matmul(*a))(lhs, rhs, sizes)  # noqa: E731 - a new trace each time
    with using(KernelConfig(use=("grouped_matmul_triton",), tiles={"grouped_matmul_triton": (16, 128, 64)})), \
            registry.recording() as ran:
        got = traced()  # interpreted on the CPU
    assert ran == {"grouped_matmul_triton"}
    _close(got, ref, jnp.float32)
    for cfg in (KernelConfig(), KernelConfig(use="xla")):  # default (auto: a GPU only) and xla: ragged_dot
        with using(cfg), registry.recording() as ran:
            np.testing.assert_array_equal(np.asarray(traced()), np.asarray(ref))
        assert ran == set()
    with using(KernelConfig(use=("grouped_matmul_triton",))), registry.recording() as ran:
        gm.grouped_matmul(lhs, rhs, sizes, impl="xla")  # an explicit impl is taken as asked
        gm.grouped_matmul(lhs[:, :96], rhs[:, :96], sizes)  # K = 96 is no multiple of block_k = 64: ragged_dot
    with using(KernelConfig(use=("grouped_matmul_triton",), grouped_matmul="xla")), registry.recording() as ran2:
        traced()  # --grouped_matmul=xla chosen explicitly: ragged_dot, not the named kernel
    assert ran == set() and ran2 == set()


def test_auto_picks_the_kernel_on_a_gpu_for_256_groups_or_more(monkeypatch):
    """Under the default config on a GPU (the backend stubbed: only the trace is taken) the kernel runs for
    qwen3.5-35b-a3b's 256 experts, where it was measured faster, and the Mosaic kernel keeps qwen3's 128."""
    from ftjax.kernels import grouped_matmul_triton as mod
    monkeypatch.setattr(registry.jax, "default_backend", lambda: "gpu")
    sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    for groups, picked in ((256, {"grouped_matmul_triton"}), (128, set())):
        with using(KernelConfig()), registry.recording() as ran:
            jax.make_jaxpr(lambda a, b, s: gm.grouped_matmul(a, b, s))(
                sd((4096, 2048), bf), sd((groups, 2048, 1024), bf), sd((groups,), jnp.int32))
        assert ran == picked, groups
    assert mod.auto_picks(256) and not mod.auto_picks(255)


def test_prefill_expert_ffn_with_the_kernel_matches_ragged_dot():
    """The call site (``compute.experts_grouped``: both matmuls, 64 tokens x top-4 over 16 experts) with the kernel
    named (interpreted here) matches the default (ragged_dot on the CPU)."""
    from ftjax.experts import compute
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((64, 256)), jnp.float32)  # N of both matmuls a multiple of block_n = 256
    ids = jnp.asarray(rng.integers(0, 12, (64, 4)), jnp.int32)  # experts 12-15 get no rows
    w = jnp.asarray(rng.random((64, 4)), jnp.float32)
    gu = jnp.asarray(rng.standard_normal((16, 256, 256)) / 16, jnp.float32)
    dn = jnp.asarray(rng.standard_normal((16, 128, 256)) / 11, jnp.float32)
    ref = compute.experts_grouped(x, ids, w, gu, dn)
    with using(KernelConfig(use=("grouped_matmul_triton",))), registry.recording() as ran:
        got = compute.experts_grouped(x, ids, w, gu, dn)
    assert ran == {"grouped_matmul_triton"}
    _close(got, ref, jnp.float32)
    # the down matmul storing its rows in pair order itself: the same values as the gather after it, bit for bit
    with using(KernelConfig(use=("grouped_matmul_triton", "grouped_matmul_scatter"))), registry.recording() as ran:
        scattered = compute.experts_grouped(x, ids, w, gu, dn)
    assert ran == {"grouped_matmul_triton", "grouped_matmul_scatter"}
    np.testing.assert_array_equal(np.asarray(scattered), np.asarray(got))


def test_default_tiles_by_contraction(monkeypatch):
    """The down projection (K <= 1024) runs 128-row tiles, the gate-up matmul 64-row ones (the H100 timings of
    ``default_tiles``); a --kernel_tiles override replaces both. Only the kernel's arguments are checked."""
    seen = []
    monkeypatch.setattr(gt, "grouped_matmul_triton", lambda *a, **kw: seen.append(kw["block_m"]))
    sizes = jnp.asarray([4, 4], jnp.int32)
    x = lambda k: jnp.zeros((8, k), jnp.bfloat16)  # noqa: E731
    w = lambda k, n: jnp.zeros((2, k, n), jnp.bfloat16)  # noqa: E731
    with using(KernelConfig(use=("grouped_matmul_triton",))):
        gm.grouped_matmul(x(512), w(512, 2048), sizes)  # qwen3.5's down
        gm.grouped_matmul(x(768), w(768, 2048), sizes)  # qwen3's down
        gm.grouped_matmul(x(2048), w(2048, 1024), sizes)  # the gate-up
    with using(KernelConfig(use=("grouped_matmul_triton",), tiles={"grouped_matmul_triton": (32, 256, 64)})):
        gm.grouped_matmul(x(512), w(512, 2048), sizes)
    assert seen == [128, 128, 64, 32]


def test_tiles_parser_and_shape_errors_are_refused():
    parse = registry.get("grouped_matmul_triton").tiles
    assert parse((64, 128, 64)) == {**gt.TILES, "block_m": 64, "block_n": 128, "block_k": 64}
    assert parse((128, 64, 64, 8, 3)) == {"block_m": 128, "block_n": 64, "block_k": 64, "num_warps": 8,
                                          "num_stages": 3, "group_m": gt.GROUP_M}
    assert parse((128, 64, 64, 8, 3, 4))["group_m"] == 4 and parse((128, 64, 64, 8, 3, 0))["group_m"] is None
    for bad in ((64, 128), (64, 128, 64, 4, 3, 1, 1), (48, 128, 64), (64, 128, 8), (64, 128, 64, 3),
                (64, 128, 64, 4, 0), (64, 128, 64, 4, 3, -1)):
        with pytest.raises(ValueError, match="grouped_matmul_triton"):
            parse(bad)
    with pytest.raises(ValueError, match="KernelConfig.tiles: .*grouped_matmul_triton"):
        KernelConfig(tiles={"grouped_matmul_triton": (64, 100, 64)})
    lhs, rhs, sizes = _operands(jnp.float32)
    call = lambda *a, **kw: gt.grouped_matmul_triton(*a, interpret=True, **kw)  # noqa: E731
    for args, kw, match in (((lhs[:, :64], rhs, sizes), {}, r"rhs expected shape \[G, 64, N\]"),
                            ((lhs[0], rhs, sizes), {}, r"lhs expected shape \[M, K\], got \(128,\)"),
                            ((lhs, rhs, sizes[:3]), {}, r"group_sizes expected .*\(7,\), got int32 \(3,\)"),
                            ((lhs, rhs, sizes.astype(jnp.float32)), {}, "group_sizes expected an integer"),
                            ((lhs, rhs.astype(jnp.bfloat16), sizes), {}, "one float dtype, got float32 and bfloat16"),
                            ((lhs, rhs, sizes), {"block_n": 512}, "N % block_n == 0, got K=128, N=256"),
                            ((lhs, rhs, sizes), {"block_m": 24}, "powers of two >= 16, got 24")):
        with pytest.raises(ValueError, match=match):
            call(*args, **kw)
    assert not gt.supported(lhs, rhs.astype(jnp.bfloat16)) and not gt.supported(lhs, rhs, block_n=512)
    assert gt.supported(lhs, rhs)  # float32 off the GPU: interpret mode


def test_lowers_for_cuda_at_qwen35_expert_shapes():
    """qwen3.5-35b-a3b's prefill expert matmuls (8192 tokens x top-8 = 65536 rows, 256 experts, hidden 2048,
    expert FFN 512; bf16): gate-up (K = 2048, N = 1024) and down (K = 512, N = 2048) each lower to one Triton
    custom call with the asked warps and stages (the GPU compile itself is not run here)."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh
    dev = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=dev)
    sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    for k, n, tiles, dest in ((2048, 1024, {}, None),
                              (512, 2048, {"block_m": 128, "num_warps": 8, "num_stages": 3}, None),
                              (512, 2048, {"block_m": 128}, sd((65536,), jnp.int32))):  # rows stored in pair order
        fn = lambda a, b, s, *d, t=tiles: gt.grouped_matmul_triton(a, b, s, row_dest=d[0] if d else None, **t)  # noqa
        with use_abstract_mesh(mesh), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the Triton backend's deprecation warning
            txt = jax.jit(fn).trace(sd((65536, k), bf), sd((256, k, n), bf), sd((256,), jnp.int32),
                                    *([dest] if dest else [])).lower(lowering_platforms=("cuda",)).as_text()
        assert txt.count("__gpu$xla.gpu.triton") == 1
        bm = tiles.get("block_m", gt.BLOCK_M)
        assert f"grid_x = {65536 // bm + 256} : i32, grid_y = {n // gt.BLOCK_N} : i32" in txt
        assert f"num_warps = {tiles.get('num_warps', gt.NUM_WARPS)} : i32" in txt
        if "num_stages" in tiles:
            assert "num_stages = 3 : i32" in txt


def test_slot_table_reads_the_pool_in_place():
    """group_slot: group g's weights at pool row group_slot[g], for the matmul and the fused gate-up kernel alike:
    the same as ragged_dot / SwiGLU over the gathered pool rows."""
    from ftjax.experts.compute import _swiglu
    lhs, _, sizes = _operands(jnp.float32)
    rng = np.random.default_rng(5)
    pool = jnp.asarray(rng.standard_normal((20, 128, 256)) / 4, jnp.float32)
    slot = jnp.asarray(rng.permutation(20)[:len(SIZES)], jnp.int32)
    got = gt.grouped_matmul_triton(lhs, pool, sizes, group_slot=slot, interpret=True, block_m=16)
    _close(got, jax.lax.ragged_dot(lhs, pool[slot], sizes), jnp.float32)
    tok = jnp.asarray(rng.integers(0, 30, sum(SIZES)), jnp.int32)
    x = lhs[:30]
    fused = gt.grouped_swiglu_triton(x, tok, pool, sizes, group_slot=slot, interpret=True, block_m=16, block_n=64)
    _close(fused, _swiglu(jax.lax.ragged_dot(x[tok], pool[slot], sizes)), jnp.float32)
    with pytest.raises(ValueError, match=r"group_sizes expected an integer array of shape \(3,\)"):
        gt.grouped_matmul_triton(lhs, pool, sizes, group_slot=slot[:3], interpret=True, block_m=16)
    with pytest.raises(ValueError, match="group_slot needs grouped_matmul_triton"):
        gm.grouped_matmul(lhs, pool, sizes, group_slot=slot)  # the default config: no Triton kernel on the CPU


def test_pool_grouping_where_named_or_auto_at_256_experts(monkeypatch):
    """``grouped_matmul.pool_grouping``: with ``grouped_matmul_pool`` named, a layer's grouped FFN reads its E
    experts in the pool through the slot table (no gather) and matches the gathered path; under ``auto`` on a GPU
    (the backend stubbed: only the decision is taken) for 256 experts a layer, not 128; never for mismatched
    dtypes nor with the Mosaic grouped matmul asked for."""
    from ftjax.experts import compute
    rng = np.random.default_rng(2)
    s, e, d, f = 24, 8, 128, 64
    x = jnp.asarray(rng.standard_normal((40, d)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, e, (40, 4)), jnp.int32)
    w = jnp.asarray(rng.random((40, 4)), jnp.float32)
    gu = jnp.asarray(rng.standard_normal((s, d, 2 * f)) / 11, jnp.float32)
    dn = jnp.asarray(rng.standard_normal((s, f, d)) / 8, jnp.float32)
    slot_of_expert = jnp.asarray(rng.permutation(s)[:e], jnp.int32).at[3].set(-1)  # expert 3 without a slot
    ref = compute.experts_from_pool(x, ids, w, slot_of_expert, gu, dn)  # the default on the CPU: gather, ragged_dot
    calls = []
    real = compute.experts_grouped
    monkeypatch.setattr(compute, "experts_grouped",
                        lambda *a, **kw: calls.append((a[3].shape[0], kw.get("group_slot") is not None))
                        or real(*a, **kw))
    named = KernelConfig(use=("grouped_matmul_triton", "grouped_matmul_pool"),
                         tiles={"grouped_matmul_triton": (16, 128, 64)})
    with using(named), registry.recording() as ran:
        got = compute.experts_from_pool(x, ids, w, slot_of_expert, gu, dn)
    assert ran == {"grouped_matmul_triton", "grouped_matmul_pool"} and calls == [(s, True)]  # the pool, in place
    _close(got, ref, jnp.float32)
    with using(named):  # F = 48 is no multiple of block_k 64: the Triton kernel does not take it, so the gather
        compute.experts_from_pool(x, ids, w, slot_of_expert, gu[:, :, :96], dn[:, :48])
    assert calls[-1] == (e, False)
    with using(KernelConfig(use=("grouped_matmul_triton",), tiles={"grouped_matmul_triton": (16, 128, 64)})):
        compute.experts_from_pool(x, ids, w, slot_of_expert, gu, dn)  # the matmul kernel alone: still the gather
    assert calls[-1] == (e, False)
    with pytest.raises(ValueError, match="group_slot reads dense pool rows in place, got format 'int8'"):
        compute.experts_grouped(x, ids, w, gu, dn, fmt="int8", group_slot=slot_of_expert)

    monkeypatch.setattr(registry.jax, "default_backend", lambda: "gpu")
    sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    xs = sd((4096, 2048), bf)
    pool = lambda slots, dtype=bf: (sd((slots, 2048, 1024), dtype), sd((slots, 512, 2048), dtype))  # noqa: E731
    with using(KernelConfig()):  # auto: where the Triton matmul is auto too (256 experts a layer, not qwen3's 128)
        assert gm.pool_grouping(xs, *pool(10240), 256) and not gm.pool_grouping(xs, *pool(6144), 128)
    with using(KernelConfig(use=("grouped_matmul_triton",))):
        assert not gm.pool_grouping(xs, *pool(10240), 256)  # a named list without it
    with using(KernelConfig(use=("grouped_matmul_triton", "grouped_matmul_pool"))):
        assert gm.pool_grouping(xs, *pool(6144), 128)  # named: any expert count the kernel takes
        assert not gm.pool_grouping(xs, *pool(10240, jnp.float32), 256)
    with using(KernelConfig(grouped_matmul="mgpu")):
        assert not gm.pool_grouping(xs, *pool(10240), 256)


def test_engine_with_the_kernel_cached_equals_resident():
    """A 48-token prompt through the engine with the pool kernel named (interpreted): the prefill reads its experts
    in place from the resident bank (24 slots), a cached and an on-demand pool of E + 3 slots and the scan's
    streamed buffers; the logits are bit-identical across them and within float32 rounding of the default path
    (gather + ragged_dot)."""
    from conftest import load_fixture
    from ftjax import Engine
    from ftjax.config import EngineConfig
    model, exp = load_fixture("olmoe_fp32")
    prompt = exp["long_prompt_ids"].tolist()[:48]  # 96 (token, expert) pairs: the grouped path (above 64)
    named = KernelConfig(use=("grouped_matmul_triton", "grouped_matmul_pool"),
                         tiles={"grouped_matmul_triton": (16, 32, 32)})

    def logits(mode, slots, kernels):
        eng = Engine(model, EngineConfig(mode, num_slots=slots, max_seq_len=64, kernels=kernels))
        out = eng.generate([prompt], 2, keep_logits=True)
        return np.asarray(out.step_logits), eng.programs.kernels_applied()

    want, _ = logits("resident", None, KernelConfig())
    resident, ran = logits("resident", None, named)
    assert {"grouped_matmul_triton", "grouped_matmul_pool"} <= ran
    _close(resident, want, jnp.float32)
    e = model.cfg.num_experts
    for mode, slots, extra in (("cached", e + 3, {}), ("on_demand", e + 3, {}),
                               ("cached", 2 * e + 2, {"prefill": "stream", "prefill_driver": "scan"})):
        eng = Engine(model, EngineConfig(mode, num_slots=slots, max_seq_len=64, kernels=named, **extra))
        got = np.asarray(eng.generate([prompt], 2, keep_logits=True).step_logits)
        assert {"grouped_matmul_triton", "grouped_matmul_pool"} <= eng.programs.kernels_applied(), (mode, extra)
        np.testing.assert_array_equal(got, resident, err_msg=f"{mode} {slots} {extra}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_gate_up_swiglu_matches_the_three_steps(dtype):
    """``grouped_swiglu_triton`` (interpreted): the token gather, the gate-up matmul and SwiGLU in one kernel match
    ``swiglu(ragged_dot(x[tok], gate_up, sizes))``; rows past the sum come out as zeros. Against the same matmul
    kernel followed by XLA's SwiGLU, bf16 results differ by at most 3 ulp (silu rounded once, not inside the
    sigmoid)."""
    from ftjax.experts.compute import _swiglu
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((30, 128)), dtype)
    m = sum(SIZES) + 6  # 6 rows past the sum
    tok = jnp.asarray(rng.integers(0, 30, m), jnp.int32)
    gu = jnp.asarray(rng.standard_normal((len(SIZES), 128, 256)) / 8, dtype)
    sizes = jnp.asarray(SIZES, jnp.int32)
    want = _swiglu(jax.lax.ragged_dot(x[tok], gu, sizes))
    got = gt.grouped_swiglu_triton(x, tok, gu, sizes, interpret=True, block_m=16, block_n=64)
    assert got.shape == (m, 128) and got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got[sum(SIZES):], np.float32), 0)
    _close(got, want, dtype)
    banded = gt.grouped_swiglu_triton(x, tok, gu, sizes, interpret=True, block_m=16, block_n=64, group_m=2)
    np.testing.assert_array_equal(np.asarray(banded, np.float32), np.asarray(got, np.float32))  # program order
    if dtype == jnp.bfloat16:
        chain = np.asarray(_swiglu(gt.grouped_matmul_triton(x[tok], gu, sizes, interpret=True, block_m=16)), np.float32)
        ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(chain), 2.0 ** -100))) - 7)  # bf16: 8 significant bits
        assert np.max(np.abs(np.asarray(got, np.float32) - chain) / ulp) <= 3
    with pytest.raises(ValueError, match=r"gate_up expected shape \[G, D, 2F\] with F % block_n == 0"):
        gt.grouped_swiglu_triton(x, tok, gu[:, :, :192], sizes, interpret=True, block_n=64)
    with pytest.raises(ValueError, match="row_token expected an integer array"):
        gt.grouped_swiglu_triton(x, tok.astype(jnp.float32), gu, sizes, interpret=True, block_n=64)


def test_expert_ffn_runs_the_fused_kernel_where_named_or_auto_at_256_experts(monkeypatch):
    """``compute.experts_grouped`` takes the fused gate-up kernel where the config names it (and matches the
    default path); under the default config on a GPU (the backend stubbed: only the trace is taken) with the
    matmul kernel, for 256 experts a layer (qwen3.5), not for qwen3's 128."""
    from ftjax.experts import compute
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((48, 128)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 8, (48, 4)), jnp.int32)
    w = jnp.asarray(rng.random((48, 4)), jnp.float32)
    gu = jnp.asarray(rng.standard_normal((8, 128, 256)) / 11, jnp.float32)
    dn = jnp.asarray(rng.standard_normal((8, 128, 128)) / 11, jnp.float32)
    ref = compute.experts_grouped(x, ids, w, gu, dn)
    tiles = {"grouped_swiglu_triton": (16, 64, 64)}
    with using(KernelConfig(use=("grouped_swiglu_triton",), tiles=tiles)), registry.recording() as ran:
        got = compute.experts_grouped(x, ids, w, gu, dn)
    assert ran == {"grouped_swiglu_triton"}
    _close(got, ref, jnp.float32)
    monkeypatch.setattr(registry.jax, "default_backend", lambda: "gpu")
    sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    for groups, picked in ((256, {"grouped_matmul_triton", "grouped_swiglu_triton"}), (128, set())):
        with using(KernelConfig()), registry.recording() as ran:
            jax.make_jaxpr(compute.experts_grouped)(sd((1024, 2048), bf), sd((1024, 8), jnp.int32),
                                                    sd((1024, 8), bf), sd((groups, 2048, 1024), bf),
                                                    sd((groups, 512, 2048), bf))
        assert ran == picked, groups


def test_fused_kernel_lowers_for_cuda_at_qwen35_shapes():
    """qwen3.5-35b-a3b's gate-up (8192 tokens x top-8 rows, 256 experts, D 2048, F 512, bf16) with the gather and
    SwiGLU fused lowers to one Triton custom call over F / block_n column blocks."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh
    dev = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=dev)
    sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    with use_abstract_mesh(mesh), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the Triton backend's deprecation warning
        txt = jax.jit(lambda *a: gt.grouped_swiglu_triton(*a)).trace(
            sd((8192, 2048), bf), sd((65536,), jnp.int32), sd((256, 2048, 1024), bf), sd((256,), jnp.int32)).lower(
            lowering_platforms=("cuda",)).as_text()
    assert txt.count("__gpu$xla.gpu.triton") == 1
    assert f"grid_x = {65536 // gt.BLOCK_M + 256} : i32, grid_y = {512 // gt.BLOCK_N} : i32" in txt
