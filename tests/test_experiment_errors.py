"""Bad input to an experiment script stops it with one ``error: ...`` line naming the problem and exit status
1, not a traceback or absl's whole usage text. Each script's ``main`` runs in this process
(tests/cli_helpers.py) under ``experiments.common.guard``, as its ``common.run(main)`` runs it (ab_commits,
which imports nothing of the tree but the ``ftjax`` it measures, under its own ``guarded_main``); every case
stops before a model is built."""

from __future__ import annotations

import pathlib

import pytest

from cli_helpers import run_module_app

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _cases(tmp: pathlib.Path) -> dict:
    """script -> (arguments, the expected error line's text after ``error: ``)."""
    (tmp / "a_file").write_text("")
    missing = tmp / "missing.npz"
    return {
        "replay_policies": ([f"--trace={missing}", "--slots=4"],
                            f"{missing}: cannot read it as a routing trace (FileNotFoundError: "),
        "check_oracle_gpu": ([f"--fixtures_dir={tmp / 'nowhere'}", f"--out_dir={tmp}"],
                             f"--fixtures_dir={tmp / 'nowhere'}: no such folder"),
        "policy_study": ([f"--ckpt={tmp / 'no_ckpt'}", f"--out_dir={tmp}"],
                         f"--ckpt={tmp / 'no_ckpt'}: no config.json there (train one: experiments/train_moe.py)"),
        "bench_prefill": ([f"--out_dir={tmp / 'a_file'}", "--preset=tiny"],
                          f"--out_dir={tmp / 'a_file'}: expected a folder, but it is a file"),
        "bench_decode": ([f"--out_dir={tmp / 'a_file' / 'sub'}", "--preset=tiny"],
                         f"--out_dir={tmp / 'a_file' / 'sub'}: expected a folder, but it cannot be made: "
                         f"{tmp / 'a_file'} is a file"),
        "ab_commits": (["--measure=decode_resident,bogus", "--commit=x", f"--out={tmp / 'ab.json'}"],
                       "--measure: unknown ['bogus']; expected from "),
        # the other flags at their defaults (an empty --kernel_blocks among them) parse
        "bench_miss_copy": (["--preset=tiny", "--misses=999", f"--out_dir={tmp}"],
                            "--misses=999 exceeds the experts per layer (16), --bank_experts or --slots"),
        "bench_miss_copy:kernel_blocks": (["--preset=tiny", "--variants=static", "--kernel_blocks=16",
                                           f"--out_dir={tmp}"],
                                          "--kernel_blocks=16 adds rows beside kernel's: give --variants with kernel"),
        "policy_study:hybrid": (["--random_preset=qwen3.5-35b-a3b", f"--out_dir={tmp}"],
                                 "--random_preset=qwen3.5-35b-a3b: its linear_attention layers are not in the study's "
                                 "forward (train_moe.forward_train: attention layers only)"),
        "probe_copy_stream:kernel_async": (["--copy=kernel_async", f"--out_dir={tmp}"],
                                           "--copy=kernel_async: nothing to run here (the slot-copy kernel needs a "
                                           "GPU backend, not cpu)"),
        "bench_decode_speed:split_probe": (["--preset=tiny", "--split_probe", f"--out_dir={tmp}"],
                                           "--split_probe needs the slot-copy kernel: the slot-copy kernel needs a "
                                           "GPU backend, not cpu"),
        "probe_copy_stream": (["--copies=8", "--pool_experts=4", f"--out_dir={tmp}"],
                              "--pool_experts=4 is less than two layers' copies (2 x --copies=8): a layer would write "
                              "the rows it reads"),
    }


@pytest.mark.parametrize("case", ["replay_policies", "check_oracle_gpu", "policy_study", "bench_prefill",
                                  "bench_decode", "ab_commits", "bench_miss_copy", "bench_miss_copy:kernel_blocks",
                                  "probe_copy_stream", "probe_copy_stream:kernel_async", "policy_study:hybrid",
                                  "bench_decode_speed:split_probe"])
def test_bad_input_is_one_error_line_and_status_1(tmp_path, case):
    from experiments import common
    args, message = _cases(tmp_path)[case]
    script = case.split(":")[0]
    own = script == "ab_commits"
    define = (lambda m: m.define_flags()) if script == "policy_study" else None  # defined when run as a script
    r = run_module_app(f"experiments.{script}", args, program=str(ROOT / "experiments" / f"{script}.py"),
                       cwd=str(ROOT), main="guarded_main" if own else "main", wrap=None if own else common.guard,
                       define=define)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1, r.stderr
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), r.stderr
    assert not list(tmp_path.glob("*.json"))  # nothing written



def test_policy_study_says_matplotlib_is_missing_before_it_runs(tmp_path, monkeypatch):
    """The study's figure comes last: without matplotlib the script stops at once with one line naming the
    extra that installs it, instead of failing after the whole study."""
    import importlib.util

    from experiments import common
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    r = run_module_app("experiments.policy_study", [f"--ckpt={ROOT / 'ftjax' / 'assets' / 'stdlib_moe'}",
                                                    f"--out_dir={tmp_path}"],
                       program=str(ROOT / "experiments" / "policy_study.py"), cwd=str(ROOT), main="main",
                       wrap=common.guard, define=lambda m: m.define_flags())
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip() == "error: the study's figure needs matplotlib: pip install -e '.[train]'"
    assert not list(tmp_path.glob("*.json"))


def test_a_nan_in_a_number_list_is_refused_at_parse_time(tmp_path):
    """``float("nan")`` and ``float("inf")`` parse, and NaN passes every bound: the list check refuses them
    by name before the script builds anything."""
    args = ["--budgets_gb=8,nan", f"--out_dir={tmp_path}"]
    script = ROOT / "experiments" / "bench_miss_policy.py"
    r = run_module_app("experiments.bench_miss_policy", args, program=str(script), cwd=str(ROOT))
    assert r.returncode == 1, r.stderr
    assert "flag --budgets_gb=['8', 'nan']: expected finite numbers, got 8,nan" in r.stderr.splitlines()[0]
    assert not list(tmp_path.glob("*.json"))
