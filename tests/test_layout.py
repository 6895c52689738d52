"""The package's layout rules, checked on the source: no import cycle between ftjax's modules (imports
inside functions count too), and no environment read below the command-line entry points."""

from __future__ import annotations

import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parent.parent / "ftjax"

#: Modules that may read the environment: where a run's provenance is recorded, and the default folders
#: of the calibration profile and of the compilation cache (XDG_CACHE_HOME, FTJAX_COMPILATION_CACHE).
#: Kernel and program choices live in EngineConfig.kernels.
ENV_READERS = {"ftjax.provenance", "ftjax.calibrate", "ftjax.compile_cache"}


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        out[name] = ast.parse(path.read_text(), str(path))
    return out


def _imports(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """The ftjax modules ``name`` imports anywhere in its source (a package's ``from pkg import mod`` is
    an import of ``pkg.mod``)."""
    found = set()
    pkg = name if any(k.startswith(name + ".") for k in known) and name in known else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m in known and m != name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                got = visit(m)
                if got:
                    return got
        state[n] = 2
        stack.pop()
        return None

    for n in sorted(graph):
        if n not in state:
            got = visit(n)
            if got:
                return got
    return None


def test_no_import_cycle():
    mods = _modules()
    known = set(mods)
    # a package imports its parents implicitly; that is no cycle of the code's own
    graph = {n: {m for m in _imports(n, t, known) if not n.startswith(m + ".")} for n, t in mods.items()}
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_environment_reads_below_the_entry_points():
    readers = set()
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") and \
                    isinstance(node.value, ast.Name) and node.value.id == "os":
                readers.add(name)
    assert readers <= ENV_READERS, f"modules reading the environment: {sorted(readers - ENV_READERS)}"
