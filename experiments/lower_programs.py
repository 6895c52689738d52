"""How big an engine's GPU programs are, measured on a machine without a GPU.

Builds a resident engine at a preset cut to ``--layers`` (random weights), admits one ``--prompt_len`` prompt,
records every program its precompile would compile (nothing is compiled or run here: ``common.capture_programs``),
and lowers each for CUDA with the kernel choices a GPU would make (``registry.lowering_for("gpu")``, an abstract
H200 device; no GPU needed), once per ``--grouped_matmuls`` value. Per program it records the seconds of jax's
tracing and of its lowering to StableHLO, the module's size, its custom calls by target (each Triton or Mosaic GPU
kernel is one; XLA compiles each on the GPU) and the kernels that applied. XLA's own compile (the other part of a
GPU compile) is not measured here.

Why (issue 32, the hybrid family's compile): on an H100 (2026-12-05) a 4-layer qwen3.5-35b-a3b cut compiled in
44 s, the prefill program 12.8 s of tracing and lowering plus 27.5 s in XLA. The program's size does not grow with
the layer count past one block of the layer pattern (the layer scan runs over blocks), so a 4-layer cut stands
for 16 and 40 layers.

Usage (about 2 minutes on 2 cores; a peak of ~19 GB of host memory at 4 layers of qwen3.5-35b-a3b in bf16)::

  PYTHONPATH=. python experiments/lower_programs.py --preset=qwen3.5-35b-a3b --layers=4 \\
      --grouped_matmuls=auto,mgpu,xla
"""

from __future__ import annotations

import dataclasses

from absl import flags

from experiments import common
from ftjax.kernels.registry import GROUPED_MATMULS

flags.DEFINE_string("preset", "qwen3.5-35b-a3b", "Model preset.")
flags.DEFINE_integer("layers", 4, "Layers of the cut (one block of qwen3.5's pattern is 4).", lower_bound=1)
flags.DEFINE_integer("prompt_len", 64, "Prompt tokens (one prefill chunk).", lower_bound=1)
flags.DEFINE_integer("steps", 16, "The request's max_tokens (sizes the KV cache).", lower_bound=1)
flags.DEFINE_integer("block", 16, "EngineConfig.decode_block.", lower_bound=1)
flags.DEFINE_list("grouped_matmuls", ["auto", "mgpu", "xla"], "KernelConfig.grouped_matmul values to lower with.")
flags.DEFINE_string("dtype", "bfloat16", "The random weights' dtype.")
flags.DEFINE_string("device_kind", "NVIDIA H200", "The abstract GPU lowered for.")
flags.DEFINE_string("out_dir", "experiments/results/checks", "Where the JSON goes.")
flags.DEFINE_string("tag", "", "Suffix of the JSON name.")
common.check_preset()
common.check_names("grouped_matmuls", GROUPED_MATMULS)
FLAGS = flags.FLAGS


def main(argv):
    del argv
    import numpy as np

    from ftjax import Engine
    from ftjax.checkpoint import random_model
    from ftjax.config import EngineConfig
    cfg = common.preset_cut(FLAGS.preset, FLAGS.layers)
    model = random_model(cfg, FLAGS.dtype)
    eng = Engine(model, EngineConfig("resident", batch=1, max_seq_len=FLAGS.prompt_len + FLAGS.steps + 8,
                                     prefill_chunk=FLAGS.prompt_len, decode_block=FLAGS.block))
    prompt = list(np.random.default_rng(0).integers(0, cfg.vocab_size, FLAGS.prompt_len))
    eng.open_rows(1)
    eng.admit(prompt, FLAGS.steps)

    def precompile():
        eng.precompile()
        eng.precompile_block(FLAGS.block, eos_width=1)
    captured = common.capture_programs(precompile)
    rows = []
    print(f"{'program':>14} {'tokens':>6} {'grouped_matmul':>14}: tracing, lowering, StableHLO size, custom calls")
    for fn, args, static in captured:
        for gm in FLAGS.grouped_matmuls:
            opts = static["opts"]  # every engine step carries its StepOptions
            st = dict(static, opts=dataclasses.replace(opts, kernels=dataclasses.replace(opts.kernels,
                                                                                       grouped_matmul=gm)))
            row = {"program": fn.__name__, "tokens": common.call_tokens(fn, args), "grouped_matmul": gm,
                   **common.lower_for_cuda(fn, args, st, FLAGS.device_kind)}
            rows.append(row)
            print(f"{row['program']:>14} {row['tokens'] or '':>6} {gm:>14}: trace {row['trace_s']:.2f} s, "
                  f"lower {row['lower_s']:.2f} s, {row['chars'] / 1e3:.0f} k chars, custom calls "
                  f"{row['custom_calls']}", flush=True)
    name = f"lower_programs_{FLAGS.preset}_{FLAGS.layers}l" + (f"_{FLAGS.tag}" if FLAGS.tag else "") + ".json"
    path = common.write_json(FLAGS.out_dir, name, {"preset": FLAGS.preset, "layers": FLAGS.layers,
                                                   "device_kind": FLAGS.device_kind, "rows": rows,
                                                   "note": "lowered on this machine for CUDA; XLA's compile "
                                                           "is not included"})
    print(path)


if __name__ == "__main__":
    common.run(main)
