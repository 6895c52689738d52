r"""Profile first (issue 13, item 1): where the GPU time of one decode step / prefill chunk goes.

  PYTHONPATH=. python3 experiments/profile_step.py --out_dir=$OUT                        # on the GPU
  .venv/bin/python experiments/profile_step.py --preset=tiny --dtype=float32 --vram_budget_gb=1.02 \
      --prompt_len=32 --prefill_tokens=256 --warm_steps=2 --timed_steps=3 --trace_steps=2 \
      --hbm_gb=0.0625 --out_dir=/tmp/profile_smoke                                       # CPU smoke

Random weights at --preset (``ftjax.checkpoint.random_model``). Runs (--runs):

* ``cached_decode``: decode steps with an expert cache of --slots slots (0: those --vram_budget_gb leaves,
  ``ftjax.runtime.planner``), at each of --batches, with --prefetch_guesses;
* ``resident_decode``: the same with every expert on the device;
* ``resident_prefill``: one prefill chunk of --prefill_tokens tokens (one jitted call).

For each: a prompt of --prompt_len tokens is prefilled, --warm_steps decode steps run untimed,
--timed_steps are timed one by one (``step_s``: median / p10 / p90 / min / max, seconds; each step
waits for its logits), then --pipelined_steps run back to back with one wait at the end, as
``Engine.generate`` decodes (``pipelined_step_s``: their mean, seconds: the host's dispatch of a step
overlaps the device's work on the one before, so this is the TPOT a generation sees; the timed steps
add each step's dispatch and wake-up to it), then --trace_steps steps run under ``jax.profiler`` (perfetto trace in
--trace_dir), each inside a host annotation ``profile_step#<i>``. The prefill run times
--prefill_repeats calls after one warm-up and traces one. Each trace is reduced by
``experiments.timeline.step_breakdown``: per step, GPU time per op category (attention, router,
slot_table, experts, norm, head, h2d_copy, loop, other: ``timeline.CATEGORIES``), classified by
kernel name and the ``jax.named_scope`` path of each event's HLO instruction (read from the
compiled program's HLO text), plus the idle gaps inside the step; categories + gap = the step's
device span. On the CPU backend the "device" events are the host events that run each HLO
instruction, classified the same way.

Bytes and floor. Bytes each category must read from device memory, stated analytically (not
measured): non-expert weights by category (attention projections, router, norms, head: LM head,
final norm, embedding rows), experts = distinct routed experts of the traced steps (from the
step's own stats) x bytes per expert as stored, KV rows read (every filled position of each
sequence, once) and written, and the fetched experts written into their slots; activations are
left out. ``floor_hbm_s`` = HBM bytes / HBM bandwidth (measured in the same run: a negate of a
--hbm_gb GiB bfloat16 array, ``common.measure_hbm``); ``floor_h2d_s`` = fetched bytes / B_P
(host-to-device, measured in the same run); ``floor_s`` = the larger; ``ratio_to_floor`` = median
step / floor_s. XLA's own cost analysis of the compiled step (``bytes accessed``, ``flops``) is
reported beside it as ``xla_cost``: it counts a Pallas kernel by its operands (the whole pool),
so it is no floor. ``flops`` is the analytic matmul + attention count (2 per multiply-add).
Every engine runs with the kernel config of the kernel flags (``--kernel_tiles``, ``--decode_gemm``,
``--decode_graphs``, ``--min_dot_rows``, ... as ``ftjax.generate``; ``EngineConfig.kernels``, recorded
in each run's ``engine``); ``--kernels`` may be repeated: every run once per value, in this process
(an A/B of kernel choices; programs are keyed by their kernel config, so nothing is recompiled by hand).
Writes ``profile_step_<preset>.json`` (after every run, ``partial`` until the end) and prints
the tables.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
import time

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments import common  # noqa: E402
from experiments.timeline import CATEGORIES, hlo_op_names, step_breakdown, targets, trace_events  # noqa: E402
from ftjax.layers import gated_deltanet  # noqa: E402
from ftjax import Engine  # noqa: E402
from ftjax.checkpoint import DTYPES  # noqa: E402
from ftjax.config import EngineConfig  # noqa: E402
from ftjax.runtime.planner import GB, plan_memory  # noqa: E402

RUNS = ("cached_decode", "resident_decode", "resident_prefill")

FLAGS = flags.FLAGS
flags.DEFINE_string("preset", "qwen3-30b-a3b", "Model shape (random weights).")
flags.DEFINE_integer("layers", 0, "Cut the preset to its first N layers (0: all; a hybrid keeps their kinds).",
                     lower_bound=0)
flags.DEFINE_string("dtype", "bfloat16", "Compute and bank dtype.")
flags.DEFINE_float("vram_budget_gb", 24.0, "Device budget that sizes the expert cache of cached_decode.")
flags.DEFINE_integer("slots", 0, "Expert slots of cached_decode (0: as many as --vram_budget_gb leaves).",
                     lower_bound=0)
flags.DEFINE_integer("prefetch_guesses", 0, "EngineConfig.prefetch_guesses of cached_decode: each layer's experts "
                     "guessed before its token mixer and copied beside it (0: off).", lower_bound=0)
flags.DEFINE_list("batches", ["1", "4"], "Decode batch sizes.")
flags.DEFINE_list("runs", list(RUNS), f"What to profile: {', '.join(RUNS)}.")
flags.DEFINE_integer("prompt_len", 512, "Prompt tokens before the decode steps.")
flags.DEFINE_integer("warm_steps", 8, "Untimed decode steps before the timed ones.")
flags.DEFINE_integer("timed_steps", 16, "Decode steps timed one by one.")
flags.DEFINE_integer("pipelined_steps", 16, "Decode steps run back to back (one wait at the end), after the "
                     "timed ones: pipelined_step_s.")
flags.DEFINE_integer("trace_steps", 3, "Decode steps traced.")
flags.DEFINE_integer("prefill_tokens", 8192, "Tokens of the resident prefill chunk.")
flags.DEFINE_integer("prefill_repeats", 3, "Timed prefill calls (after one warm-up).")
flags.DEFINE_float("hbm_gb", 2.0, "GiB of the bfloat16 array whose negate measures the HBM bandwidth.")
flags.DEFINE_integer("hbm_repeats", 10, "Timed calls of the HBM measurement.")
flags.DEFINE_string("hlo_dir", None, "Where the compiled decode steps' HLO text goes (none: not written).")
flags.DEFINE_string("trace_dir", None, "Where the raw traces go (default: a temporary folder).")
flags.DEFINE_string("out_dir", "experiments/results/profiles", "Where the JSON goes.")
# the kernel config of every engine (EngineConfig.kernels); --kernels repeated: every run once per value
common.define_kernel_flags(multi_use=True)
common.check_preset()
common.check_choice("dtype", DTYPES)
common.check_numbers("batches", int, low=1)
common.check_names("runs", RUNS)
for _name in ("prompt_len", "timed_steps", "trace_steps", "prefill_tokens", "hbm_repeats"):
    flags.register_validator(_name, lambda v: v >= 1, "must be >= 1")
flags.register_multi_flags_validator(["prefill_repeats", "runs"], lambda d: d["prefill_repeats"] >= 1 or (
    d["prefill_repeats"] == 0 and "resident_prefill" not in d["runs"]), "--prefill_repeats must be >= 1 (0: only "
    "without the resident_prefill run)")
for _name in ("warm_steps", "pipelined_steps"):
    flags.register_validator(_name, lambda v: v >= 0, "must be >= 0")
flags.register_validator("hbm_gb", lambda v: v > 0, "must be > 0")

# int32 [B, 1]: the greedy next tokens, shaped as the decode step's input (no reshape dispatch per step)
_next_token = jax.jit(lambda logits: jnp.argmax(logits, axis=-1).astype(jnp.int32)[:, None])


# --------------------------------------------------------------------------------------------
# Analytic bytes and flops
# --------------------------------------------------------------------------------------------
def _layer_param_groups(cfg, params) -> dict[str, list]:
    """The stacked layer params by category: router, norm, experts (a hybrid's shared expert),
    linear_attention (a hybrid's Gated DeltaNet weights but its norm), attention (everything else)."""
    linear = set(gated_deltanet.param_shapes(cfg)) if cfg.is_hybrid else set()
    groups: dict[str, list] = {"attention": [], "linear_attention": [], "router": [], "norm": [], "experts": []}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params["layers"])[0]:
        name = str(path[-1].key) if hasattr(path[-1], "key") else jax.tree_util.keystr(path)
        key = name.lower()
        cat = ("router" if "router" in key else "norm" if "norm" in key else "experts" if "shared" in key else
               "linear_attention" if name in linear else "attention")
        groups[cat].append(leaf)
    return groups


def analytic_bytes(model, tokens: int, kv_rows_read: int, kv_rows_written: int, distinct_experts: float,
                   fetched_experts: float, sequences: int = 1) -> dict:
    """Bytes one step must move, by category (see the module docstring).

    tokens: embedding rows read (B for a decode step, the chunk's tokens for prefill);
    kv_rows_read / kv_rows_written: (sequence, position) K/V rows of all attention layers read /
    written; distinct_experts: distinct routed experts summed over layers; fetched_experts: experts
    copied from the host; sequences: rows of the step, each with a hybrid's recurrent and conv states read and
    written once per linear-attention layer. Returns {hbm: {category: bytes}, hbm_total, h2d_link} in bytes.
    """
    cfg, params = model.cfg, model.params
    item = jnp.dtype(params["embed"].dtype).itemsize
    nbytes = lambda xs: int(sum(x.size * jnp.dtype(x.dtype).itemsize for x in xs))  # noqa: E731
    groups = _layer_param_groups(cfg, params)
    head_w = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    kv_row = 2 * cfg.num_attention_layers * cfg.num_kv_heads * cfg.head_dim * item
    eb = model.expert_bytes
    states = 0
    if cfg.is_hybrid:
        conv, rec = gated_deltanet.state_shapes(cfg, cfg.num_linear_layers, sequences)
        states = 2 * (int(np.prod(conv)) * item + int(np.prod(rec)) * 4)  # read and written; the state is float32
    hbm = {"attention": nbytes(groups["attention"]) + (kv_rows_read + kv_rows_written) * kv_row,
           "linear_attention": nbytes(groups["linear_attention"]) + states,
           "router": nbytes(groups["router"]), "norm": nbytes(groups["norm"]) + nbytes([params["final_norm"]]),
           "experts": int(distinct_experts * eb) + nbytes(groups["experts"]),
           "head": nbytes([head_w]) + (0 if cfg.tie_word_embeddings else tokens * cfg.hidden_size * item),
           "h2d_copy": int(fetched_experts * eb)}
    return {"hbm": hbm, "hbm_total": sum(hbm.values()), "h2d_link": int(fetched_experts * eb)}


def analytic_flops(model, tokens: int, sequences: int, key_pairs: int) -> float:
    """Matmul + attention flops (2 per multiply-add) of a step: every token through the attention
    projections, router and its top-k experts; one LM head row per sequence; ``key_pairs`` (query,
    visible key) pairs per attention layer and head."""
    cfg = model.cfg
    groups = _layer_param_groups(cfg, model.params)
    dense = sum(x.size for x in groups["attention"] + groups["linear_attention"] + groups["router"] + groups["experts"])
    routed = cfg.num_layers * cfg.top_k * 3 * cfg.hidden_size * cfg.expert_ffn
    attn = 4 * cfg.num_heads * cfg.head_dim * cfg.num_attention_layers * key_pairs
    return float(2 * tokens * (dense + routed) + 2 * sequences * cfg.hidden_size * cfg.vocab_size + attn)


def xla_cost(exe) -> dict:
    """``bytes accessed`` and ``flops`` of XLA's cost analysis of a compiled program ({} if none)."""
    try:
        ca = exe.cost_analysis()
    except Exception as e:  # not every backend / version has it
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else {}
    return {"bytes_accessed": float(ca.get("bytes accessed", 0.0)), "flops": float(ca.get("flops", 0.0))}


# --------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------
def _trace_steps(step, n: int, log_dir: str, after=None):
    """Runs ``step()`` (which waits for its own work) n times under the profiler, each inside the
    host annotation ``profile_step#<i>``, and ``after(step's value)`` between them, outside the
    annotations; returns (the step values, trace events)."""
    def body():
        outs = []
        for i in range(n):
            with jax.profiler.TraceAnnotation(f"profile_step#{i}"):
                outs.append(step())
            if after is not None:
                after(outs[-1])
        return outs
    return trace_events(body, log_dir, python_tracer=False)


def _breakdown(exe, events) -> dict:
    """``timeline.step_breakdown`` of the traced steps of the compiled step ``exe``."""
    return step_breakdown(events, hlo_op_names(exe.as_text()), module="forward_step")


def _prefetch_counts(stats) -> dict:
    """The prefetch's copies and the routed ones among them, mean per step over the steps' stacked LayerStats
    (empty without a prefetch)."""
    if not stats or stats[0].prefetched is None:
        return {}
    return {f"{name}_per_step": float(np.mean([np.sum(np.asarray(getattr(s, name))) for s in stats]))
            for name in ("prefetched", "prefetch_used")}


def _stats(outs) -> tuple[float, float]:
    """(distinct routed experts summed over layers, fetched experts), mean per step, of the
    steps' stacked LayerStats."""
    distinct = [float(np.sum(np.asarray(s.routed()))) for s in outs]
    fetched = [float(np.sum(np.asarray(s.fetched))) for s in outs]
    return float(np.mean(distinct)), float(np.mean(fetched))


def _decode_max_seq_len() -> int:
    """Cache rows a decode run needs: the prompt, every warm / timed / pipelined / traced step and two spare,
    rounded up to 128."""
    n_steps = FLAGS.warm_steps + FLAGS.timed_steps + FLAGS.pipelined_steps + FLAGS.trace_steps
    return -(-(FLAGS.prompt_len + n_steps + 2) // 128) * 128


def decode_run(model, mode: str, batch: int, slots: int | None, trace_dir: str, kernels, tag: str = "") -> dict:
    """Profile of --trace_steps decode steps at ``batch`` after a --prompt_len prefill (module docstring),
    on an engine with kernel config ``kernels``; ``tag`` names its HLO file apart."""
    cfg = model.cfg
    max_seq_len = _decode_max_seq_len()
    prefetch = FLAGS.prefetch_guesses if mode == "cached" else 0
    eng = Engine(model, EngineConfig(mode, num_slots=slots, max_seq_len=max_seq_len, batch=batch, kernels=kernels,
                                     prefetch_guesses=prefetch))
    rng = np.random.default_rng(batch)
    prompts = [rng.integers(0, cfg.vocab_size, FLAGS.prompt_len).tolist() for _ in range(batch)]
    cache = eng.new_cache(batch)
    eng.prepare_prefill(prompts, cache)  # compiles the prefill calls and the decode step
    logits, cache, lengths, _ = eng.prefill(prompts, cache)
    state = {"tok": _next_token(logits), "pos": lengths.astype(np.int32), "cache": cache}
    plan, ones = eng.planner.plan(batch, 1, batch), np.ones(batch, np.int32)  # the decode step's, as generate's

    def step(wait: bool = True):
        out = eng._run(plan, state["tok"], state["pos"], ones, state["cache"])
        if wait:
            out.logits.block_until_ready()
        state["cache"] = out.cache
        return out

    def advance(out, wait: bool = True):  # the next greedy token, outside the timed / traced step
        state["tok"], state["pos"] = _next_token(out.logits), state["pos"] + 1
        if wait:
            state["tok"].block_until_ready()

    exe = common.scan_executable(eng, plan, np.zeros((batch, 1), np.int32), state["pos"], ones, state["cache"])
    if FLAGS.hlo_dir:  # what XLA made of the step: the copies it inserted (e.g. weight slices) show here
        os.makedirs(FLAGS.hlo_dir, exist_ok=True)
        tag = f"_{tag.replace(',', '+')}" if tag else ""  # one file per kernel set under --kernels
        with open(os.path.join(FLAGS.hlo_dir, f"{mode}_decode_b{batch}{tag}.hlo.txt"), "w") as f:
            f.write(exe.as_text())
    for _ in range(FLAGS.warm_steps):
        advance(step())
    times, fetched_timed = [], []
    for _ in range(FLAGS.timed_steps):
        t = time.perf_counter()
        out = step()
        times.append(time.perf_counter() - t)
        fetched_timed.append(_stats([out.layer_stats])[1])  # this step's misses (the routing varies by step)
        advance(out)
    pipelined = None
    if FLAGS.pipelined_steps:
        t = time.perf_counter()
        for _ in range(FLAGS.pipelined_steps):  # as Engine.generate: no wait between steps
            advance(step(wait=False), wait=False)
        state["tok"].block_until_ready()
        pipelined = (time.perf_counter() - t) / FLAGS.pipelined_steps
    pos0 = state["pos"].copy()
    outs, events = _trace_steps(step, FLAGS.trace_steps, os.path.join(trace_dir, f"{mode}_decode_b{batch}"), advance)
    distinct, fetched = _stats([o.layer_stats for o in outs])
    rows_read = float(np.mean([np.sum(pos0 + i + 1) for i in range(FLAGS.trace_steps)]))
    key_pairs = int(round(rows_read))
    row = {"run": f"{mode}_decode", "variant": "decode", "mode": mode, "batch": batch, "tokens": batch,
           "slots": eng.num_slots, "prefetch_guesses": prefetch, "prompt_len": FLAGS.prompt_len,
           "step_s": common.spread(times),
           "pipelined_step_s": pipelined, "pipelined_steps": FLAGS.pipelined_steps,
           "timed_steps": {"s": times, "h2d_bytes": [int(f * model.expert_bytes) for f in fetched_timed]},
           "traced_steps": FLAGS.trace_steps, "routing": {"distinct_experts_per_step": distinct,
                                                           "fetched_experts_per_step": fetched,
                                                           "hit_rate": 1.0 - fetched / distinct if distinct else None,
                                                           **_prefetch_counts([o.layer_stats for o in outs])},
           "bytes": analytic_bytes(model, batch, int(rows_read), batch, distinct, fetched, sequences=batch),
           "flops": analytic_flops(model, batch, batch, key_pairs), "xla_cost": xla_cost(exe),
           "profile": _breakdown(exe, events), "engine": eng.describe()}
    return row


def prefill_run(model, trace_dir: str, kernels) -> dict:
    """Profile of one resident prefill chunk of --prefill_tokens tokens (module docstring), on an engine
    with kernel config ``kernels``."""
    cfg, n = model.cfg, FLAGS.prefill_tokens
    eng = Engine(model, EngineConfig("resident", max_seq_len=-(-(n + 1) // 128) * 128, prefill_chunk=n,
                                     kernels=kernels))
    prompt = np.random.default_rng(7).integers(0, cfg.vocab_size, n).tolist()
    state = {"cache": eng.new_cache(1)}
    (call,) = eng.plan_prefill([prompt])
    plan = eng.planner.plan(1, call.bucket, call.tokens)
    if plan.driver == "pipelined":
        raise ValueError("the resident prefill runs on the layer-pipelined driver: not one program to profile")
    tokens = np.zeros((1, call.bucket), np.int32)
    tokens[0, :n] = prompt
    start, valid = np.zeros(1, np.int32), np.full(1, n, np.int32)

    def step():
        out = eng._run(plan, tokens, start, valid, state["cache"])
        out.logits.block_until_ready()
        state["cache"] = out.cache
        return out

    exe = common.scan_executable(eng, plan, tokens, start, valid, state["cache"])  # compiles this call only
    step()
    times = []
    for _ in range(FLAGS.prefill_repeats):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    outs, events = _trace_steps(step, 1, os.path.join(trace_dir, "resident_prefill"))
    distinct, fetched = _stats([o.layer_stats for o in outs])
    row = {"run": "resident_prefill", "variant": "prefill", "mode": "resident", "batch": 1, "tokens": n,
           "bucket": call.bucket, "step_s": common.spread(times), "traced_steps": 1,
           "routing": {"distinct_experts_per_step": distinct, "fetched_experts_per_step": fetched},
           "bytes": analytic_bytes(model, n, n, n, distinct, fetched),
           "flops": analytic_flops(model, n, 1, n * (n + 1) // 2), "xla_cost": xla_cost(exe),
           "profile": _breakdown(exe, events), "engine": eng.describe()}
    return row


def finish_row(row: dict, hbm_gbps: float, bp_gbps: float) -> dict:
    """Adds the floor (HBM and H2D), the ratios to it, achieved rates and per-category bytes."""
    med = row["step_s"]["median"]
    b = row["bytes"]
    floor = {"hbm_s": b["hbm_total"] / (hbm_gbps * 1e9), "h2d_s": b["h2d_link"] / (bp_gbps * 1e9)}
    floor["s"] = max(floor["hbm_s"], floor["h2d_s"])
    row.update(floor=floor, ratio_to_floor=med / floor["s"], ratio_to_hbm_floor=med / floor["hbm_s"],
               achieved_hbm_GBps=b["hbm_total"] / med / 1e9, achieved_TFLOPs=row["flops"] / med / 1e12)
    for cat, c in row["profile"]["categories"].items():
        c["bytes"] = b["hbm"].get(cat, 0)
        c["floor_s"] = c["bytes"] / (hbm_gbps * 1e9)
    return row


def _label(r: dict) -> str:
    label = f"{r['run']} b{r['batch']}" if r.get("variant") == "decode" else f"{r['run']} {r.get('tokens')}"
    return label + (f" [{r['kernels']}]" if "kernels" in r else "")


def tables(rows: list[dict]) -> str:
    """The summary table and the per-category milliseconds table of the finished rows."""
    ok = [r for r in rows if "profile" in r]
    summary = [{"run": _label(r), "step_ms": r["step_s"]["median"] * 1e3,
                "pipelined_ms": (r.get("pipelined_step_s") or float("nan")) * 1e3,
                "span_ms": r["profile"]["span_s"] * 1e3,
                "gap_ms": r["profile"]["gap_s"] * 1e3, "floor_ms": r["floor"]["s"] * 1e3,
                "step/floor": r["ratio_to_floor"], "HBM_MB": r["bytes"]["hbm_total"] / 1e6,
                "H2D_MB": r["bytes"]["h2d_link"] / 1e6, "GBps": r["achieved_hbm_GBps"],
                "kernels": sum(c["count"] for c in r["profile"]["categories"].values()),
                "unnamed_ms": r["profile"]["unnamed_kernel_s"] * 1e3} for r in ok]
    cats = [{"run": _label(r), **{c: r["profile"]["categories"][c]["s"] * 1e3 for c in CATEGORIES},
             "gap": r["profile"]["gap_s"] * 1e3} for r in ok]
    errors = [f"{_label(r)}: {r['error'][:200]}" for r in rows if "error" in r]
    out = [common.table(summary, list(summary[0]))] if summary else []
    if cats:
        out.append("device ms per step by category:\n" + common.table(cats, ["run", *CATEGORIES, "gap"]))
    return "\n\n".join(out + errors)


def main(argv):
    del argv
    info = common.meta()
    cfg, model, build_s, bp = common.build_random_model(FLAGS.preset, FLAGS.dtype, FLAGS.layers)
    bp_gbps = bp["h2d_GBps"]["median"]
    hbm = common.measure_hbm(int(FLAGS.hbm_gb * 2**30), FLAGS.hbm_repeats)
    print(f"{info['device']}: random {FLAGS.preset} built in {build_s:.1f} s; B_P = {bp_gbps:.1f} GB/s; "
          f"HBM = {hbm['GBps']:.0f} GB/s", flush=True)
    trace_dir = FLAGS.trace_dir or tempfile.mkdtemp(prefix="ftjax_profile_step_")
    itemsize = np.dtype(DTYPES[FLAGS.dtype]).itemsize
    todo = []  # cached first: the resident runs put the whole pool on the device
    for run in RUNS:
        if run in FLAGS.runs:
            todo += [(run, b) for b in map(int, FLAGS.batches)] if run.endswith("decode") else [(run, 1)]
    rows, plans = [], {}
    name = f"profile_step_{FLAGS.preset}" + (f"_{FLAGS.layers}l" if FLAGS.layers else "") + ".json"
    kernel_sets = FLAGS.kernels or [None]
    configs = {k: common.kernel_config(use=k) for k in kernel_sets}  # each engine's (EngineConfig.kernels)
    for kernels, run, batch in [(k, r, b) for k in kernel_sets for r, b in todo]:
        print(f"-- {run} batch {batch}" + (f" --kernels={kernels}" if kernels is not None else ""), flush=True)
        try:
            if run == "resident_prefill":
                row = prefill_run(model, trace_dir, configs[kernels])
            else:
                slots = None
                if run == "cached_decode" and FLAGS.slots:
                    plans[f"b{batch}"], slots = {"slots": FLAGS.slots, "from": "--slots"}, FLAGS.slots
                elif run == "cached_decode":
                    plan = plan_memory(cfg, itemsize, budget_bytes=int(FLAGS.vram_budget_gb * GB), batch=batch,
                                       max_seq_len=_decode_max_seq_len(),
                                       expert_bytes=model.expert_bytes, kernels=configs[kernels])
                    plans[f"b{batch}"], slots = plan.as_dict(), plan.slots
                row = decode_run(model, run.split("_")[0], batch, slots,
                                 trace_dir if kernels is None else os.path.join(trace_dir, kernels.replace(",", "+")),
                                 configs[kernels], kernels or "")
            row = finish_row(row, hbm["GBps"], bp_gbps)
        except Exception as e:  # record and go on: one failing run must not lose the others
            row = {"run": run, "batch": batch, "variant": "prefill" if run.endswith("prefill") else "decode",
                   "error": f"{type(e).__name__}: {e}"[:2000]}
        if kernels is not None:
            row["kernels"] = kernels
        gc.collect()
        rows.append(row)
        print(tables([row]), flush=True)
        common.write_json(FLAGS.out_dir, name, {"meta": info, "partial": True, "B_P": bp, "hbm": hbm,
                                                "memory_plans": plans, "runs": rows})
    payload = {"meta": info, "script": "experiments/profile_step.py", "model_build_s": build_s, "B_P": bp,
               "hbm": hbm, "categories": list(CATEGORIES), "memory_plans": plans, "trace_dir": trace_dir,
               "runs": rows, "targets": targets([r for r in rows if r.get("kernels") in (kernel_sets[0], None)]
                                                or rows, bp_gbps)}
    if len(kernel_sets) > 1:  # the targets under each kernel choice; "targets" holds the first one's
        payload["targets_by_kernels"] = {k: targets([r for r in rows if r.get("kernels") == k], bp_gbps)
                                         for k in kernel_sets}
    path = common.write_json(FLAGS.out_dir, name, payload)
    if len(rows) > 1:  # each run's tables were printed as it ended
        print(tables(rows))
    for k, t in payload.get("targets_by_kernels", {None: payload["targets"]}).items():
        label = "decode step / floor and cached / (resident + misses), same run" + (f", --kernels={k}" if k else "")
        print(label + ":", {n: v if isinstance(v, list) else round(v, 3) for n, v in t.items()})
    print("wrote", path)


if __name__ == "__main__":
    common.run(main)
