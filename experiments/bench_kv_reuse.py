r"""TTFT with layerwise KV prefix reuse vs load-all-first vs full recompute (DESIGN.md 1.4).

  PYTHONPATH=. python3 experiments/bench_kv_reuse.py --out_dir=$OUT               # GPU (H200)
  PYTHONPATH=. python3 experiments/bench_kv_reuse.py --preset=qwen3.5-35b-a3b --out_dir=$OUT   # hybrid
  .venv/bin/python experiments/bench_kv_reuse.py --preset=tiny --dtype=float32 \
      --prefix_tokens=192 --suffix_tokens=64 --chunk_tokens=32 --prefill_chunk=128 \
      --expert_slots=32 --kv_host_gb=0.1 --h2d_mb=16 --out_dir=/tmp/kvb             # CPU smoke
  .venv/bin/python experiments/bench_kv_reuse.py --preset=tiny-hybrid --dtype=float32 \
      --prefix_tokens=192 --suffix_tokens=64 --chunk_tokens=64 --prefill_chunk=128 \
      --expert_slots=32 --kv_host_gb=0.1 --h2d_mb=16 --noprobe --out_dir=/tmp/kvb    # CPU smoke, hybrid

Scenario (the issue's): preset qwen3-30b-a3b with random weights, bf16. An earlier request of
``prefix_tokens`` (15,872 = 62 chunks of 256) is prefilled and its chunks stored in host memory
(``pinned_host``). Then a request of prefix + ``suffix_tokens`` (256) new tokens arrives; its
TTFT (prefill + first greedy token; compilation excluded; lookup included) is measured with:

* ``recompute``: the same system's miss path on an empty store (capacity 0): the whole 16,128-token
  context in prefill calls of ``prefill_chunk`` tokens at increasing start offsets.
* ``prefetch``: layerwise reuse, layer l+1's prefix KV copied inside the scan while layer l
  computes (``ftjax.kv.layerwise``, variant "prefetch"); only the suffix is computed.
* ``xs``: layerwise reuse with the chunk arrays as scan xs (the JAX docs' streaming pattern).
* ``pipelined``: layerwise reuse on the layer-pipelined driver (``ftjax.runtime.drivers``: one
  program per layer, layer l+1's prefix rows copied from Python while layer l computes), run by an
  engine of its own with ``EngineConfig.prefill_driver="pipelined"`` (after the other loads; the
  first engine is freed first) and the KV load "xs" (the driver hands each layer its slices); once
  per ``--prefix_copies`` value, each by an engine of its own with that ``EngineConfig.prefix_copy``
  (``put`` from Python, row ``pipelined``; ``in_program``, row ``pipelined_in_program``: each
  layer's program copies the next layer's slices), and for ``put`` once per ``--prefix_copy_layers``
  value (``EngineConfig.prefix_copy_layers``: one put per group of that many layers, a group
  ahead; rows ``pipelined_g<n>`` for n > 1). Every load's row records its engine's config
  (``engine``: ``Engine.describe()``, ``prefix_copy`` and the resolved group included).
* ``all_first``: the ablation: every hit chunk is ``device_put`` to the device (timed:
  ``load_s``), then the suffix prefill runs with no host copies.

for the expert modes ``cached`` (expert offload, slots planned from ``--vram_budget_gb``) and
``resident`` (whole model on the device). ``--prefill_driver`` is the engine's driver for the
recompute and the scan loads (under "auto" a GPU runs the calls that stream experts on the
pipelined driver; each load records its calls per driver, ``driver_calls``). Each reuse
repetition uses a fresh random suffix (so it hits exactly the 62 stored chunks; its own new
chunk is stored, as in serving). Before them, one untimed warm-up request per load runs the
first recompute's prompt against a copy of the store's prefix entries (the same arrays, its own
LRU, so nothing it stores reaches the timed store): its first greedy token must equal the
recompute's (``first_token_equals_recompute``; the logits differ by rounding only, since the
calls cut the sequence elsewhere: ``max_abs_logit_diff_vs_recompute``).

Derived figures: speedup = TTFT recompute / TTFT reuse (target >= 10); hidden = (TTFT all_first -
TTFT layerwise) / load_s of all_first, for each layerwise load including ``pipelined`` (target
>= 0.8: layerwise hides >= 80% of the load time); achieved GB/s of the all-first load; the in-scan
copy alone (no model math, ``load_prefix_only``) and its GB/s; ``B_P``, whole-array pinned_host ->
device ``device_put`` bandwidth measured in this run; and op counts of the compiled reuse programs
(copy-start/copy-done show asynchronous copies; for ``pipelined``, one layer's program).

Chunk sizes are read from the entries the earlier request stored (``chunk_layout`` of each mode;
top level: ``chunk_bytes`` = ``chunk_kv_bytes`` + ``chunk_state_bytes``). The hybrid family
(``qwen3_5_moe``, e.g. ``--preset=qwen3.5-35b-a3b``; ``ftjax.layers.gated_deltanet``) has K/V only in its
full-attention layers (1 in 4), and each stored chunk is ``(kv [L_att, 2, C, Hkv, hd], conv
[G, Nl, K-1, conv_dim], rec [G, Nl, Hv, dk, dv] float32)``: the linear layers' state at the
chunk's end (~63 MB per chunk for the 35B-A3B, beside 5 MB of K/V). A layerwise load copies the
K/V of every hit chunk but only the last chunk's state (``layerwise_copy_bytes``); the all-first
ablation copies whole entries. For this family the chunk must be a multiple of 64 tokens, and two
parts are skipped with the reason in ``in_scan_copy_only`` / ``loads_skipped``: the in-scan copy
alone (``load_prefix_only`` scans K/V layers only, not the block scan that loads the state) and
``pipelined`` (a call with a KV hook on a model with a layer kind that carries a recurrent state runs
on the layer scan only: ``CallPlanner.pipelines``).

Every engine (the probes' too) runs with the kernel config of the kernel flags (``--kernels``,
``--kernel_tiles``, ... as ``ftjax.generate``; ``EngineConfig.kernels``), recorded in each load's
``engine``.

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

from experiments import common  # noqa: E402
from experiments.common import hlo_ops, measure_h2d, meta, spread, table, write_json  # noqa: E402
from ftjax import Engine  # noqa: E402
from ftjax import layers as layer_kinds  # noqa: E402
from ftjax import model as model_lib  # noqa: E402
from ftjax.checkpoint import DTYPES, random_model  # noqa: E402
from ftjax.config import (EXPERT_MODES, KV_LOADS, PREFILL_DRIVERS, PREFIX_COPIES, EngineConfig,  # noqa: E402
                          KVOffloadConfig, ModelConfig, preset)
from ftjax.layers.gated_deltanet import DELTA_CHUNK  # noqa: E402
from ftjax.runtime.planner import GB, plan_memory  # noqa: E402
from ftjax.runtime.programs import compiled_programs  # noqa: E402
from ftjax.kv import prefix_cache as pc_lib  # noqa: E402
from ftjax.kv.host_store import HostKVStore, entry_nbytes  # noqa: E402
from ftjax.kv.layerwise import bucket_chunks, load_prefix_only  # noqa: E402

#: Loads of ``--loads``: the KV offload config's loads, and layerwise reuse on the pipelined driver.
LOADS = KV_LOADS + ("pipelined",)

FLAGS = flags.FLAGS
flags.DEFINE_string("preset", "qwen3-30b-a3b", "Model shape (random weights).")
flags.DEFINE_string("dtype", "bfloat16", "Compute, expert bank and KV dtype.")
flags.DEFINE_float("vram_budget_gb", 8.0, "Device budget (GB) that sizes the expert cache of mode 'cached'.")
flags.DEFINE_integer("expert_slots", None, "Slots of mode 'cached' instead of --vram_budget_gb.")
flags.DEFINE_list("modes", ["cached", "resident"], "Expert modes (offloading first: resident needs the pool).")
flags.DEFINE_list("loads", ["prefetch", "xs", "all_first"], f"Prefix loads to compare, of {', '.join(LOADS)} "
                  "(pipelined: layerwise reuse on the layer-pipelined driver, run last, by an engine of its own).")
flags.DEFINE_list("prefix_copies", ["put"], "How the 'pipelined' load copies each layer's prefix slices "
                  f"(EngineConfig.prefix_copy, one engine and run of the load per value): {', '.join(PREFIX_COPIES)}; "
                  "rows 'pipelined' (put) and 'pipelined_<copy>'.")
flags.DEFINE_list("prefix_copy_layers", ["4"], "With the put copy: layers of prefix rows per device_put "
                  "(EngineConfig.prefix_copy_layers; default 4 as the engine's), one engine and run per value; rows "
                  "'pipelined' (1) and 'pipelined_g<n>'.")
flags.DEFINE_enum("prefill_driver", "auto", list(PREFILL_DRIVERS), "EngineConfig.prefill_driver of the runs "
                  "(recompute and the loads other than 'pipelined', which always runs on the pipelined driver).")
flags.DEFINE_integer("prefix_tokens", 15872, "Tokens stored by the earlier request (a multiple of chunk_tokens).")
flags.DEFINE_integer("suffix_tokens", 256, "New tokens after the stored prefix.")
flags.DEFINE_integer("chunk_tokens", 256, "Tokens per stored KV chunk (hybrid family: a multiple of 64).")
flags.DEFINE_integer("prefill_chunk", 8192, "Most tokens per prefill call (a multiple of chunk_tokens).")
flags.DEFINE_float("kv_host_gb", None, "Host KV store capacity, GB (default: room for the prefix's chunks and "
                   "4 more, at least 4 GB).")
flags.DEFINE_enum("store_route", "scan", ["scan", "after"], "Where new chunks go to host memory "
                  "(falls back to 'after' if 'scan' fails to compile).")
flags.DEFINE_integer("reps", 3, "Timed repetitions of each reuse load (after one warm-up).")
flags.DEFINE_integer("recompute_reps", 1, "Timed repetitions of the recompute (warmed by the earlier request).")
flags.DEFINE_integer("h2d_mb", 512, "Size of the B_P device_put measurement, MiB.")
flags.DEFINE_boolean("hlo", True, "Write the compiled reuse programs' HLO (first mode) and count their ops.")
flags.DEFINE_integer("seed", 0, "Prompt seed.")
flags.DEFINE_boolean("probe", True, "First run each variant on the tiny preset of the family (tiny, or "
                     "tiny-hybrid) in a child process (XLA can abort the process on unsupported host-memory ops); "
                     "drop the variants that fail.")
flags.DEFINE_string("probe_only", None, "Internal: run the probe of this variant and print one JSON line.")
flags.DEFINE_float("time_budget_s", 400.0, "Skip the modes not yet started once this many seconds have passed "
                   "(the JSON is rewritten after every mode).")
flags.DEFINE_string("out_dir", "experiments/results/kv_reuse", "Where the JSON goes.")
common.define_kernel_flags()  # the kernel config of every engine (EngineConfig.kernels)
common.check_preset()
common.check_choice("dtype", DTYPES)
common.check_names("modes", EXPERT_MODES)
common.check_names("loads", LOADS)
common.check_names("prefix_copies", PREFIX_COPIES)
common.check_numbers("prefix_copy_layers", int, low=1)
for _name in ("chunk_tokens", "prefill_chunk", "reps", "recompute_reps", "h2d_mb"):
    flags.register_validator(_name, lambda v: v >= 1, "must be >= 1")
flags.register_validator("expert_slots", lambda v: v is None or v >= 1, "must be >= 1")


# ---- the family's limits -----------------------------------------------------------------------
def pipelined_refusal(cfg: ModelConfig) -> str | None:
    """Why the layer-pipelined driver cannot run ``cfg`` (the message of ``EngineConfig.for_model``),
    or None when it can. Asked with an offloading config, the one the config checks it for."""
    try:
        EngineConfig("cached", num_slots=cfg.num_experts, max_seq_len=min(512, cfg.max_position_embeddings),
                     prefill_driver="pipelined").for_model(cfg)
    except ValueError as e:
        return f"EngineConfig refuses prefill_driver='pipelined' for {cfg.model_type}: {e}"
    stateful = [k for k in model_lib.structure(cfg).pattern if layer_kinds.get(k).state == ("conv", "rec")]
    if stateful:  # CallPlanner.pipelines keeps a call with a KV hook on the scan for such a model
        return (f"{cfg.model_type} has layer kind {', '.join(dict.fromkeys(stateful))} (a recurrent state): a "
                "call with a KV hook runs on the layer scan only (CallPlanner.pipelines)")
    return None


SCAN_COPY_HYBRID = ("load_prefix_only copies K/V chunks [L, 2, C, Hkv, hd] through a scan over K/V layers; a "
                    "hybrid chunk is (kv, conv, rec) whose linear state the KV hook loads for the model's block "
                    "scan (LayerwiseKV.load_state), which that measurement does not model")


def chunk_layout(entry) -> dict:
    """Bytes and shapes of one stored chunk: its K/V array, and for a hybrid model the linear
    states after it (``(kv, conv, rec)``). Sizes in bytes."""
    parts = entry if isinstance(entry, tuple) else (entry,)
    kv, states = parts[0], parts[1:]
    return {"bytes": entry_nbytes(entry), "kv_bytes": entry_nbytes(kv), "state_bytes": entry_nbytes(states),
            "kv_shape": list(kv.shape), "state_shapes": [list(a.shape) for a in states],
            "dtypes": [str(a.dtype) for a in parts]}


# ---- probes ---------------------------------------------------------------------------------
#: Probes of a load of ``--loads`` (the variant is the load's name), in the order they are run.
LOAD_PROBES = ("prefetch", "xs", "all_first", "pipelined")
#: Every probe: the loads', the pipelined load's in-program prefix copy, and the in-scan store route.
PROBES = LOAD_PROBES + ("pipelined_in_program", "store_scan")


def probe_variants(cfg: ModelConfig, loads, route: str) -> list[str]:
    """The probes a run needs: one per requested load the family can run (:data:`LOAD_PROBES`),
    ``pipelined_in_program`` with ``--prefix_copies`` in_program, and the in-scan store route when
    it is asked for."""
    pipelined = "pipelined" in loads and not pipelined_refusal(cfg)
    out = [v for v in LOAD_PROBES if v in loads and (v != "pipelined" or pipelined)]
    out += ["pipelined_in_program"] if pipelined and "in_program" in FLAGS.prefix_copies else []
    return out + (["store_scan"] if route == "scan" else [])


def probe(variant: str) -> dict:
    """Child process: a reuse request on the tiny preset of ``--preset``'s family (bf16) with this
    variant. ``ok`` means it compiled and ran; the logit difference to a full recompute (the miss
    path, other call shapes, so not bit-equal) is recorded, not judged."""
    hybrid = preset(FLAGS.preset).is_hybrid
    model = random_model(preset("tiny-hybrid" if hybrid else "tiny"), "bfloat16")
    c, n, first_n = (64, 200, 136) if hybrid else (32, 136, 96)  # hybrid chunks sit on 64-token delta-rule chunks
    load = {"store_scan": "all_first", "pipelined": "xs", "pipelined_in_program": "xs"}.get(variant, variant)
    route = "scan" if variant == "store_scan" else "after"
    driver = "pipelined" if variant.startswith("pipelined") else "scan"
    copy = "in_program" if variant == "pipelined_in_program" else "put"  # the prefix copy this probe stands for
    engine = Engine(model, EngineConfig("resident", max_seq_len=256, prefill_driver=driver, prefix_copy=copy,
                                        kernels=common.kernel_config()))
    mgr = pc_lib.PrefixCache(HostKVStore(10**8), KVOffloadConfig(chunk_tokens=c, load=load, store_route=route,
                                                                 prefill_chunk=128))
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, model.cfg.vocab_size, n).tolist()
    first = timed_request(engine, mgr, prompt[:first_n])
    cache = engine.new_cache(1)
    req = engine.prepare_prefill([prompt], cache, mgr)
    logits, cache, _, _ = engine.prefill([prompt], cache, kv_manager=mgr, request=req)
    out = {"variant": variant, "ok": True, "model_type": model.cfg.model_type, "stored": first["chunks_stored"],
           "reused": req.reused_tokens, "finite": bool(jnp.all(jnp.isfinite(logits))),
           "driver_calls": dict(engine.prefill_driver_calls)}
    try:
        ref_mgr = pc_lib.PrefixCache(HostKVStore(0), KVOffloadConfig(chunk_tokens=c, store_route="after",
                                                                     prefill_chunk=128))
        c2 = engine.new_cache(1)
        r = engine.prepare_prefill([prompt], c2, ref_mgr)
        ref, _, _, _ = engine.prefill([prompt], c2, kv_manager=ref_mgr, request=r)
        out["max_abs_logit_diff_vs_recompute"] = float(jnp.max(jnp.abs(logits - ref)))
        out["max_abs_logit"] = float(jnp.max(jnp.abs(ref)))
    except Exception as e:  # noqa: BLE001 -- the reference must not fail the probe
        out["reference_error"] = f"{type(e).__name__}: {e}"[:500]
    return out


def run_probes(variants) -> dict:
    """Runs each probe in its own child process at once (no GPU memory preallocation)."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.environ.get("PYTHONPATH", "")]))
    procs = {v: subprocess.Popen([sys.executable, os.path.abspath(__file__), f"--probe_only={v}",
                                  f"--preset={FLAGS.preset}", *common.kernel_flag_args()], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for v in variants}
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


def timed_request(engine, mgr, prompt, keep_logits: bool = False) -> dict:
    """Lookup and compile (``prepare_prefill``), then the timed prefill and first greedy token.

    Returns the request's record (``PrefixRequest.record``) with ``ttft_s`` (seconds, lookup
    included), ``first_token`` (the greedy id) and, with ``keep_logits``, ``logits`` (float32
    numpy [V], the last prompt token's)."""
    cache = engine.new_cache(1)
    req = engine.prepare_prefill([prompt], cache, mgr)
    t0 = time.perf_counter()
    logits, cache, _, _ = engine.prefill([prompt], cache, kv_manager=mgr, request=req)
    tok = _greedy(logits)
    tok.block_until_ready()
    ttft = time.perf_counter() - t0 + req.lookup_s
    out = dict(req.record(), ttft_s=ttft, first_token=int(tok[0]))
    if keep_logits:
        out["logits"] = np.asarray(logits[0], np.float32)
    del cache, logits
    return out


def _copy_layers() -> list[int]:
    """``--prefix_copy_layers`` as integers.
    Raises:
      app.UsageError: a value that is not an integer >= 1."""
    try:
        values = [int(x) for x in FLAGS.prefix_copy_layers]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise app.UsageError(f"--prefix_copy_layers {FLAGS.prefix_copy_layers}: expected integers >= 1")
    return values


def reuse_executables(mode: str, load: str, copy: str | None = None, rows: int = 1, kernels=None) -> list:
    """Compiled reuse programs (with a prefix) of this mode and load, from the shared program cache
    (``ftjax.runtime.programs``); for ``pipelined``, its layer programs that take a prefix, of prefix
    copy ``copy`` (``EngineConfig.prefix_copy``; None: "put") and ``rows`` layers per copy group: with
    "in_program", the ones that also copy the next layer's slices (more arguments) first, not the
    last layer's. ``kernels``: only the programs of this ``KernelConfig`` (None: any)."""
    if load == "pipelined":
        next_copies = (copy or "put") == "in_program"
        found = [(len(signature), exe) for _, statics, signature, exe in compiled_programs("layer_program")
                 if statics["opts"].has_prefix and statics["opts"].step.mode == mode
                 and (kernels is None or statics["opts"].step.kernels == kernels)
                 and statics["opts"].prefix_next == next_copies
                 and any(len(s[0]) == 5 and s[0][0] == rows and s[0][1] == 2 for s in signature)]
        return [exe for _, exe in sorted(found, key=lambda x: -x[0])]
    variant = "xs" if load == "all_first" else load
    kind = "device" if load == "all_first" else None
    found = []
    for _, statics, signature, exe in compiled_programs("forward_step"):
        prefix = [s for s in signature if len(s[0]) == 5 and s[0][1] == 2]
        opts = statics["opts"]
        if opts.mode != mode or opts.kv is None or opts.kv.variant != variant or not prefix:
            continue
        if kernels is not None and opts.kernels != kernels:
            continue
        if (kind == "device") != all(s[2] == "device" for s in prefix):
            continue
        found.append(exe)
    return found


def load_only(store_sharding, cfg, dtype, n_chunks: int, max_seq_len: int, reps: int) -> dict:
    """The in-scan prefix copy alone (no model math): ``load_prefix_only`` per variant. K/V chunks
    only (every layer with K/V: the families other than the hybrid one)."""
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
def _calls_since(engine, before: dict) -> dict:
    return {k: engine.prefill_driver_calls[k] - before.get(k, 0) for k in engine.prefill_driver_calls}


def run_mode(model, mode: str, slots, max_seq_len: int, prefix: list[int], rng, write_hlo: bool,
             deadline: float, store_bytes: int, progress=lambda row: None) -> dict:
    """The earlier request, the recompute and every load of ``FLAGS.loads`` for one expert mode.
    Returns the mode's row (see the module docstring); ``progress(row)`` gets the row so far after the
    recompute and after each load, so that a run cut by a time limit keeps what it measured."""
    cfg = model.cfg
    c = FLAGS.chunk_tokens

    def new_engine(driver, prefix_copy="put", copy_layers=1):
        return Engine(model, EngineConfig(mode, num_slots=slots, max_seq_len=max_seq_len, prefill_driver=driver,
                                          prefix_copy=prefix_copy, prefix_copy_layers=copy_layers,
                                          kernels=common.kernel_config()))

    engine = new_engine(FLAGS.prefill_driver)
    store = HostKVStore(store_bytes)
    route = FLAGS.store_route
    row: dict = {"mode": mode, "slots": engine.num_slots, "prefill_driver": FLAGS.prefill_driver}

    chunk = FLAGS.prefill_chunk

    def manager(load, st=None):
        kv_load = "xs" if load == "pipelined" else load  # the driver hands each layer its prefix slices
        return pc_lib.PrefixCache(st if st is not None else store,
                                  KVOffloadConfig(chunk_tokens=c, load=kv_load, store_route=route,
                                                  prefill_chunk=chunk))

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
            store = HostKVStore(store_bytes)
            del engine
            gc.collect()
            engine = new_engine(FLAGS.prefill_driver)
    row["prefill_chunk_used"] = chunk
    row["store_route"] = route
    row["store_request"] = first
    # the prefix's stored entries: their real layout and bytes, and the warm-up requests' store
    prefix_keys = manager("prefetch").keys(engine, prefix)
    entries = [store.peek(k) for k in prefix_keys]
    entries = entries[: next((i for i, e in enumerate(entries) if e is None), len(entries))]
    if entries:
        row["chunk_layout"] = dict(chunk_layout(entries[0]), bytes_expected=manager("prefetch").entry_bytes(engine))
    print(f"[{mode}] earlier request: {len(prefix)} tokens, {first['chunks_stored']} chunks stored"
          + (f" ({row['chunk_layout']['kv_bytes']} B K/V + {row['chunk_layout']['state_bytes']} B state each)"
             if entries else "") + f", TTFT {first['ttft_s']:.3f} s", flush=True)

    def check_store():
        """A store holding the prefix's entries (the same host arrays, adopted, no copy) and nothing
        else: the warm-up request's, so that the chunk it stores stays out of the timed store."""
        st = HostKVStore(store_bytes)
        for k, e in zip(prefix_keys, entries):
            st.put(k, e, copy=False)
        return st

    def new_prompt():
        return prefix + rng.integers(0, cfg.vocab_size, FLAGS.suffix_tokens).tolist()

    # full recompute: the miss path on an empty store (nothing kept)
    rec_prompts = [new_prompt() for _ in range(FLAGS.recompute_reps)]
    before = dict(engine.prefill_driver_calls)
    rec = [timed_request(engine, manager("prefetch", HostKVStore(0)), p, keep_logits=i == 0)
           for i, p in enumerate(rec_prompts)]
    ref_logits, ref_token = rec[0].pop("logits"), rec[0]["first_token"]
    row["recompute"] = {"ttft_s": spread([r["ttft_s"] for r in rec]), "prefill_calls": rec[0]["prefill_calls"],
                        "first_token": ref_token, "driver_calls": _calls_since(engine, before)}
    print(f"[{mode}] recompute {len(prefix) + FLAGS.suffix_tokens} tokens: TTFT "
          f"{row['recompute']['ttft_s']['median']:.3f} s", flush=True)
    progress(row)

    compile_s = 0.0
    # pipelined last: it needs an engine of its own (two resident engines would hold two expert pools);
    # it runs once per --prefix_copies value, each by an engine built with that EngineConfig.prefix_copy
    # (the one before it freed first), named "pipelined" for "put" and "pipelined_<copy>" otherwise
    def name_of(load, copy, layers):
        if load != "pipelined":
            return load
        return f"pipelined_{copy}" if copy != "put" else ("pipelined" if layers == 1 else f"pipelined_g{layers}")

    variants = [(load, name_of(load, copy, layers), copy, layers)
                for load in sorted(FLAGS.loads, key=lambda x: x == "pipelined")
                for copy in (FLAGS.prefix_copies if load == "pipelined" else [None])
                for layers in (_copy_layers() if copy == "put" else [1])]
    row["loads_measured"] = []
    for load, name, copy, layers in variants:
        if time.perf_counter() > deadline:
            row.setdefault("skipped_loads", []).append(name)
            continue
        try:  # a failing load (a device OOM, say) must not lose the mode's other loads
            if load == "pipelined" and (engine.config.prefill_driver != "pipelined"
                                        or engine.config.prefix_copy != copy
                                        or engine.config.prefix_copy_layers != layers):
                compile_s += engine.compile_s
                engine = None  # freed before the next one is built
                gc.collect()
                engine = new_engine("pipelined", copy, layers)
            mgr = manager(load)
            check = timed_request(engine, manager(load, check_store()), rec_prompts[0], keep_logits=True)  # warm-up
            before = dict(engine.prefill_driver_calls)
            runs = [timed_request(engine, mgr, new_prompt()) for _ in range(FLAGS.reps)]
            r0 = runs[0]
            res = {"ttft_s": spread([r["ttft_s"] for r in runs]), "reused_tokens": r0["reused_tokens"],
                   "hit_chunks": r0["hit_chunks"], "prefix_chunks_passed": r0["prefix_chunks_passed"],
                   "bytes_loaded": r0["bytes_loaded"], "bytes_padding": r0["bytes_padding"],
                   "lookup_s": spread([r["lookup_s"] for r in runs]), "prefill_driver": engine.config.prefill_driver,
                   "driver_calls": _calls_since(engine, before),
                   "check_reused_tokens": check["reused_tokens"], "first_token": check["first_token"],
                   "first_token_equals_recompute": check["first_token"] == ref_token,
                   "max_abs_logit_diff_vs_recompute": float(np.max(np.abs(check["logits"] - ref_logits))),
                   "max_abs_logit_recompute": float(np.max(np.abs(ref_logits))), "engine": engine.describe()}
            if copy is not None:
                res["prefix_copy"] = copy
                res["prefix_copy_layers"] = engine.prefix_copy_rows()
            if load == "all_first":
                res["load_s"] = spread([r["load_s"] for r in runs])
                res["compute_s"] = spread([r["ttft_s"] - r["load_s"] for r in runs])
                res["load_GBps"] = (r0["bytes_loaded"] + r0["bytes_padding"]) / res["load_s"]["median"] / 1e9
            exes = reuse_executables(mode, load, copy, engine.prefix_copy_rows() if load == "pipelined" else 1,
                                     engine.config.kernels)
            if exes:
                text = exes[0].as_text()
                res["hlo_ops"] = hlo_ops(text)
                if write_hlo:
                    with open(os.path.join(FLAGS.out_dir, f"hlo_kv_reuse_{name}.txt"), "w") as f:
                        f.write(text)
            row[name] = res
            row["loads_measured"].append(name)
            print(f"[{mode}] {name}: TTFT {res['ttft_s']['median']:.4f} s, reused {res['reused_tokens']} tokens"
                  + (f", load {res['load_s']['median']:.4f} s ({res['load_GBps']:.1f} GB/s)" if "load_s" in res else "")
                  + f", first token {'=' if res['first_token_equals_recompute'] else '!='} recompute's", flush=True)
        except Exception as e:  # noqa: BLE001
            row.setdefault("load_errors", {})[name] = f"{type(e).__name__}: {e}"[:3000]
            print(f"[{mode}] {name} failed: {row['load_errors'][name]}", flush=True)
        progress(row)
        if name in row.get("load_errors", {}):
            if engine is None:  # the pipelined engine could not be built
                break

    # derived figures
    t_rec = row["recompute"]["ttft_s"]["median"]
    af = row.get("all_first")
    for load in row["loads_measured"]:
        t = row[load]["ttft_s"]["median"]
        row[load]["speedup_vs_recompute"] = t_rec / t
        if af and load != "all_first" and af["load_s"]["median"] > 0:
            row[load]["hidden_fraction"] = (af["ttft_s"]["median"] - t) / af["load_s"]["median"]
            row[load]["exposed_load_s"] = t - af["compute_s"]["median"]
    row["kv_store"] = store.stats_dict()
    row["compile_s"] = compile_s + (engine.compile_s if engine is not None else 0.0)
    del engine
    entries.clear()
    store = None  # frees the host KV store (and the entries' host arrays) before the next mode
    gc.collect()
    return row


def main(argv):
    del argv
    if FLAGS.probe_only:
        print(json.dumps(probe(FLAGS.probe_only)), flush=True)
        return
    cfg = preset(FLAGS.preset)
    c = FLAGS.chunk_tokens
    if FLAGS.prefix_tokens % c or FLAGS.prefix_tokens <= 0 or FLAGS.suffix_tokens < 1:
        raise app.UsageError("--prefix_tokens must be a positive multiple of --chunk_tokens; --suffix_tokens >= 1")
    if cfg.is_hybrid and c % DELTA_CHUNK:
        raise app.UsageError(f"--chunk_tokens must be a multiple of {DELTA_CHUNK} for {cfg.model_type} (stored "
                             f"linear states sit on the delta rule's chunk boundaries)")
    bad = [x for x in FLAGS.prefix_copies if x not in PREFIX_COPIES]
    if bad or not FLAGS.prefix_copies:
        raise app.UsageError(f"--prefix_copies {FLAGS.prefix_copies}: expected some of {', '.join(PREFIX_COPIES)}")
    _copy_layers()  # a bad value fails before the GPU is touched
    unknown = [x for x in FLAGS.loads if x not in LOADS]
    if unknown:
        raise app.UsageError(f"unknown --loads {unknown}; expected some of {', '.join(LOADS)}")
    refusal = pipelined_refusal(cfg)
    if FLAGS.prefill_driver == "pipelined" and refusal:
        raise app.UsageError(f"--prefill_driver=pipelined: {refusal}")
    loads_skipped = {}
    if "pipelined" in FLAGS.loads and refusal:
        loads_skipped["pipelined"] = refusal
    loads = [x for x in FLAGS.loads if x not in loads_skipped]
    probes, route = None, FLAGS.store_route
    if FLAGS.probe:  # before this process touches the accelerator
        t = time.perf_counter()
        probes = run_probes(probe_variants(cfg, loads, route))
        for v, r in probes.items():
            print(f"probe {v}: {'ok' if r['ok'] else 'FAILED'} "
                  + (f"(max logit diff vs recompute {r.get('max_abs_logit_diff_vs_recompute')})" if r["ok"] else
                     r["stderr_tail"][-300:]), flush=True)
        for x in loads:
            if not probes.get(x, {"ok": True})["ok"]:
                loads_skipped[x] = "its probe failed (see probes)"
        loads = [x for x in loads if x not in loads_skipped]
        if not probes.get("pipelined_in_program", {"ok": True})["ok"]:
            loads_skipped["pipelined_in_program"] = "its probe failed (see probes)"
            FLAGS.prefix_copies = [x for x in FLAGS.prefix_copies if x != "in_program"]
            if not FLAGS.prefix_copies:  # nothing left to run the pipelined load with
                loads = [x for x in loads if x != "pipelined"]
        if route == "scan" and not probes["store_scan"]["ok"]:
            route = "after"
        probes["elapsed_s"] = time.perf_counter() - t
    for x, why in loads_skipped.items():
        print(f"load {x} skipped: {why}", flush=True)
    FLAGS.loads, FLAGS.store_route = loads, route
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
            plan = plan_memory(cfg, itemsize, slots=FLAGS.expert_slots, max_seq_len=max_seq_len,
                               kernels=common.kernel_config())
        else:
            plan = plan_memory(cfg, itemsize, budget_bytes=int(FLAGS.vram_budget_gb * GB), max_seq_len=max_seq_len,
                               kernels=common.kernel_config())
        print(plan.describe(), flush=True)
    # store capacity only: one chunk's K/V and linear state are the cache bytes of C tokens of one
    # sequence (the JSON's chunk bytes are read from the stored entries)
    if FLAGS.kv_host_gb is not None:
        store_bytes = int(FLAGS.kv_host_gb * GB)
    else:
        store_bytes = max(int(4 * GB), (n_chunks + 4) * cfg.kv_cache_bytes(1, c, itemsize))
    rng = np.random.default_rng(FLAGS.seed)
    prefix = rng.integers(0, cfg.vocab_size, FLAGS.prefix_tokens).tolist()

    if cfg.is_hybrid:
        scan_copy = {"skipped": SCAN_COPY_HYBRID}
    else:
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

    def layout(rows):
        return next((r["chunk_layout"] for r in rows if "chunk_layout" in r), None)

    def write(rows):
        lay = layout(rows)
        sizes = {"chunk_bytes": None, "chunk_kv_bytes": None, "chunk_state_bytes": None, "prefix_bytes": None,
                 "prefix_kv_bytes": None, "prefix_state_bytes": None, "layerwise_copy_bytes": None}
        if lay:
            sizes = {"chunk_bytes": lay["bytes"], "chunk_kv_bytes": lay["kv_bytes"],
                     "chunk_state_bytes": lay["state_bytes"], "prefix_bytes": n_chunks * lay["bytes"],
                     "prefix_kv_bytes": n_chunks * lay["kv_bytes"], "prefix_state_bytes": n_chunks * lay["state_bytes"],
                     "layerwise_copy_bytes": n_chunks * lay["kv_bytes"] + lay["state_bytes"]}
        payload = {"meta": info, "script": "experiments/bench_kv_reuse.py", "model_type": cfg.model_type,
                   "model_build_s": build_s, "B_P": bp, "max_seq_len": max_seq_len, "kv_store_capacity": store_bytes,
                   **sizes, "prefix_chunks": n_chunks,
                   "memory_plan": plan.as_dict() if plan else None, "in_scan_copy_only": scan_copy,
                   "loads_skipped": loads_skipped,
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
                           write_hlo=FLAGS.hlo and i == 0, deadline=t0 + FLAGS.time_budget_s,
                           store_bytes=store_bytes,
                           progress=lambda r: write(rows + [dict(r, partial="the mode had not finished")]))
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
        for load in r.get("loads_measured", []):
            x = r[load]
            flat.append({"mode": r["mode"], "load": load, "ttft_ms": x["ttft_s"]["median"] * 1e3,
                         "speedup": x["speedup_vs_recompute"], "reused": x["reused_tokens"],
                         "MB_loaded": x["bytes_loaded"] / 1e6,
                         "load_ms": x["load_s"]["median"] * 1e3 if "load_s" in x else None,
                         "load_GBps": x.get("load_GBps"), "hidden": x.get("hidden_fraction"),
                         "exposed_ms": x["exposed_load_s"] * 1e3 if "exposed_load_s" in x else None,
                         "tok_eq": x["first_token_equals_recompute"]})
    lay = layout(rows)
    print(f"B_P (whole-array device_put, {FLAGS.h2d_mb} MiB) = {bp['h2d_GBps']['median']:.1f} GB/s; "
          + (f"prefix {n_chunks} chunks = {n_chunks * lay['bytes'] / 1e9:.3f} GB "
             f"(K/V {n_chunks * lay['kv_bytes'] / 1e9:.3f} GB, state {n_chunks * lay['state_bytes'] / 1e9:.3f} GB)"
             if lay else f"prefix {n_chunks} chunks (none stored)"))
    if scan_copy and "error" not in scan_copy and "skipped" not in scan_copy:
        print(f"in-scan copy alone ({scan_copy['chunks']} chunks, {scan_copy['bytes'] / 1e9:.3f} GB): "
              + ", ".join(f"{v} {scan_copy[v]['s']['median'] * 1e3:.1f} ms = {scan_copy[v]['GBps']:.1f} GB/s"
                          for v in ("prefetch", "xs")))
    elif scan_copy and "skipped" in scan_copy:
        print(f"in-scan copy alone: skipped ({scan_copy['skipped']})")
    for x, why in loads_skipped.items():
        print(f"load {x} skipped: {why}")
    print("wrote", path)
    print(table(flat, ["mode", "load", "ttft_ms", "speedup", "reused", "MB_loaded", "load_ms", "load_GBps",
                       "hidden", "exposed_ms", "tok_eq"]))


if __name__ == "__main__":
    common.run(main)
