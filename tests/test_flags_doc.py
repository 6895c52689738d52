"""docs/FLAGS.md lists every flag of ``python -m ftjax.generate``, as scripts/make_flags_doc.py writes it from
the flag definitions."""

from __future__ import annotations

import importlib.util
import os
import re

from absl import flags

from cli_helpers import flag_namespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = "run python scripts/make_flags_doc.py"


def _script():
    spec = importlib.util.spec_from_file_location("make_flags_doc", os.path.join(ROOT, "scripts", "make_flags_doc.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _doc() -> str:
    with open(os.path.join(ROOT, "docs", "FLAGS.md")) as f:
        return f.read()


def _listed(text: str) -> list[str]:
    """The flag names of a FLAGS.md text's table rows, in order."""
    return re.findall(r"^\| `--(\w+)` \|", text, re.M)


def _generate_doc() -> tuple[list[str], str]:
    """(generate's flag names, the doc the script writes for them), from the flags of the real module."""
    script = _script()
    with flag_namespace("ftjax.generate", "ftjax.generate"):
        return [f.name for _, f in script.flag_rows(flags.FLAGS)], script.render(flags.FLAGS)


def test_flags_doc_lists_every_generate_flag():
    names, _ = _generate_doc()
    listed = _listed(_doc())
    assert len(names) >= 50 and {"cache_policy", "expert_slots", "prompt", "trace_routing"} <= set(names)
    missing, stale = sorted(set(names) - set(listed)), sorted(set(listed) - set(names))
    assert not missing, f"docs/FLAGS.md lacks --{', --'.join(missing)}: {FIX}"
    assert not stale, f"docs/FLAGS.md lists --{', --'.join(stale)}, which ftjax.generate no longer has: {FIX}"
    assert len(listed) == len(set(listed)), f"docs/FLAGS.md lists a flag twice: {FIX}"


def test_flags_doc_is_what_the_script_writes():
    _, text = _generate_doc()
    assert _doc() == text, f"docs/FLAGS.md is out of date (a flag's type, default or help changed): {FIX}"


def test_a_new_flag_gets_a_row_and_the_committed_doc_lacks_it():
    """The check above can fail: a flag defined beside generate's is rendered, typed, and missing from the doc."""
    from ftjax import engine_flags
    from ftjax.experts import policies
    fv = flags.FlagValues()
    engine_flags.define_flags(fv, module_name="ftjax.generate")
    flags.DEFINE_integer("new_knob", 3, "A knob | with a pipe.", lower_bound=1, flag_values=fv,
                         module_name="ftjax.generate")
    flags.DEFINE_enum("new_mode", "b", ["a", "b"], "A mode.", flag_values=fv, module_name="ftjax.generate")
    text = _script().render(fv)
    assert "| `--new_knob` | int >= 1 | `3` | A knob \\| with a pipe. |" in text
    assert "| `--new_mode` | one of `a`, `b` | `b` | A mode. |" in text
    assert text.index("`--new_knob`") > text.index("(`ftjax.generate` only)")  # not an engine flag
    assert f"| `--cache_policy` | one of {', '.join(f'`{p}`' for p in policies.names())} | `lru` |" in text
    assert {"new_knob", "new_mode"} <= set(_listed(text)) and not {"new_knob", "new_mode"} & set(_listed(_doc()))
