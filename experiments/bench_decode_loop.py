r"""Decode block loop forms (``KernelConfig.decode_loop``), resident, in one process: "dynamic", the block's
while loop ending at its limit or once every row stopped (XLA reads that predicate back to the host each
step), against "fixed", a trip count of ``decode_block`` iterations XLA knows. Tokens/s of ``Engine.generate``
(medians of ``--repeats``, the engines' timed generates alternating) and whether both gave the same tokens.
``--eos_at``: the timed generates stop on an EOS id mid-generation, where a fixed-loop generate reads each block's
stop flags before dispatching the next (``decode_s``: the decode's seconds, the stop's cost included).

``--kernels`` may be repeated: one engine per kernel config and form, all timed in turn in this process, so a
kernel's decode A/B shares the machine's state of the moment (HBM clocks, the host) with its baseline; each row
of a later config gives ``over_first_kernels`` against the first config's row of its form. ``--forms=fixed`` alone
times only the fixed loop (the A/B of kernels under auto's loop on a GPU).

  PYTHONPATH=. python3 experiments/bench_decode_loop.py --out_dir=$OUT
  PYTHONPATH=. python3 experiments/bench_decode_loop.py --forms=fixed --kernels=auto --kernels=auto+route_decode
  .venv/bin/python experiments/bench_decode_loop.py --preset=tiny --layers=2 --steps=32 --repeats=1 --out_dir=/tmp/x
"""

from __future__ import annotations

import dataclasses
import gc
import os
import statistics
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from experiments import common  # noqa: E402

FLAGS = flags.FLAGS
common.define_kernel_flags(skip=("decode_loop",), multi_use=True)  # the forms are --forms
flags.DEFINE_string("preset", "qwen3.5-35b-a3b", "Model shape (random weights).")
flags.DEFINE_integer("layers", 16, "Layers the shape is cut to.", lower_bound=0)
flags.DEFINE_list("batches", ["1"], "Sequences decoded together (a row per form and batch).")
flags.DEFINE_integer("prompt_len", 512, "Prompt tokens.", lower_bound=1)
flags.DEFINE_integer("steps", 128, "Decode steps after the prompt's token.", lower_bound=1)
flags.DEFINE_integer("decode_block", 16, "Steps per block.", lower_bound=1)
flags.DEFINE_integer("repeats", 5, "Timed generates per form, alternating (after one untimed each).", lower_bound=1)
flags.DEFINE_integer("eos_at", None, "With EOS ids: the timed generates stop at the first token new to row 0's "
                     "untimed generate at or after this index (the path where a fixed-loop generate keeps one block "
                     "in flight; each row's `generated` says where it stopped); unset: no EOS ids.", lower_bound=1)
flags.DEFINE_bool("alternate", True, "Both engines held, the forms' timed generates alternating.")
flags.DEFINE_list("forms", ["dynamic", "fixed"], "The loop forms timed, in the order their engines are built and "
                  "timed in (with --noalternate: one engine's generates all before the next's), each named at most "
                  "once.")
flags.DEFINE_string("out_dir", "experiments/results/decode_speed", "Where the JSON goes.")
flags.DEFINE_string("tag", "", "Goes into the JSON's name.")
common.check_preset()
common.check_numbers("batches", int, low=1)
flags.register_validator("forms", lambda v: bool(v) and len(set(v)) == len(v) and set(v) <= {"dynamic", "fixed"},
                         message="--forms: expected dynamic and / or fixed, each at most once, in the order to run")


def _distinct_uses(uses) -> bool:
    from ftjax.kernels.registry import KernelConfig
    try:
        keys = [KernelConfig(use=u).use for u in uses]
    except ValueError:
        return True  # common's own validator names the bad value
    return len(set(keys)) == len(keys)


flags.register_validator("kernels", _distinct_uses, message="--kernels: a kernel config named twice (in any spelling)")


def main(argv):
    del argv
    if FLAGS.eos_at is not None and FLAGS.eos_at > FLAGS.steps:  # before the model is built
        raise app.UsageError(f"--eos_at={FLAGS.eos_at} is past --steps={FLAGS.steps}")
    from ftjax.checkpoint import random_model
    cfg = common.preset_cut(FLAGS.preset, FLAGS.layers)
    model = random_model(cfg, "bfloat16")
    out = {"rows": []}
    name = f"bench_decode_loop_{FLAGS.preset}" + (f"_{FLAGS.tag}" if FLAGS.tag else "") + ".json"
    for batch in map(int, FLAGS.batches):
        out["rows"] += _rows(model, batch)
        print("wrote", common.write_json(FLAGS.out_dir, name, out))  # after each batch: a cut run keeps its rows


def _first_new_token(ids: list[int], at: int) -> int:
    """The token whose first occurrence in ``ids`` is the earliest at or after index ``at`` (a stop id there ends
    the generate there, not at an earlier repeat: random weights often decode into repeated tokens).
    Raises:
      app.UsageError: every token from ``at`` on occurred before it."""
    seen = set(ids[:at])
    for tok in ids[at:]:
        if tok not in seen:
            return tok
        seen.add(tok)
    raise app.UsageError(f"--eos_at={at}: every token from there on occurred before it (the greedy decode repeats): "
                         "no stop id ends the generate there; try a smaller --eos_at")


def _rows(model, batch: int) -> list[dict]:
    """Every (kernel config, form) at ``batch`` rows: an untimed (compiling) generate each, then ``--repeats`` in turn
    (with ``--noalternate`` one engine after the other: two resident engines of a large cut do not fit)."""
    from ftjax import Engine
    from ftjax.config import EngineConfig
    cfg = model.cfg
    config = EngineConfig(experts="resident", batch=batch, decode_block=FLAGS.decode_block,
                          max_seq_len=-(-(FLAGS.prompt_len + FLAGS.steps + 1) // 128) * 128)
    rng = np.random.default_rng(batch)
    prompts = [rng.integers(0, cfg.vocab_size, FLAGS.prompt_len).tolist() for _ in range(batch)]
    uses = FLAGS.kernels or ["auto"]
    runs = [(use, form) for use in uses for form in FLAGS.forms]  # the build order
    engines, times, first, eos = {}, {r: [] for r in runs}, {}, ()
    decode_s = {r: [] for r in runs}
    applied = {}

    def timed(e, run) -> None:  # with EOS ids, the generates compared are the timed ones
        r = e.generate(prompts, FLAGS.steps + 1, eos_ids=eos)
        times[run].append(r.decode_tokens_per_s)
        decode_s[run].append(r.decode_s)
        if eos:
            first[run] = r

    for run in runs:
        use, form = run
        e = Engine(model, dataclasses.replace(config, kernels=common.kernel_config(use=use, decode_loop=form)))
        first[run] = e.generate(prompts, FLAGS.steps + 1)  # compiles
        applied[run] = (sorted(e.programs.kernels_applied()), e.kernel_notes())
        if FLAGS.eos_at is not None and not eos:
            eos = (_first_new_token(first[run].generated_ids[0], FLAGS.eos_at),)
        if FLAGS.alternate:
            engines[run] = e
        else:
            for _ in range(FLAGS.repeats):
                timed(e, run)
            del e
            gc.collect()
    for _ in range(FLAGS.repeats if engines else 0):
        for run, e in engines.items():
            timed(e, run)
    rows = []
    for use in uses:  # dynamic before fixed, whatever order they ran in
        for form in sorted(f for u, f in runs if u == use):
            run = (use, form)
            rows.append({"batch": batch, "kernels": use, "form": form, "tokens_per_s": common.spread(times[run]),
                         "decode_s": common.spread(decode_s[run]),
                         "step_ms": 1e3 * batch / statistics.median(times[run]), "eos_ids": list(eos),
                         "generated": [len(g) for g in first[run].generated_ids], "run_order": runs.index(run),
                         "kernels_applied": applied[run][0], "kernel_notes": applied[run][1]})
    by = {(r["kernels"], r["form"]): r for r in rows}
    for r in rows:  # with EOS ids the ids compared are the last timed generate's
        rate = r["tokens_per_s"]["median"]
        ids = first[(r["kernels"], r["form"])].generated_ids
        dyn = by.get((r["kernels"], "dynamic"))
        if r["form"] == "fixed" and dyn is not None:
            r["same_tokens_as_dynamic"] = ids == first[(r["kernels"], "dynamic")].generated_ids
            r["over_dynamic"] = rate / dyn["tokens_per_s"]["median"]
        base = by.get((uses[0], r["form"]))
        if r["kernels"] != uses[0] and base is not None:
            r["same_tokens_as_first_kernels"] = ids == first[(uses[0], r["form"])].generated_ids
            r["over_first_kernels"] = rate / base["tokens_per_s"]["median"]
        print(f"batch {batch} {r['kernels']:>24s} {r['form']:8s} {rate:8.1f} tok/s  step {r['step_ms']:.3f} ms"
              + (f"  x{r['over_dynamic']:.3f} dynamic, same tokens: {r['same_tokens_as_dynamic']}"
                 if "over_dynamic" in r else "")
              + (f"  x{r['over_first_kernels']:.3f} {uses[0]}, same tokens: {r['same_tokens_as_first_kernels']}"
                 if "over_first_kernels" in r else ""), flush=True)
    return rows


if __name__ == "__main__":
    app.run(main)
