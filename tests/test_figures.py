"""docs/FIGURES.md: every CPU smoke command of its table runs and writes the files its row names.

Each smoke cell holds the script's run and the ``plots.py`` command drawing the figure from its
JSON; both run here in child processes (some set JAX options before the backend starts), with
``/tmp/fig`` rewritten to this test's tmp_path.
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIGURES = ROOT / "docs" / "FIGURES.md"
SMOKE_DIR = "/tmp/fig"


def figure_rows() -> list[dict]:
    """The table rows of docs/FIGURES.md: {figure, smoke (commands), outputs (paths)}, read from the
    cells' code spans."""
    lines = [ln for ln in FIGURES.read_text().splitlines() if ln.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = []
    for ln in lines[1:]:  # after the header (the rule below it starts with "|-")
        cells = dict(zip(header, (c.strip() for c in ln.strip("|").split(" | "))))
        rows.append({"figure": cells["figure"],
                     "smoke": re.findall(r"`([^`]+)`", cells["CPU smoke, then its figure"]),
                     "outputs": re.findall(r"`([^`]+)`", cells["smoke outputs"])})
    return rows


def test_figures_table_parses():
    """Every row has a smoke run and its figure, writing under /tmp/fig; the papers' figures are all there."""
    rows = figure_rows()
    assert len(rows) >= 9
    for r in rows:
        assert len(r["smoke"]) == 2 and r["smoke"][1].startswith("python experiments/plots.py "), r
        assert r["outputs"] and all(o.startswith(SMOKE_DIR + "/") for o in r["outputs"]), r
        assert any(o.endswith(".png") for o in r["outputs"]), r
    scripts = {shlex.split(r["smoke"][0])[1] for r in rows}
    assert {f"experiments/{s}.py" for s in ("bench_decode", "bench_prefill", "bench_miss_policy", "bench_kv_reuse",
                                             "bench_serve", "policy_study", "bench_decode_speed")} <= scripts


@pytest.mark.slow
@pytest.mark.parametrize("row", figure_rows(), ids=lambda r: r["figure"][:48])
def test_figure_smoke_commands_run(row, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    for cmd in row["smoke"]:
        args = shlex.split(cmd.replace(SMOKE_DIR, str(tmp_path)))
        assert args[0] == "python", cmd
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, *args[1:]], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=300)
        print(f"{time.perf_counter() - t0:.1f} s: {cmd}")
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for out in row["outputs"]:
        path = pathlib.Path(out.replace(SMOKE_DIR, str(tmp_path)))
        assert path.is_file() and path.stat().st_size > 0, (out, sorted(p.name for p in tmp_path.rglob("*")))
