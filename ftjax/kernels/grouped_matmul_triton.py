"""Grouped (ragged) matmul as a Pallas Triton kernel driven by a precomputed tile schedule.

``out[r] = lhs[r] @ rhs[g(r)]`` for rows of lhs sorted contiguously by group, as ``jax.lax.ragged_dot``.
The Mosaic GPU kernel ``grouped_matmul`` uses (``ragged_dot_mgpu``) finds each output tile's group with
a loop unrolled over all G groups in every program: measured on an H200, the same rows in 256 groups
took 1.57 ms vs 1.00 ms in 64 groups, and the G = 256 hybrid model compiles slowly. Here the group
lookup happens once, outside the kernel, in a few jnp ops (:func:`tile_schedule`): a work list of T =
cdiv(M, block_m) + min(G, M) row tiles, each inside one group, so a program reads three scalars and never
loops over groups.

The idea is the grouped GEMM with a per-tile work list: MegaBlocks' block-sparse expert matmul and the
Triton tutorial's grouped GEMM both hand every program a precomputed (problem, tile) entry instead of
letting it search for its work. Here the entries are row tiles cut at each group's own first row (not
aligned to block_m), so no tile straddles two groups and the kernel needs only a row mask; the price
is at most one partial tile per group with rows, hence the + min(G, M) in T.

With a slot table (``group_slot``, int32 [G]), group g's weights are read at row ``group_slot[g]`` of an rhs of
any number of rows: the expert FFN then reads a layer's experts where they sit in the pool, without gathering
them into a [E, K, N] temporary first (kernel name ``grouped_matmul_pool``, auto where this kernel is:
:func:`ftjax.kernels.grouped_matmul.pool_grouping`). Rows stay grouped by expert, so T does not grow with the
pool; a pool above 4 GiB makes Pallas address it with 64-bit offsets.

Generic Pallas primitives plus the Triton backend's masked ``load`` / ``store``: interpreted on the CPU
(the tests, any float dtype), lowered through Triton on a GPU (16-bit floats).

Measured on an H100 (2026-12-05, ``experiments/results/gated_delta/bench_grouped_matmul_h100_2026-12-05.json``:
8192 tokens x top-8 = 65536 rows over qwen3.5-35b-a3b's 256 experts, bf16), at the default tiles below: gate-up
(K = 2048, N = 1024) 1.37 ms against 1.98 ms for the Mosaic kernel at its default tiles and 1.49 ms at its best
of eleven; down (K = 512, N = 2048) 1.10 ms against 1.32 ms at its 64x256 tiles; the outputs bit-identical. The
down matmul has since taken 128-row tiles (:func:`default_tiles`: 0.96 ms in a later run).
``auto`` therefore picks it on a GPU for calls of at least :data:`AUTO_MIN_GROUPS` groups. Fewer groups (the
qwen3 family's 128) keep the Mosaic kernel: there its gate-up matmul ran faster (docs/HYBRID.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ftjax.kernels import common, registry

#: Rows, output columns and contraction of one program's step, Triton's warps and pipeline stages
#: (``KernelConfig.tiles``: ``grouped_matmul_triton=(block_m, block_n, block_k[, num_warps[, num_stages]])``).
#: The fastest of four configs for both of qwen3.5-35b-a3b's expert matmuls on an H100 (module docstring).
BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES = 64, 256, 64, 8, 3
#: The order programs are handed their (row tile, column block): None walks every row tile of one column block
#: before the next column block (grid (T, N / block_n)), so the lhs rows go through HBM once per column block; an
#: integer walks ``group_m`` row tiles over all column blocks before the next ``group_m`` (the Triton tutorial's
#: "grouped ordering" for L2 reuse), so programs that run together share both their rows and their weights.
GROUP_M = None
#: ``auto`` picks the kernel for rhs [G, K, N] with G at least this (module docstring).
AUTO_MIN_GROUPS = 256
TILES = {"block_m": BLOCK_M, "block_n": BLOCK_N, "block_k": BLOCK_K, "num_warps": NUM_WARPS,
         "num_stages": NUM_STAGES, "group_m": GROUP_M}
#: A contraction of at most SHORT_K (the experts' down projection, K = F) takes SHORT_K_BLOCK_M rows a tile: on
#: an H100 (2026-12-05, e9fe957,
#: ``experiments/results/gated_delta/bench_grouped_matmul_tiles-e9fe957_h100_2026-12-05.json``) the down matmul
#: ran 0.96 vs 1.15 ms (256 experts, K = 512) and 1.06 vs 1.29 ms (128 experts, K = 768) at 128
#: rows; the gate-up matmul (K = 2048) stays at 64. block_k is unchanged, so each row's sums are the same.
SHORT_K, SHORT_K_BLOCK_M = 1024, 128


def default_tiles(k: int) -> dict:
    """The default tiles of ``grouped_matmul_triton`` for rhs [G, k, N]: :data:`TILES`, with block_m
    :data:`SHORT_K_BLOCK_M` for k <= :data:`SHORT_K` (the down projection)."""
    return {**TILES, "block_m": SHORT_K_BLOCK_M} if k <= SHORT_K else dict(TILES)


def tile_schedule(group_sizes: jax.Array, m: int, block_m: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The kernel's work list for ``m`` rows in groups of ``group_sizes`` (int [G], >= 0).

    Returns (tile_group, tile_row, tile_rows), int32 [T] with T = cdiv(m, block_m) + min(G, m) (static): tile t
    covers rows [tile_row[t], tile_row[t] + tile_rows[t]) of group tile_group[t]. Each group is cut into
    ceil(size / block_m) tiles from its own first row, so no tile spans two groups; empty groups get none.
    Groups are clipped to the m rows (as ragged_dot); rows past sum(group_sizes) form the pseudo-group
    G (the kernel writes zeros there, as ragged_dot does). Tiles past the last have tile_rows = 0 (and
    tile_group = G, tile_row = 0). T is enough: over the n <= min(G + 1, m) groups with rows (the pseudo-group
    included; their sizes sum to m), sum_i ceil(s_i / b) <= ceil(m / b) + n - 1.
    """
    g = group_sizes.shape[0]
    t = pl.cdiv(m, block_m) + min(g, m)
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), m)
    ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])  # + the pseudo-group of the rows past the sum
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    sizes = ends - starts
    tiles = (sizes + block_m - 1) // block_m
    tile_end = jnp.cumsum(tiles)  # one past each group's last tile
    ids = jnp.arange(t, dtype=jnp.int32)
    grp = jnp.minimum(jnp.searchsorted(tile_end, ids, side="right"), g).astype(jnp.int32)  # empty groups skipped
    used = ids < tile_end[-1]
    local = (ids - (tile_end[grp] - tiles[grp])) * block_m  # this tile's first row within its group
    tile_rows = jnp.where(used, jnp.clip(sizes[grp] - local, 0, block_m), 0)
    tile_row = jnp.where(used, starts[grp] + local, 0)
    return jnp.where(used, grp, g), tile_row.astype(jnp.int32), tile_rows.astype(jnp.int32)


def supported(lhs: jax.Array, rhs: jax.Array, block_k: int = BLOCK_K, block_n: int = BLOCK_N) -> bool:
    """Operands the kernel takes: lhs [M, K], rhs [G, K, N] of one float dtype, 16-bit on a GPU (float32
    only interpreted: Triton would run its dot as TF32), K % block_k == 0 and N % block_n == 0 (no edge
    masks along K and N)."""
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.dtype != rhs.dtype or not jnp.issubdtype(lhs.dtype, jnp.floating):
        return False
    k, n = rhs.shape[1], rhs.shape[2]
    return lhs.shape[1] == k and common.dot_dtype_ok(lhs.dtype) and k % block_k == 0 and n % block_n == 0


def auto_picks(groups: int) -> bool:
    """Whether ``use="auto"`` picks this kernel on a GPU for a call of ``groups`` groups (G of rhs [G, K, N], or
    of a slot table): G >= :data:`AUTO_MIN_GROUPS`, the many small groups where it was measured faster than the
    Mosaic kernel (module docstring). G is the call's: under expert parallelism (``ftjax.experts.parallel``)
    each device's share of the experts."""
    return groups >= AUTO_MIN_GROUPS


def program_tile(num_tiles: int, num_cols: int, group_m: int | None) -> tuple[jax.Array, jax.Array]:
    """This program's (row tile t, column block j) of a (num_tiles, num_cols) work grid (:data:`GROUP_M`): with
    group_m None, the grid's own two axes; else from a 1-D grid of num_tiles * num_cols programs, taken in bands
    of group_m row tiles (the last band narrower), column-major inside a band. Every (t, j) comes once."""
    if group_m is None:
        return pl.program_id(0), pl.program_id(1)
    pid, band = pl.program_id(0), group_m * num_cols
    first = (pid // band) * group_m
    width = jnp.minimum(num_tiles - first, group_m)
    local = pid % band
    return first + local % width, local // width


def _kernel(group_ref, row_ref, rows_ref, *refs, groups, bm, bn, bk, k_steps, up_cols, slots, gather, scatter,
            num_tiles, num_cols, group_m):
    """One (row tile, column block) of the product, or with ``up_cols`` (F) of SwiGLU(gate, up) where gate and up
    are column blocks j and F / bn + j. refs: [slot_ref] (``slots``: group g's weights at rhs row slot[g]),
    [tok_ref] (``gather``: the tile's lhs rows gathered from the token rows ``lhs[tok[r]]``, no copy of them),
    [dest_ref] (``scatter``: output row r stored at row dest[r]; the output's last row takes the tile's dead rows),
    lhs_ref, rhs_ref, o_ref."""
    refs = list(refs)
    slot_ref = refs.pop(0) if slots else None
    tok_ref = refs.pop(0) if gather else None
    dest_ref = refs.pop(0) if scatter else None
    lhs_ref, rhs_ref, o_ref = refs
    t, j = program_tile(num_tiles, num_cols, group_m)
    g, row0, n_rows = group_ref[t], row_ref[t], rows_ref[t]
    rows, cols = pl.ds(row0, bm), pl.ds(j * bn, bn)
    # Masked to the tile's rows: the block may run into the next group's rows (or past M), which are
    # neither read into the product nor written.
    live1 = lax.broadcasted_iota(jnp.int32, (bm,), 0) < n_rows
    live = live1[:, None]
    blocks = (cols,) if up_cols is None else (cols, pl.ds(up_cols + j * bn, bn))

    def store(out):
        if dest_ref is None:
            plt.store(o_ref.at[rows, cols], out, mask=live)
        else:  # dead rows go to the trash row (the last), so the store needs no mask
            dest = plt.load(dest_ref.at[rows], mask=live1, other=o_ref.shape[0] - 1)
            o_ref[dest, cols] = out

    @pl.when((n_rows > 0) & (g < groups))
    def _():
        w = g if slot_ref is None else slot_ref[g]  # the weights' row of rhs
        if tok_ref is None:
            load = lambda ks: plt.load(lhs_ref.at[rows, ks], mask=live, other=0)  # noqa: E731
        else:  # a dead row reads token row 0 (valid) and is never stored
            tok = plt.load(tok_ref.at[rows], mask=live1, other=0)
            load = lambda ks: lhs_ref[tok, ks]  # noqa: E731

        def step(i, accs):
            ks = pl.ds(pl.multiple_of(i * bk, bk), bk)
            a = load(ks)
            return tuple(acc + jnp.dot(a, rhs_ref[w, ks, c], preferred_element_type=jnp.float32)
                         for acc, c in zip(accs, blocks))

        accs = lax.fori_loop(0, k_steps, step, tuple(jnp.zeros((bm, bn), jnp.float32) for _ in blocks))
        store(accs[0].astype(o_ref.dtype) if up_cols is None else common.silu_mul(*accs, o_ref.dtype))

    @pl.when((n_rows > 0) & (g == groups))
    def _():  # rows past sum(group_sizes): zeros, as ragged_dot
        store(jnp.zeros((bm, bn), o_ref.dtype))


def _check(lhs, rhs, group_sizes, block_m, block_n, block_k, name="grouped_matmul_triton", group_slot=None):
    """Raises ValueError naming the kernel and the operand (expected vs got) or the tile."""
    if lhs.ndim != 2:
        raise ValueError(f"{name}: lhs expected shape [M, K], got {lhs.shape}")
    k = lhs.shape[1]
    if rhs.ndim != 3 or rhs.shape[1] != k:
        raise ValueError(f"{name}: rhs expected shape [G, {k}, N] (K of lhs), got {rhs.shape}")
    g = rhs.shape[0]
    if group_slot is not None:
        if group_slot.ndim != 1 or not jnp.issubdtype(group_slot.dtype, jnp.integer):
            raise ValueError(f"{name}: group_slot expected an integer array of shape [G], got {group_slot.dtype} "
                             f"{group_slot.shape}")
        g = group_slot.shape[0]
    if group_sizes.shape != (g,) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"{name}: group_sizes expected an integer array of shape ({g},), "
                         f"got {group_sizes.dtype} {group_sizes.shape}")
    if not jnp.issubdtype(lhs.dtype, jnp.floating) or rhs.dtype != lhs.dtype:
        raise ValueError(f"{name}: lhs and rhs expected one float dtype, got {lhs.dtype} and {rhs.dtype}")
    if not all(common.pow2(b) and b >= 16 for b in (block_m, block_n, block_k)):
        raise ValueError(f"{name}: block_m, block_n, block_k expected powers of two >= 16, "
                         f"got {block_m}, {block_n}, {block_k}")
    if k % block_k or rhs.shape[2] % block_n:
        raise ValueError(f"{name}: rhs expected K % block_k == 0 and N % block_n == 0, got K={k}, N={rhs.shape[2]} "
                         f"with block_k={block_k}, block_n={block_n}")


@functools.partial(jax.jit, static_argnames=("interpret", "block_m", "block_n", "block_k", "num_warps", "num_stages",
                                             "group_m"))
def grouped_matmul_triton(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                          group_slot: jax.Array | None = None, interpret: bool = False, block_m: int = BLOCK_M,
                          block_n: int = BLOCK_N, block_k: int = BLOCK_K, num_warps: int | None = NUM_WARPS,
                          num_stages: int | None = NUM_STAGES, group_m: int | None = GROUP_M,
                          row_dest: jax.Array | None = None) -> jax.Array:
    """``jax.lax.ragged_dot(lhs, rhs, group_sizes)``: out[r] = lhs[r] @ rhs[g(r)] (module docstring).

    lhs: [M, K]; rhs: [G, K, N], lhs's dtype (16-bit floats on a GPU; any float interpreted); group_sizes:
    int [G] >= 0, rows of lhs contiguous by group, meant to sum to M: rows past the sum come out as zeros
    and groups past row M are cut (both as ragged_dot). group_slot: int32 [G] or None: group g's weights are
    rhs[group_slot[g]] of an rhs [S, K, N] (``ragged_dot(lhs, rhs[group_slot], group_sizes)`` without the
    gather; slots in [0, S)). Returns [M, N] in lhs's dtype, each row a float32
    sum over K in block_k steps. Grid (T, N / block_n) over :func:`tile_schedule`'s T row tiles; a tile
    with no rows returns at once. interpret: Pallas interpret mode (CPU); block_m, block_n, block_k:
    powers of two >= 16, K % block_k == 0, N % block_n == 0; num_warps / num_stages: Triton's; group_m: the
    programs' order (:data:`GROUP_M`; the output does not depend on it). row_dest: int32 [M] or None: a
    permutation of [0, M) (not checked: its values are known only at run time; a repeated or out-of-range
    destination leaves rows unwritten); product row r is stored at row row_dest[r] (``out.at[row_dest].set(product)``,
    the same values): the experts' down matmul writes its rows back in (token, expert) pair order itself, so no
    gather with the inverse permutation reads them again (kernel name ``grouped_matmul_scatter``).

    Raises:
      ValueError: shapes or dtypes that disagree, or tiles that do not fit (the message names the
        operand, expected vs got).
    """
    _check(lhs, rhs, group_sizes, block_m, block_n, block_k, group_slot=group_slot)
    m, n = lhs.shape[0], rhs.shape[2]
    if row_dest is not None and row_dest.shape != (m,):
        raise ValueError(f"grouped_matmul_triton: row_dest expected shape ({m},) (rows of lhs), got {row_dest.shape}")
    if m == 0:
        return jnp.zeros((0, n), lhs.dtype)
    return _scheduled(tile_schedule(group_sizes, m, block_m), lhs, rhs, interpret=interpret, block_m=block_m,
                      block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages,
                      group_slot=group_slot, group_m=group_m, dest=row_dest)


def _scheduled(schedule, lhs, rhs, *, interpret, block_m, block_n, block_k, num_warps, num_stages, tok=None,
               swiglu=False, group_slot=None, group_m=GROUP_M, dest=None):
    """The pallas_call over a :func:`tile_schedule` (any order of its tiles gives the same output: on a GPU
    the programs run in no fixed order). tok: int32 [M], lhs's row of each output row (None: row r itself);
    swiglu: out = SwiGLU of the product's two column halves ([M, N / 2]); group_slot: int32 [G], each group's
    row of rhs (None: row g); dest: int32 [M], the output row of each product row (None: row r itself; else the
    kernel writes M + 1 rows, the last one the dead rows' trash, and the first M are returned)."""
    k, n = lhs.shape[1], rhs.shape[2]
    g = rhs.shape[0] if group_slot is None else group_slot.shape[0]
    m = lhs.shape[0] if tok is None else tok.shape[0]
    n_out = n // 2 if swiglu else n
    extra = tuple(a.astype(jnp.int32) for a in (group_slot, tok, dest) if a is not None)
    num_tiles, num_cols = schedule[0].shape[0], n_out // block_n
    group_m = None if group_m is None else min(group_m, num_tiles)  # a wider band is the whole grid's order
    out = pl.pallas_call(
        functools.partial(_kernel, groups=g, bm=block_m, bn=block_n, bk=block_k, k_steps=k // block_k,
                          up_cols=n_out if swiglu else None, slots=group_slot is not None, gather=tok is not None,
                          scatter=dest is not None, num_tiles=num_tiles, num_cols=num_cols, group_m=group_m),
        out_shape=jax.ShapeDtypeStruct((m + (dest is not None), n_out), lhs.dtype),
        grid=(num_tiles, num_cols) if group_m is None else (num_tiles * num_cols,),
        interpret=interpret, compiler_params=common.triton_params(interpret, num_warps, num_stages),
        name="grouped_swiglu_triton" if swiglu else "grouped_matmul_triton",
    )(*schedule, *extra, lhs, rhs)
    return out if dest is None else out[:m]


@functools.partial(jax.jit, static_argnames=("interpret", "block_m", "block_n", "block_k", "num_warps", "num_stages",
                                             "group_m"))
def grouped_swiglu_triton(x: jax.Array, row_token: jax.Array, gate_up: jax.Array, group_sizes: jax.Array, *,
                          group_slot: jax.Array | None = None, interpret: bool = False, block_m: int = BLOCK_M,
                          block_n: int = BLOCK_N, block_k: int = BLOCK_K, num_warps: int | None = NUM_WARPS,
                          num_stages: int | None = NUM_STAGES, group_m: int | None = GROUP_M) -> jax.Array:
    """The experts' gate-up matmul with the token gather before it and SwiGLU after it, in one kernel:
    ``swiglu(ragged_dot(x[row_token], gate_up, group_sizes))`` with swiglu(h) = silu(h[:, :F]) * h[:, F:].

    x: [N, D] token rows; row_token: int32 [M] in [0, N), the token of each (token, expert) row, rows sorted
    by group; gate_up: [G, D, 2F] (gate columns first), x's dtype; group_sizes: int [G] >= 0 and group_slot (as
    :func:`grouped_matmul_triton`). Returns [M, F] in x's dtype: the gate and up products are each rounded to
    x's dtype first (as the unfused matmul's output is), then silu(gate) = g / (1 + exp(-g)) is computed in
    float32 and rounded, then the product. XLA's SwiGLU of the unfused path rounds inside the sigmoid too, so the
    two differ by a few ulp of x's dtype (at most 3 in the tests): not bit-identical, though every expert mode
    runs the same kernel and so agrees with the others.
    Saves the gathered rows [M, D] and the product [M, 2F] that the unfused path writes and reads back. Tiles
    as :func:`grouped_matmul_triton`, with F % block_n == 0.

    Raises:
      ValueError: shapes or dtypes that disagree, or tiles that do not fit (expected vs got).
    """
    name = "grouped_swiglu_triton"
    if row_token.ndim != 1 or not jnp.issubdtype(row_token.dtype, jnp.integer):
        raise ValueError(f"{name}: row_token expected an integer array of shape [M], got {row_token.dtype} "
                         f"{row_token.shape}")
    if gate_up.ndim != 3 or gate_up.shape[2] % (2 * block_n):
        raise ValueError(f"{name}: gate_up expected shape [G, D, 2F] with F % block_n == 0, got {gate_up.shape} "
                         f"with block_n={block_n}")
    _check(x, gate_up, group_sizes, block_m, block_n, block_k, name, group_slot)
    m = row_token.shape[0]
    if m == 0:
        return jnp.zeros((0, gate_up.shape[2] // 2), x.dtype)
    return _scheduled(tile_schedule(group_sizes, m, block_m), x, gate_up, interpret=interpret, block_m=block_m,
                      block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages,
                      tok=row_token, swiglu=True, group_slot=group_slot, group_m=group_m)


def _tiles(vals: tuple[int, ...], name: str = "grouped_matmul_triton") -> dict:
    bm, bn, bk, *rest = common.tile_values(name, vals, (3, 4, 5, 6),
                                           "(block_m, block_n, block_k[, num_warps[, num_stages[, group_m]]])")
    warps = rest[0] if rest else NUM_WARPS
    stages = rest[1] if len(rest) > 1 else NUM_STAGES
    group_m = (rest[2] or None) if len(rest) > 2 else GROUP_M  # 0: the two-axis grid
    if not (all(common.pow2(v) and v >= 16 for v in (bm, bn, bk)) and common.pow2(warps)
            and (stages is None or stages >= 1) and (group_m is None or group_m >= 1)):
        raise ValueError(f"tiles of kernel {name!r}: block_m, block_n, block_k must be powers of two "
                         f">= 16, num_warps a power of two, num_stages >= 1 and group_m >= 0, got {vals}")
    return {"block_m": bm, "block_n": bn, "block_k": bk, "num_warps": warps, "num_stages": stages,
            "group_m": group_m}


registry.register(registry.Kernel(
    "grouped_matmul_triton", "jax.lax.ragged_dot",
    "prefill's routed-expert grouped matmul (ftjax.kernels.grouped_matmul, called without an explicit impl): "
    "16-bit float operands on a GPU, K % block_k == 0 and N % block_n == 0; auto for >= 256 experts",
    auto=True, tiles=_tiles))
registry.register(registry.Kernel(
    "grouped_swiglu_triton", "jax.lax.ragged_dot",
    "prefill's gate-up matmul with its token gather and SwiGLU fused (ftjax.experts.compute.experts_grouped): "
    "16-bit float operands on a GPU, D % block_k == 0 and F % block_n == 0; auto for >= 256 experts, as "
    "grouped_matmul_triton (16-layer qwen3.5 TTFT 0.1211 -> 0.1128 s on an H100)",
    tiles=functools.partial(_tiles, name="grouped_swiglu_triton")))
registry.register(registry.Kernel(
    "grouped_matmul_scatter", "jax.lax.ragged_dot",
    "prefill's routed-expert down matmul storing each row in (token, expert) pair order itself (row_dest of "
    "grouped_matmul_triton), instead of a gather with the inverse permutation after it "
    "(ftjax.experts.compute.experts_grouped), the same values; by name only: the 16-layer qwen3.5 TTFT did not move "
    "on an H100 (0.1104 s with it, 0.1105 without, 2026-12-06)",
    auto=False, needs=("grouped_matmul_triton",)))
registry.register(registry.Kernel(
    "grouped_matmul_pool", "jax.lax.ragged_dot",
    "prefill's routed-expert FFN reading a layer's experts in the slot pool through a slot table, without gathering "
    "them first (ftjax.experts.compute.experts_from_pool): dense weights, where grouped_matmul_triton takes the "
    "operands; auto for >= 256 experts a layer, as grouped_matmul_triton (ftjax.kernels.grouped_matmul.pool_auto)",
    auto=True, needs=("grouped_matmul_triton",)))
