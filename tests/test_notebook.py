"""The walkthrough notebook runs top to bottom (its cells assert that cached == resident)."""

from __future__ import annotations

import json
import os

import pytest

pytestmark = pytest.mark.slow  # the whole walkthrough, top to bottom

NOTEBOOK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks",
                        "walkthrough.ipynb")


def test_walkthrough_runs(monkeypatch, capsys):
    monkeypatch.chdir(os.path.dirname(NOTEBOOK))
    with open(NOTEBOOK) as f:
        cells = [c for c in json.load(f)["cells"] if c["cell_type"] == "code"]
    assert cells
    scope: dict = {}
    for cell in cells:
        exec("".join(cell["source"]), scope)  # noqa: S102 - our own notebook
    out = capsys.readouterr().out
    assert "max |logit difference|: 0.0" in out
    assert "lookahead" in out
