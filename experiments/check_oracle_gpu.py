r"""The transformers oracle on the accelerator: every fixture x every expert mode vs expected.npz.

  PYTHONPATH=. .venv/bin/python experiments/check_oracle_gpu.py --out_dir=experiments/results/checks   # GPU
  PYTHONPATH=. JAX_PLATFORMS=cpu .venv/bin/python experiments/check_oracle_gpu.py --smoke \
      --out_dir=/tmp/oracle_smoke                                                             # CPU smoke

GPU runtime (estimate, not measured: the lead runs it): about 4-8 min, almost all of it
compilation (5 fixtures x 8 modes x 3 programs x 2 dtypes, the tiny programs compile in ~1 s
each; fixtures with the same config share programs). Split it with --fixtures=... if needed.
CPU: the smoke run (qwen3_moe_fp32, short prompt, 8 modes in float32, resident in bfloat16) takes
~45 s on 2 busy cores (5 s per compiled program); the full run (160 cases) took 907 s there and
passed every float32 case.

For each fixture under tests/fixtures/ (README there), each prompt (``short``: 12 tokens,
``long``: 300) and each expert mode of :data:`MODES` (resident; cached at S=E and S=2E;
on_demand; streamed prefill (prefill="stream", S=2E); the miss policies fetch, cpu and adaptive
(a fixed fetch count, as tests/test_miss_policy.py does) at S=E), it greedily generates
--steps tokens and compares with transformers' float32 outputs in ``expected.npz``:

* **float32 pass** (asserted), engines built with ``EngineConfig(matmul_precision=--f32_precision)``
  (default "auto", which is "highest" for float32: full float32 dots, not TF32 as XLA:GPU does by
  default; the engine applies it inside its step):
  greedy ids equal, and max |logit error| <= tol = 2e-5 * max|expected logit| + 1e-5 over every
  step (tests/test_oracle.py's tolerance and its reasoning).
* **bfloat16 pass** (reported, not asserted), weights and compute in bfloat16 under
  ``--bf16_precision`` ("auto": the backend's default, today's fast path): how many greedy ids
  agree with the float32 oracle, and the max |logit error| vs its float32 logits over the steps
  whose context still equals the oracle's (after a divergence the contexts differ).

Every engine runs with the kernel config of the kernel flags (``--kernels``, ``--decode_gemm``, ... as
``ftjax.generate``; ``EngineConfig.kernels``) and the miss modes' ``MissPolicyConfig`` (``EngineConfig.miss``).

Output: one JSON, ``check_oracle_gpu.json`` (``meta``, flags, the precision each pass ran
under, tolerances, one row per case with its engine's config, a summary). Exit status 1 if any float32 case fails (or
raises); the failing cases are printed.
"""

from __future__ import annotations

import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from experiments import common  # noqa: E402
from ftjax import Engine  # noqa: E402
from ftjax.checkpoint import load_checkpoint  # noqa: E402
from ftjax.config import MATMUL_PRECISIONS, EngineConfig, MissPolicyConfig  # noqa: E402
from ftjax.experts import cpu_experts  # noqa: E402

PROMPTS = ("short", "long")

# name -> (experts mode, slots in units of E (None: resident), prefill mode, miss policy or None)
MODES = {
    "resident": ("resident", None, "auto", None),
    "cached_S=E": ("cached", 1, "auto", None),
    "cached_S=2E": ("cached", 2, "auto", None),
    "on_demand": ("on_demand", 1, "auto", None),
    "stream_S=2E": ("cached", 2, "stream", None),
    "miss_fetch": ("cached", 1, "auto", "fetch"),
    "miss_cpu": ("cached", 1, "auto", "cpu"),
    "miss_adaptive": ("cached", 1, "auto", "adaptive"),
}
SMOKE_FIXTURES = ("qwen3_moe_fp32",)
SMOKE_PROMPTS = ("short",)
SMOKE_BF16_MODES = ("resident",)

FLAGS = flags.FLAGS
flags.DEFINE_string("fixtures_dir", common.FIXTURES_DIR, "Folder of fixture folders (each with expected.npz).")
flags.DEFINE_list("fixtures", None, "Fixture folders under tests/fixtures/ (default: every one with expected.npz).")
flags.DEFINE_list("modes", list(MODES), f"Expert modes, of {list(MODES)}.")
flags.DEFINE_list("bf16_modes", None, "Modes of the bfloat16 pass (default: --modes; empty: no bfloat16 pass).")
flags.DEFINE_list("prompts", list(PROMPTS), "Prompts of expected.npz: short, long.")
flags.DEFINE_integer("steps", 16, "Greedy steps compared (at most the 16 stored).")
flags.DEFINE_enum("f32_precision", "auto", list(MATMUL_PRECISIONS),
                  "EngineConfig.matmul_precision of the float32 pass (auto = highest for float32).")
flags.DEFINE_enum("bf16_precision", "auto", list(MATMUL_PRECISIONS),
                  "EngineConfig.matmul_precision of the bfloat16 pass (auto = the backend's fast default).")
flags.DEFINE_enum("cpu_expert_impl", "compute_on", list(cpu_experts.IMPLS), "CPU mechanism of miss_cpu / "
                  "miss_adaptive (the callback ones need synchronous CPU dispatch, set at start).")
flags.DEFINE_integer("fixed_fetch", 1, "miss_adaptive: misses fetched per layer and step (the rest on the CPU).",
                     lower_bound=0)
flags.DEFINE_boolean("smoke", False, f"CPU smoke: fixtures {','.join(SMOKE_FIXTURES)}, prompts "
                     f"{','.join(SMOKE_PROMPTS)}, bfloat16 modes {','.join(SMOKE_BF16_MODES)} (each unless given); "
                     "every mode in float32.")
flags.DEFINE_string("out_dir", "experiments/results/checks", "Where the JSON goes.")
# the kernel config of every engine (EngineConfig.kernels); --decode_gemm=cublas: float32 decode programs
# without Triton GEMMs and the dot merger too
common.define_kernel_flags()
common.check_names("modes", MODES)
common.check_names("bf16_modes", MODES, allow_empty=True)
common.check_names("prompts", PROMPTS)
flags.register_validator("steps", lambda v: 1 <= v <= 16, "must be in [1, 16] (16 steps are stored)")


def tolerance(expected: np.ndarray, hybrid: bool = False) -> float:
    """tests/test_oracle.py's float32 bound on |ours - transformers|: 2e-5 * max|logit| + 1e-5;
    5e-5 * max|logit| + 1e-5 for the hybrid family (tests/test_hybrid.py says why)."""
    return (5e-5 if hybrid else 2e-5) * float(np.abs(expected).max()) + 1e-5


def build_engine(model, mode: str, max_seq_len: int, precision: str = "auto") -> Engine:
    """The one place an engine is built (adapt here when the Engine API changes).

    ``mode``: a key of :data:`MODES`. Raises ValueError for an unknown mode.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {list(MODES)}")
    experts, slots_e, prefill, policy = MODES[mode]
    cfg = model.cfg
    miss = MissPolicyConfig()
    if policy is not None:
        miss = MissPolicyConfig(policy, cpu_impl=FLAGS.cpu_expert_impl,
                                fixed_fetch=FLAGS.fixed_fetch if policy == "adaptive" else None)
    slots = None if slots_e is None else slots_e * cfg.num_experts
    config = EngineConfig(experts, num_slots=slots, max_seq_len=max_seq_len, prefill=prefill,
                          matmul_precision=precision, kernels=common.kernel_config(), miss=miss)
    return Engine(model, config)


def load(name: str, dtype: str):
    """(LoadedModel in ``dtype``, expected dict) of fixture ``name``; the banks are host-typed
    (the compute_on mechanisms read them in-graph; the other paths do not care)."""
    path = os.path.join(FLAGS.fixtures_dir, name)
    model = load_checkpoint(path, dtype, progress=False)
    if FLAGS.cpu_expert_impl not in cpu_experts.CALLBACK_IMPLS:
        model.banks = model.banks.replace(gate_up=cpu_experts.ensure_host_typed(model.banks.gate_up),
                                          down=cpu_experts.ensure_host_typed(model.banks.down))
    with np.load(os.path.join(path, "expected.npz")) as z:
        expected = {k: z[k] for k in z.files}
    return model, expected


def compare(got_ids: list[int], got_logits: np.ndarray, want_ids: np.ndarray, want_logits: np.ndarray) -> dict:
    """Greedy ids and step logits (float32 [steps, V]) against the oracle's.

    ``max_abs_err`` is over the steps whose context equals the oracle's (all previous ids equal);
    ``ids_equal``: every id equal; ``first_mismatch``: the first differing step or None.
    """
    n = len(got_ids)
    want_ids = [int(x) for x in want_ids[:n]]
    mismatch = next((i for i in range(n) if got_ids[i] != want_ids[i]), None)
    comparable = n if mismatch is None else mismatch + 1
    err = np.abs(got_logits[:comparable] - want_logits[:comparable])
    per_step = err.max(axis=-1)
    return {"ids_equal": mismatch is None, "first_mismatch": mismatch,
            "ids_agree": sum(a == b for a, b in zip(got_ids, want_ids)), "steps": n,
            "max_abs_err": float(per_step.max()), "max_abs_err_step0": float(per_step[0]),
            "max_abs_logit": float(np.abs(want_logits[:n]).max()),
            "generated_ids": got_ids, "expected_ids": want_ids}


def run_case(model, expected, fixture: str, dtype: str, mode: str, prompt: str, precision: str = "auto") -> dict:
    row = {"fixture": fixture, "dtype": dtype, "mode": mode, "prompt": prompt}
    ids = expected[f"{prompt}_prompt_ids"].tolist()
    want_logits = expected[f"{prompt}_step_logits"][: FLAGS.steps]
    max_seq_len = -(-(len(ids) + FLAGS.steps) // 128) * 128
    t0 = time.perf_counter()
    try:
        eng = build_engine(model, mode, max_seq_len, precision)
        res = eng.generate([ids], FLAGS.steps, keep_logits=True)
        row.update(compare(res.generated_ids[0], np.asarray(res.step_logits[:, 0], np.float32),
                           expected[f"{prompt}_generated_ids"], want_logits))
        ec = eng.expert_cache_metrics()
        row.update(misses=ec["misses"], hits=ec["hits"], cpu_computed=ec.get("cpu_computed", 0),
                   compile_s=res.compile_s, engine=eng.describe())
    except Exception as e:  # noqa: BLE001 -- a failing case is recorded, and fails the float32 pass
        row["error"] = f"{type(e).__name__}: {e}"[:2000]
    row["wall_s"] = time.perf_counter() - t0
    if dtype == "float32":
        row["tol"] = tolerance(want_logits, model.cfg.is_hybrid)
        row["ok"] = "error" not in row and row["ids_equal"] and row["max_abs_err"] <= row["tol"]
    return row


def prompts() -> list[str]:
    return list(SMOKE_PROMPTS) if FLAGS.smoke and not FLAGS["prompts"].present else FLAGS.prompts


def run_pass(dtype: str, precision: str | None, fixtures: list[str], modes: list[str]) -> list[dict]:
    """Every (fixture, prompt, mode) in ``dtype`` with the engine's ``matmul_precision``
    (``EngineConfig``; "auto" = full float32 for float32, the fast default for bfloat16)."""
    rows = []
    for fixture in fixtures:
        model, expected = load(fixture, dtype)
        for prompt in prompts():
            for mode in modes:
                row = run_case(model, expected, fixture, dtype, mode, prompt, precision)
                rows.append(row)
                status = ("ERROR " + row["error"][:200] if "error" in row else
                          f"ids {'equal' if row['ids_equal'] else 'DIFFER at ' + str(row['first_mismatch'])}, "
                          f"max err {row['max_abs_err']:.2e}")
                verdict = "" if dtype != "float32" else (" ok" if row["ok"] else " FAIL")
                print(f"[{dtype}] {fixture:<18} {prompt:<5} {mode:<14} {status}{verdict}", flush=True)
        del model
    return rows


def summarize(rows: list[dict]) -> dict:
    f32 = [r for r in rows if r["dtype"] == "float32"]
    bf = [r for r in rows if r["dtype"] == "bfloat16" and "error" not in r]
    out = {"float32_cases": len(f32), "float32_failed": [f"{r['fixture']}/{r['prompt']}/{r['mode']}"
                                                         for r in f32 if not r["ok"]]}
    if f32:
        ok = [r for r in f32 if "error" not in r]
        out["float32_max_abs_err"] = max((r["max_abs_err"] for r in ok), default=None)
        out["float32_max_err_over_tol"] = max((r["max_abs_err"] / r["tol"] for r in ok), default=None)
    if bf:
        out["bfloat16_cases"] = len(bf)
        out["bfloat16_errors"] = sum(1 for r in rows if r["dtype"] == "bfloat16" and "error" in r)
        out["bfloat16_ids_agree"] = f"{sum(r['ids_agree'] for r in bf)}/{sum(r['steps'] for r in bf)}"
        out["bfloat16_all_ids_equal_cases"] = sum(r["ids_equal"] for r in bf)
        out["bfloat16_max_abs_err"] = max(r["max_abs_err"] for r in bf)
        out["bfloat16_max_rel_err"] = max(r["max_abs_err"] / r["max_abs_logit"] for r in bf)
    return out


def main(argv):
    del argv
    if FLAGS.cpu_expert_impl in cpu_experts.CALLBACK_IMPLS:
        cpu_experts.use_sync_cpu_dispatch()
    bad = [m for m in FLAGS.modes + (FLAGS.bf16_modes or []) if m not in MODES]
    if bad or not 1 <= FLAGS.steps <= 16 or set(FLAGS.prompts) - set(PROMPTS):
        raise app.UsageError(f"need modes of {list(MODES)} (bad: {bad}), 1 <= --steps <= 16, prompts of {PROMPTS}")
    root = FLAGS.fixtures_dir
    if not os.path.isdir(root):
        raise app.UsageError(f"--fixtures_dir={root}: no such folder")
    fixtures = FLAGS.fixtures or (list(SMOKE_FIXTURES) if FLAGS.smoke else sorted(
        d for d in os.listdir(root) if os.path.exists(os.path.join(root, d, "expected.npz"))))
    missing = [f for f in fixtures if not os.path.exists(os.path.join(root, f, "expected.npz"))]
    if missing or not fixtures:
        raise app.UsageError(f"no expected.npz for fixtures {missing or fixtures} under {root}")
    bf16_modes = FLAGS.bf16_modes if FLAGS.bf16_modes is not None else (
        list(SMOKE_BF16_MODES) if FLAGS.smoke else FLAGS.modes)
    info = common.meta()
    print(f"{info['device']} ({info['backend']}), jax {info['jax']}: fixtures {fixtures}", flush=True)
    t0 = time.perf_counter()
    rows = run_pass("float32", FLAGS.f32_precision, fixtures, FLAGS.modes)
    if bf16_modes:
        rows += run_pass("bfloat16", FLAGS.bf16_precision, fixtures, bf16_modes)
    summary = summarize(rows)
    payload = {"meta": info, "script": "experiments/check_oracle_gpu.py",
               "prompts": prompts(),
               "fixtures": fixtures, "modes": {m: dict(zip(("experts", "slots_per_E", "prefill", "miss_policy"),
                                                           MODES[m])) for m in MODES},
               "precision": {"float32": EngineConfig(matmul_precision=FLAGS.f32_precision).precision("float32"),
                             "bfloat16": EngineConfig(matmul_precision=FLAGS.bf16_precision).precision("bfloat16")},
               "tolerance": {"float32": "max|ours - transformers| <= 2e-5 * max|expected| + 1e-5 per case, "
                                        "greedy ids equal (asserted)",
                             "bfloat16": "reported only: ids agreeing with the float32 oracle, max |error| vs "
                                         "its float32 logits over the steps with an equal context"},
               "wall_s": time.perf_counter() - t0, "summary": summary, "results": rows}
    path = common.write_json(FLAGS.out_dir, "check_oracle_gpu.json", payload)
    print({k: v for k, v in summary.items()})
    print("wrote", path)
    if summary["float32_failed"]:
        print("FAILED float32 cases:", ", ".join(summary["float32_failed"]), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    common.run(main)
