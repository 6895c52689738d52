r"""Decode block loop forms (``KernelConfig.decode_loop``), resident, in one process: "dynamic", the block's
while loop ending at its limit or once every row stopped (XLA reads that predicate back to the host each
step), against "fixed", a trip count of ``decode_block`` iterations XLA knows. Tokens/s of ``Engine.generate``
(medians of ``--repeats``, the two forms alternating) and whether both gave the same tokens. ``--eos_at``: the
timed generates stop on an EOS id mid-generation, where a fixed-loop generate reads each block's stop flags
before dispatching the next (``decode_s``: the decode's seconds, the stop's cost included).

  PYTHONPATH=. python3 experiments/bench_decode_loop.py --out_dir=$OUT
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
common.define_kernel_flags(skip=("decode_loop",))  # both forms, always
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
flags.DEFINE_list("forms", ["dynamic", "fixed"], "The order the forms' engines are built and timed in (with "
                  "--noalternate: one form's generates all before the other's), both named once.")
flags.DEFINE_string("out_dir", "experiments/results/decode_speed", "Where the JSON goes.")
flags.DEFINE_string("tag", "", "Goes into the JSON's name.")
common.check_preset()
common.check_numbers("batches", int, low=1)
flags.register_validator("forms", lambda v: sorted(v) == ["dynamic", "fixed"],
                         message="--forms: expected dynamic and fixed, each once, in the order to run them")


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
    """Both forms at ``batch`` rows: an untimed (compiling) generate each, then ``--repeats`` alternating (with
    ``--noalternate`` one form's engine after the other's: two resident engines of a large cut do not fit)."""
    from ftjax import Engine
    from ftjax.config import EngineConfig
    cfg = model.cfg
    config = EngineConfig(experts="resident", batch=batch, decode_block=FLAGS.decode_block,
                          max_seq_len=-(-(FLAGS.prompt_len + FLAGS.steps + 1) // 128) * 128)
    rng = np.random.default_rng(batch)
    prompts = [rng.integers(0, cfg.vocab_size, FLAGS.prompt_len).tolist() for _ in range(batch)]
    engines, times, first, eos = {}, {"dynamic": [], "fixed": []}, {}, ()
    decode_s = {f: [] for f in times}

    def timed(e, form: str) -> None:  # with EOS ids, the generates compared are the timed ones
        r = e.generate(prompts, FLAGS.steps + 1, eos_ids=eos)
        times[form].append(r.decode_tokens_per_s)
        decode_s[form].append(r.decode_s)
        if eos:
            first[form] = r

    for f in FLAGS.forms:
        e = Engine(model, dataclasses.replace(config, kernels=common.kernel_config(decode_loop=f)))
        first[f] = e.generate(prompts, FLAGS.steps + 1)  # compiles
        if FLAGS.eos_at is not None and not eos:
            eos = (_first_new_token(first[f].generated_ids[0], FLAGS.eos_at),)
        if FLAGS.alternate:
            engines[f] = e
        else:
            for _ in range(FLAGS.repeats):
                timed(e, f)
            del e
            gc.collect()
    for _ in range(FLAGS.repeats if engines else 0):
        for f, e in engines.items():
            timed(e, f)
    rows = [{"batch": batch, "form": f, "tokens_per_s": common.spread(times[f]), "decode_s": common.spread(decode_s[f]),
             "step_ms": 1e3 * batch / statistics.median(times[f]), "eos_ids": list(eos),
             "generated": [len(g) for g in first[f].generated_ids], "run_order": FLAGS.forms.index(f)}
            for f in times]  # dynamic, then fixed, whatever order they ran in
    same = first["dynamic"].generated_ids == first["fixed"].generated_ids  # with EOS ids: the last timed ones
    rows[1]["same_tokens_as_dynamic"] = same
    rows[1]["over_dynamic"] = rows[1]["tokens_per_s"]["median"] / rows[0]["tokens_per_s"]["median"]
    for r in rows:
        print(f"batch {batch} {r['form']:8s} {r['tokens_per_s']['median']:8.1f} tok/s  step {r['step_ms']:.3f} ms"
              + (f"  x{r['over_dynamic']:.3f}, same tokens: {same}" if "over_dynamic" in r else ""), flush=True)
    return rows


if __name__ == "__main__":
    app.run(main)
