r"""Writes docs/FLAGS.md, the table of ``python -m ftjax.generate``'s flags, from their absl definitions.

  python scripts/make_flags_doc.py           # rewrite docs/FLAGS.md
  python scripts/make_flags_doc.py --check   # exit 1 when docs/FLAGS.md is not what this writes

The flags are those ``ftjax/generate.py`` defines, its own and the ones ``ftjax/engine_flags.py`` defines for
it (shared with ``python -m ftjax.serve``), in definition order, each with its type, default and help text.
tests/test_flags_doc.py fails when the committed file differs, so a new or changed flag shows up here.
"""

from __future__ import annotations

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "FLAGS.md")
MODULE = "ftjax.generate"

HEADER = """# Flags of `python -m ftjax.generate`

Written by `python scripts/make_flags_doc.py` from the flag definitions (`ftjax/generate.py`, and
`ftjax/engine_flags.py` for those shared with `python -m ftjax.serve`); `tests/test_flags_doc.py` fails when
this file is not what the script writes, so run it after adding or changing a flag. A boolean `--NAME` is
turned off by `--noNAME` (`--no_prefill_overlap` is read as `--noprefill_overlap`). `python -m ftjax.generate
--helpfull` also lists absl's own flags (`--flagfile`, logging). The README's "Generating" section has a short
table of the most-used flags.
"""

SECTIONS = (
    ("Model, expert cache, quantization, kernels, miss policy, KV offload (shared with `python -m ftjax.serve`)",
     True),
    ("What to generate, and what to write (`ftjax.generate` only)", False),
)


def _cell(text: str) -> str:
    """``text`` safe inside a Markdown table cell: pipes and asterisks escaped, one line."""
    return " ".join(text.split()).replace("|", "\\|").replace("*", "\\*")


def _type(flag) -> str:
    """A flag's type as the table shows it, e.g. "int >= 1", "one of `a`, `b`", "comma list"."""
    parser = flag.parser
    if getattr(parser, "enum_values", None):
        return "one of " + ", ".join(f"`{v}`" for v in parser.enum_values)
    kind = {"string": "string", "int": "int", "float": "float", "bool": "bool"}.get(flag.flag_type(), "comma list")
    bounds = [f">= {parser.lower_bound}" if getattr(parser, "lower_bound", None) is not None else "",
              f"<= {parser.upper_bound}" if getattr(parser, "upper_bound", None) is not None else ""]
    return " ".join([kind, *[b for b in bounds if b]])


def _help(flag) -> str:
    """A flag's help text without the "<a|b|c>: " that absl puts before an enum's (the type column has it)."""
    return re.sub(r"^<[^>]*>: ", "", flag.help)


def _default(flag) -> str:
    """A flag's default as the table shows it: "unset", "empty", "`true`", "`8192`", "`a,b`"."""
    value = flag.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, list):
        return f"`{','.join(map(str, value))}`" if value else "empty"
    return f"`{value}`" if value != "" else "empty"


def flag_rows(flag_values, module: str = MODULE) -> list[tuple[bool, object]]:
    """(shared with the engine flags?, absl ``Flag``) for every flag ``module`` defines or marks as its key
    flag in ``flag_values`` (an absl ``FlagValues`` into which ``module`` was imported), absl's own left out,
    in definition order. Raises ValueError when ``module`` has no flags there."""
    from ftjax.engine_flags import FLAG_NAMES
    rows = [(f.name in FLAG_NAMES, f) for f in flag_values.get_key_flags_for_module(module)
            if not (flag_values.find_module_defining_flag(f.name) or "").startswith("absl")]
    if not rows:
        raise ValueError(f"no flags of {module} in the given FlagValues (import {module} first)")
    return rows


def render(flag_values, module: str = MODULE) -> str:
    """docs/FLAGS.md's text for ``module``'s flags in ``flag_values`` (see :func:`flag_rows`). Raises
    ValueError when ``module`` has no flags there."""
    rows = flag_rows(flag_values, module)
    out = [HEADER]
    for title, shared in SECTIONS:
        out += [f"## {title}", "", "| flag | type | default | meaning |", "|---|---|---|---|"]
        out += [f"| `--{f.name}` | {_cell(_type(f))} | {_cell(_default(f))} | {_cell(_help(f))} |"
                for s, f in rows if s == shared]
        out.append("")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    """Writes (or with ``--check`` compares) docs/FLAGS.md; returns the exit status."""
    if argv not in ([], ["--check"]):
        print("usage: python scripts/make_flags_doc.py [--check]", file=sys.stderr)
        return 2
    sys.path.insert(0, ROOT)
    from absl import flags
    __import__(MODULE)
    text = render(flags.FLAGS)
    if argv == ["--check"]:
        with open(DOC) as f:
            same = f.read() == text
        if not same:
            print(f"{os.path.relpath(DOC, ROOT)} is out of date: run python scripts/make_flags_doc.py", file=sys.stderr)
        return 0 if same else 1
    with open(DOC, "w") as f:
        f.write(text)
    print(f"wrote {os.path.relpath(DOC, ROOT)}: {len(flag_rows(flags.FLAGS))} flags")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
