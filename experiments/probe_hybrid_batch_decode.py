"""Does a resident hybrid (Gated DeltaNet) decode compile and run at batch > 1 on this backend?

A probe, not a benchmark: the qwen3.5-35b-a3b shape cut to ``--layers`` (one block of 3 Gated DeltaNet +
1 gated attention at 4), random bf16 weights, ``--batches`` rows of a 64-token prompt, ``--steps`` greedy
steps with ``EngineConfig.decode_block`` ``--block``; writes each batch's compile seconds and tokens/s (the JSON
is rewritten after each batch, so a hang leaves the batches before it). Run it under ``timeout -s ABRT`` with
``python -X faulthandler`` to see where a hang sits (``experiments/gpu_stages.sh hybrid-batch-probe``): on an
H200 (2026-12-04) XLA's compile of a 16-step chain of the layer's decode update hung at B = 2 and 4, not at 1;
on 2026-12-05 the engine compiled B = 1 and 2 in 46.5 and 53.5 s and B = 4 had not finished at 150 s.

Where that compile time goes: each row records its programs' ``compile_log`` (tracing and lowering vs XLA
seconds) and the kernels that applied; ``--kernels=xla`` (the kernel flags of ``ftjax.generate``) compiles the
same programs without any Pallas kernel (``experiments/gpu_stages.sh hybrid-compile`` runs both). Traced on the
CPU, a 4-layer cut's decode-block program holds 15 distinct Pallas kernels (11 of them ``dense_decode``, one
per projection shape) and its prefill program 8 more, each a Triton compile of its own on a GPU.
"""

import time

from absl import flags

from experiments import common

flags.DEFINE_integer("layers", 4, "Layers of the cut model.", lower_bound=1)
flags.DEFINE_list("batches", ["1", "2", "4"], "Rows decoded together.")
flags.DEFINE_integer("block", 16, "Decode steps per program (EngineConfig.decode_block).", lower_bound=1)
flags.DEFINE_integer("steps", 32, "Greedy decode steps.", lower_bound=1)
flags.DEFINE_string("preset", "qwen3.5-35b-a3b", "A preset with Gated DeltaNet layers.")
flags.DEFINE_string("dtype", "bfloat16", "The random weights' dtype.")
flags.DEFINE_string("out_dir", "experiments/results/checks", "Where the JSON goes.")
flags.DEFINE_string("tag", "", "Suffix of the JSON name.")
common.define_kernel_flags()
FLAGS = flags.FLAGS


def main(argv):
    del argv
    import numpy as np

    from ftjax import Engine
    from ftjax.checkpoint import random_model
    from ftjax.config import EngineConfig
    cfg = common.preset_cut(FLAGS.preset, FLAGS.layers)
    model = random_model(cfg, FLAGS.dtype)
    rng = np.random.default_rng(0)
    out = {"layers": FLAGS.layers, "block": FLAGS.block, "steps": FLAGS.steps, "rows": []}
    name = f"probe_hybrid_batch_decode_{FLAGS.preset}" + (f"_{FLAGS.tag}" if FLAGS.tag else "") + ".json"
    batches = [int(b) for b in FLAGS.batches]
    prompts_all = [list(rng.integers(0, cfg.vocab_size, 64)) for _ in range(max(batches))]
    for b in batches:
        eng = Engine(model, EngineConfig("resident", batch=b, max_seq_len=64 + FLAGS.steps + 8, prefill_chunk=64,
                                         decode_block=FLAGS.block, kernels=common.kernel_config()))
        prompts = prompts_all[:b]  # the same first rows at every batch
        t0 = time.perf_counter()
        res = eng.generate(prompts, FLAGS.steps)
        print(f"batch {b}: first generate {time.perf_counter() - t0:.1f} s (compile {eng.compile_s:.1f} s), "
              f"{res.decode_tokens_per_s:.1f} tok/s", flush=True)
        out["rows"].append({"batch": b, "first_generate_s": time.perf_counter() - t0, "compile_s": eng.compile_s,
                            "decode_tokens_per_s": res.decode_tokens_per_s,
                            # (program, tracing and lowering s, XLA compile s) of each program compiled
                            "compile_log": [list(x) for x in eng.programs.log],
                            "kernels_applied": sorted(eng.programs.kernels_applied()),
                            "tokens": [list(map(int, ids)) for ids in res.generated_ids]})
        common.write_json(FLAGS.out_dir, name, out)


if __name__ == "__main__":
    common.run(main)
