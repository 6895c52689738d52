r"""TTFT with layerwise KV prefix reuse vs load-all-first vs full recompute (DESIGN.md 1.4).

  PYTHONPATH=. python3 experiments/bench_kv_reuse.py --out_dir=$OUT               # GPU (H200)
  .venv/bin/python experiments/bench_kv_reuse.py --preset=tiny --dtype=float32 \
      --prefix_tokens=192 --suffix_tokens=64 --chunk_tokens=32 --prefill_chunk=128 \
      --expert_slots=32 --kv_host_gb=0.1 --h2d_mb=16 --out_dir=/tmp/kvb             # CPU smoke

Scenario (the issue's): preset qwen3-30b-a3b with random weights, bf16. An earlier request of
``prefix_tokens`` (15,872 = 62 chunks of 256) is prefilled and its chunks stored in host memory
(``pinned_host``). Then a request of prefix + ``suffix_tokens`` (256) new tokens arrives; its
TTFT (prefill + first greedy token; compilation excluded; lookup included) is measured with:

* ``recompute``: the same system's miss path on an empty store (capacity 0): the whole 16,128-token
  context in prefill calls of ``prefill_chunk`` tokens at increasing start offsets.
* ``prefetch``: layerwise reuse, layer l+1's prefix KV copied inside the scan while layer l
  computes (``ftjax.kv.layerwise``, variant "prefetch"); only the suffix is computed.
* ``xs``: layerwise reuse with the chunk arrays as scan xs (the JAX docs' streaming pattern).
* ``all_first``: the ablation: every hit chunk is ``device_put`` to the device (timed:
  ``load_s``), then the suffix prefill runs with no host copies.

for the expert modes ``cached`` (expert offload, slots planned from ``--vram_budget_gb``) and
``resident`` (whole model on the device). Each reuse repetition uses a fresh random suffix (so it
hits exactly the 62 stored chunks; its own new chunk is stored, as in serving). Derived figures:
speedup = TTFT recompute / TTFT reuse (target >= 10); hidden = (TTFT all_first - TTFT layerwise)
/ load_s of all_first (target >= 0.8: layerwise hides >= 80% of the load time); achieved GB/s of
the all-first load; the in-scan copy alone (no model math, ``load_prefix_only``) and its GB/s;
``B_P``, whole-array pinned_host -> device ``device_put`` bandwidth measured in this run; and op
counts of the compiled reuse programs (copy-start/copy-done show asynchronous copies).
Writes ONE JSON (``bench_kv_reuse_<preset>.json``), plus HLO text of the reuse programs of the
first mode, and prints a table last. Sizes in bytes, times in seconds, GB = 1e9 bytes.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import subprocess
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments.common import hlo_ops, measure_h2d, meta, spread, table, write_json  # noqa: E402
from ftjax.checkpoint import DTYPES, random_model  # noqa: E402
from ftjax.config import preset  # noqa: E402
from ftjax.engine import Engine, compiled_programs  # noqa: E402
from ftjax.config import EngineConfig, KVOffloadConfig  # noqa: E402
from ftjax.experts.planner import GB, plan_memory  # noqa: E402
from ftjax.kv import prefix_cache as pc_lib  # noqa: E402
from ftjax.kv.host_store import HostKVStore  # noqa: E402
from ftjax.kv.layerwise import bucket_chunks, load_prefix_only  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("preset", "qwen3-30b-a3b", "Model shape (random weights).")
flags.DEFINE_string("dtype", "bfloat16", "Compute, expert bank and KV dtype.")
flags.DEFINE_float("vram_budget_gb", 8.0, "Device budget (GB) that sizes the expert cache of mode 'cached'.")
flags.DEFINE_integer("expert_slots", None, "Slots of mode 'cached' instead of --vram_budget_gb.")
flags.DEFINE_list("modes", ["cached", "resident"], "Expert modes (offloading first: resident needs the pool).")
flags.DEFINE_list("loads", ["prefetch", "xs", "all_first"], "Prefix loads to compare.")
flags.DEFINE_integer("prefix_tokens", 15872, "Tokens stored by the earlier request (a multiple of chunk_tokens).")
flags.DEFINE_integer("suffix_tokens", 256, "New tokens after the stored prefix.")
flags.DEFINE_integer("chunk_tokens", 256, "Tokens per stored KV chunk.")
flags.DEFINE_integer("prefill_chunk", 8192, "Most tokens per prefill call (a multiple of chunk_tokens).")
flags.DEFINE_float("kv_host_gb", 4.0, "Host KV store capacity, GB.")
flags.DEFINE_enum("store_route", "scan", ["scan", "after"], "Where new chunks go to host memory "
                  "(falls back to 'after' if 'scan' fails to compile).")
flags.DEFINE_integer("reps", 3, "Timed repetitions of each reuse load (after one warm-up).")
flags.DEFINE_integer("recompute_reps", 1, "Timed repetitions of the recompute (warmed by the earlier request).")
flags.DEFINE_integer("h2d_mb", 512, "Size of the B_P device_put measurement, MiB.")
flags.DEFINE_boolean("hlo", True, "Write the compiled reuse programs' HLO (first mode) and count their ops.")
flags.DEFINE_integer("seed", 0, "Prompt seed.")
flags.DEFINE_boolean("probe", True, "First run each variant on the tiny preset in a child process (XLA can abort "
                     "the process on unsupported host-memory ops); drop the variants that fail.")
flags.DEFINE_string("probe_only", None, "Internal: run the probe of this variant and print one JSON line.")
flags.DEFINE_float("time_budget_s", 400.0, "Skip the modes not yet started once this many seconds have passed "
                   "(the JSON is rewritten after every mode).")
flags.DEFINE_string("out_dir", "experiments/results", "Where the JSON goes.")


# ---- probes ---------------------------------------------------------------------------------
PROBES = ("prefetch", "xs", "all_first", "store_scan")


def probe(variant: str) -> dict:
    """Child process: a reuse request on the tiny preset (bf16) with this variant. ``ok`` means it
    compiled and ran; the logit difference to a full recompute (the miss path, other call shapes,
    so not bit-equal) is recorded, not judged."""
    model = random_model(preset("tiny"), "bfloat16")
    load = "all_first" if variant == "store_scan" else variant
    route = "scan" if variant == "store_scan" else "after"
    engine = Engine(model, EngineConfig("resident", max_seq_len=256))
    mgr = pc_lib.PrefixCache(HostKVStore(10**8), KVOffloadConfig(chunk_tokens=32, load=load, store_route=route,
                                                                 prefill_chunk=128))
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, model.cfg.vocab_size, 136).tolist()
    first = timed_request(engine, mgr, prompt[:96])
    cache = engine.new_cache(1)
    req = engine.prepare_prefill([prompt], cache, mgr)
    logits, cache, _, _ = engine.prefill([prompt], cache, kv_manager=mgr, request=req)
    out = {"variant": variant, "ok": True, "stored": first["chunks_stored"], "reused": req.reused_tokens,
           "finite": bool(jnp.all(jnp.isfinite(logits)))}
    try:
        ref_mgr = pc_lib.PrefixCache(HostKVStore(0), KVOffloadConfig(chunk_tokens=32, store_route="after",
                                                                     prefill_chunk=128))
        c2 = engine.new_cache(1)
        r = engine.prepare_prefill([prompt], c2, ref_mgr)
        ref, _, _, _ = engine.prefill([prompt], c2, kv_manager=ref_mgr, request=r)
        out["max_abs_logit_diff_vs_recompute"] = float(jnp.max(jnp.abs(logits - ref)))
        out["max_abs_logit"] = float(jnp.max(jnp.abs(ref)))
    except Exception as e:  # noqa: BLE001 -- the reference must not fail the probe
        out["reference_error"] = f"{type(e).__name__}: {e}"[:500]
    return out


def run_probes() -> dict:
    """Runs every probe in its own child process at once (no GPU memory preallocation)."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.environ.get("PYTHONPATH", "")]))
    procs = {v: subprocess.Popen([sys.executable, os.path.abspath(__file__), f"--probe_only={v}"], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for v in PROBES}
    out = {}
    for v, p in procs.items():
        try:
            so, se = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            p.kill()
            so, se = p.communicate()
        line = next((x for x in so.splitlines()[::-1] if x.startswith("{")), None)
        if p.returncode == 0 and line:
            out[v] = json.loads(line)
        else:
            out[v] = {"variant": v, "ok": False, "returncode": p.returncode, "stderr_tail": se[-3000:]}
    return out


# ---- one request ---------------------------------------------------------------------------
_greedy = jax.jit(lambda logits: jnp.argmax(logits, axis=-1))


def timed_request(engine, mgr, prompt) -> dict:
    """Lookup and compile (``prepare_prefill``), then the timed prefill and first greedy token."""
    cache = engine.new_cache(1)
    req = engine.prepare_prefill([prompt], cache, mgr)
    t0 = time.perf_counter()
    logits, cache, _, _ = engine.prefill([prompt], cache, kv_manager=mgr, request=req)
    _greedy(logits).block_until_ready()
    ttft = time.perf_counter() - t0 + req.lookup_s
    del cache, logits
    return dict(req.record(), ttft_s=ttft)


def reuse_executables(mode: str, load: str) -> list:
    """Compiled reuse programs (with a prefix) of this mode and load, from the engine's AOT cache."""
    variant = "xs" if load == "all_first" else load
    kind = "device" if load == "all_first" else None
    found = []
    for _, statics, signature, exe in compiled_programs("_forward_step"):
        prefix = [s for s in signature if len(s[0]) == 5 and s[0][1] == 2]
        opts = statics["opts"]
        if opts.mode != mode or opts.kv is None or opts.kv.variant != variant or not prefix:
            continue
        if (kind == "device") != all(s[2] == "device" for s in prefix):
            continue
        found.append(exe)
    return found


def load_only(store_sharding, cfg, dtype, n_chunks: int, max_seq_len: int, reps: int) -> dict:
    """The in-scan prefix copy alone (no model math): ``load_prefix_only`` per variant."""
    shape = (cfg.num_layers, 2, FLAGS.chunk_tokens, cfg.num_kv_heads, cfg.head_dim)
    make = jax.jit(lambda k: jax.random.normal(k, shape, jnp.float32).astype(dtype), out_shardings=store_sharding)
    chunks = tuple(make(k) for k in jax.random.split(jax.random.key(1), n_chunks))
    nbytes = sum(c.nbytes for c in chunks)
    cache_shape = (cfg.num_layers, 1, max_seq_len, cfg.num_kv_heads, cfg.head_dim)
    out = {"chunks": n_chunks, "bytes": nbytes}
    for variant in ("prefetch", "xs"):
        f = jax.jit(functools.partial(load_prefix_only, variant=variant), donate_argnums=(0, 1))
        ck, cv = jnp.zeros(cache_shape, dtype), jnp.zeros(cache_shape, dtype)
        t0 = time.perf_counter()
        exe = f.lower(ck, cv, chunks).compile()
        compile_s = time.perf_counter() - t0
        times = []
        for i in range(reps + 1):
            t0 = time.perf_counter()
            ck, cv = exe(ck, cv, chunks)
            jax.block_until_ready((ck, cv))
            if i:
                times.append(time.perf_counter() - t0)
        s = spread(times)
        out[variant] = {"s": s, "GBps": nbytes / s["median"] / 1e9, "compile_s": compile_s,
                        "hlo_ops": hlo_ops(exe.as_text())}
        del ck, cv
    del chunks
    return out


# ---- one expert mode -----------------------------------------------------------------------
def run_mode(model, mode: str, slots, max_seq_len: int, prefix: list[int], rng, write_hlo: bool,
             deadline: float) -> dict:
    cfg = model.cfg
    c = FLAGS.chunk_tokens
    engine = Engine(model, EngineConfig(mode, num_slots=slots, max_seq_len=max_seq_len))
    store = HostKVStore(int(FLAGS.kv_host_gb * GB))
    route = FLAGS.store_route
    row: dict = {"mode": mode, "slots": engine.num_slots}

    chunk = FLAGS.prefill_chunk

    def manager(load, st=None):
        return pc_lib.PrefixCache(st if st is not None else store,
                                  KVOffloadConfig(chunk_tokens=c, load=load, store_route=route, prefill_chunk=chunk))

    # the earlier request: stores the prefix's chunks (also warms the long prefill program). Falls
    # back to the 'after' store route if host-memory scan outputs fail, and halves the prefill
    # call length on a device out-of-memory error.
    while True:
        try:
            first = timed_request(engine, manager("prefetch"), prefix)
            break
        except Exception as e:  # noqa: BLE001
            msg = f"{type(e).__name__}: {e}"
            oom = "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower()
            if oom and chunk // 2 >= c and (chunk // 2) % c == 0:
                row.setdefault("oom_retries", []).append({"prefill_chunk": chunk, "error": msg[:500]})
                chunk //= 2
            elif route == "scan" and not oom:
                row["store_route_scan_error"] = msg[:2000]
                route = "after"
            else:
                raise
            store = HostKVStore(int(FLAGS.kv_host_gb * GB))
            del engine
            gc.collect()
            engine = Engine(model, EngineConfig(mode, num_slots=slots, max_seq_len=max_seq_len))
    row["prefill_chunk_used"] = chunk
    row["store_route"] = route
    row["store_request"] = first
    print(f"[{mode}] earlier request: {len(prefix)} tokens, {first['chunks_stored']} chunks stored, "
          f"TTFT {first['ttft_s']:.3f} s", flush=True)

    def new_prompt():
        return prefix + rng.integers(0, cfg.vocab_size, FLAGS.suffix_tokens).tolist()

    # full recompute: the miss path on an empty store (nothing kept)
    rec = [timed_request(engine, manager("prefetch", HostKVStore(0)), new_prompt())
           for _ in range(FLAGS.recompute_reps)]
    row["recompute"] = {"ttft_s": spread([r["ttft_s"] for r in rec]), "prefill_calls": rec[0]["prefill_calls"]}
    print(f"[{mode}] recompute {len(prefix) + FLAGS.suffix_tokens} tokens: TTFT "
          f"{row['recompute']['ttft_s']['median']:.3f} s", flush=True)

    for load in FLAGS.loads:
        if time.perf_counter() > deadline:
            row.setdefault("skipped_loads", []).append(load)
            continue
        mgr = manager(load)
        runs = [timed_request(engine, mgr, new_prompt()) for _ in range(FLAGS.reps + 1)][1:]
        r0 = runs[0]
        res = {"ttft_s": spread([r["ttft_s"] for r in runs]), "reused_tokens": r0["reused_tokens"],
               "hit_chunks": r0["hit_chunks"], "prefix_chunks_passed": r0["prefix_chunks_passed"],
               "bytes_loaded": r0["bytes_loaded"], "bytes_padding": r0["bytes_padding"],
               "lookup_s": spread([r["lookup_s"] for r in runs])}
        if load == "all_first":
            res["load_s"] = spread([r["load_s"] for r in runs])
            res["compute_s"] = spread([r["ttft_s"] - r["load_s"] for r in runs])
            res["load_GBps"] = (r0["bytes_loaded"] + r0["bytes_padding"]) / res["load_s"]["median"] / 1e9
        exes = reuse_executables(mode, load)
        if exes:
            text = exes[0].as_text()
            res["hlo_ops"] = hlo_ops(text)
            if write_hlo:
                with open(os.path.join(FLAGS.out_dir, f"hlo_kv_reuse_{load}.txt"), "w") as f:
                    f.write(text)
        row[load] = res
        print(f"[{mode}] {load}: TTFT {res['ttft_s']['median']:.4f} s, reused {res['reused_tokens']} tokens"
              + (f", load {res['load_s']['median']:.4f} s ({res['load_GBps']:.1f} GB/s)" if "load_s" in res else ""),
              flush=True)

    # derived figures
    t_rec = row["recompute"]["ttft_s"]["median"]
    af = row.get("all_first")
    for load in [x for x in FLAGS.loads if x in row]:
        t = row[load]["ttft_s"]["median"]
        row[load]["speedup_vs_recompute"] = t_rec / t
        if af and load != "all_first" and af["load_s"]["median"] > 0:
            row[load]["hidden_fraction"] = (af["ttft_s"]["median"] - t) / af["load_s"]["median"]
            row[load]["exposed_load_s"] = t - af["compute_s"]["median"]
    row["kv_store"] = store.stats_dict()
    row["compile_s"] = engine.compile_s
    del engine
    store = None  # frees the host KV store before the next mode
    gc.collect()
    return row


def main(argv):
    del argv
    if FLAGS.probe_only:
        print(json.dumps(probe(FLAGS.probe_only)), flush=True)
        return
    probes, loads, route = None, list(FLAGS.loads), FLAGS.store_route
    if FLAGS.probe:  # before this process touches the accelerator
        t = time.perf_counter()
        probes = run_probes()
        for v, r in probes.items():
            print(f"probe {v}: {'ok' if r['ok'] else 'FAILED'} "
                  + (f"(max logit diff vs recompute {r.get('max_abs_logit_diff_vs_recompute')})" if r["ok"] else
                     r["stderr_tail"][-300:]), flush=True)
        loads = [x for x in loads if probes[x]["ok"]]
        if route == "scan" and not probes["store_scan"]["ok"]:
            route = "after"
        probes["elapsed_s"] = time.perf_counter() - t
    FLAGS.loads, FLAGS.store_route = loads, route
    cfg = preset(FLAGS.preset)
    c = FLAGS.chunk_tokens
    if FLAGS.prefix_tokens % c or FLAGS.prefix_tokens <= 0 or FLAGS.suffix_tokens < 1:
        raise app.UsageError("--prefix_tokens must be a positive multiple of --chunk_tokens; --suffix_tokens >= 1")
    info = meta()
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    t0 = time.perf_counter()
    model = random_model(cfg, FLAGS.dtype, seed=FLAGS.seed)
    model.host_down.block_until_ready()
    build_s = time.perf_counter() - t0
    bp = measure_h2d(FLAGS.h2d_mb * 2**20)
    print(f"{info['device']} jax {info['jax']}: random {FLAGS.preset} built in {build_s:.1f} s; "
          f"B_P = {bp['h2d_GBps']['median']:.1f} GB/s", flush=True)
    n_chunks = FLAGS.prefix_tokens // c
    context = FLAGS.prefix_tokens + FLAGS.suffix_tokens
    max_seq_len = max(-(-(context + 1) // 128) * 128, bucket_chunks(n_chunks) * c)
    itemsize = np.dtype(DTYPES[FLAGS.dtype]).itemsize
    plan = None
    if "cached" in FLAGS.modes:
        if FLAGS.expert_slots is not None:
            plan = plan_memory(cfg, itemsize, slots=FLAGS.expert_slots, max_seq_len=max_seq_len)
        else:
            plan = plan_memory(cfg, itemsize, budget_bytes=int(FLAGS.vram_budget_gb * GB), max_seq_len=max_seq_len)
        print(plan.describe(), flush=True)
    entry = cfg.num_layers * 2 * c * cfg.num_kv_heads * cfg.head_dim * itemsize
    rng = np.random.default_rng(FLAGS.seed)
    prefix = rng.integers(0, cfg.vocab_size, FLAGS.prefix_tokens).tolist()

    scan_copy = None
    try:
        scan_copy = load_only(HostKVStore(0).sharding, cfg, jnp.dtype(DTYPES[FLAGS.dtype]),
                              bucket_chunks(n_chunks), max_seq_len, FLAGS.reps)
        print(f"in-scan copy alone ({scan_copy['bytes'] / 1e9:.3f} GB): "
              + ", ".join(f"{v} {scan_copy[v]['s']['median'] * 1e3:.1f} ms = {scan_copy[v]['GBps']:.1f} GB/s"
                          for v in ("prefetch", "xs")), flush=True)
    except Exception as e:  # noqa: BLE001 -- record and go on
        scan_copy = {"error": f"{type(e).__name__}: {e}"[:2000]}

    name = f"bench_kv_reuse_{FLAGS.preset}.json"
    path = os.path.join(FLAGS.out_dir, name)

    def write(rows):
        payload = {"meta": info, "script": "experiments/bench_kv_reuse.py",
                   "model_build_s": build_s, "B_P": bp, "max_seq_len": max_seq_len,
                   "chunk_bytes": entry, "prefix_chunks": n_chunks, "prefix_bytes": n_chunks * entry,
                   "memory_plan": plan.as_dict() if plan else None, "in_scan_copy_only": scan_copy,
                   "targets": {"speedup_vs_recompute": ">= 10", "hidden_fraction": ">= 0.8"}, "probes": probes,
                   "elapsed_s": time.perf_counter() - t0, "results": rows}
        write_json(FLAGS.out_dir, name, payload)

    rows = []
    for i, mode in enumerate(sorted(FLAGS.modes, key=lambda m: m == "resident")):
        if time.perf_counter() - t0 > FLAGS.time_budget_s:
            rows.append({"mode": mode, "error": f"skipped: time budget {FLAGS.time_budget_s} s spent"})
            continue
        try:
            row = run_mode(model, mode, plan.slots if mode != "resident" else None, max_seq_len, prefix, rng,
                           write_hlo=FLAGS.hlo and i == 0, deadline=t0 + FLAGS.time_budget_s)
        except Exception as e:  # noqa: BLE001 -- one failing mode must not lose the others
            row = {"mode": mode, "error": f"{type(e).__name__}: {e}"[:3000]}
            print(f"[{mode}] failed: {row['error']}", flush=True)
        rows.append(row)
        gc.collect()
        write(rows)
    write(rows)

    flat = []
    for r in rows:
        if "error" in r:
            flat.append({"mode": r["mode"], "load": "error"})
            continue
        flat.append({"mode": r["mode"], "load": "recompute", "ttft_ms": r["recompute"]["ttft_s"]["median"] * 1e3})
        for load in [x for x in FLAGS.loads if x in r]:
            x = r[load]
            flat.append({"mode": r["mode"], "load": load, "ttft_ms": x["ttft_s"]["median"] * 1e3,
                         "speedup": x["speedup_vs_recompute"], "reused": x["reused_tokens"],
                         "MB_loaded": x["bytes_loaded"] / 1e6,
                         "load_ms": x["load_s"]["median"] * 1e3 if "load_s" in x else None,
                         "load_GBps": x.get("load_GBps"), "hidden": x.get("hidden_fraction"),
                         "exposed_ms": x["exposed_load_s"] * 1e3 if "exposed_load_s" in x else None})
    print(f"B_P (whole-array device_put, {FLAGS.h2d_mb} MiB) = {bp['h2d_GBps']['median']:.1f} GB/s; "
          f"prefix {n_chunks} chunks = {n_chunks * entry / 1e9:.3f} GB")
    if scan_copy and "error" not in scan_copy:
        print(f"in-scan copy alone ({scan_copy['chunks']} chunks, {scan_copy['bytes'] / 1e9:.3f} GB): "
              + ", ".join(f"{v} {scan_copy[v]['s']['median'] * 1e3:.1f} ms = {scan_copy[v]['GBps']:.1f} GB/s"
                          for v in ("prefetch", "xs")))
    print("wrote", path)
    print(table(flat, ["mode", "load", "ttft_ms", "speedup", "reused", "MB_loaded", "load_ms", "load_GBps",
                       "hidden", "exposed_ms"]))


if __name__ == "__main__":
    app.run(main)
