"""CITATION.cff and LICENSE: the citation file reads as YAML (or, without PyYAML, has its required keys), and
its version and license are pyproject's."""

from __future__ import annotations

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _top_level(text: str) -> dict:
    """Top-level ``key: value`` lines of a YAML file (values of nested or folded keys left as '')."""
    out = {}
    for line in text.splitlines():
        if line and not line[0].isspace() and not line.startswith(("#", "-")) and ":" in line:
            key, _, value = line.partition(":")
            out[key.strip()] = value.strip().strip('"')
    return out


def test_citation_cff_has_the_required_keys_and_pyproject_version():
    text = (ROOT / "CITATION.cff").read_text()
    try:
        import yaml
        cff = yaml.safe_load(text)
        assert cff["authors"] == [{"name": "the ftjax authors"}], cff["authors"]
    except ImportError:
        cff = _top_level(text)
    assert {"cff-version", "message", "title", "authors", "abstract", "license", "version"} <= set(cff), cff
    assert str(cff["cff-version"]) == "1.2.0" and cff["title"] == "ftjax"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert str(cff["version"]) == project["version"]
    assert cff["license"] == project["license"]["text"] == "Apache-2.0"
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "Copyright 2026 the ftjax authors" in license_text
