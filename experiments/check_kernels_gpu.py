r"""Pallas kernels of ftjax.kernels on the GPU: accuracy against their jnp references at real shapes,
kernel vs XLA time, and the resident decode step / prefill with the kernels on and off.

  PYTHONPATH=. timeout 590 python experiments/check_kernels_gpu.py --out_dir=experiments/results/checks
  PYTHONPATH=. python experiments/check_kernels_gpu.py --sections=moe --moe_slots=280 --out_dir=/tmp/k
  PYTHONPATH=. python experiments/check_kernels_gpu.py --smoke --out_dir=/tmp/k   # CPU: tiny shapes, interpreted

Sections (--sections; by default in the order moe, decode_attention, rope_cache, slot_lookup, route_decode,
flash_prefill, e2e,
e2e_prefill; each check in its own try/except, the JSON rewritten after every check, so a
failure or a timeout keeps what ran before it):

* ``moe``: ``ftjax.kernels.moe_decode`` vs ``compute.gather_outputs_reference`` (qwen3-30b-a3b:
  D=2048, F=768, k=8; pools of --moe_slots slots; batch 1 and 4; dense bf16 at every pool size,
  int8 / fp8 / int4 at the largest): max abs diff, median time of the per-pair outputs and of the
  whole ``experts_gather`` (kernel + weighted sum vs the jnp path, traced under
  ``registry.using(KernelConfig(use=...))``; int4 with ``use="moe_decode"``, since ``auto`` keeps int4
  on XLA), weight bytes read / time, for a sweep of tiles and warps
  (``MOE_TILES``: dense; ``MOE_TILES_INT4``: int4's d_split 1, 2, 4, 8 and a few column / down
  tiles; ``MOE_TILES_QUANT``: int8 and fp8; ``--moe_tiles`` replaces them all), e.g.

    PYTHONPATH=. python experiments/check_kernels_gpu.py --out_dir=/tmp/k --sections=moe \
        --moe_formats=int4,int8 --time_budget_s=120
* ``decode_attention``: ``ftjax.kernels.decode_attention`` vs ``layers.attention.attention`` (T=1) on a
  4-layer stacked cache, 32/4 heads, hd 128, S_max 1024 and 8192, 600 filled, batch 1 and 4.
* ``rope_cache``: ``ftjax.kernels.rope_cache`` (the decode attention's prologue: q/k norms, RoPE, K/V
  written into the cache) vs the model's jnp path; 48 layers, S_max 4096, batch 1 and 4; and its
  epilogue ``dense_decode.merge_dense_decode`` (16 key splits merged in the wo product) vs
  ``decode_attention.merge_splits`` then the reference product.
* ``slot_lookup``: ``ftjax.kernels.slot_lookup`` vs ``slot_table.lookup_layer`` (lru) over a random decode
  of qwen3-30b-a3b's 24 GB table (1975 slots), batch 1 and 4: outputs bit for bit, time per lookup.
* ``route_decode``: ``ftjax.kernels.route_decode`` vs ``layers.moe.top_k_route`` on the summed partial logits
  (qwen3-30b-a3b's router: 32 K-split parts of 128 logits, top-8, bf16), batch 1 and 4: ids differing over
  200 random draws, the largest weight difference, time per call.
* ``flash_prefill``: ``flash_prefill.flash_attention`` (Triton backend) and the shipped Mosaic GPU
  kernel (``mgpu_attention``) vs ``layers.attention.attention`` at 32 / 4 heads of 128 (qwen3) and 16 / 2 heads
  of 256 (the qwen3.5 family's gated attention): T=8192 from position 0 in an 8192 row, and (Triton kernel only)
  T=1024 from position 4096. Each row's ``ok``: max |diff| within ``FLASH_TOL``; the
  script exits 1 if a row is not.
* ``e2e``: qwen3-30b-a3b cut to --e2e_layers layers, random bf16 weights, resident: decode step
  time (median of --e2e_steps) and TTFT of a --prompt_len prompt with the engine's kernel config
  (``EngineConfig.kernels``) ``KernelConfig(use=...)`` xla, auto, auto with the fastest MoE tiles of the
  ``moe`` section (``tiles={"moe_decode": ...}``), and each kernel alone; logits diff and greedy ids vs
  xla; a cached run (--e2e_slots) with kernels on must give the resident run's logits bit for bit.
  Each row records its engine's config (``engine``: the kernel config and ``kernels_applied``).
* ``e2e_prefill``: one --prefill_len prompt, resident, kernels off / flash (Triton) / flash (mgpu) / flash (auto)
  (``KernelConfig(use="flash_prefill", flash_prefill="pallas" | "mgpu" | "auto")``). The ``e2e`` rows take the
  default ``flash_prefill`` (auto since 2026-12-06; pallas before), so their TTFTs from then on include the
  Mosaic attention.

First of all, the device memory bandwidth of a large elementwise op (``hbm``), the figure the
kernels' GBps compare against.

Medians of --repeats timed calls after two warm-up calls; times in microseconds unless named _s.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import os
import re
import sys
import time
import traceback

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments import common  # noqa: E402
from ftjax.experts import formats  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("out_dir", "experiments/results/checks", "Where the JSON goes.")
flags.DEFINE_list("sections", ["moe", "decode_attention", "rope_cache", "slot_lookup", "route_decode", "flash_prefill",
                               "e2e", "e2e_prefill"],
                  "What to run.")
flags.DEFINE_list("moe_slots", ["280", "6144"], "Pool sizes for the MoE kernel.")
flags.DEFINE_list("moe_formats", [f.name for f in formats.all_formats() if f.fused_decode],
                  "Pool formats for the MoE kernel (default: every registered format it supports).")
flags.DEFINE_list("moe_tiles", [], "MoE kernel tiles to time in every format instead of the built-in lists: "
                  "block_d:block_f:num_warps:d_split[:down_cols:down_rows] each (down_* 0 = the gate/up tile).")
flags.DEFINE_integer("moe_ffn", None, "The experts' intermediate size F of the moe section (default 768: "
                     "qwen3-30b-a3b; 512: qwen3.5-35b-a3b's experts, D = 2048 in both).", lower_bound=8)
flags.DEFINE_list("batches", ["1", "4"], "Tokens per decode step.")
flags.DEFINE_integer("repeats", 10, "Timed calls per measurement (after two warm-up calls).")
flags.DEFINE_integer("e2e_layers", 16, "Layers of the cut qwen3-30b-a3b preset for the end-to-end runs.")
flags.DEFINE_integer("e2e_steps", 32, "Decode steps timed per end-to-end run.")
flags.DEFINE_integer("e2e_slots", 280, "Slots of the cached run checked bit for bit against resident.")
flags.DEFINE_integer("prompt_len", 512, "Prompt tokens of the end-to-end decode runs.")
flags.DEFINE_integer("prefill_len", 8192, "Prompt tokens of the end-to-end prefill run.")
flags.DEFINE_float("time_budget_s", 540, "Skip the remaining checks after this many seconds.")
flags.DEFINE_bool("smoke", False, "Tiny shapes and the tiny preset, kernels interpreted off the GPU (CPU smoke run).")


def _check_moe_tiles(values):
    for t in values:
        parts = t.split(":")
        if len(parts) not in (4, 6) or not all(p.isdigit() for p in parts):
            return f"tile {t!r}: expected block_d:block_f:num_warps:d_split[:down_cols:down_rows] (integers)"
    return None


common.check_names("sections", ("moe", "decode_attention", "rope_cache", "slot_lookup", "route_decode",
                                "flash_prefill", "e2e", "e2e_prefill"))
common.check_names("moe_formats", ("dense", "int8", "fp8", "int4"))
common.check_numbers("moe_slots", int, low=1)
common.check_numbers("batches", int, low=1)
common.validate("moe_tiles", _check_moe_tiles)
for _name in ("repeats", "e2e_layers", "e2e_slots", "prompt_len", "prefill_len"):
    flags.register_validator(_name, lambda v: v >= 1, "must be >= 1")
flags.register_validator("e2e_steps", lambda v: v >= 0, "must be >= 0")

# qwen3-30b-a3b shapes (--smoke replaces them in main)
D, F, K = 2048, 768, 8
HQ, HKV, HD = 32, 4, 128
S_MAX, FILLED, PREFILL = (1024, 8192), 600, ((8192, 0), (1024, 4096))
PRESET = "qwen3-30b-a3b"
INTERPRET = False  # kernels called directly run in Pallas interpret mode (off the GPU)
#: Largest |kernel - reference| a flash prefill row may show (bf16 outputs of unit-scale random inputs: 0.016 measured)
FLASH_TOL = 0.05
#: (query heads, KV heads, head dim) of the flash_prefill section: qwen3's attention and the qwen3.5 family's
#: gated attention (where ``mgpu_block_kv`` takes key blocks of 64).
FLASH_HEADS = ((HQ, HKV, HD), (16, 2, 256))
T0 = time.perf_counter()
OUT: dict = {"script": "experiments/check_kernels_gpu.py", "checks": []}


def _save():
    OUT["elapsed_s"] = time.perf_counter() - T0
    common.write_json(FLAGS.out_dir, "check_kernels_gpu.json", OUT)


def _over_budget() -> bool:
    return time.perf_counter() - T0 > FLAGS.time_budget_s


def check(section: str, name: str, fn, **info):
    """Runs one check; its row (or error) is appended and the JSON rewritten."""
    row = {"section": section, "name": name, **info}
    if _over_budget():
        row["skipped"] = "time budget"
    else:
        t = time.perf_counter()
        try:
            row.update(fn())
        except Exception as e:  # record and go on
            row["error"] = f"{type(e).__name__}: {e}"[:3000]
            row["traceback"] = traceback.format_exc()[-3000:]
        row["wall_s"] = time.perf_counter() - t
    OUT["checks"].append(row)
    print(_summary(row), flush=True)
    _save()
    return row


def _summary(row: dict) -> str:
    """One short line per check for the log (the JSON has everything)."""
    keep = ("slots", "fmt", "batch", "s_max", "T", "start", "max_abs_diff", "speedup_vs_xla", "speedup", "GBps",
            "TFLOPs", "tpot_ms", "ttft_s", "bit_identical_to_resident", "greedy_ids_equal_xla",
            "max_abs_logit_diff_vs_xla", "outputs_differing", "misses", "ids_differing", "unsupported", "skipped")
    parts = [f"{row['section']}: {row.get('name', '')}"]
    for key in ("xla_us", "kernel_us", "auto_us", "moe_decode_us"):
        if key in row:
            parts.append(f"{key}={row[key]['median']:.1f}")
    parts += [f"{k}={row[k]:.4g}" if isinstance(row[k], float) else f"{k}={row[k]}" for k in keep if k in row]
    if "decode_hlo" in row and row["decode_hlo"]:
        h = row["decode_hlo"]
        parts.append(f"triton={h.get('triton_calls')} copies={h.get('copies')} cache_copies={h.get('cache_copies')}")
    if "error" in row:
        parts.append("ERROR " + row["error"][:300].replace("\n", " "))
    return " ".join(parts)


def median_us(fn, *args, repeats=None) -> dict:
    """Spread of the wall time of ``fn(*args)`` (blocked) in microseconds, after two warm-ups."""
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(repeats or FLAGS.repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append((time.perf_counter() - t) * 1e6)
    return common.spread(ts)


def maxdiff(a, b) -> float:
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def kernels(value: str):
    """The kernel config ``use=value`` for what is traced inside (``registry.using``; a function must be
    jitted inside it: jax caches a trace per function)."""
    from ftjax.kernels import registry
    return registry.using(registry.KernelConfig(use=value))


# ------------------------------------------------------------------------------------------ moe
def _random_pool(s: int, fmt: str):
    """A pool of s random experts (qwen3-30b-a3b shape) in ``fmt``, made slot by slot on the device."""
    from ftjax.experts import quant

    def one(key):
        kg, kd = jax.random.split(key)
        gu = (jax.random.normal(kg, (D, 2 * F), jnp.float32) * (0.5 / D ** 0.5)).astype(jnp.bfloat16)
        dn = (jax.random.normal(kd, (F, D), jnp.float32) * (0.5 / F ** 0.5)).astype(jnp.bfloat16)
        if not formats.get(fmt).has_scales:
            return gu, dn
        qg, sg = quant.quantize(fmt, gu, 2)
        qd, sd = quant.quantize(fmt, dn, 1)
        return qg, qd, sg, sd

    keys = jax.random.split(jax.random.key(1), s)
    out = jax.jit(lambda k: jax.lax.map(one, k, batch_size=64))(keys)
    jax.block_until_ready(out)
    return (out[0], out[1], (out[2], out[3])) if formats.get(fmt).has_scales else (out[0], out[1], None)


# (block_d, block_f, num_warps, d_split[, down_cols, down_rows]) of ftjax.kernels.moe_decode (down_* left out
# or 0: the gate/up tile transposed); its defaults are the first two (d_split 4 at batch 1, 1 at batch 4:
# moe_decode.auto_d_split)
MOE_TILES = [(64, 64, 4, 1), (64, 64, 4, 4), (32, 128, 4, 4), (128, 64, 8, 4), (64, 128, 8, 8), (256, 64, 8, 2),
             (128, 32, 4, 1), (32, 64, 4, 8)]
MOE_TILES_QUANT = [(64, 64, 4, 1), (64, 64, 4, 4), (32, 128, 4, 1)]
# int4: the gate/up d_split first (1, 2, 4, 8; 96 gate/up programs at batch 1 unsplit), then wider column
# tiles, 32-row steps (the scales still read once per 64-row group), and the down stage's tile: 128 columns
# (64-byte rows, 128 programs at batch 1) or 32 (16-byte rows, 512 programs) instead of 64 (256 programs)
MOE_TILES_INT4 = [(64, 64, 4, 1), (64, 64, 4, 2), (64, 64, 4, 4), (64, 64, 4, 8), (64, 128, 4, 8), (32, 64, 4, 4),
                  (64, 64, 8, 4), (64, 64, 4, 4, 128, 64), (64, 64, 4, 4, 32, 64)]


def moe_tiles(fmt: str) -> list[tuple]:
    """The tiles the moe section times for ``fmt`` (``--moe_tiles`` when given)."""
    if FLAGS.moe_tiles:
        return [tuple(int(v) for v in t.split(":")) for t in FLAGS.moe_tiles]
    return {"dense": MOE_TILES, "int4": MOE_TILES_INT4}.get(fmt, MOE_TILES_QUANT)


def section_moe():
    from ftjax.experts import compute
    from ftjax.kernels import moe_decode as md
    sizes = list(map(int, FLAGS.moe_slots))
    for s in sizes:
        for fmt in FLAGS.moe_formats:
            if fmt != "dense" and s != max(sizes):  # quantized pools: the largest size only (64-bit offsets)
                continue
            pool = {}
            check("moe", "make pool", lambda s=s, fmt=fmt: pool.update(p=_random_pool(s, fmt)) or {}, slots=s, fmt=fmt)
            if "p" not in pool:
                continue
            gu, dn, sc = pool.pop("p")
            expert_bytes = (gu.size + dn.size) // s * gu.dtype.itemsize + (
                0 if sc is None else sum(a.size // s * 4 for a in sc))
            for batch in map(int, FLAGS.batches):
                rng = np.random.default_rng(batch)
                x = jnp.asarray(rng.standard_normal((batch, D)), jnp.bfloat16)
                slots = jnp.asarray(rng.choice(s, (batch, K), replace=False), jnp.int32)
                w = jax.nn.softmax(jnp.asarray(rng.standard_normal((batch, K)), jnp.float32)).astype(jnp.bfloat16)
                ref_fn = jax.jit(lambda x, sl, g, d, c: compute.gather_outputs_reference(x, sl, g, d, c, fmt))
                info = {"slots": s, "fmt": fmt, "batch": batch, "pairs": batch * K,
                        "weight_bytes": batch * K * expert_bytes}

                def ref_row():
                    return {"xla_us": median_us(ref_fn, x, slots, gu, dn, sc)}
                ref = check("moe", "xla gather_outputs", ref_row, **info)
                want = ref_fn(x, slots, gu, dn, sc)
                for tile in moe_tiles(fmt):
                    bd, bf, nw, ds, dc, dr = tuple(tile) + (0, 0)[len(tile) - 4:]

                    def kern_row(bd=bd, bf=bf, nw=nw, ds=ds, dc=dc, dr=dr):
                        if not md.supported(x, gu, dn, fmt, bd, bf, ds, dc, dr):
                            return {"unsupported": True}
                        fn = jax.jit(lambda x, sl, g, d, c: md.moe_decode_pairs(
                            x, sl, g, d, c, fmt, block_d=bd, block_f=bf, num_warps=nw or None, d_split=ds,
                            down_cols=dc, down_rows=dr, interpret=INTERPRET))
                        got = fn(x, slots, gu, dn, sc)
                        t = median_us(fn, x, slots, gu, dn, sc)
                        row = {"max_abs_diff": maxdiff(got, want), "max_abs_ref": float(jnp.max(jnp.abs(
                            want.astype(jnp.float32)))), "kernel_us": t,
                            "GBps": info["weight_bytes"] / (t["median"] * 1e-6) / 1e9}
                        if "xla_us" in ref:
                            row["speedup_vs_xla"] = ref["xla_us"]["median"] / t["median"]
                        return row
                    down = f" down_cols={dc} down_rows={dr}" if dc or dr else ""
                    check("moe", f"kernel bd={bd} bf={bf} warps={nw} d_split={ds}{down}", kern_row,
                          tiles=[bd, bf, nw, ds] + ([dc, dr] if down else []), **info)

                # experts_gather as the model calls it (default tiles: auto_d_split), kernels off vs on; on is
                # auto, except for int4, which auto keeps on XLA (moe_decode.maybe_pairs): there the kernel by name
                on = "interpret" if INTERPRET else ("moe_decode" if fmt == "int4" else "auto")

                def whole_op(on=on):
                    res = {}
                    for value in ("xla", on):
                        with kernels(value):
                            fn = jax.jit(lambda x, sl, ww, g, d, c: compute.experts_gather(x, sl, ww, g, d, c, fmt))
                            res[f"{value}_out"] = fn(x, slots, w, gu, dn, sc)
                            res[f"{value}_us"] = median_us(fn, x, slots, w, gu, dn, sc)
                    res["max_abs_diff"] = maxdiff(res.pop(f"{on}_out"), res.pop("xla_out"))
                    res["speedup"] = res["xla_us"]["median"] / res[f"{on}_us"]["median"]
                    return res
                check("moe", f"experts_gather xla vs {on}", whole_op, kernels=on, **info)
            gu = dn = sc = None  # free the pool before the next one
            gc.collect()


# ---------------------------------------------------------------------------------- attention
def section_decode_attention():
    from ftjax.kernels import decode_attention as da
    from ftjax.layers import attention as attention_lib
    L, layer, filled = 4, 2, FILLED
    for s_max in S_MAX:
        for batch in map(int, FLAGS.batches):
            rng = np.random.default_rng(s_max + batch)
            shape = (L, batch, s_max, HKV, HD)
            kc = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
            vc = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
            q = jnp.asarray(rng.standard_normal((batch, 1, HQ, HD)), jnp.bfloat16)
            pos = jnp.full((batch, 1), filled - 1, jnp.int32).at[0, 0].set(filled // 3)  # rows of other lengths
            ref_fn = jax.jit(lambda q, k, v, p: attention_lib.attention(q, k[layer], v[layer], p))
            want = ref_fn(q, kc, vc, pos)
            info = {"s_max": s_max, "batch": batch, "filled": filled}
            ref = check("decode_attention", "xla attention", lambda: {"xla_us": median_us(ref_fn, q, kc, vc, pos)},
                        **info)
            for bk, ns, nw in [(64, 16, 4), (64, 8, 4), (128, 16, 4), (64, 32, 4), (32, 16, 2), (128, 8, 8)]:
                def row(bk=bk, ns=ns, nw=nw):
                    fn = jax.jit(lambda q, k, v, p: da.decode_attention(q, k, v, layer, p[:, 0] + 1, block_k=bk,
                                                                        n_split=ns, num_warps=nw,
                                                                        interpret=INTERPRET))
                    got = fn(q, kc, vc, pos)
                    t = median_us(fn, q, kc, vc, pos)
                    r = {"max_abs_diff": maxdiff(got, want), "kernel_us": t}
                    if "xla_us" in ref:
                        r["speedup_vs_xla"] = ref["xla_us"]["median"] / t["median"]
                    return r
                check("decode_attention", f"kernel bk={bk} split={ns} warps={nw}", row, **info)
            kc = vc = None
            gc.collect()


def section_rope_cache():
    """``ftjax.kernels.rope_cache`` compiled vs the model's jnp path (the parts' sum, ``layers.attention.qk``,
    the cache scatter) at qwen3-30b-a3b's decode shapes: 48 layers, K split 8, S_max 4096."""
    import types

    from ftjax.kernels import rope_cache as rc
    from ftjax.layers import attention as attention_lib
    L, layer, s_max, parts, bf = (48, 7, 4096, 8, jnp.bfloat16) if not INTERPRET else (4, 3, 128, 2, jnp.bfloat16)
    cfg = types.SimpleNamespace(head_dim=HD, qk_norm="per_head", num_heads=HQ, num_kv_heads=HKV, rms_norm_eps=1e-6,
                                rope_theta=1e6, norm_offset=False, rotary_dim=HD)
    for batch in map(int, FLAGS.batches):
        def row(batch=batch):
            rng = np.random.default_rng(batch)
            qkv = jnp.asarray(rng.standard_normal((parts, batch, (HQ + 2 * HKV) * HD)), jnp.float32)
            qn, kn = (jnp.asarray(1 + 0.1 * rng.standard_normal((L, HD)), bf) for _ in range(2))
            kc, vc = (jnp.asarray(rng.standard_normal((L, batch, s_max, HKV, HD)), bf) for _ in range(2))
            pos = jnp.asarray(rng.integers(0, s_max, batch), jnp.int32)

            def ref(qkv, kc, vc, pos):
                y = jnp.sum(qkv, axis=0).astype(bf)[:, None]
                q, k, v = jnp.split(y, [HQ * HD, (HQ + HKV) * HD], axis=-1)
                q, k, v = attention_lib.qk(cfg, {"q_norm": qn[layer], "k_norm": kn[layer]}, y, pos[:, None],
                                           [q, k, v])
                rows = jnp.arange(batch)[:, None]
                return (q.reshape(batch, HKV, HQ // HKV, HD), kc.at[layer, rows, pos[:, None]].set(k)[layer],
                        vc.at[layer, rows, pos[:, None]].set(v)[layer])

            want = jax.jit(ref)(qkv, kc, vc, pos)
            got = jax.jit(lambda p, k, v, i: rc.rope_cache(p, qn, kn, k, v, layer, i, hq=HQ, hkv=HKV, eps=1e-6,
                                                           theta=1e6, dtype=bf, interpret=INTERPRET))(qkv, kc, vc, pos)
            got = (got[0][:, :, :HQ // HKV], got[1][layer], got[2][layer])
            return {"max_abs_diff": max(maxdiff(a, b) for a, b in zip(got, want)),
                    "max_abs_diff_q_k_v": [maxdiff(a, b) for a, b in zip(got, want)],
                    "differing_elements": [int(jnp.sum(a != b)) for a, b in zip(got, want)],
                    "max_abs": max(float(jnp.max(jnp.abs(b.astype(jnp.float32)))) for b in want)}
        check("rope_cache", "kernel vs jnp path", row, batch=batch, s_max=s_max, parts=parts)

        def merge_row(batch=batch):  # the epilogue: the key splits' merge in the wo product's prologue
            from ftjax.kernels import decode_attention as da
            from ftjax.kernels import dense_decode as dd
            rng = np.random.default_rng(batch + 7)
            ns, rows, g = 16, 16, HQ // HKV
            o = jnp.asarray(rng.standard_normal((batch, HKV, ns, rows, HD)), jnp.float32)
            m = jnp.asarray(3 * rng.standard_normal((batch, HKV, ns, rows)), jnp.float32)
            l = jnp.asarray(rng.uniform(0.5, 4.0, (batch, HKV, ns, rows)), jnp.float32)
            w = jnp.asarray(rng.standard_normal((L, HQ * HD, 2048)) / np.sqrt(HQ * HD), bf)
            want = jax.jit(lambda o, m, l, w: dd.dense_decode_reference(
                da.merge_splits(o, m, l, g, bf).reshape(batch, -1), w, layer))(o, m, l, w)
            got = jax.jit(lambda o, m, l, w: dd.merge_dense_decode(o, m, l, w, layer, g=g, dtype=bf,
                                                                   k_split=2 if INTERPRET else 16,
                                                                   block_k=min(64, HD),
                                                                   interpret=INTERPRET))(o, m, l, w)
            return {"max_abs_diff": maxdiff(got, want), "max_abs": float(jnp.max(jnp.abs(want.astype(jnp.float32)))),
                    "differing_elements": int(jnp.sum(got != want))}
        check("rope_cache", "merge_dense_decode vs merge then product", merge_row, batch=batch)


def section_slot_lookup():
    """``ftjax.kernels.slot_lookup`` compiled vs ``slot_table.lookup_layer`` (lru) on the GPU: a random
    decode of qwen3-30b-a3b's table at 24 GB (48 x 128 experts, 1975 slots), batch 1 and 4, every
    output compared bit for bit at each lookup; and the time of one lookup each way."""
    from ftjax.experts import slot_table as st
    from ftjax.experts.offload import routed_mask
    from ftjax.kernels import slot_lookup as sl
    layers, e, s, k = (48, 128, 1975, 8) if not INTERPRET else (3, 16, 37, 2)
    for batch in map(int, FLAGS.batches):
        def row(batch=batch):
            ref_fn = jax.jit(lambda t, l, ids, v: st.lookup_layer(t, l, routed_mask(ids, v, e), e, "lru"))
            ker_fn = jax.jit(lambda t, l, ids, v: sl.lookup_lru(ids, v, t.slot_of, t.id_of_slot, t.last_use, t.clock, l,
                                                                num_experts=e, interpret=INTERPRET))
            rng = np.random.default_rng(batch)
            table, bad, misses = st.init_slot_table(layers, e, s), 0, 0
            valid = jnp.ones((batch,), bool)
            for step in range(4 * layers):
                layer = jnp.int32(step % layers)
                ids = jnp.asarray(rng.integers(0, e, (batch, k)), jnp.int32)
                ref = ref_fn(table, layer, ids, valid)
                got = ker_fn(table, layer, ids, valid)
                want = (ref.table.slot_of, ref.table.id_of_slot, ref.table.last_use, ref.slot_of_expert,
                        ref.miss_experts, ref.miss_slots, ref.evicted_ids, ref.n_miss, ref.n_hit,
                        jnp.where(ref.miss_experts >= 0, layer * e + ref.miss_experts, -1), ref.slot_of_expert[ids])
                bad += sum(int(not jnp.array_equal(a, b)) for a, b in zip(got, want))
                misses += int(ref.n_miss)
                table = ref.table
            ids = jnp.asarray(rng.integers(0, e, (batch, k)), jnp.int32)
            return {"lookups": 4 * layers, "outputs_differing": bad, "misses": misses,
                    "xla_us": median_us(ref_fn, table, jnp.int32(0), ids, valid),
                    "kernel_us": median_us(ker_fn, table, jnp.int32(0), ids, valid)}
        check("slot_lookup", "kernel vs lookup_layer", row, batch=batch, slots=s)


def section_route_decode():
    """``ftjax.kernels.route_decode`` compiled vs ``layers.moe.top_k_route`` on the summed partial logits on the GPU:
    qwen3-30b-a3b's router (32 K-split parts of 128 logits, top-8, renormalised, bf16), batch 1 and 4, 200
    random draws each: ids differing, largest weight difference; and the time of one call each way."""
    from ftjax.config import preset
    from ftjax.kernels import route_decode as rd
    from ftjax.layers import moe
    cfg = preset("qwen3-30b-a3b") if not INTERPRET else dataclasses.replace(preset("tiny"), top_k=4)
    p, e, k = (32 if not INTERPRET else 2), cfg.num_experts, cfg.top_k
    bf = jnp.bfloat16
    ref_fn = jax.jit(lambda parts: moe.top_k_route(cfg, jnp.sum(parts, axis=0).astype(bf), bf))
    ker_fn = jax.jit(lambda parts: rd.route_decode(parts, top_k=k, norm_topk_prob=cfg.norm_topk_prob,
                                                   logits_dtype=bf, dtype=bf, interpret=INTERPRET))
    for batch in map(int, FLAGS.batches):
        def row(batch=batch):
            rng = np.random.default_rng(batch)
            ids_bad = rows_bad = 0
            wdiff = 0.0
            for _ in range(200 if not INTERPRET else 5):
                parts = jnp.asarray(rng.standard_normal((p, batch, e)) * 0.5, jnp.float32)
                (ri, rw), (gi, gw) = ref_fn(parts), ker_fn(parts)
                ids_bad += int(jnp.sum(ri != gi))
                rows_bad += int(jnp.sum(jnp.any(ri != gi, axis=-1)))
                same = jnp.all(ri == gi, axis=-1, keepdims=True)  # weights compared where the rows route alike
                diff = jnp.abs(rw.astype(jnp.float32) - gw.astype(jnp.float32))
                wdiff = max(wdiff, float(jnp.max(jnp.where(same, diff, 0.0))))
            parts = jnp.asarray(rng.standard_normal((p, batch, e)), jnp.float32)
            return {"draws": 200 if not INTERPRET else 5, "ids_differing": ids_bad, "rows_differing": rows_bad,
                    "max_abs_diff": wdiff, "xla_us": median_us(ref_fn, parts), "kernel_us": median_us(ker_fn, parts)}
        check("route_decode", "kernel vs top_k_route", row, batch=batch, parts=p)


def section_flash_prefill():
    for hq, hkv, hd in FLASH_HEADS:
        _flash_rows(hq, hkv, hd)


def _flash_rows(hq: int, hkv: int, hd: int):
    from ftjax.kernels import flash_prefill as fp
    from ftjax.layers import attention as attention_lib
    s_max = S_MAX[-1]
    for t, start in PREFILL:
        rng = np.random.default_rng(t)
        k = jnp.asarray(rng.standard_normal((1, s_max, hkv, hd)), jnp.bfloat16)
        v = jnp.asarray(rng.standard_normal((1, s_max, hkv, hd)), jnp.bfloat16)
        q = jnp.asarray(rng.standard_normal((1, t, hq, hd)), jnp.bfloat16)
        st = jnp.asarray([start], jnp.int32)
        pos = st[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
        ref_fn = jax.jit(attention_lib.attention)
        want = ref_fn(q, k, v, pos)
        info = {"T": t, "start": start, "s_max": s_max, "heads": f"{hq}/{hkv}x{hd}",
                "flops": 4 * hq * hd * sum(min(start + i + 1, s_max) for i in range(t))}
        ref = check("flash_prefill", "xla blocked attention", lambda: {"xla_us": median_us(ref_fn, q, k, v, pos)},
                    **info)

        def finish(fn, got):
            tm = median_us(fn, q, k, v, st)
            r = {"max_abs_diff": maxdiff(got, want), "kernel_us": tm, "TFLOPs": info["flops"] / tm["median"] / 1e6}
            # judged, not only recorded: the mgpu rows once ran at max |diff| 5.36 (unscaled scores) unnoticed
            r["ok"] = r["max_abs_diff"] <= FLASH_TOL
            if "xla_us" in ref:
                r["speedup_vs_xla"] = ref["xla_us"]["median"] / tm["median"]
            return r

        for bq, bk, nw, ns in [(64, 64, 4, 3), (128, 64, 8, 3), (64, 128, 4, 2), (128, 128, 8, 2), (128, 32, 4, 3)]:
            def row(bq=bq, bk=bk, nw=nw, ns=ns):
                fn = jax.jit(lambda q, k, v, s: fp.flash_attention(q, k, v, s, block_q=bq, block_k=bk, num_warps=nw,
                                                                    num_stages=ns, interpret=INTERPRET))
                return finish(fn, fn(q, k, v, st))
            check("flash_prefill", f"pallas bq={bq} bk={bk} warps={nw} stages={ns}", row, **info)
        if start == 0:
            for bq, bkv, steps in [(64, 128, 2), (64, 64, 2), (64, 128, 4)] if hd <= 128 else [(64, 64, 2),
                                                                                                 (64, 128, 2)]:
                def mrow(bq=bq, bkv=bkv, steps=steps):
                    fn = jax.jit(lambda q, k, v, s: fp.mgpu_attention(q, k, v, bq, bkv, steps))
                    return finish(fn, fn(q, k, v, st))
                check("flash_prefill", f"mgpu bq={bq} bkv={bkv} steps={steps}", mrow, **info)
        k = v = q = None
        gc.collect()


# ---------------------------------------------------------------------------------- end to end
_MODEL: dict = {}
_HLO: dict = {}


def _shape_bytes(shape: str) -> int:
    """Bytes of an HLO array shape such as ``bf16[16,1,1024,4,128]{4,3,2,1,0}`` (0 if unparsable)."""
    m = re.match(r"([a-z]+)(\d*)\[([\d,]*)\]", shape)
    if not m:
        return 0
    bits = int(m.group(2) or 8) if m.group(1) != "pred" else 8
    return int(np.prod([int(d) for d in m.group(3).split(",") if d] or [1])) * bits // 8


def decode_hlo_stats(engine, max_seq_len: int, batch: int = 1) -> dict:
    """Op counts of ``engine``'s compiled decode step (tokens [batch, 1]): Triton kernel calls, copies,
    copies of a whole KV cache ([L, B, S_max, Hkv, hd]) and the five largest copies (a kernel
    reading the carried KV cache or slot pool must not make XLA copy it every layer)."""
    cfg = engine.cfg
    cache = f"[{cfg.num_layers},{batch},{max_seq_len},{cfg.num_kv_heads},{cfg.head_dim}]"
    for _, _, shapes, exe in common.engine_programs(engine, "forward_step"):
        if (batch, 1) in [sh[0] for sh in shapes]:
            text = exe.as_text()
            copies = re.findall(r"=\s*(\S+)\s+copy(?:-start)?\(", text)  # result shapes of copy ops
            return {"triton_calls": text.count("__gpu$xla.gpu.triton"), "copies": len(copies),
                    "cache_copies": sum(cache in c for c in copies),
                    "largest_copies": sorted(copies, key=_shape_bytes, reverse=True)[:5], **common.hlo_ops(text)}
    return {}


def _model():
    if "m" not in _MODEL:
        from ftjax.checkpoint import random_model
        from ftjax.config import preset
        cfg = dataclasses.replace(preset(PRESET), num_layers=min(FLAGS.e2e_layers, preset(PRESET).num_layers))
        t = time.perf_counter()
        _MODEL["m"] = random_model(cfg, "bfloat16")
        _MODEL["m"].host_down.block_until_ready()
        OUT["e2e_model_build_s"] = time.perf_counter() - t
    return _MODEL["m"]


def _run(model, value, mode="resident", slots=None, prompt_len=None, steps=None, max_seq_len=1024, flash=None,
         tiles=None):
    """A run of an engine whose kernel config is ``KernelConfig(use=value, flash_prefill=flash, tiles=tiles)``;
    returns the GenerationResult and keeps the engine's config in ``_ENGINES[value, mode]`` and its
    decode step's op counts in ``_HLO[value, mode]``."""
    from ftjax import Engine
    from ftjax.config import EngineConfig
    from ftjax.kernels.registry import KernelConfig
    prompt = np.random.default_rng(0).integers(0, model.cfg.vocab_size, prompt_len or FLAGS.prompt_len).tolist()
    kcfg = KernelConfig(use=value, flash_prefill=flash or "auto", tiles=tiles or {})
    eng = Engine(model, EngineConfig(mode, num_slots=slots, max_seq_len=max_seq_len, kernels=kcfg))
    try:
        n = steps if steps is not None else FLAGS.e2e_steps
        res = eng.generate([prompt], n + 1, time_steps=True, keep_logits=True)
        _HLO[value, mode] = decode_hlo_stats(eng, max_seq_len)
        if steps == 0:  # prefill only: a second, timed run (the first one compiled)
            res2 = eng.generate([prompt], 1, keep_logits=True)
            res = dataclasses.replace(res, ttft_s=min(res.ttft_s, res2.ttft_s))
        _ENGINES[value, mode] = eng.describe()
    finally:
        eng = None  # the engine's device pool goes before the next run builds its own
        gc.collect()
    return res


_RUNS: dict = {}
_ENGINES: dict = {}


def best_moe_tiles():
    """(block_d, block_f, num_warps, d_split) of the fastest dense MoE kernel at batch 1 on the
    largest pool whose max abs diff stayed below 0.05, or None."""
    rows = [r for r in OUT["checks"] if r.get("section") == "moe" and r.get("fmt") == "dense"
            and r.get("batch") == 1 and "kernel_us" in r and r.get("max_abs_diff", 1) < 0.05]
    if not rows:
        return None
    big = max(r["slots"] for r in rows)
    return min((r for r in rows if r["slots"] == big), key=lambda r: r["kernel_us"]["median"])["tiles"]


def e2e_row(value: str, key: str, tiles=None) -> dict:
    """One resident decode run with kernel config use=value (and ``tiles``), kept as _RUNS[key]; diffs against
    xla."""
    res = _run(_model(), value, tiles=tiles)
    _RUNS[key] = res
    r = {"tpot_s": common.spread(res.step_s), "tpot_ms": float(np.median(res.step_s)) * 1e3,
         "ttft_s": res.ttft_s, "compile_s": res.compile_s, "decode_hlo": _HLO.get((value, "resident"), {}),
         "engine": _ENGINES.get((value, "resident"))}
    ref = _RUNS.get("xla")
    if key != "xla" and ref is not None:
        r["max_abs_logit_diff_vs_xla"] = float(np.max(np.abs(res.step_logits - ref.step_logits)))
        r["greedy_ids_equal_xla"] = res.generated_ids == ref.generated_ids
        r["speedup_vs_xla"] = float(np.median(ref.step_s) / np.median(res.step_s))
    return r


def section_e2e():
    model = _model()
    runs = _RUNS
    on = "interpret" if INTERPRET else "auto"

    def cached_row():
        n = min(8, FLAGS.e2e_steps)
        res = _run(model, on, "cached", FLAGS.e2e_slots, steps=n)
        want = runs[on].step_logits[: n + 1]
        return {"bit_identical_to_resident": bool(np.array_equal(res.step_logits, want)),
                "max_abs_diff": float(np.max(np.abs(res.step_logits - want))),
                "tpot_ms": float(np.median(res.step_s)) * 1e3, "decode_hlo": _HLO.get((on, "cached"), {}),
                "engine": _ENGINES.get((on, "cached"))}

    best = best_moe_tiles()
    for value in ("xla", on, "cached", "best_tiles", "moe_decode", "decode_attention"):
        if value == "best_tiles":  # kernels on, with the fastest accurate MoE tiles of the moe section
            if best:
                tiles = {"moe_decode": tuple(best)}
                check("e2e", f"resident decode kernels={on} tiles=moe_decode:{'/'.join(map(str, best))}",
                      functools.partial(e2e_row, on, f"{on}+best", tiles), layers=model.cfg.num_layers, tiles=best)
            continue
        if value == "cached":
            check("e2e", f"cached (kernels {on}) vs resident (kernels {on})", cached_row, slots=FLAGS.e2e_slots)
            continue

        check("e2e", f"resident decode kernels={value}", functools.partial(e2e_row, value, value),
              layers=model.cfg.num_layers, prompt_len=FLAGS.prompt_len, steps=FLAGS.e2e_steps)


def section_e2e_prefill():
    model = _model()
    n = FLAGS.prefill_len
    msl = -(-(n + 2) // 128) * 128
    runs = {}
    for name, value, flash in (("xla", "xla", None), ("flash pallas", "flash_prefill", "pallas"),
                               ("flash mgpu", "flash_prefill", "mgpu"), ("flash auto", "flash_prefill", "auto")):
        def row(name=name, value=value, flash=flash):
            res = _run(model, value, prompt_len=n, steps=0, max_seq_len=msl, flash=flash)
            runs[name] = res
            r = {"ttft_s": res.ttft_s, "compile_s": res.compile_s, "engine": _ENGINES.get((value, "resident"))}
            if name != "xla" and "xla" in runs:
                r["max_abs_logit_diff_vs_xla"] = float(np.max(np.abs(res.step_logits[0] - runs["xla"].step_logits[0])))
                r["speedup_vs_xla"] = runs["xla"].ttft_s / res.ttft_s
            return r
        check("e2e_prefill", f"resident prefill {name}", row, layers=model.cfg.num_layers, prompt_len=n)


def hbm_bandwidth() -> dict:
    """Device memory bandwidth of a large elementwise op (negate: reads and writes every byte once),
    in GB/s of bytes read + written: the speed the kernels' GBps figures compare against."""
    return common.measure_hbm((256 << 20) if FLAGS.smoke else (2 << 30), FLAGS.repeats)


SECTIONS = {"moe": section_moe, "decode_attention": section_decode_attention, "rope_cache": section_rope_cache,
            "slot_lookup": section_slot_lookup, "route_decode": section_route_decode,
            "flash_prefill": section_flash_prefill, "e2e": section_e2e, "e2e_prefill": section_e2e_prefill}


def _smoke():
    global D, F, K, HQ, HKV, HD, S_MAX, FILLED, PREFILL, PRESET, INTERPRET
    D, F, K, HQ, HKV, HD = 256, 128, 4, 4, 2, 32
    S_MAX, FILLED, PREFILL, PRESET = (128, 256), 100, ((128, 0), (64, 64)), "tiny"
    FLAGS.moe_slots, FLAGS.repeats, FLAGS.e2e_steps, FLAGS.prompt_len = ["16"], 2, 3, 20
    FLAGS.prefill_len, FLAGS.e2e_slots = 100, 16
    MOE_TILES[:] = MOE_TILES[:2]
    MOE_TILES_QUANT[:] = MOE_TILES_QUANT[:1]
    MOE_TILES_INT4[:] = MOE_TILES_INT4[:4]  # d_split 1, 2, 4, 8 (8 is unsupported at D = 256: 32-row parts)


def main(argv):
    del argv
    global INTERPRET, F
    INTERPRET = jax.default_backend() != "gpu"
    if FLAGS.smoke:
        _smoke()
    F = FLAGS.moe_ffn or F
    OUT["meta"] = common.meta()
    print(OUT["meta"], flush=True)
    check("hbm", "negate 2 GiB bf16", lambda: OUT.setdefault("hbm", hbm_bandwidth()))
    for name in FLAGS.sections:
        if name not in SECTIONS:
            OUT["checks"].append({"section": name, "error": f"unknown section; expected {list(SECTIONS)}"})
            continue
        try:
            SECTIONS[name]()
        except Exception as e:  # a section's own setup failed; the next section still runs
            OUT["checks"].append({"section": name, "error": f"{type(e).__name__}: {e}"[:3000],
                                  "traceback": traceback.format_exc()[-3000:]})
        _save()
    rows = [dict(r, ms=(r.get("kernel_us") or r.get("xla_us") or {}).get("median", 0) / 1e3,
                 error=r.get("error", "")[:50]) for r in OUT["checks"]]
    print(common.table(rows, ["section", "name", "slots", "fmt", "batch", "s_max", "T", "max_abs_diff", "ms",
                              "speedup_vs_xla", "GBps", "tpot_ms", "ttft_s", "error"]))
    print("wrote", os.path.join(FLAGS.out_dir, "check_kernels_gpu.json"))
    bad = [f"{r['section']} {r.get('name')}" for r in OUT["checks"] if r.get("ok") is False]
    if bad:
        print(f"outside tolerance: {bad}")
        sys.exit(1)


if __name__ == "__main__":
    common.run(main)
