r"""Prefill with expert offload: full-layer streaming (overlap on/off) vs on_demand vs resident,
per expert storage format (--expert_dtypes: bfloat16, int8, int4, fp8, ...: the ftjax.experts.formats registry).

  PYTHONPATH=. python3 experiments/bench_prefill.py --out_dir=experiments/results/prefill
  .venv/bin/python experiments/bench_prefill.py --preset=tiny --dtype=float32 --lengths=64,256 \
      --prefill_chunk=128 --vram_budget_gb=1.02 --out_dir=/tmp/bench_smoke       # CPU smoke
  .venv/bin/python experiments/bench_prefill.py --preset=tiny --dtype=float32 --lengths=256 \
      --prefill_chunk=128 --vram_budget_gb=1.02 --variants=stream,resident --repeats=1 \
      --expert_dtypes=bfloat16,int8,int4,fp8 --out_dir=/tmp/bench_smoke          # CPU smoke, formats

Per expert format, prompt length and variant: TTFT (prefill + first token, median of --repeats,
each from an empty expert cache, or for the stream_warm variants from the cache a short request
leaves), tokens/s, seconds per --prefill_chunk chunk, H2D bytes and achieved GB/s, device-to-device
bytes (cached experts copied into streamed layers: stream_d2d_hits), and
  bound = max(chunks x pool bytes / B_P, resident TTFT of the same format and length)
(DESIGN.md 1.3), with B_P measured in the same run and pool bytes = L x E x bytes per expert as
stored (quantized weights and their float32 scales: ``ExpertBanks.expert_bytes``). Each format
quantizes the random banks once (round to nearest) and plans its slots by its own bytes per
expert; every row names its format (``expert_dtype``), its ``expert_bytes`` and ``pool_bytes``.
Also times the grouped expert matmul (Mosaic GPU kernel vs jax.lax.ragged_dot, dense) on one
layer's 8192-token routing, and counts async-copy ops in the HLO of the streamed scan step. Every
engine runs with the kernel config of the kernel flags (``--kernels``, ``--grouped_matmul``,
``--flash_prefill``, ... as ``ftjax.generate``; ``EngineConfig.kernels``, recorded in each row's
``engine``); under ``--grouped_matmul=auto`` the engines use ragged_dot ("xla") when the Mosaic GPU
kernel failed or is unsupported in the timing above (``grouped_matmul.used``).

  PYTHONPATH=. python3 experiments/bench_prefill.py --vram_budget_gb=24 --lengths=8192 \
      --variants=stream_warm,stream_warm_no_d2d,resident     # D2D copies of cache hits on / off
"""

from __future__ import annotations

import dataclasses
import gc
import os
import sys
import time

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments import common  # noqa: E402
from ftjax import Engine  # noqa: E402
from ftjax.checkpoint import DTYPES  # noqa: E402
from ftjax.config import EngineConfig  # noqa: E402
from ftjax.experts import quant  # noqa: E402
from ftjax.runtime.planner import GB, plan_memory  # noqa: E402
from ftjax.kernels.grouped_matmul import grouped_matmul, mgpu_supported  # noqa: E402

# variant: (experts mode, prefill, overlap, prefill driver, stream_d2d_hits, warm); "auto" is the layer-pipelined
# driver on a GPU (for 16-bit dtypes: float32 runs auto on the scan). warm: before each timed prefill, a short
# request (loaded on demand, then --warm_decode_tokens decode steps) fills the slot cache, as earlier requests
# would; the stream_warm pair compares copying those cached experts device to device (the default) with copying
# every expert over PCIe. Cold variants start from an empty cache, so they have nothing to copy device to device.
VARIANTS = {"stream": ("cached", "stream", True, "auto", True, False),
            "stream_no_overlap": ("cached", "stream", False, "auto", True, False),
            "stream_scan": ("cached", "stream", True, "scan", True, False),
            "stream_scan_no_overlap": ("cached", "stream", False, "scan", True, False),
            "stream_warm": ("cached", "auto", True, "pipelined", True, True),
            "stream_warm_no_d2d": ("cached", "auto", True, "pipelined", False, True),
            "on_demand": ("cached", "on_demand", True, "auto", True, False),
            "resident": ("resident", "auto", True, "auto", True, False)}

FLAGS = flags.FLAGS
flags.DEFINE_string("preset", "qwen3-30b-a3b", "Model shape (random weights).")
flags.DEFINE_string("dtype", "bfloat16", "Compute and bank dtype.")
flags.DEFINE_float("vram_budget_gb", 8.0, "Device budget that sizes the expert cache.")
flags.DEFINE_list("lengths", ["1024", "4096", "8192", "16384"], "Prompt lengths in tokens.")
flags.DEFINE_list("variants", ["stream", "stream_no_overlap", "stream_scan", "resident"],
                  f"What to compare: {', '.join(VARIANTS)}.")
flags.DEFINE_integer("prefill_chunk", 8192, "Prefill chunk in tokens.")
flags.DEFINE_integer("repeats", 2, "Timed prefills per (length, variant).", lower_bound=1)
flags.DEFINE_integer("warmups", 1, "Untimed prefills per (length, variant) before the timed ones (their TTFTs are "
                     "recorded as first_calls_s: the first call of an engine can pay one-time work).", lower_bound=0)
flags.DEFINE_integer("warm_decode_tokens", 32, "stream_warm variants: decode steps of the request that fills the slot "
                     "cache before each timed prefill.")
common.define_expert_dtypes()
flags.DEFINE_string("out_dir", "experiments/results/prefill", "Where the JSON goes.")
common.define_kernel_flags()  # the kernel config of every engine (EngineConfig.kernels)
common.check_preset()
common.check_choice("dtype", DTYPES)
common.check_numbers("lengths", int, low=1)
common.check_names("variants", VARIANTS)
common.check_names("expert_dtypes", quant.FORMATS)
flags.register_validator("prefill_chunk", lambda v: v >= 1, "must be >= 1")
flags.register_validator("warm_decode_tokens", lambda v: v >= 1, "must be >= 1")


def bench_grouped_matmul(cfg, dtype, tokens: int = 8192) -> dict:
    """One layer's grouped expert matmul (gate_up) at ``tokens`` x top-k uneven rows."""
    e, d, f, k = cfg.num_experts, cfg.hidden_size, cfg.expert_ffn, cfg.top_k
    m = tokens * k
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    lhs = jax.random.normal(kx, (m, d), jnp.float32).astype(dtype)
    rhs = (jax.random.normal(kw, (e, d, 2 * f), jnp.float32) / d ** 0.5).astype(dtype)
    ids = jax.random.categorical(kg, jnp.zeros((e,)), shape=(m,))
    sizes = jnp.bincount(ids, length=e).astype(jnp.int32)
    out = {"rows": m, "groups": e, "K": d, "N": 2 * f, "flops": 2 * m * d * 2 * f}
    ref = None
    for impl in ("xla", "mgpu"):
        if impl == "mgpu" and not mgpu_supported(lhs, rhs):
            out[impl] = "unsupported here"
            continue
        fn = jax.jit(lambda a, b, s, impl=impl: grouped_matmul(a, b, s, impl))
        try:
            y = fn(lhs, rhs, sizes).block_until_ready()
            ts = []
            for _ in range(5):
                t = time.perf_counter()
                fn(lhs, rhs, sizes).block_until_ready()
                ts.append(time.perf_counter() - t)
            y = np.asarray(y, np.float32)
            ref = y if ref is None else ref
            rel = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
            out[impl] = {"s": common.spread(ts), "TFLOPs": out["flops"] / np.median(ts) / 1e12, "rel_err_vs_xla": rel}
        except Exception as ex:  # record: the kernel may not compile on every setup
            out[impl] = f"{type(ex).__name__}: {ex}"[:1000]
    return out


def hlo_counts(engine, stream: bool) -> dict:
    """Async-copy op counts of ``engine``'s cached scan step with ``stream`` ({} when it ran none: a
    streamed call on the layer-pipelined driver)."""
    for _, static, _, exe in common.engine_programs(engine, "forward_step"):
        if static["opts"].stream == stream and static["opts"].mode == "cached":
            return common.hlo_ops(exe.as_text())
    return {}


def main(argv):
    del argv
    info = common.meta()
    cfg, model, build_s, bp = common.build_random_model(FLAGS.preset, FLAGS.dtype)
    bp_gbps = bp["h2d_GBps"]["median"]
    itemsize = np.dtype(DTYPES[FLAGS.dtype]).itemsize
    pool_bytes = cfg.pool_bytes(itemsize)  # the banks as built (dense at --dtype)
    print(f"{info['device']}: B_P = {bp_gbps:.1f} GB/s; pool {pool_bytes / 1e9:.1f} GB; "
          f"bound per chunk {pool_bytes / bp_gbps / 1e9:.3f} s", flush=True)
    kernel = bench_grouped_matmul(cfg, jnp.dtype(DTYPES[FLAGS.dtype]))
    print("grouped matmul:", kernel, flush=True)
    kernels = common.kernel_config()
    if kernels.grouped_matmul == "auto" and not isinstance(kernel.get("mgpu"), dict):
        kernels = dataclasses.replace(kernels, grouped_matmul="xla")  # the kernel failed or is unsupported
    kernel["used"] = kernels.grouped_matmul
    lengths = [int(x) for x in FLAGS.lengths]
    rows, hlo, plans, first_logits, pools = [], {}, {}, {}, {}
    for fmt in FLAGS.expert_dtypes or [None]:
        t_q = time.perf_counter()
        fmodel = model if fmt is None else dataclasses.replace(model, banks=quant.quantize_banks(model.banks, fmt))
        jax.block_until_ready(fmodel.banks)  # quantizing runs asynchronously: not inside a timed call
        quantize_s = time.perf_counter() - t_q if fmt is not None else 0.0
        label = fmt or model.banks.fmt
        fpool = cfg.num_layers * cfg.num_experts * fmodel.expert_bytes  # weights and scales as stored
        pools[label] = fpool
        print(f"experts stored {label}: {fmodel.banks.fmt} {fmodel.banks.gate_up.dtype}, "
              f"{fmodel.expert_bytes / 1e6:.3f} MB per expert, pool {fpool / 1e9:.2f} GB, "
              f"bound per chunk {fpool / bp_gbps / 1e9:.3f} s", flush=True)
        rng = np.random.default_rng(0)  # the same prompts for every format
        for n in lengths:
            # the KV cache is sized for this prompt, so shorter prompts leave more room for slots
            max_seq_len = -(-(n + 1) // 128) * 128
            plan_of = {}
            for pipelined in (True, False):  # the layer buffers differ by driver (ftjax.runtime.planner)
                name = f"{n}/{'pipelined' if pipelined else 'scan'}"
                if FLAGS.expert_dtypes:
                    name = f"{label}/{name}"
                try:
                    plan = plan_memory(cfg, itemsize, budget_bytes=int(FLAGS.vram_budget_gb * GB),
                                       max_seq_len=max_seq_len, pipelined=pipelined, expert_bytes=fmodel.expert_bytes,
                                       kernels=common.kernel_config())
                except ValueError as ex:  # the budget does not hold this driver's buffers: its variants are skipped
                    plans[name] = {"error": str(ex)}
                    print(name, ex, flush=True)
                    continue
                plan_of[pipelined] = plan
                plans[name] = plan.as_dict()
                print(plan.describe(), flush=True)
            prompt = rng.integers(0, cfg.vocab_size, n).tolist()
            for variant in sorted(FLAGS.variants, key=lambda v: v == "resident"):
                mode, prefill, overlap, driver, d2d, warm = VARIANTS[variant]
                print(f"-- {label} {variant} at {n} tokens", flush=True)
                try:
                    config = EngineConfig(mode, num_slots=1, max_seq_len=max_seq_len, prefill=prefill,
                                          prefill_chunk=FLAGS.prefill_chunk, prefill_overlap=overlap,
                                          prefill_driver=driver, stream_d2d_hits=d2d, kernels=kernels)
                    # the driver the engine will run (a float32 model's auto is the scan on a GPU)
                    plan = plan_of[config.for_compute_dtype(np.dtype(fmodel.params["embed"].dtype).name)
                                   .pipelines_streams()]
                    eng = Engine(fmodel, dataclasses.replace(config, num_slots=plan.slots))
                    # fewer (token, expert) pairs than E: the warm-up request loads its experts on demand
                    warm_prompt = prompt[: max(1, (cfg.num_experts - 1) // cfg.top_k)]
                    ttfts, cached = [], 0
                    for _ in range(FLAGS.warmups + FLAGS.repeats):
                        eng.reset_expert_cache()  # every timed prefill starts from the same state
                        if warm:
                            eng.generate([warm_prompt], FLAGS.warm_decode_tokens)
                            cached = sum(eng.resident_experts_per_layer())
                        before = eng.expert_cache_metrics()["prefill"]
                        res = eng.generate([prompt], 1, keep_logits=n == lengths[0])
                        ttfts.append(res.ttft_s)
                        after = eng.expert_cache_metrics()["prefill"]
                        moved = after["bytes_h2d"] - before["bytes_h2d"]
                        d2d_bytes, d2d_copies = (after[k] - before[k] for k in ("bytes_d2d", "d2d_copies"))
                    if n == lengths[0]:
                        first_logits[(label, variant)] = res.step_logits[0, 0]
                    first_calls, ttfts = ttfts[:FLAGS.warmups], ttfts[FLAGS.warmups:]
                    chunks = -(-n // FLAGS.prefill_chunk)
                    ttft = float(np.median(ttfts))
                    row = {"variant": variant, "tokens": n, "slots": plan.slots, "ttft_s": common.spread(ttfts),
                           "first_calls_s": first_calls,
                           "tokens_per_s": n / ttft, "chunks": chunks, "s_per_chunk": ttft / chunks,
                           "streamed": eng.planner.streams(min(n, FLAGS.prefill_chunk)), "h2d_bytes": moved,
                           "achieved_h2d_GBps": moved / ttft / 1e9, "compile_s": eng.compile_s,
                           "stream_d2d_hits": d2d, "warm_decode_tokens": FLAGS.warm_decode_tokens if warm else 0,
                           "cached_experts_before": cached, "d2d_bytes": d2d_bytes, "d2d_copies": d2d_copies,
                           "h2d_bound_s": moved / (bp_gbps * 1e9),
                           "driver_calls": dict(eng.prefill_driver_calls),
                           "copy_path": eng.stream_copy_path,
                           "workspace_bytes": eng.programs.workspace_bytes(), "planned_bytes": plan.planned_bytes,
                           "engine": eng.describe()}
                    if variant != "resident":
                        row["copy_bound_s"] = chunks * fpool / (bp_gbps * 1e9)
                    if variant.startswith("stream") and variant not in hlo:
                        hlo[variant] = hlo_counts(eng, True)
                    del eng
                except Exception as ex:
                    row = {"variant": variant, "tokens": n, "error": f"{type(ex).__name__}: {ex}"[:2000]}
                row.update(expert_dtype=label, expert_bytes=fmodel.expert_bytes, pool_bytes=fpool,
                           quantize_s=quantize_s)
                gc.collect()
                rows.append(row)
                print({k: v for k, v in row.items() if k not in ("ttft_s", "engine")}, flush=True)
                common.write_json(FLAGS.out_dir, f"bench_prefill_{FLAGS.preset}.json",  # partial, in case of a cut
                                  {"meta": info, "partial": True, "B_P": bp, "memory_plans": plans, "results": rows})
        del fmodel
        gc.collect()
    # same math whatever the expert source: first-token logits of the first length vs resident of the same format
    by_format: dict[str, dict[str, float]] = {}
    for (label, v), lg in first_logits.items():
        ref = first_logits.get((label, "resident"))
        if ref is not None:
            by_format.setdefault(label, {})[v] = float(np.abs(np.asarray(lg) - np.asarray(ref)).max())
    logits_check = next(iter(by_format.values()), {})  # the first format's, as before --expert_dtypes
    # D2D copies of cache hits must not change the logits: stream_warm vs stream_warm_no_d2d (needs no resident run)
    d2d_check = {label: float(np.abs(np.asarray(lg) - np.asarray(first_logits[(label, "stream_warm_no_d2d")])).max())
                 for (label, v), lg in first_logits.items()
                 if v == "stream_warm" and (label, "stream_warm_no_d2d") in first_logits}
    print("max |logits - resident| at", lengths[0], "tokens:", by_format, flush=True)
    if d2d_check:
        print("max |logits D2D on - off| at", lengths[0], "tokens:", d2d_check, flush=True)
    for r in rows:  # bound = max(copy bytes / B_P, resident compute of the same prompt and format), both from this run
        res = next((x for x in rows if x.get("variant") == "resident" and x.get("tokens") == r.get("tokens")
                    and x["expert_dtype"] == r["expert_dtype"] and "ttft_s" in x), None)
        if "copy_bound_s" in r and "ttft_s" in r:
            r["bound_s"] = max(r["copy_bound_s"], res["ttft_s"]["median"] if res else 0.0)
            r["ratio_to_bound"] = r["ttft_s"]["median"] / r["bound_s"]
    for r in rows:  # overlap speed-up at the same length, driver and format
        off_variant = {"stream": "stream_no_overlap", "stream_scan": "stream_scan_no_overlap"}.get(r.get("variant"))
        if off_variant and "ttft_s" in r:
            off = next((x for x in rows if x.get("variant") == off_variant and x.get("tokens") == r["tokens"]
                        and x["expert_dtype"] == r["expert_dtype"] and "ttft_s" in x), None)
            if off:
                r["overlap_speedup"] = off["ttft_s"]["median"] / r["ttft_s"]["median"]
        if r.get("variant") == "stream_warm" and "ttft_s" in r:
            off = next((x for x in rows if x.get("variant") == "stream_warm_no_d2d" and x.get("tokens") == r["tokens"]
                        and x["expert_dtype"] == r["expert_dtype"] and "ttft_s" in x), None)
            if off:
                r["d2d_speedup"] = off["ttft_s"]["median"] / r["ttft_s"]["median"]
    for r in rows:  # speed-up of each format over the first format's same variant and length
        ref = next((x for x in rows if x["expert_dtype"] == rows[0]["expert_dtype"] and x.get("variant") == r["variant"]
                    and x.get("tokens") == r["tokens"] and "ttft_s" in x), None)
        if ref and "ttft_s" in r:
            r["speedup_vs_first_format"] = ref["ttft_s"]["median"] / r["ttft_s"]["median"]
    payload = {"meta": info, "script": "experiments/bench_prefill.py", "expert_dtypes": FLAGS.expert_dtypes,
               "model_build_s": build_s, "B_P": bp, "pool_bytes": pool_bytes, "pool_bytes_by_format": pools,
               "memory_plans": plans, "logits_max_abs_diff_vs_resident": logits_check,
               "logits_max_abs_diff_vs_resident_by_format": by_format,
               "logits_max_abs_diff_d2d_on_vs_off": d2d_check,
               "grouped_matmul": kernel, "hlo_stream_step": hlo, "results": rows}
    path = common.write_json(FLAGS.out_dir, f"bench_prefill_{FLAGS.preset}.json", payload)
    flat = [dict(r, ttft=r["ttft_s"]["median"] if "ttft_s" in r else None, pool_GB=r["pool_bytes"] / 1e9)
            for r in rows]
    print(common.table(flat, ["expert_dtype", "pool_GB", "variant", "tokens", "slots", "ttft", "s_per_chunk",
                              "achieved_h2d_GBps", "ratio_to_bound", "overlap_speedup", "speedup_vs_first_format",
                              "d2d_bytes", "d2d_speedup", "workspace_bytes"]))
    print("wrote", path)


if __name__ == "__main__":
    common.run(main)
