"""Routing traces record their shape (ftjax/routing_trace.py), and experiments/replay_policies.py takes E
and L from it: --num_experts is needed only for a trace without the shape, must agree when given, and a
trace whose arrays disagree with it is refused in one line. The script runs in this process
(tests/cli_helpers.py) under ``experiments.common.guard``, as ``common.run`` runs it."""

from __future__ import annotations

import json
import pathlib
import types

import numpy as np
import pytest

from cli_helpers import run_module_app
from ftjax import routing_trace

ROOT = pathlib.Path(__file__).resolve().parents[1]
CFG = types.SimpleNamespace(num_layers=2, num_experts=4, top_k=2)


def _steps(num_layers: int = 2, top: int = 3) -> list[np.ndarray]:
    """Three calls of int32 [num_layers, tokens, 2] ids in [0, top], a padding token in the prefill."""
    rng = np.random.default_rng(0)
    steps = [rng.integers(0, top + 1, (num_layers, n, 2)).astype(np.int32) for n in (3, 1, 1)]
    steps[0][:, 0] = -1
    return steps


def _write(path: pathlib.Path, steps, shape: dict | None = CFG.__dict__) -> str:
    arrays = {f"step{i}": s for i, s in enumerate(steps)}
    np.savez(path, **arrays, **{k: np.asarray(v) for k, v in (shape or {}).items()})
    return str(path)


def _replay(*args: str):
    from experiments import common
    return run_module_app("experiments.replay_policies", args, program=str(ROOT / "experiments" / "replay_policies.py"),
                          cwd=str(ROOT), wrap=common.guard)


def test_arrays_record_the_shape_as_scalar_ints(tmp_path):
    steps = _steps()
    arrays = routing_trace.arrays(steps, CFG)
    assert sorted(arrays) == ["num_experts", "num_layers", "step0", "step1", "step2", "top_k"]
    for k in routing_trace.SHAPE_KEYS:
        assert arrays[k].shape == () and arrays[k].dtype == np.int64 and int(arrays[k]) == getattr(CFG, k)
    np.savez_compressed(tmp_path / "t.npz", **arrays)
    got, shape = routing_trace.load(str(tmp_path / "t.npz"))
    assert shape == {"num_layers": 2, "num_experts": 4, "top_k": 2}
    assert len(got) == 3 and all(np.array_equal(a, b) for a, b in zip(got, steps))


def test_replay_takes_num_experts_from_the_trace(tmp_path):
    trace = _write(tmp_path / "t.npz", _steps())
    out = tmp_path / "r.json"
    r = _replay(f"--trace={trace}", "--slots=4,8", "--policies=lru", f"--out={out}")
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert (res["num_experts"], res["num_layers"], res["steps"]) == (4, 2, 3)
    assert [row["slots"] for row in res["results"]] == [4, 8]
    # the same numbers as with the (agreeing) flag given
    out2 = tmp_path / "r2.json"
    assert _replay(f"--trace={trace}", "--slots=4,8", "--policies=lru", "--num_experts=4",
                   f"--out={out2}").returncode == 0
    assert json.loads(out2.read_text())["results"] == res["results"]


@pytest.mark.parametrize("case", ["flag_disagrees", "old_trace_no_flag", "id_too_large", "layers_disagree",
                                  "top_k_disagrees", "partial_shape"])
def test_replay_refuses_a_trace_that_disagrees_in_one_line(tmp_path, case):
    path = str(tmp_path / "t.npz")
    flags_, message = [], None
    if case == "flag_disagrees":
        _write(tmp_path / "t.npz", _steps())
        flags_, message = ["--num_experts=8"], f"{path}: num_experts: expected 8 (--num_experts), got 4 (the trace's)"
    elif case == "old_trace_no_flag":
        _write(tmp_path / "t.npz", _steps(), shape=None)
        message = f"{path}: no num_layers, num_experts, top_k fields (a trace written before they were recorded): " \
                  "give --num_experts"
    elif case == "id_too_large":
        steps = _steps(top=5)
        _write(tmp_path / "t.npz", steps)
        bad = int(steps[0][steps[0] >= 4].flat[0])
        message = f"{path}: step0: routed expert id {bad}: expected ids in [0, num_experts=4) or -1"
    elif case == "layers_disagree":
        _write(tmp_path / "t.npz", _steps(num_layers=3))
        message = f"{path}: step0: num_layers: expected 2, got 3 layers"
    elif case == "top_k_disagrees":
        _write(tmp_path / "t.npz", _steps(), shape={**CFG.__dict__, "top_k": 3})
        message = f"{path}: step0: top_k: expected 3, got 2 ids per token"
    else:
        _write(tmp_path / "t.npz", _steps(), shape={"num_experts": 4})
        message = (f"{path}: has num_experts but not num_layers, top_k (a routing trace records num_layers, "
                   "num_experts, top_k together)")
    r = _replay(f"--trace={path}", "--slots=4", "--policies=lru", *flags_)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and lines == [f"error: {message}"], r.stderr


def test_an_old_trace_replays_with_the_flag(tmp_path):
    trace = _write(tmp_path / "t.npz", _steps(), shape=None)
    r = _replay(f"--trace={trace}", "--slots=4", "--policies=lru", "--num_experts=4")
    assert r.returncode == 0 and "lru" in r.stdout, r.stderr
