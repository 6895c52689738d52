"""experiments/results/ stays organized and its references stay true: every result path the docs name
exists, every figure folder is described in the results README, and that README's "Full index" is
``experiments/results_index.py``'s current output. Pure file checks (no model, no JAX)."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "experiments", "results")
sys.path.insert(0, os.path.join(ROOT, "experiments"))
import results_index  # noqa: E402

#: The documents whose result paths are checked: a path is relative to experiments/results/ (to the
#: document's own folder inside it), or to the repository root when it starts with ``experiments/``.
DOCS = sorted(["README.md", "BUILD.md", "experiments/results/README.md", "experiments/results/archive/README.md",
               *(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))])
SPAN = re.compile(r"`([^`\n]+)`|\]\(([^)\s]+)\)")
DATED = re.compile(r"_(?:h200|cpu)_\d{4}-\d\d-\d\d")  # a committed run's name: <script>_..._<device>_<date>...
RESULT_EXT = (".json", ".png", ".txt", ".pdf", ".svg", ".*")


def _words(text: str):
    """Each word of the code spans and link targets of a Markdown text (a flag's value on its own)."""
    for m in SPAN.finditer(text):
        for w in (m.group(1) or m.group(2)).split():
            w = w.strip("(),;:'\"")
            yield w.split("=", 1)[1] if w.startswith("--") and "=" in w else w


def _expand(word: str) -> list[str]:
    """Brace alternatives, as a shell expands them: ``a_{x,y}_b`` -> ``a_x_b``, ``a_y_b``."""
    m = re.search(r"\{([^{}]*)\}", word)
    if not m:
        return [word]
    return [w for alt in m.group(1).split(",") for w in _expand(word[:m.start()] + alt + word[m.end():])]


def result_refs(doc: str) -> list[str]:
    """The result paths ``doc`` names (words of its code spans and links): those under experiments/results/,
    results-relative paths of result files, and bare names of committed runs. Abbreviations (``...``),
    placeholders (``$OUT``, ``<name>``) and absolute paths are not paths of the repository."""
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        text = f.read()
    refs = []
    for w in _words(text):
        if not w or w.startswith(("/", "~", "#", "http")) or any(s in w for s in ("...", "$", "<", ">")):
            continue
        if "experiments/results" in w or ("/" in w and w.endswith(RESULT_EXT)) or DATED.search(w):
            refs.append(w)
    return refs


def _exists(doc: str, ref: str) -> bool:
    here = os.path.dirname(os.path.join(ROOT, doc))  # a link's target is relative to its document
    base = here if doc.startswith("experiments/results/") else RESULTS
    for path in _expand(ref.split("#")[0]):
        roots = [ROOT] if path.startswith("experiments/") else [base, here, ROOT]
        if not any(glob.glob(os.path.join(r, path)) for r in roots):
            return False
    return True


@pytest.mark.parametrize("doc", DOCS)
def test_every_result_path_named_exists(doc):
    refs = result_refs(doc)
    missing = sorted({r for r in refs if not _exists(doc, r)})
    assert not missing, (f"{doc} names result files that do not exist (paths are relative to experiments/results/, "
                         f"or start with experiments/; a bare name needs its folder): {missing}")


def test_the_reference_check_finds_and_refuses():
    """The check sees the forms the docs use, and a name without its folder (or a moved file) fails it."""
    assert _expand("prefill/a_{x,y}_b.json") == ["prefill/a_x_b.json", "prefill/a_y_b.json"]
    refs = result_refs("docs/FIGURES.md")
    assert "decode_by_budget/bench_decode_qwen3-30b-a3b_8gb_lookahead-c602b22_h200_2026-12-02.json" in refs
    assert not any(r.startswith("/tmp/") for r in refs)
    name = "bench_prefill_qwen3-30b-a3b_9gb_pipelined-repeats5_h200_2026-11-30.json"
    assert _exists("docs/OVERLAP.md", "prefill/" + name)
    assert not _exists("docs/OVERLAP.md", name)  # at the top level no more
    assert not _exists("docs/OVERLAP.md", "decode_by_budget/" + name)
    assert _exists("experiments/results/archive/README.md", "../prefill/" + name)
    assert _exists("README.md", "experiments/results/prefill/" + name)


def test_results_are_filed_in_documented_folders():
    """No result JSON at the top level; every folder (and only those) has a row in the README's layout table."""
    top = sorted(n for n in os.listdir(RESULTS) if n.endswith((".json", ".png")))
    assert not top, f"file these into their figure's folder (experiments/results/README.md, 'Layout'): {top}"
    folders = {n + "/" for n in os.listdir(RESULTS) if os.path.isdir(os.path.join(RESULTS, n))}
    with open(os.path.join(RESULTS, "README.md"), encoding="utf-8") as f:
        layout = f.read().split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    rows = set(re.findall(r"^\| \[?`([\w\-]+/)`", layout, re.M))
    assert rows == folders, (f"folders without a row: {sorted(folders - rows)}; "
                             f"rows without a folder: {sorted(rows - folders)}")
    assert {"decode_by_budget/", "prefill/", "kv_reuse/", "checks/", "archive/"} <= folders


def test_full_index_is_current():
    """The README's "Full index" is results_index.py's table of today's files (every JSON but archive/'s)."""
    with open(results_index.README, encoding="utf-8") as f:
        readme = f.read()
    want = results_index.table(results_index.DEFAULT_DIR)
    assert results_index.readme_index(readme) == want, (
        "experiments/results/README.md's Full index is stale: run python experiments/results_index.py --write_readme")
    files = results_index.result_files(results_index.DEFAULT_DIR)
    assert len(files) >= 80 and not any(f.startswith("archive/") for f in files)
    assert all(f"| `{f}` |" in want for f in files)
    assert results_index.with_index(readme, "| x |") != readme and results_index.readme_index(
        results_index.with_index(readme, "| x |")) == "| x |"


#: The travelling tree's limit on the GPU machine is 64 MiB (tracked files, untracked ones and shared/); the
#: repository keeps 6 MiB of it free for a run's untracked files and the next results.
TREE_BUDGET_MIB = 58


def test_committed_pngs_are_the_ones_a_document_shows():
    """A result PNG is committed only where a document names it on a line that speaks of a PNG (its own name
    or its JSON's): every other figure is one ``plots.py FILE`` away, and 158 unshown PNGs once took 9.5 of
    the tree's 64 MiB."""
    texts = []
    for pattern in ("*.md", "docs/*.md", "experiments/**/*.md", "experiments/*.py", "experiments/*.sh"):
        for path in glob.glob(os.path.join(ROOT, pattern), recursive=True):
            with open(path, encoding="utf-8") as f:
                texts += [line for line in f if "png" in line.lower()]
    shown = "\n".join(texts)
    pngs = glob.glob(os.path.join(RESULTS, "**", "*.png"), recursive=True)
    assert pngs, "the figures of docs/FIGURES.md have PNGs under experiments/results/"
    unshown = sorted(os.path.relpath(p, RESULTS) for p in pngs
                     if "archive" not in os.path.relpath(p, RESULTS).split(os.sep)
                     and os.path.splitext(os.path.basename(p))[0] not in shown)
    assert not unshown, f"PNGs no document shows (git rm them; plots.py draws them on demand): {unshown}"


def test_the_tree_fits_the_gpu_machines_limit():
    """The files that travel to the GPU machine (tracked, and untracked but not ignored: git's own list) stay under
    TREE_BUDGET_MIB: over 64 MiB no GPU command runs at all."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    total = sum(os.path.getsize(os.path.join(ROOT, n)) for n in listed if n and os.path.isfile(os.path.join(ROOT, n)))
    assert 1 << 20 < total < TREE_BUDGET_MIB << 20, (
        f"the tree holds {total / 2**20:.1f} MiB (limit {TREE_BUDGET_MIB}): move superseded results out or "
        "drop PNGs no document shows")
