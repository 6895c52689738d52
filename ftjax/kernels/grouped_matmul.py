"""Grouped (ragged) matrix multiply for MoE experts: rows sorted by expert, one weight per group.

``jax.lax.ragged_dot`` is the reference and the CPU path, but on the H200 with jax 0.11.2 it ran
at 5 TFLOP/s (DESIGN.md section 3), which would make 8192-token prefill compute-bound. On GPUs the
Mosaic GPU Pallas kernel shipped with JAX (``jax.experimental.pallas.ops.gpu.ragged_dot_mgpu``,
measured 233 TFLOP/s on the same shapes) is used instead when the shapes fit its tiles.

Where ``ragged_dot`` runs (the CPU; float32 on a GPU, which the kernel does not take) XLA expands it
into one dense matmul (jax's ``_ragged_dot_general_impl`` on the CPU, XLA's ``RaggedDotRewriter`` on
a GPU): the lhs is broadcast to [G, M, K], masked to each row's group and contracted over G*K
against rhs [G*K, N]. That operand grows as M*G*K: 137 GB in float32 for one 8192-token prefill
layer of qwen3.5-35b-a3b (M = 8192 * top-8 rows, G = 256, K = 2048), the RESOURCE_EXHAUSTED
"146.47GiB" of its float32 prefill on the H200. :func:`ragged_dot_tiled` runs the same expansion on
tiles of rows, one at a time, once the whole one would exceed :data:`XLA_EXPAND_BYTES`.

The named kernel ``grouped_matmul_triton`` (``ftjax.kernels.grouped_matmul_triton``: a Pallas Triton
kernel over a precomputed tile schedule, no per-tile loop over the groups) replaces both where the
kernel config names it, and under ``auto`` on a GPU for 256 groups or more (measured faster there:
:mod:`ftjax.kernels.grouped_matmul_triton`). Through a slot table it also reads a layer's experts where
they sit in the pool (``grouped_matmul_pool``, :func:`pool_grouping`; auto where the Triton kernel is).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ftjax.kernels import grouped_matmul_triton as gmt
from ftjax.kernels import registry

#: Largest dense operand [G, M, K] of ragged_dot's expansion built at once (bytes); above it the
#: rows go through the expansion in tiles (:func:`ragged_dot_tiled`).
XLA_EXPAND_BYTES = 1 << 29
#: Row tiles are a multiple of this many rows. On the CPU (XLA's YNNPACK dot, jax 0.11) tiles of
#: 64 rows or more gave results bit-identical to the untiled matmul, tiles of 8 to 48 rows did not
#: (tests/test_prefill.py).
TILE_ROW_MULTIPLE = 64

# Tiles of the Mosaic GPU kernel (DESIGN.md section 3: 128x128x64, 4 stages). A matmul of a short K (at most
# SHORT_K: the experts' down projection, K = F) takes SHORT_K_TILES where N allows: measured on an H200
# (2026-12-05, experiments/results/gated_delta/bench_grouped_matmul_h200_2026-12-05.json, 8192 tokens, top-8) the
# down matmul ran 1.30 vs 1.59 ms (256 experts, F = 512) and 1.16 vs 1.38 ms (128 experts, F = 768) against the
# default tiles, the same bits. A longer K (the gate-up matmul, K = D) walks its output tiles 4 column blocks at a
# time (LONG_K_GRID_BLOCK_N: the kernel's planar snake over the tile grid, the same arithmetic per tile) where 4 x
# block_n divides N: the qwen3 family's 128-expert gate-up (K = 2048, N = 1536; the Mosaic kernel stays auto there)
# ran 1.38 vs 1.92 ms on an H100 (gated_delta/bench_grouped_matmul_tiles-e9fe957_h100_2026-12-05.json) and 1.27
# vs 1.69 ms on an H200 (gated_delta/bench_grouped_matmul_h200_2026-12-05.json); at 256 experts it was faster in 3
# of 4 runs.
BLOCK_M, BLOCK_N, BLOCK_K, STAGES = 128, 128, 64, 4
SHORT_K = 1024
SHORT_K_TILES = {"block_m": 64, "block_n": 256}
LONG_K_GRID_BLOCK_N = 4


def mgpu_tiles(k: int, n: int) -> dict:
    """Keyword tiles of the Mosaic GPU kernel for rhs [G, k, n]: block_m, block_n, block_k,
    max_concurrent_steps, grid_block_n."""
    tiles = {"block_m": BLOCK_M, "block_n": BLOCK_N, "block_k": BLOCK_K, "max_concurrent_steps": STAGES,
             "grid_block_n": 1}
    if k <= SHORT_K and n % SHORT_K_TILES["block_n"] == 0:
        tiles.update(SHORT_K_TILES)
    elif k > SHORT_K and n % (LONG_K_GRID_BLOCK_N * BLOCK_N) == 0:
        tiles["grid_block_n"] = LONG_K_GRID_BLOCK_N
    return tiles


def mgpu_supported(lhs: jax.Array, rhs: jax.Array) -> bool:
    """True when the Mosaic GPU kernel can run these operands on the current backend:
    a GPU, 16-bit float operands of one dtype, K % 64 == 0 and N % 128 == 0."""
    if registry.backend() != "gpu" or lhs.dtype != rhs.dtype or lhs.dtype not in (jnp.bfloat16, jnp.float16):
        return False
    k, n = rhs.shape[1], rhs.shape[2]
    return k % BLOCK_K == 0 and n % BLOCK_N == 0


def _triton_mode(lhs, rhs, auto: bool, record: bool = True, name: str = "grouped_matmul_triton") -> tuple[str, dict]:
    """How kernel ``name`` (``grouped_matmul_triton`` or ``grouped_swiglu_triton``) would run on lhs [M, K] /
    rhs [G, K, N] under the active kernel config ("xla": it does not), and its tiles."""
    tiles = registry.tiles(name, gmt.default_tiles(rhs.shape[1]) if name == "grouped_matmul_triton" else gmt.TILES)
    bn = tiles["block_n"] * (2 if name == "grouped_swiglu_triton" else 1)  # F = N / 2 split in block_n columns
    how = registry.mode(name, gmt.supported(lhs, rhs, tiles["block_k"], bn), auto=auto, record=record)
    return how, tiles


def grouped_swiglu(x: jax.Array, row_token: jax.Array, gate_up: jax.Array, group_sizes: jax.Array,
                   group_slot: jax.Array | None = None) -> jax.Array | None:
    """``swiglu(grouped_matmul(x[row_token], gate_up, group_sizes, group_slot=group_slot))`` in one kernel where
    the kernel config selects ``grouped_swiglu_triton`` and it takes the operands (:func:`ftjax.kernels.
    grouped_matmul_triton.grouped_swiglu_triton`; interpreted off a GPU), else None: the caller runs the three
    steps. x: [N, D]; row_token: int32 [M]; gate_up: [G, D, 2F] (or [S, D, 2F] with group_slot int32 [G]);
    returns [M, F] in x's dtype. ``auto`` picks it on a GPU where it picks ``grouped_matmul_triton`` (G >= 256):
    on an H100 (2026-12-05, 0a3c039, ``experiments/results/gated_delta/
    bench_gated_delta_qwen3.5-35b-a3b_model-offset-norms_h100_2026-12-05.json``) the 16-layer qwen3.5-35b-a3b
    cut's resident 8192-token TTFT went 0.1211 -> 0.1128 s with it, reading the pool in place; its bf16 outputs
    are within 3 ulp of the three steps' (``grouped_swiglu_triton``), and every expert mode runs it alike."""
    if registry.active().grouped_matmul != "auto":
        return None
    groups = gate_up.shape[0] if group_slot is None else group_slot.shape[0]
    how, tiles = _triton_mode(x, gate_up, gmt.auto_picks(groups), name="grouped_swiglu_triton")
    if how == "xla":
        return None
    return gmt.grouped_swiglu_triton(x, row_token, gate_up, group_sizes, group_slot=group_slot,
                                     interpret=how == "interpret", **tiles)


def pool_auto(groups: int) -> bool:
    """Whether ``use="auto"`` reads a layer's ``groups`` experts in the pool on a GPU (``grouped_matmul_pool``):
    where it also picks ``grouped_matmul_triton`` (at least :data:`ftjax.kernels.grouped_matmul_triton.
    AUTO_MIN_GROUPS` experts a layer). Measured on an H100 (2026-12-05, ``experiments/results/gated_delta/
    bench_gated_delta_qwen3.5-35b-a3b_model-moe_h100_2026-12-05.json``): qwen3.5-35b-a3b cut to 16 layers,
    resident, an 8192-token prefill: TTFT 0.122 s against 0.140 s with the layer gather (1.6 GB copied a layer),
    logits bit-identical, with the 25.8 GB pool addressed in 64-bit offsets."""
    return gmt.auto_picks(groups)


def pool_grouping(x: jax.Array, gate_up: jax.Array, down: jax.Array, groups: int) -> bool:
    """Whether a layer's grouped expert FFN reads its experts in the pool through a slot table (the kernel
    ``grouped_matmul_pool``) instead of gathering them first: x [N, D]; gate_up [S, D, 2F] and down [S, F, D],
    a pool of S slots in x's dtype; ``groups``: the layer's experts E (the slot table's length). True where
    ``grouped_matmul_triton`` takes both matmuls and the kernel config names ``grouped_matmul_pool`` (or
    interprets every kernel), or under ``use="auto"`` on a GPU for E >= 256 (:func:`pool_auto`). Decided from
    the config and shapes alone, so every expert mode decides alike."""
    if registry.active().grouped_matmul != "auto" or gate_up.dtype != x.dtype:
        return False
    auto = pool_auto(groups)
    h = jax.ShapeDtypeStruct((x.shape[0], down.shape[1]), x.dtype)
    takes = all(_triton_mode(a, w, auto, record=False)[0] != "xla" for a, w in ((x, gate_up), (h, down)))
    return takes and registry.mode("grouped_matmul_pool", auto=auto) != "xla"


def reads_pool_in_place(hidden: int, expert_ffn: int, groups: int, itemsize: int) -> bool:
    """Whether a layer's grouped expert FFN would read dense experts of ``itemsize`` bytes (hidden D, width F) in
    the pool (:func:`pool_grouping`) under the active kernel config and backend, so that no layer gather is
    allocated: what a stated memory plan reserves or not (``ftjax.runtime.planner.plan_memory``)."""
    dtype = {2: jnp.bfloat16, 4: jnp.float32}.get(itemsize)
    if dtype is None:
        return False
    sd = jax.ShapeDtypeStruct
    x = sd((gmt.AUTO_MIN_GROUPS, hidden), dtype)  # the row count does not enter the decision
    return pool_grouping(x, sd((groups, hidden, 2 * expert_ffn), dtype), sd((groups, expert_ffn, hidden), dtype),
                         groups)


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, impl: str | None = None,
                   group_slot: jax.Array | None = None, row_dest: jax.Array | None = None) -> jax.Array:
    """out[r] = lhs[r] @ rhs[g(r)], rows of lhs grouped contiguously by group.

    lhs: [M, K]; rhs: [G, K, N]; group_sizes: int32 [G] with sum == M. Returns [M, N] in lhs's dtype.
    group_slot: int32 [G] or None: group g's weights are rhs[group_slot[g]] of an rhs [S, K, N], read in place
    by ``grouped_matmul_triton`` (only where :func:`pool_grouping` said so). row_dest: int32 [M], a permutation
    of [0, M), or None: the product's row r comes out at row row_dest[r] (the same values in another order):
    stored there by ``grouped_matmul_triton`` where the kernel config selects ``grouped_matmul_scatter``, else
    gathered with the inverse permutation afterwards.
    impl: "auto" (Mosaic GPU kernel where supported, else ragged_dot), "mgpu", or "xla";
      default: the active kernel config's ``grouped_matmul`` (``ftjax.kernels.registry``).
    With impl left out and ``KernelConfig.grouped_matmul`` "auto", the kernel ``grouped_matmul_triton`` runs
    instead where the kernel config selects it (by name, ``use="interpret"``, or ``use="auto"`` on a GPU for
    G >= 256: :func:`ftjax.kernels.grouped_matmul_triton.auto_picks`) and it takes the operands
    (:func:`ftjax.kernels.grouped_matmul_triton.supported` at the config's tiles); interpreted off a GPU.
    Raises:
      ValueError: unknown impl, or "mgpu" asked for where it cannot run; a group_slot where the Triton
        kernel does not run.
    """
    if row_dest is not None:
        out = _grouped_matmul(lhs, rhs, group_sizes, impl, group_slot, row_dest)
        if out is not None:
            return out
        # the same rows gathered back: out[row_dest[r]] = y[r], i.e. out = y[inverse of row_dest]
        inv = jnp.zeros_like(row_dest).at[row_dest].set(jnp.arange(row_dest.size, dtype=row_dest.dtype),
                                                         unique_indices=True)
        return _grouped_matmul(lhs, rhs, group_sizes, impl, group_slot)[inv]
    return _grouped_matmul(lhs, rhs, group_sizes, impl, group_slot)


def _grouped_matmul(lhs, rhs, group_sizes, impl, group_slot, row_dest=None):
    """:func:`grouped_matmul`; with ``row_dest``: the Triton kernel storing in that order where the kernel config
    selects ``grouped_matmul_scatter`` for it, else None (the caller gathers)."""
    if row_dest is not None:
        groups = rhs.shape[0] if group_slot is None else group_slot.shape[0]
        how, tiles = _triton_mode(lhs, rhs, gmt.auto_picks(groups), record=False)
        if impl is not None or registry.active().grouped_matmul != "auto" or how == "xla" \
                or registry.mode("grouped_matmul_scatter") == "xla":  # by name only (its registry entry)
            return None
        _triton_mode(lhs, rhs, gmt.auto_picks(groups))  # recorded as run
        return gmt.grouped_matmul_triton(lhs, rhs, group_sizes, group_slot=group_slot, row_dest=row_dest,
                                         interpret=how == "interpret", **tiles)
    if group_slot is not None:
        how, tiles = _triton_mode(lhs, rhs, pool_auto(group_slot.shape[0]))
        if how == "xla" or impl is not None:
            raise ValueError("grouped_matmul: group_slot needs grouped_matmul_triton (see pool_grouping)")
        return gmt.grouped_matmul_triton(lhs, rhs, group_sizes, group_slot=group_slot, interpret=how == "interpret",
                                         **tiles)
    if impl is None and registry.active().grouped_matmul == "auto":  # an explicit choice is taken as asked
        how, tiles = _triton_mode(lhs, rhs, gmt.auto_picks(rhs.shape[0]))
        if how != "xla":
            return gmt.grouped_matmul_triton(lhs, rhs, group_sizes, interpret=how == "interpret", **tiles)
    impl = impl or registry.active().grouped_matmul
    if impl not in ("auto", "mgpu", "xla"):
        raise ValueError(f"unknown grouped matmul impl {impl!r}")
    use_mgpu = impl == "mgpu" or (impl == "auto" and mgpu_supported(lhs, rhs))
    if use_mgpu:
        if not mgpu_supported(lhs, rhs):
            raise ValueError(f"mgpu grouped matmul cannot run here (backend {registry.backend()}, "
                             f"dtype {lhs.dtype}, K={rhs.shape[1]}, N={rhs.shape[2]})")
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
        return ragged_dot_mgpu.ragged_dot(lhs, rhs, group_sizes=group_sizes, **mgpu_tiles(rhs.shape[1], rhs.shape[2]))
    return ragged_dot_tiled(lhs, rhs, group_sizes)


def tile_rows(m: int, g: int, k: int, itemsize: int, max_bytes: int | None = None) -> int | None:
    """Rows per tile of :func:`ragged_dot_tiled` for lhs [m, k] and g groups, or None when the whole
    expansion ([g, m, k] of ``itemsize`` bytes) fits ``max_bytes`` (default :data:`XLA_EXPAND_BYTES`):
    the largest multiple of :data:`TILE_ROW_MULTIPLE` whose expansion fits, at least one multiple."""
    max_bytes = XLA_EXPAND_BYTES if max_bytes is None else max_bytes
    per_row = g * k * itemsize
    if m * per_row <= max_bytes:
        return None
    return max(TILE_ROW_MULTIPLE, max_bytes // per_row // TILE_ROW_MULTIPLE * TILE_ROW_MULTIPLE)


def ragged_dot_tiled(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, rows: int | None = None) -> jax.Array:
    """``jax.lax.ragged_dot(lhs, rhs, group_sizes)`` (groups contiguous, sum(group_sizes) = M), its
    dense expansion built ``rows`` rows at a time.

    Tile i holds rows [i*rows, (i+1)*rows) of lhs (the last one zero-padded) with each group's size
    clipped to them, and is one ragged_dot inside a ``lax.scan``: every row is multiplied by its
    group's matrix exactly as in the whole expansion (the other groups' blocks are zeros in both), so
    only the matmul's row count changes, not its operands: bit-identical on the CPU for tiles of
    :data:`TILE_ROW_MULTIPLE` rows or more (tests/test_prefill.py). Workspace: one tile's [G, rows, K]
    instead of [G, M, K]. rows: default :func:`tile_rows` (None there: one plain ragged_dot).
    """
    m, k = lhs.shape
    rows = rows or tile_rows(m, rhs.shape[0], k, jnp.dtype(lhs.dtype).itemsize)
    if rows is None or rows >= m:
        return jax.lax.ragged_dot(lhs, rhs, group_sizes)
    tiles = -(-m // rows)
    x = jnp.pad(lhs, ((0, tiles * rows - m), (0, 0))).reshape(tiles, rows, k)
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes

    def tile(_, xs):
        x_t, lo = xs
        sizes = jnp.clip(ends, lo, lo + rows) - jnp.clip(starts, lo, lo + rows)
        return None, jax.lax.ragged_dot(x_t, rhs, sizes.astype(group_sizes.dtype))

    _, out = jax.lax.scan(tile, None, (x, jnp.arange(tiles, dtype=ends.dtype) * rows))
    return out.reshape(tiles * rows, -1)[:m]
