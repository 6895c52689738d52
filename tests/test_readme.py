"""The README's links lead somewhere: its table of contents names its own headings, and every relative link
names a file of the repository."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def _anchors(text: str) -> set[str]:
    """GitHub's anchors of a Markdown text's headings: lower case, punctuation but '-' dropped, spaces to '-'."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # a '# comment' in a code block is no heading
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_readme_anchors_name_its_headings():
    text = _readme()
    anchors = [t[1:] for t in LINK.findall(text) if t.startswith("#")]
    assert len(anchors) >= 7 and "research-workflows" in anchors
    missing = sorted(set(anchors) - _anchors(text))
    assert not missing, f"README.md links #{', #'.join(missing)}, which no heading of it makes"


def test_readme_relative_links_exist():
    targets = [t.split("#")[0] for t in LINK.findall(_readme()) if not re.match(r"#|[a-z]+:", t)]
    assert "docs/FLAGS.md" in targets and "docs/FIGURES.md" in targets
    missing = sorted({t for t in targets if not os.path.exists(os.path.join(ROOT, t))})
    assert not missing, f"README.md links {missing}, which do not exist"
