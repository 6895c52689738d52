r"""Resident vs cached on the accelerator, bit for bit: the decode-step options of issue 13 must not move a logit.

Every offload mode has to give the fully resident model's logits (the project's first rule). On the
CPU the tests check it; this script checks it where the decode programs differ most from the CPU's: on
a GPU, in bfloat16, with the cached modes' decode steps as CUDA graphs (``KernelConfig.decode_graphs``)
and the slot table's all-hit fast path (``lookup_layer(skip_if_all_hit=True)``). For each fixture and
prompt it greedily generates ``--steps`` tokens with a resident engine and with each cached variant
(S = E and S = 2E slots; ``decode_graphs`` auto, i.e. on, and off; on request with the prefetch of
``EngineConfig.prefetch_guesses``, or with the prefill on the layer scan) and compares every step's logits
bit for bit (the float32 logits' bits, so -0.0 against 0.0 and NaNs count as differences; ids equal).

    PYTHONPATH=. python3 experiments/check_identity_gpu.py --out_dir=$OUT
    PYTHONPATH=. JAX_PLATFORMS=cpu .venv/bin/python experiments/check_identity_gpu.py --fixtures=qwen3_moe_fp32 \
        --dtype=float32 --prompts=short --steps=4 --out_dir=/tmp/ident      # CPU smoke (~1 min)

Every engine runs with the kernel config of the kernel flags (``--kernels``, ``--kernel_tiles``, ... as
``ftjax.generate``; ``EngineConfig.kernels``) with each variant's ``decode_graphs`` (so no
``--decode_graphs`` flag); the resident reference runs with ``decode_graphs`` auto.

Output: ``check_identity_gpu.json`` (meta, flags, one row per case with both engines' configs, a
summary). Exit status 1 if any case differs.
"""

from __future__ import annotations

import os
import sys

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from experiments import common  # noqa: E402
from ftjax import Engine  # noqa: E402
from ftjax.checkpoint import DTYPES, load_checkpoint  # noqa: E402
from ftjax.config import EngineConfig  # noqa: E402

# name -> (slots in units of E, KernelConfig.decode_graphs, EngineConfig.prefetch_guesses)
#: variant -> (slots / E, decode_graphs, prefetch_guesses, prefill_driver)
VARIANTS = {"cached_S=E": (1, "auto", 0, "auto"), "cached_S=2E": (2, "auto", 0, "auto"),
            "cached_S=E_graphs_off": (1, "off", 0, "auto"), "cached_S=E_prefetch-2": (1, "auto", 2, "auto"),
            "cached_S=E_scan": (1, "auto", 0, "scan"), "cached_S=E_pipelined": (1, "auto", 0, "pipelined")}
DEFAULT_VARIANTS = ["cached_S=E", "cached_S=2E", "cached_S=E_graphs_off"]

FLAGS = flags.FLAGS
flags.DEFINE_list("fixtures", ["qwen3_moe_bf16", "qwen3_5_moe_bf16"], "Fixture folders under tests/fixtures/.")
flags.DEFINE_string("dtype", "bfloat16", "Compute and bank dtype.")
flags.DEFINE_list("prompts", ["short", "long"], "Prompts of expected.npz.")
flags.DEFINE_list("variants", DEFAULT_VARIANTS, f"Cached variants, of {list(VARIANTS)} (prefetch-2: "
                  "EngineConfig.prefetch_guesses=2, a layer's guessed experts copied beside its token mixer; scan / "
                  "pipelined: the prefill on that driver, where a GPU's auto driver streams a prompt of >= E "
                  "routed tokens on the pipelined driver in 16-bit dtypes and on the scan in float32).")
flags.DEFINE_integer("steps", 16, "Greedy steps compared.", lower_bound=1)
flags.DEFINE_string("out_dir", "experiments/results/checks", "Where the JSON goes.")
common.define_kernel_flags(skip=("decode_graphs",))  # each variant sets its own
common.check_names("variants", VARIANTS)
common.check_names("prompts", ("short", "long"))
common.check_choice("dtype", DTYPES)
common.validate("fixtures", lambda v: next((f"no fixture {f!r} (no {os.path.join(common.FIXTURES_DIR, f)})"
                                            for f in v if not os.path.isdir(os.path.join(common.FIXTURES_DIR, f))),
                                           None))


def _generate(model, experts: str, slots, graphs: str, prompt: list[int], prefetch: int = 0, driver: str = "auto"):
    config = EngineConfig(experts, num_slots=slots, max_seq_len=len(prompt) + FLAGS.steps + 8,
                          kernels=common.kernel_config(decode_graphs=graphs), prefetch_guesses=prefetch,
                          prefill_driver=driver)
    eng = Engine(model, config)
    res = eng.generate([prompt], max_new_tokens=FLAGS.steps, keep_logits=True)
    return np.asarray(res.step_logits, np.float32), res.generated_ids, eng.describe()


def main(argv):
    del argv
    rows = []
    for fixture in FLAGS.fixtures:
        path = os.path.join(common.FIXTURES_DIR, fixture)
        model = load_checkpoint(path, FLAGS.dtype, progress=False)
        e = model.cfg.num_experts
        with np.load(os.path.join(path, "expected.npz")) as z:
            prompts = {p: z[f"{p}_prompt_ids"].tolist() for p in FLAGS.prompts}
        for name, prompt in prompts.items():
            ref_logits, ref_ids, ref_engine = _generate(model, "resident", None, "auto", prompt)
            for variant in FLAGS.variants:
                mult, graphs, prefetch, driver = VARIANTS[variant]
                logits, ids, engine = _generate(model, "cached", mult * e, graphs, prompt, prefetch, driver)
                same_shape = logits.shape == ref_logits.shape
                diff = float(np.max(np.abs(logits - ref_logits))) if same_shape else float("inf")
                bits = same_shape and np.array_equal(logits.view(np.uint32), ref_logits.view(np.uint32))
                rows.append({"fixture": fixture, "prompt": name, "variant": variant, "max_abs_diff": diff,
                             "shapes": [list(logits.shape), list(ref_logits.shape)], "ids_equal": ids == ref_ids,
                             "identical": bool(bits) and ids == ref_ids,
                             "decode_compiler_options": engine["decode_compiler_options"], "engine": engine,
                             "resident_engine": ref_engine})
                print(f"{fixture:18s} {name:5s} {variant:22s} max |diff| {diff:.3g} ids equal {ids == ref_ids}",
                      flush=True)
    failed = [f"{r['fixture']}/{r['prompt']}/{r['variant']}" for r in rows if not r["identical"]]
    summary = {"cases": len(rows), "failed": failed}
    common.write_json(FLAGS.out_dir, "check_identity_gpu.json", {"meta": common.meta(), "flags": common.script_flags(),
                                                             "rows": rows, "summary": summary})
    print(summary)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    common.run(main)
