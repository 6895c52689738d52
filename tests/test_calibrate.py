"""Calibration of the miss split (ftjax.calibrate): fits, the profile file, the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cli_helpers import run_module_app
from ftjax import calibrate
from ftjax.experts.miss_split import SplitModel, split_table


def test_fit_line_recovers_affine_costs():
    alpha, beta = calibrate.fit_line([(1, 0.5e-3 + 0.3e-3), (2, 0.5e-3 + 0.6e-3), (8, 0.5e-3 + 2.4e-3)])
    assert alpha == pytest.approx(0.5e-3) and beta == pytest.approx(0.3e-3)
    # a negative intercept is refit through the origin
    alpha, beta = calibrate.fit_line([(1, 0.1), (2, 0.3), (4, 0.7)])
    assert alpha == 0.0 and beta == pytest.approx((0.1 + 0.6 + 2.8) / 21)
    assert calibrate.fit_line([(4, 0.0)]) == (0.0, calibrate.MIN_BETA_S)  # noise floor: never zero
    # a time that fell with n (noise above the per-expert cost): charged per expert, not taken for a free expert
    # (the clamped slope printed 110592 GB/s and sent every miss to the CPU)
    alpha, beta = calibrate.fit_line([(1, 0.40e-3), (8, 0.36e-3)])
    assert alpha == 0.0 and beta == pytest.approx((0.40e-3 + 8 * 0.36e-3) / 65)
    with pytest.raises(calibrate.CalibrationError):
        calibrate.fit_line([])


@pytest.mark.parametrize("overlap", [0.0, 0.4, 1.0])
def test_fit_impl_recovers_a_known_model(overlap):
    ap, bp, ah, bh, base = 0.6e-3, 0.22e-3, 0.1e-3, 1.2e-3, 0.05e-3
    a = lambda n: ap + n * bp  # noqa: E731
    c = lambda n: ah + n * bh  # noqa: E731
    both = lambda f, n: max(a(f), c(n)) + (1 - overlap) * min(a(f), c(n))  # noqa: E731
    pts = {"base_s": base, "fetch": [(n, base + a(n)) for n in (1, 2, 4, 8)],
           "cpu": [(n, base + c(n)) for n in (1, 2, 4, 8)],
           "together": [(f, n, base + both(f, n)) for f, n in ((4, 4), (1, 7), (7, 1))]}
    eb = 9437184
    r = calibrate.fit_impl(pts, eb, 8)
    assert r["ok"] and r["fetch"]["alpha_s"] == pytest.approx(ap) and r["fetch"]["beta_s"] == pytest.approx(bp)
    assert r["cpu"]["alpha_s"] == pytest.approx(ah) and r["cpu"]["beta_s"] == pytest.approx(bh)
    assert r["fetch"]["GBps"] == pytest.approx(eb / bp / 1e9)
    assert r["together"]["overlap"] == pytest.approx(overlap, abs=1e-9)
    model = calibrate.split_model_from(r)
    assert r["split_table"] == list(split_table(model, 8))
    want = SplitModel(bp, bh, ap, ah, overlap).as_dict()
    assert model.as_dict() == pytest.approx(want, abs=1e-12)
    with pytest.raises(calibrate.CalibrationError, match="failed"):
        calibrate.split_model_from({"ok": False, "error": "boom"})


def test_plan_points():
    p = calibrate.plan_points(8, quick=False)
    assert p["alone"] == [1, 2, 4, 8] and (4, 4) in p["together"] and (8, 8) in p["together"]
    assert calibrate.plan_points(8, quick=True) == {"alone": [1, 8], "together": [(4, 4)], "capacity": 8}
    assert calibrate.plan_points(1, quick=True)["together"] == [(1, 1)]


def _good(beta_h=1e-3):
    """A well-formed successful mechanism result, as ``fit_impl`` writes it."""
    sm = {"beta_p": 2e-4, "beta_h": beta_h, "alpha_p": 0.0, "alpha_h": 2e-3, "overlap": 0.5}
    return {"ok": True, "split_model": sm, "split_table": [0, 1],
            "fetch": {"alpha_s": 0.0, "beta_s": 2e-4, "GBps": 40.0},
            "cpu": {"alpha_s": 2e-3, "beta_s": beta_h, "GBps": 9.0}, "together": {"overlap": 0.5},
            "mechanism": {"impl": "callback", "threads": 4}}


def test_profile_file_merge_atomic_and_errors(tmp_path):
    path = str(tmp_path / "sub" / "cal.json")
    fmt = {"hidden": 2048, "expert_ffn": 768, "dtype": "bfloat16", "expert_bytes": 9437184}
    key = calibrate.profile_key("NVIDIA H200", fmt, 1)
    assert key == "NVIDIA H200|bfloat16|D2048|F768|T1" and calibrate.profile_key("x", fmt, 4).endswith("|T4")
    assert calibrate.get_entry(path, key) is None
    calibrate.save_entry(path, key, {"device": "NVIDIA H200", "format": fmt, "impls": {"callback": _good()}})
    calibrate.save_entry(path, key, {"date": "x", "impls": {"compute_on": {"ok": False, "error": "e"}}})
    calibrate.save_entry(path, "cpu|float32|D64|F32|T1", {"impls": {}})
    e = calibrate.get_entry(path, key)
    assert set(e["impls"]) == {"callback", "compute_on"} and e["device"] == "NVIDIA H200" and e["date"] == "x"
    assert len(calibrate.load_profile(path)["entries"]) == 2
    assert [f for f in os.listdir(tmp_path / "sub")] == ["cal.json"]  # no temporary left behind
    # a failed re-calibration keeps the earlier good result; a new good one replaces it
    calibrate.save_entry(path, key, {"impls": {"callback": {"ok": False, "error": "max_workers"}}})
    assert calibrate.get_entry(path, key)["impls"]["callback"]["ok"] is True
    calibrate.save_entry(path, key, {"impls": {"callback": _good(beta_h=5e-3)}})
    assert calibrate.get_entry(path, key)["impls"]["callback"]["split_model"]["beta_h"] == 5e-3
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(calibrate.CalibrationError, match="cannot read"):
        calibrate.load_profile(str(tmp_path / "bad.json"))
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(calibrate.CalibrationError, match="bin.json: cannot read"):
        calibrate.load_profile(str(tmp_path / "bin.json"))
    (tmp_path / "old.json").write_text(json.dumps({"version": 0, "entries": {}}))
    with pytest.raises(calibrate.CalibrationError, match="version"):
        calibrate.save_entry(str(tmp_path / "old.json"), key, {"impls": {}})
    assert calibrate.default_profile_path().endswith(os.path.join("ftjax", "calibration.json"))


def _with(change):
    r = _good()
    change(r)
    return r


@pytest.mark.parametrize("entry,match", [
    ([1, 2], "entry must be an object"),
    ({"impls": [1]}, "entry must be an object"),
    ({"impls": {"callback": "fast"}}, "boolean 'ok'"),
    ({"impls": {"callback": _with(lambda r: r["split_model"].update(extra=1.0))}}, "split_model"),
    ({"impls": {"callback": _with(lambda r: r["split_model"].pop("overlap"))}}, "split_model"),
    ({"impls": {"callback": _with(lambda r: r["split_model"].update(beta_p="fast"))}}, "split_model"),
    ({"impls": {"callback": _with(lambda r: r["split_model"].update(alpha_h=float("inf")))}}, "split_model"),
    ({"impls": {"callback": _with(lambda r: r["split_model"].update(beta_p=True))}}, "split_model"),
    ({"impls": {"callback": _with(lambda r: r["split_model"].update(overlap=2.0))}}, "overlap"),
    ({"impls": {"callback": _with(lambda r: r.update(cpu=[1]))}}, r"callback\.cpu"),
    ({"impls": {"callback": _with(lambda r: r.update(mechanism="x"))}}, "mechanism must be"),
    ({"impls": {"callback": _with(lambda r: r["mechanism"].update(threads=-3))}}, "threads"),
])
def test_malformed_profile_entries_are_named(tmp_path, entry, match):
    path = tmp_path / "p.json"
    key = "cpu|float32|D64|F32|T1"
    path.write_text(json.dumps({"version": 1, "entries": {key: entry}}))
    before = path.read_bytes()
    with pytest.raises(calibrate.CalibrationError, match=match) as err:
        calibrate.get_entry(str(path), key)
    assert str(path) in str(err.value) and key in str(err.value)
    with pytest.raises(calibrate.CalibrationError):
        calibrate.save_entry(str(path), key, {"impls": {"callback": _good()}})
    assert path.read_bytes() == before  # nothing half-written or replaced


def _run_calibrate(*args: str):
    """``python -m ftjax.calibrate *args`` in this process (its flags defined as under ``__main__``).
    Only for runs that stop before calibrating: the callback mechanisms need synchronous CPU
    dispatch set before JAX starts, which only a process of their own has."""
    return run_module_app("ftjax.calibrate", args, define=lambda m: setattr(m, "FLAGS", m._flags()))


def test_calibrate_cli_quick(tmp_path):
    """The quick calibration in a process of its own (``python -m ftjax.calibrate``: synchronous CPU
    dispatch before JAX starts); its refusals of bad flags in this one."""
    prof = tmp_path / "p.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "ftjax.calibrate", "--quick", "--impls=callback,compute_on",
                        "--bank_rows=16", "--cpu_threads=2", f"--profile={prof}"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "profile written" in r.stdout
    entry = json.loads(prof.read_text())["entries"]["cpu|float32|D128|F128|T1"]
    assert entry["format"]["expert_bytes"] == 3 * 128 * 128 * 4 and entry["tokens"] == 1
    assert entry["max_misses"] == 4  # tiny: top-4 of 16 experts, one token
    for impl in ("callback", "compute_on"):
        r_ = entry["impls"][impl]
        assert r_["ok"], r_
        assert r_["fetch"]["beta_s"] > 0 and r_["cpu"]["beta_s"] > 0 and 0 <= r_["together"]["overlap"] <= 1
        assert len(r_["split_table"]) == 5 and r_["split_table"][0] == 0
        assert [p[0] for p in r_["fetch"]["points"]] == [1, 4]
    assert entry["impls"]["callback"]["mechanism"]["threads"] == 2
    r = _run_calibrate("--impls=torch", f"--profile={prof}")
    assert r.returncode == 1 and "unknown --impls" in r.stderr and "Traceback" not in r.stderr
    before = prof.read_bytes()
    for bad, msg in (("--cpu_threads=-3", "--cpu_threads must be >= 0"), ("--impls=", "--impls is empty")):
        r = _run_calibrate("--quick", bad, f"--profile={prof}")
        assert r.returncode == 1 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert prof.read_bytes() == before
