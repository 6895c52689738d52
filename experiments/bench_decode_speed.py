r"""Decode speed on the seed's side-by-side shape: tokens/s of ``Engine.generate`` per layer count, experts
mode, batch and decode block (``EngineConfig.decode_block``: 1 = one program per step and the sampler's own
program; N = N steps per program with the token fed back on the device), all in one process.

  PYTHONPATH=. python3 experiments/bench_decode_speed.py
  .venv/bin/python experiments/bench_decode_speed.py --preset=tiny --layers=2 --slots=16 --prompt_len=16 \
      --steps=8 --repeats=1 --trace_steps=4 --out_dir=/tmp/speed                                # CPU smoke

The shape is the seed's benchmark (issue 33): qwen3-30b-a3b with random bf16 weights cut to each of
``--layers``, greedy, a ``--prompt_len`` prompt then ``--steps`` tokens; tokens/s = decode steps / decode
seconds (``GenerationResult.decode_tokens_per_s``, summed over the batch), the figure FreeToken reports.
Each row is the median of ``--repeats`` generates after one untimed (compiling) generate, with the spread.
Cached rows (``--slots`` slots, LRU) also give the step's bound: the resident step of the same layers,
batch and block plus the step's H2D bytes / B_P (B_P: a 512 MiB pinned ``device_put`` measured here), and
step / bound. ``--trace_steps`` traces that many resident batch-1 decode steps per block setting and
reports the GPU's busy share of the decode (kernels and copies merged over the wall time of the traced
steps): what the host's per-step work leaves idle.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import tempfile
import time

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from experiments import common, timeline  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("preset", "qwen3-30b-a3b", "Model shape (random weights).")
flags.DEFINE_list("layers", ["16", "48"], "Layer counts the shape is cut to (0: the preset's own).")
flags.DEFINE_list("modes", ["resident", "cached"], "Experts modes.")
flags.DEFINE_list("batches", ["1", "4"], "Sequences decoded together.")
flags.DEFINE_list("decode_blocks", ["1", "16"], "EngineConfig.decode_block values compared.")
flags.DEFINE_integer("slots", 280, "Expert slots of the cached rows (the seed's 8 GB plan).", lower_bound=1)
flags.DEFINE_integer("prompt_len", 512, "Prompt tokens.", lower_bound=1)
flags.DEFINE_integer("steps", 128, "Tokens generated per sequence.", lower_bound=2)
flags.DEFINE_integer("cached_steps", None, "Tokens generated per sequence in the cached rows (default --steps).",
                     lower_bound=2)
flags.DEFINE_integer("repeats", 3, "Timed generates per row (after one untimed).", lower_bound=1)
flags.DEFINE_integer("cached_repeats", 1, "Timed generates per cached row (after one untimed).", lower_bound=1)
flags.DEFINE_integer("trace_steps", 32, "Resident batch-1 decode steps traced per block setting (0: no trace).",
                     lower_bound=0)
flags.DEFINE_integer("prefetch_guesses", 0, "EngineConfig.prefetch_guesses of the cached rows: experts guessed per "
                     "token and copied before each layer's token mixer (0: none).", lower_bound=0)
flags.DEFINE_boolean("split_probe", False, "Put an empty start / wait pair of the slot-copy kernel on its own "
                     "stream (slot_copy.copy_into_slots_start, wait_slots; count 0) in every cached layer, side by "
                     "side before the lookup (as many graph segments a layer as a prefetch started before the "
                     "attention): what a prefetch on that stream costs the step by splitting its command buffers, "
                     "with nothing copied. GPU only.")
flags.DEFINE_string("out_dir", "experiments/results/decode_speed", "Where the JSON goes.")
flags.DEFINE_string("tag", "", "Goes into the JSON's name.")
common.define_kernel_flags()
common.check_numbers("layers", int, low=0)
common.check_numbers("batches", int, low=1)
common.check_numbers("decode_blocks", int, low=1)
common.check_names("modes", ("resident", "cached"))
common.check_preset()

#: FreeToken 0.1.3 on one H200 (2026-12-03, the issue's side-by-side; not measured by this script).
SEED_TOKENS_PER_S = {(16, "resident", 1): 535.0, (48, "resident", 1): 209.0, (16, "cached", 1): 42.9,
                     (48, "cached", 1): 13.13, (48, "resident", 4): 548.0, (48, "cached", 4): 15.1}


def _row(model, layers: int, mode: str, batch: int, block: int, repeats: int) -> dict:
    from ftjax import Engine
    from ftjax.config import EngineConfig
    cfg = model.cfg
    config = EngineConfig(experts=mode, num_slots=FLAGS.slots if mode == "cached" else None, batch=batch,
                          max_seq_len=-(-(FLAGS.prompt_len + FLAGS.steps) // 128) * 128, decode_block=block,
                          kernels=common.kernel_config(),
                          prefetch_guesses=FLAGS.prefetch_guesses if mode == "cached" else 0)
    engine = Engine(model, config)
    rng = np.random.default_rng(batch)
    prompts = [rng.integers(0, cfg.vocab_size, FLAGS.prompt_len).tolist() for _ in range(batch)]
    n_new = FLAGS.cached_steps if mode == "cached" and FLAGS.cached_steps else FLAGS.steps
    first = engine.generate(prompts, n_new)  # compiles
    before = engine.counters["decode"].copy()
    runs = [engine.generate(prompts, n_new) for _ in range(repeats)]
    decode = (engine.counters["decode"] - before).summary(model.expert_bytes)
    tok_s = [r.decode_tokens_per_s for r in runs]
    steps = n_new - 1
    row = {"layers": layers, "mode": mode, "batch": batch, "decode_block": block, "new_tokens": n_new,
           "prefetch_guesses": config.prefetch_guesses, "generated_ids": runs[-1].generated_ids,
           "tokens_per_s": common.spread(tok_s), "step_ms": 1e3 * batch / statistics.median(tok_s),
           "ttft_s": statistics.median(r.ttft_s for r in runs), "compile_s": first.compile_s,
           "hit_rate": decode["hit_rate"], "h2d_bytes_per_step": decode["bytes_h2d"] / (steps * repeats)}
    seed = SEED_TOKENS_PER_S.get((layers, mode, batch))
    if seed is not None and FLAGS.preset == "qwen3-30b-a3b":
        row["seed_tokens_per_s"] = seed
        row["vs_seed"] = statistics.median(tok_s) / seed
    if FLAGS.trace_steps and mode == "resident" and batch == 1:
        row["trace"] = _trace(engine, prompts, block)
    del engine
    gc.collect()
    return row


def _trace(engine, prompts, block: int) -> dict:
    """The GPU's busy share of ``--trace_steps`` decode steps (a 1-token-prompt generate under the profiler)."""
    n = FLAGS.trace_steps
    engine.generate([prompts[0][:1]], n + 1)  # compile this prompt length's programs outside the trace
    with tempfile.TemporaryDirectory() as d:
        res, events = timeline.trace_events(lambda: engine.generate([prompts[0][:1]], n + 1), d, python_tracer=False)
    dev, source = timeline.device_events(events)
    merged = timeline._merge([(e["ts"], e["end"]) for e in dev])
    if not merged:
        return {"source": source, "events": 0}
    busy = sum(e - s for s, e in merged)
    span = merged[-1][1] - merged[0][0]
    return {"source": source, "steps": n, "events": len(dev), "decode_s": res.decode_s,
            "device_busy_s": busy * 1e-6, "device_span_s": span * 1e-6, "busy_of_span": busy / span,
            "kernels_per_step": len(dev) / (n + 1), "programs": _by_program(dev, n)}


def _by_program(dev: list[dict], steps: int, top: int = 30) -> list[dict]:
    """The traced device work per compiled program (``hlo_module``), most events first: events, busy and span
    (ms, merged over the program's own events), and for the program with the most events (the decode steps' or
    blocks') its ``top`` kernel names by time, each with its count and microseconds per decode step: what a step
    launches besides the layers (issue 33 item 1)."""
    mods: dict[str, list[dict]] = {}
    for e in dev:
        mods.setdefault(e["hlo_module"] or "?", []).append(e)
    out = []
    for name, evs in sorted(mods.items(), key=lambda kv: -len(kv[1])):
        merged = timeline._merge([(e["ts"], e["end"]) for e in evs])
        row = {"module": name, "events": len(evs), "busy_ms": sum(b - a for a, b in merged) * 1e-3,
               "span_ms": (merged[-1][1] - merged[0][0]) * 1e-3}
        if not out:
            kinds: dict[str, list[float]] = {}
            for e in evs:
                k = kinds.setdefault(e["name"][:80], [0, 0.0])
                k[0] += 1
                k[1] += e["end"] - e["ts"]
            row["top_kernels_per_step"] = [{"name": k, "count": c / steps, "us": t / steps} for k, (c, t) in
                                           sorted(kinds.items(), key=lambda kv: -kv[1][1])[:top]]
        out.append(row)
    return out


def _split_probe() -> None:
    """Wraps every cached expert function built from here on (``offload.make_expert_fn``) so that its layer starts
    with an empty asynchronous copy into the gate_up pool and its wait (count 0: nothing copied, the same results):
    the two calls XLA keeps out of its CUDA graphs, where a predicted prefetch would put them."""
    import jax.numpy as jnp

    from ftjax.experts import offload, slot_copy
    build = offload.make_expert_fn

    def make(mode, num_experts, banks=None, *args, **kw):
        fn = build(mode, num_experts, banks, *args, **kw)
        if mode != "cached":
            return fn

        def expert_fn(state, layer, r):
            none, count = jnp.zeros((1,), jnp.int32), jnp.int32(0)
            pool = slot_copy.copy_into_slots_start(banks.gate_up, state.gate_up, none, none, count, blocks_per_miss=4)
            return fn(state.replace(gate_up=slot_copy.wait_slots(pool, none, none, count)), layer, r)
        return expert_fn
    offload.make_expert_fn = make


def _first_difference(ids: list[list[int]], want: list[list[int]]) -> int | None:
    """The first index (0: the first generated token, the prefill's) at which a row's generated tokens differ from
    ``want``'s, over the tokens both generated (ids, want: [rows][tokens] generated ids), or None where they agree.

    Raises:
      ValueError: ids and want have different numbers of rows (not the same batch)."""
    if len(ids) != len(want):
        raise ValueError(f"tokens of {len(ids)} rows compared with {len(want)} rows")
    steps = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(ids, want)]
    steps = [i for i in steps if i is not None]
    return min(steps) if steps else None


def _bounds(rows: list[dict], bp_gbps: float) -> None:
    res = {(r["layers"], r["batch"], r["decode_block"]): r["step_ms"] for r in rows if r["mode"] == "resident"}
    tokens = {(r["layers"], r["batch"], r["decode_block"]): r["generated_ids"] for r in rows if r["mode"] == "resident"}
    for r in rows:  # greedy: a cached row's tokens are the resident row's; the ids stay in the row, so that runs on
        ids = r["generated_ids"]  # other machines compare (the prefetch's GPU tokens differ on some machines only)
        want = tokens.get((r["layers"], r["batch"], r["decode_block"]))
        if r["mode"] == "cached" and want is not None:  # the cached rows may run fewer steps (--cached_steps)
            first = _first_difference(ids, want)
            r["same_tokens_as_resident"] = first is None
            r["first_token_unlike_resident"] = first
    for r in rows:
        base = res.get((r["layers"], r["batch"], r["decode_block"]))
        if r["mode"] == "cached" and base is not None:
            r["bound_ms"] = base + 1e3 * r["h2d_bytes_per_step"] / (bp_gbps * 1e9)
            r["step_over_bound"] = r["step_ms"] / r["bound_ms"]
    one = {(r["layers"], r["mode"], r["batch"]): r for r in rows if r["decode_block"] == 1}
    for r in rows:
        base = one.get((r["layers"], r["mode"], r["batch"]))
        if base is not None and r["decode_block"] != 1:
            r["speedup_vs_block1"] = r["tokens_per_s"]["median"] / base["tokens_per_s"]["median"]


def main(argv):
    del argv
    import jax

    from absl import app

    from ftjax.checkpoint import random_model
    from ftjax.experts import slot_copy
    if FLAGS.split_probe:
        why = slot_copy.unavailable()
        if why is not None:
            raise app.UsageError(f"--split_probe needs the slot-copy kernel: {why}")
        _split_probe()
    bp = common.measure_h2d()
    rows = []
    for n in map(int, FLAGS.layers):
        cfg = common.preset_cut(FLAGS.preset, n)  # a hybrid keeps its first n layers' kinds
        t0 = time.perf_counter()
        model = random_model(cfg, "bfloat16")
        jax.block_until_ready(model.params)
        build_s = time.perf_counter() - t0
        print(f"{n or cfg.num_layers} layers: model built in {build_s:.1f} s", flush=True)
        for mode in FLAGS.modes:
            for batch in map(int, FLAGS.batches):
                for block in map(int, FLAGS.decode_blocks):
                    repeats = FLAGS.cached_repeats if mode == "cached" else FLAGS.repeats
                    row = _row(model, cfg.num_layers, mode, batch, block, repeats)
                    rows.append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "trace"}), flush=True)
                    if "trace" in row:
                        print("  trace:", json.dumps(row["trace"]), flush=True)
        del model
        gc.collect()
    _bounds(rows, bp["h2d_GBps"]["median"])
    name = f"bench_decode_speed_{FLAGS.preset}{'_' + FLAGS.tag if FLAGS.tag else ''}.json"
    path = common.write_json(FLAGS.out_dir, name, {
        "b_p": bp, "rows": rows, "split_probe": FLAGS.split_probe,
        "seed_note": "seed_tokens_per_s: FreeToken 0.1.3 on one H200, 2026-12-03 (issue 33's table), not measured "
                     "in this run"})
    cols = ["layers", "mode", "batch", "decode_block", "prefetch_guesses", "tokens_per_s", "step_ms",
            "speedup_vs_block1", "vs_seed", "hit_rate", "step_over_bound", "same_tokens_as_resident",
            "first_token_unlike_resident"]
    print(common.table([{**r, "tokens_per_s": r["tokens_per_s"]["median"]} for r in rows], cols))
    print("wrote", path)


if __name__ == "__main__":
    common.run(main)
