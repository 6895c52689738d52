"""Does a resident hybrid (Gated DeltaNet) decode compile and run at batch > 1 on this backend?

A probe, not a benchmark: the qwen3.5-35b-a3b shape cut to ``--layers`` (one block of 3 Gated DeltaNet +
1 gated attention at 4), random bf16 weights, ``--batches`` rows of a 64-token prompt, ``--steps`` greedy
steps with ``EngineConfig.decode_block`` ``--block``; prints each batch's compile seconds and tokens/s.
Run it under ``timeout -s ABRT`` with ``python -X faulthandler`` to see where a hang sits.
"""

import dataclasses
import time

from absl import flags

from experiments import common

flags.DEFINE_integer("layers", 4, "Layers of the cut model.", lower_bound=1)
flags.DEFINE_list("batches", ["1", "2", "4"], "Rows decoded together.")
flags.DEFINE_integer("block", 16, "Decode steps per program (EngineConfig.decode_block).", lower_bound=1)
flags.DEFINE_integer("steps", 32, "Greedy decode steps.", lower_bound=1)
flags.DEFINE_string("preset", "qwen3.5-35b-a3b", "A preset with Gated DeltaNet layers.")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    import numpy as np

    from ftjax import Engine
    from ftjax.checkpoint import random_model
    from ftjax.config import PRESETS, EngineConfig
    base = PRESETS[FLAGS.preset]
    cfg = dataclasses.replace(base, num_layers=FLAGS.layers, layer_types=base.layer_types[:FLAGS.layers])
    model = random_model(cfg, "bfloat16")
    rng = np.random.default_rng(0)
    for b in map(int, FLAGS.batches):
        eng = Engine(model, EngineConfig("resident", batch=b, max_seq_len=64 + FLAGS.steps + 8, prefill_chunk=64,
                                         decode_block=FLAGS.block))
        prompts = [list(rng.integers(0, cfg.vocab_size, 64)) for _ in range(b)]
        t0 = time.perf_counter()
        res = eng.generate(prompts, FLAGS.steps)
        print(f"batch {b}: first generate {time.perf_counter() - t0:.1f} s (compile {eng.compile_s:.1f} s), "
              f"{res.decode_tokens_per_s:.1f} tok/s", flush=True)


if __name__ == "__main__":
    common.run(main)
