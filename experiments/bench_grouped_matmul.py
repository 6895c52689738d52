r"""Where one prefill layer's grouped expert FFN spends its time, and the grouped matmul's tiles (issue 32).

  PYTHONPATH=. python3 experiments/bench_grouped_matmul.py --out_dir=$OUT                         # on the GPU
  .venv/bin/python experiments/bench_grouped_matmul.py --presets=tiny --tokens=256 --repeats=2 \
      --configs= --out_dir=/tmp/gmm                                                               # CPU smoke

At each of --presets' expert shapes (E experts, hidden D, expert FFN F, top-k), one layer's routed-expert
FFN over a --tokens prefill in the grouped formulation (``ftjax.experts.compute.experts_grouped``), batch 1,
random bf16 inputs and weights, top-k ids of random router logits (groups of about tokens * k / E rows).
Every row is the median (and spread) of --repeats calls of one jitted function after a compiling call
(``compile_s``):

* ``pieces``: the formulation's steps, each its own program: the sort (argsort of the N*k expert ids,
  group sizes, inverse permutation), the token gather into expert order (``x[order // k]``), the two grouped
  matmuls at the default tiles, and the gather back to pair order with the weighted sum; then the whole
  ``experts_grouped`` as one program (its fusions included), with ``bytes_floor_s``: its weights read once,
  at --hbm_gbps.
* ``tiles``: the Mosaic GPU kernel (``jax.experimental.pallas.ops.gpu.ragged_dot_mgpu``) for the gate-up
  (K = D, N = 2F) and down (K = F, N = D) matmuls at each of --configs
  (``block_m:block_n:block_k:stages:grid_block_n``), with TFLOP/s counted as 2*M*K*N over the time and
  ``err`` (max |x - ref| / max |ref|) against the default tiles. A config the kernel refuses (shared memory,
  divisibility) is recorded with its error. Then the first config's gate-up matmul with the same rows in
  E/2, E/4, E/8 groups (``groups``): what the group count alone costs (the kernel looks up each tile's group
  with a loop unrolled over all G groups). Then the Pallas Triton kernel over a precomputed tile schedule
  (``ftjax.kernels.grouped_matmul_triton``, ``"kernel": "triton"``) on both matmuls at each of --triton_configs
  (``block_m:block_n:block_k:num_warps:num_stages[:group_m]``: group_m the programs' order,
  ``grouped_matmul_triton.GROUP_M``), ``err`` against the Mosaic GPU kernel at its default tiles
  (``grouped_matmul.mgpu_tiles``); a refused config is recorded with its error. At the same configs, the gate-up
  matmul with its token gather and SwiGLU: as a jitted chain of the three (``gate_up+swiglu chain``) and fused
  in one kernel (``gate_up+swiglu fused``, ``grouped_swiglu_triton``), err against the chain. With --batched,
  both matmuls as XLA's batched matmul over E groups padded to the largest and as one dense matmul (cuBLAS at
  these shapes). GPU only.

Writes ``bench_grouped_matmul[_<tag>].json`` (``presets``: each shape's stages; ``rows``: one per timed program,
for experiments/plots.py) and prints the tables.
"""

from __future__ import annotations

import os
import sys

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from experiments import common  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("presets", ["qwen3.5-35b-a3b", "qwen3-30b-a3b"], "Model shapes whose expert FFN is timed.")
flags.DEFINE_integer("tokens", 8192, "Prompt tokens (rows before top-k).", lower_bound=1)
flags.DEFINE_list("configs", ["128:128:64:4:1", "64:128:64:4:1", "64:256:64:4:1", "128:256:64:3:1",
                              "128:128:64:4:4", "128:128:64:2:1", "64:128:64:6:1", "128:64:64:4:1",
                              "64:64:64:6:1", "128:128:128:3:1", "64:128:128:4:1"],
                  "Tiles of the Mosaic GPU grouped matmul to time (block_m:block_n:block_k:stages:grid_block_n); "
                  "empty: none (with --triton_configs empty too: no tiles stage).")
flags.DEFINE_list("triton_configs", ["64:128:64:4:3", "128:128:64:8:3", "64:256:64:8:3", "128:64:64:4:4"],
                  "Tiles of the Pallas Triton grouped matmul to time (block_m:block_n:block_k:num_warps:num_stages); "
                  "empty: none.")
flags.DEFINE_integer("repeats", 10, "Timed calls per row.", lower_bound=1)
flags.DEFINE_bool("batched", False, "Also time both matmuls as XLA's batched matmul over E equal groups padded to "
                  "the largest group (cuBLAS: what a padded-capacity layout could reach) and as one dense matmul of "
                  "the same rows (one weight: the ceiling).")
flags.DEFINE_float("hbm_gbps", 4800.0, "HBM bandwidth for the weights' byte floor (GB/s; the H200's 4.8 TB/s).",
                   lower_bound=1.0)
flags.DEFINE_string("tag", "", "Suffix of the JSON name.")
flags.DEFINE_string("out_dir", "experiments/results/gated_delta", "Where the JSON goes.")


def _tile_entries_ok(entries, counts=(5,)) -> bool:
    """Each entry one of ``counts`` integers separated by colons, >= 1 but for a sixth (group_m, 0: the two-axis
    grid) (checked when the flags are parsed)."""
    return all(len(e.split(":")) in counts and all(x.isdigit() for x in e.split(":"))
               and all(int(x) >= 1 for x in e.split(":")[:5]) for e in entries)


flags.register_validator("configs", _tile_entries_ok,
                         "--configs: each must be block_m:block_n:block_k:stages:grid_block_n (integers >= 1)")
flags.register_validator("triton_configs", lambda e: _tile_entries_ok(e, (5, 6)),
                         "--triton_configs: each must be block_m:block_n:block_k:num_warps:num_stages[:group_m] "
                         "(integers >= 1; group_m >= 0)")
common.check_preset("presets")


#: Keyword names of the five fields of a --configs (Mosaic GPU kernel) and a --triton_configs entry.
MGPU_TILE_NAMES = ("block_m", "block_n", "block_k", "max_concurrent_steps", "grid_block_n")
TRITON_TILE_NAMES = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "group_m")


def _tiles(entry: str, names: tuple[str, ...]) -> dict:
    """A tile entry (checked when the flags were parsed) as the kernel's keyword arguments; a group_m of 0 is
    None (the two-axis grid)."""
    tiles = dict(zip(names, (int(v) for v in entry.split(":"))))
    if "group_m" in tiles:
        tiles["group_m"] = tiles["group_m"] or None
    return tiles


def _timed_row(row: dict, fn, args, ref=None):
    """Fills ``row`` with fn(*args)'s compile and call times, TFLOP/s (2*M*K*N) and, given ``ref``, ``err``
    against it; or with the error of a call that fails (a config the kernel refuses: the sweep goes on).
    Returns the output, or None where it failed."""
    try:
        row.update(_time(fn, *args))
        got = fn(*args)
    except Exception as exc:  # noqa: BLE001 - recorded, the sweep goes on
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        return None
    row["ms"] = row["s"]["median"] * 1e3
    row["tflops"] = 2.0 * row["M"] * row["K"] * row["N"] / row["s"]["median"] / 1e12
    if ref is not None:
        row["err"] = _err(got, ref)
    return got


def _time(fn, *args) -> dict:
    """Compile seconds, then the spread of --repeats calls (seconds)."""
    return common.time_calls(fn, *args, repeats=FLAGS.repeats)


_err = common.rel_err


def _inputs(cfg, n: int):
    """x [n, D], ids int32 [n, k], weights [n, k], gate_up [E, D, 2F], down [E, F, D]; bf16 where floating."""
    import jax
    import jax.numpy as jnp
    keys = jax.random.split(jax.random.key(0), 4)
    e, d, f, k = cfg.num_experts, cfg.hidden_size, cfg.expert_ffn, cfg.top_k
    x = jax.random.normal(keys[0], (n, d), jnp.bfloat16)
    weights, ids = jax.lax.top_k(jax.nn.softmax(jax.random.normal(keys[1], (n, e), jnp.float32)), k)
    gate_up = (jax.random.normal(keys[2], (e, d, 2 * f), jnp.bfloat16) * d ** -0.5).astype(jnp.bfloat16)
    down = (jax.random.normal(keys[3], (e, f, d), jnp.bfloat16) * f ** -0.5).astype(jnp.bfloat16)
    return x, ids.astype(jnp.int32), weights.astype(jnp.bfloat16), gate_up, down


def stage_pieces(cfg, n: int) -> dict:
    import jax
    import jax.numpy as jnp

    from ftjax.experts import compute
    from ftjax.kernels.grouped_matmul import grouped_matmul
    x, ids, weights, gate_up, down = _inputs(cfg, n)
    k, e = cfg.top_k, cfg.num_experts

    def sort(ids):
        flat = ids.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        inv = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype), unique_indices=True)
        return order, jnp.bincount(flat, length=e).astype(jnp.int32), inv

    order, sizes, inv = jax.jit(sort)(ids)
    xs = x[order // k]
    h = jax.jit(grouped_matmul)(xs, gate_up, sizes)
    act = jax.nn.silu(h[:, :cfg.expert_ffn]) * h[:, cfg.expert_ffn:]
    y = jax.jit(grouped_matmul)(act, down, sizes)
    rows = {
        "sort": _time(jax.jit(sort), ids),
        "gather_in": _time(jax.jit(lambda x, o: x[o // k]), x, order),
        "gmm_gate_up": _time(jax.jit(grouped_matmul), xs, gate_up, sizes),
        "swiglu": _time(jax.jit(lambda h: jax.nn.silu(h[:, :cfg.expert_ffn]) * h[:, cfg.expert_ffn:]), h),
        "gmm_down": _time(jax.jit(grouped_matmul), act, down, sizes),
        "gather_out_sum": _time(jax.jit(lambda y, inv, w: jnp.einsum(
            "nkd,nk->nd", y[inv].reshape(n, k, -1), w.astype(y.dtype))), y, inv, weights),
        "whole": _time(jax.jit(compute.experts_grouped), x, ids, weights, gate_up, down),
    }
    out = {name: {**r, "ms": r["s"]["median"] * 1e3} for name, r in rows.items()}
    weight_bytes = (gate_up.size + down.size) * gate_up.dtype.itemsize
    out["sum_of_pieces_ms"] = sum(out[p]["ms"] for p in rows if p != "whole")
    out["bytes_floor_ms"] = weight_bytes / (FLAGS.hbm_gbps * 1e9) * 1e3
    out["group_rows"] = {"mean": float(np.mean(np.asarray(sizes))), "max": int(np.max(np.asarray(sizes))),
                         "min": int(np.min(np.asarray(sizes)))}
    return out


def stage_tiles(cfg, n: int) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    from ftjax.kernels import grouped_matmul as gm
    from ftjax.kernels.grouped_matmul_triton import grouped_matmul_triton

    x, ids, _, gate_up, down = _inputs(cfg, n)
    flat = ids.reshape(-1)
    sizes = jnp.bincount(flat, length=cfg.num_experts).astype(jnp.int32)
    xs = x[jnp.argsort(flat, stable=True) // cfg.top_k]
    act = jax.random.normal(jax.random.key(1), (xs.shape[0], cfg.expert_ffn), jnp.bfloat16)
    rows = []
    for name, lhs, rhs in (("gate_up", xs, gate_up), ("down", act, down)):
        m, kk, nn = lhs.shape[0], rhs.shape[1], rhs.shape[2]
        ref = None
        for entry in FLAGS.configs:
            tiles = _tiles(entry, MGPU_TILE_NAMES)
            row = {"matmul": name, "kernel": "mgpu", "config": entry, "M": m, "K": kk, "N": nn, **tiles}
            fn = jax.jit(lambda a, b, s, t=tiles: ragged_dot_mgpu.ragged_dot(a, b, group_sizes=s, **t))
            got = _timed_row(row, fn, (lhs, rhs, sizes), ref)
            if ref is None and got is not None:  # the first config that runs is the reference
                ref, row["err"] = got, 0.0
            rows.append(row)
            print(common.table([row], ["matmul", "config", "ms", "tflops", "err", "error"]), flush=True)
        if FLAGS.triton_configs:  # err against the Mosaic GPU kernel at grouped_matmul's default tiles
            t = gm.mgpu_tiles(kk, nn)
            try:
                ref = jax.jit(lambda a, b, s: ragged_dot_mgpu.ragged_dot(a, b, group_sizes=s, **t))(lhs, rhs, sizes)
            except Exception as exc:  # noqa: BLE001 - the Triton rows then go without err
                print(f"no mgpu reference for {name}: {type(exc).__name__}", flush=True)
                ref = None
        for entry in FLAGS.triton_configs:
            tiles = _tiles(entry, TRITON_TILE_NAMES)
            row = {"matmul": name, "kernel": "triton", "config": entry, "M": m, "K": kk, "N": nn, **tiles}
            fn = jax.jit(lambda a, b, s, t=tiles: grouped_matmul_triton(a, b, s, **t))
            _timed_row(row, fn, (lhs, rhs, sizes), ref)
            rows.append(row)
            print(common.table([row], ["matmul", "kernel", "config", "ms", "tflops", "err", "error"]), flush=True)
    rows += _fused_rows(cfg, x, flat, gate_up, sizes)
    if FLAGS.batched:
        rows += _batched_rows(xs, act, gate_up, down, sizes)
    if not FLAGS.configs:
        return rows
    # The same rows and operand shapes in fewer, larger groups (neighbouring experts' rows merged, the first
    # G / f weights): what the group count alone costs at the first config's tiles.
    tiles = _tiles(FLAGS.configs[0], MGPU_TILE_NAMES)
    fn = jax.jit(lambda a, b, s: ragged_dot_mgpu.ragged_dot(a, b, group_sizes=s, **tiles))
    for f in (1, 2, 4, 8):
        g = cfg.num_experts // f
        if g < 1 or cfg.num_experts % f:
            continue
        row = {"matmul": "gate_up", "kernel": "mgpu", "config": FLAGS.configs[0], "groups": g, "M": xs.shape[0],
               "K": gate_up.shape[1], "N": gate_up.shape[2]}
        _timed_row(row, fn, (xs, gate_up[:g], sizes.reshape(g, f).sum(axis=1)))
        rows.append(row)
        print(common.table([row], ["matmul", "groups", "ms", "tflops", "error"]), flush=True)
    return rows


def _batched_rows(xs, act, gate_up, down, sizes) -> list[dict]:
    """Both matmuls as XLA's batched matmul of E groups of ``cap`` rows (``cap``: the largest group, rounded up to
    64; ``kernel`` "xla-batched", TFLOP/s counted on the M real rows, so the padding counts against it), the same
    with the weights a dynamic slice of a two-layer pool (``xla-batched-pool-slice``: does XLA copy the layer out
    first?) and as one dense [M, K] x [K, N] matmul (``kernel`` "xla-dense"): what cuBLAS reaches at these shapes."""
    import jax
    import jax.numpy as jnp
    e = gate_up.shape[0]
    cap = -(-int(jnp.max(sizes)) // 64) * 64
    rows = []
    for name, lhs, rhs in (("gate_up", xs, gate_up), ("down", act, down)):
        m, kk, nn = lhs.shape[0], rhs.shape[1], rhs.shape[2]
        padded = jnp.zeros((e, cap, kk), lhs.dtype).at[:, :m // e].set(lhs[:e * (m // e)].reshape(e, m // e, kk))
        pool = jnp.concatenate([rhs, rhs])  # two layers' experts: the batched matmul reading layer 1 in place?
        sliced = jax.jit(lambda a, p, layer: jnp.einsum("eck,ekn->ecn", a,
                                                        jax.lax.dynamic_slice_in_dim(p, layer * e, e)))
        for kernel, fn, args in (
                ("xla-batched", jax.jit(lambda a, b: jnp.einsum("eck,ekn->ecn", a, b)), (padded, rhs)),
                ("xla-batched-pool-slice", sliced, (padded, pool, jnp.int32(1))),
                ("xla-dense", jax.jit(lambda a, b: a @ b), (lhs, rhs[0]))):
            row = {"matmul": name, "kernel": kernel, "config": "dense" if kernel == "xla-dense" else f"cap {cap}",
                   "M": m, "K": kk, "N": nn}
            _timed_row(row, fn, args)
            rows.append(row)
            print(common.table([row], ["matmul", "kernel", "config", "ms", "tflops", "error"]), flush=True)
    return rows


def _fused_rows(cfg, x, flat, gate_up, sizes) -> list[dict]:
    """At each of --triton_configs: the token gather, gate-up matmul and SwiGLU as three programs' worth of work
    in one jitted chain (``gate_up+swiglu chain``: the unfused path) and as one kernel (``gate_up+swiglu fused``,
    ``grouped_swiglu_triton``), err of the fused against the chain."""
    import jax
    import jax.numpy as jnp

    from ftjax.experts.compute import _swiglu
    from ftjax.kernels.grouped_matmul_triton import grouped_matmul_triton, grouped_swiglu_triton
    tok = (jnp.argsort(flat, stable=True) // cfg.top_k).astype(jnp.int32)
    m, kk, nn = tok.shape[0], gate_up.shape[1], gate_up.shape[2]
    rows = []
    for entry in FLAGS.triton_configs:
        tiles = _tiles(entry, TRITON_TILE_NAMES)
        chain = jax.jit(lambda a, t, b, s, tl=tiles: _swiglu(grouped_matmul_triton(a[t], b, s, **tl)))
        fused = jax.jit(lambda a, t, b, s, tl=tiles: grouped_swiglu_triton(a, t, b, s, **tl))
        ref = None
        for how, fn in (("chain", chain), ("fused", fused)):
            row = {"matmul": f"gate_up+swiglu {how}", "kernel": "triton", "config": entry, "M": m, "K": kk, "N": nn,
                   **tiles}
            got = _timed_row(row, fn, (x, tok, gate_up, sizes), ref)
            ref = got if ref is None else ref
            rows.append(row)
            print(common.table([row], ["matmul", "config", "ms", "tflops", "err", "error"]), flush=True)
    return rows


def flat_rows(presets: dict) -> list[dict]:
    """One row per timed program (``preset``, ``case``, ``s``: the spread of its calls in seconds): the pieces, then
    the tiles ("gate_up 128:128:64:4:1", the Triton kernel's "gate_up triton 64:128:64:4:3") and the group counts
    ("gate_up 64 groups"); what experiments/plots.py draws."""
    rows = []
    for p, res in presets.items():
        rows += [{"preset": p, "case": k, "s": v["s"]} for k, v in (res.get("pieces") or {}).items()
                 if isinstance(v, dict) and "s" in v]
        kernel = lambda t: f"{t['kernel']} " if t.get("kernel", "mgpu") != "mgpu" else ""  # noqa: E731
        rows += [{"preset": p, "case": f"{t['matmul']} " + kernel(t)
                  + (f"{t['groups']} groups" if t.get("groups") else t["config"]),
                  "s": t["s"], "tflops": t.get("tflops")} for t in res.get("tiles") or [] if "s" in t]
    return rows


def main(argv):
    del argv
    import jax

    from ftjax.config import preset
    name = "bench_grouped_matmul" + (f"_{FLAGS.tag}" if FLAGS.tag else "") + ".json"
    out = {"tokens": FLAGS.tokens, "device": jax.devices()[0].device_kind, "presets": {}, "partial": True}
    for p in FLAGS.presets:
        cfg = preset(p)
        n = FLAGS.tokens
        res = {"shape": {"experts": cfg.num_experts, "hidden": cfg.hidden_size, "expert_ffn": cfg.expert_ffn,
                         "top_k": cfg.top_k, "rows": n * cfg.top_k}}
        res["pieces"] = stage_pieces(cfg, n)
        print(f"\n{p}: pieces (ms)")
        print(common.table([{"piece": k, "ms": v["ms"]} for k, v in res["pieces"].items() if isinstance(v, dict)
                            and "ms" in v], ["piece", "ms"]))
        print(f"sum of pieces {res['pieces']['sum_of_pieces_ms']:.3f} ms, weights' byte floor "
              f"{res['pieces']['bytes_floor_ms']:.3f} ms", flush=True)
        out["presets"][p] = res
        out["rows"] = flat_rows(out["presets"])
        common.write_json(FLAGS.out_dir, name, out)
        if (FLAGS.configs or FLAGS.triton_configs) and jax.default_backend() == "gpu":
            res["tiles"] = stage_tiles(cfg, n)
            out["rows"] = flat_rows(out["presets"])
            common.write_json(FLAGS.out_dir, name, out)
    out["partial"] = False
    print("wrote", common.write_json(FLAGS.out_dir, name, out))


if __name__ == "__main__":
    common.run(main)
