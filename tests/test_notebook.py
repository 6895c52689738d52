"""The notebooks of notebooks/ run top to bottom in a Jupyter kernel, as ``jupyter nbconvert --to notebook
--execute`` runs them (their cells assert their own results), are committed without large outputs, and import
nothing that ``pip install -e '.[notebooks]'`` does not install."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import sys
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK_DIR = os.path.join(ROOT, "notebooks")
# Each notebook, and text its executed outputs must hold (beside its cells' own asserts).
EXPECTED = {
    "walkthrough.ipynb": ["max |logit difference|: 0.0", "lookahead"],
    "routing.ipynb": ["belady", "Belady at S = E:"],
}
# What tests/test_notebook.py's kernel run needs from the test extra (else it skips).
KERNEL_PACKAGES = ("nbclient", "nbformat", "ipykernel")
MAX_OUTPUT_CHARS = 20_000  # all outputs of a committed notebook together: text, never images


def _cells(name: str) -> list[dict]:
    with open(os.path.join(NOTEBOOK_DIR, name)) as f:
        return json.load(f)["cells"]


def _distribution(requirement: str) -> str:
    """A requirement's normalised distribution name: "jupyter_core>=5.7" -> "jupyter-core"."""
    return re.split(r"[\s<>=!~;\[(]", requirement, maxsplit=1)[0].lower().replace("_", "-").replace(".", "-")


def _project() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def test_every_notebook_is_run():
    assert sorted(n for n in os.listdir(NOTEBOOK_DIR) if n.endswith(".ipynb")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_notebook_committed_without_large_outputs(name):
    outputs = [o for c in _cells(name) if c["cell_type"] == "code" for o in c["outputs"]]
    images = [k for o in outputs for k in o.get("data", {}) if k.startswith("image/")]
    assert not images, f"{name}: committed with embedded images {images}: clear its outputs"
    size = len(json.dumps(outputs))
    assert size <= MAX_OUTPUT_CHARS, f"{name}: {size} characters of outputs (at most {MAX_OUTPUT_CHARS}): clear them"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_notebook_imports_come_with_the_notebooks_extra(name):
    """Every module a notebook imports is the standard library's, the repository's, or a distribution of
    the project's dependencies or of its ``notebooks`` extra."""
    project = _project()
    declared = {_distribution(r) for r in project["dependencies"] + project["optional-dependencies"]["notebooks"]}
    provided = importlib.metadata.packages_distributions()
    modules = set()
    for cell in _cells(name):
        if cell["cell_type"] == "code":
            for node in ast.walk(ast.parse("".join(cell["source"]))):
                if isinstance(node, ast.Import):
                    modules |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    modules.add(node.module.split(".")[0])
    assert modules, f"{name}: no import found"
    third_party = sorted(m for m in modules - set(sys.stdlib_module_names)
                         if not os.path.exists(os.path.join(ROOT, m)))
    missing = [m for m in third_party if not {_distribution(d) for d in provided.get(m, [m])} & declared]
    assert not missing, f"{name} imports {missing}: add their distributions to pyproject's notebooks extra"


def test_test_extra_runs_the_notebooks():
    """The kernel run below skips without nbclient: the test extra must install what it needs."""
    test_extra = {_distribution(r) for r in _project()["optional-dependencies"]["test"]}
    assert set(KERNEL_PACKAGES) <= test_extra, sorted(set(KERNEL_PACKAGES) - test_extra)


@pytest.mark.slow  # each notebook top to bottom: about half a minute to a minute
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_notebook_runs_in_a_kernel(name):
    nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed (pip install -e '.[test]' or "
                                   "'.[notebooks]' installs it): the notebooks are not run")
    import nbformat
    nb = nbformat.read(os.path.join(NOTEBOOK_DIR, name), as_version=4)
    # The kernel imports this checkout's ftjax, whatever else is installed; it runs from notebooks/, as
    # `jupyter nbconvert --execute` runs it.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": NOTEBOOK_DIR}})
    client.execute(env=env)  # a cell that raises fails here with its traceback (CellExecutionError)
    text = "".join("".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", ""))
                   for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    for expected in EXPECTED[name]:
        assert expected in text, f"{name}: {expected!r} not in its outputs:\n{text[-2000:]}"
