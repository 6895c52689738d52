"""End-of-sequence ids of a checkpoint (issue 11, case 2): generation_config.json first, else
config.json; an int or a list; () when neither has one; a clear error for a malformed value; an id
outside the vocabulary ignored with a warning.
Also the sampling defaults of generation_config.json (do_sample, temperature, top_p, top_k), and the
line ``python -m ftjax.generate`` prints about the ones it applied."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from cli_helpers import run_generate
from conftest import FIXTURE_NAMES, fixture_path, load_fixture
from ftjax.checkpoint import CheckpointError, CheckpointWarning, eos_token_ids, random_model, sampling_defaults
from ftjax.config import preset
from ftjax.sampling import SamplingDefaults


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_committed_fixtures_have_eos_2(name):
    assert eos_token_ids(fixture_path(name)) == (2,)


def test_loaded_and_random_models_carry_their_eos():
    model, _ = load_fixture("qwen3_moe_fp32")
    assert model.eos_token_ids == (2,)
    assert random_model(preset("tiny"), "float32").eos_token_ids == ()


def _ckpt(tmp_path, config=None, generation=None, vocab=384):
    """A folder with config.json (vocab_size ``vocab`` unless None, plus ``config``) and, unless
    ``generation`` is None, generation_config.json; a value "RAW:..." is written as raw text."""
    def write(name, obj):
        text = obj[4:] if isinstance(obj, str) and obj.startswith("RAW:") else json.dumps(obj)
        (tmp_path / name).write_text(text)
    cfg = {} if vocab is None else {"vocab_size": vocab}
    write("config.json", config if isinstance(config, str) else {**cfg, **(config or {})})
    if generation is not None:
        write("generation_config.json", generation)
    return str(tmp_path)


def test_generation_config_wins_and_config_is_the_fallback(tmp_path):
    assert eos_token_ids(_ckpt(tmp_path, {"eos_token_id": 5}, {"eos_token_id": 7})) == (7,)
    assert eos_token_ids(_ckpt(tmp_path, {"eos_token_id": 5}, {"bos_token_id": 1})) == (5,)
    assert eos_token_ids(_ckpt(tmp_path, {"eos_token_id": 5}, {"eos_token_id": None})) == (5,)
    (tmp_path / "generation_config.json").unlink()
    assert eos_token_ids(_ckpt(tmp_path, {"eos_token_id": [9, 3, 9]})) == (9, 3)  # file order, no repeats
    assert eos_token_ids(_ckpt(tmp_path, {}, {"eos_token_id": [0, 383]})) == (0, 383)


def test_no_eos_anywhere(tmp_path):
    assert eos_token_ids(_ckpt(tmp_path, {}, {})) == ()
    assert eos_token_ids(_ckpt(tmp_path, {"eos_token_id": None}, {"eos_token_id": None})) == ()
    assert eos_token_ids(_ckpt(tmp_path, {}, {"eos_token_id": []})) == ()       # an empty list: no EOS
    empty = tmp_path / "empty"
    empty.mkdir()
    assert eos_token_ids(str(empty)) == ()                                      # no files at all


def test_a_copied_fixture_with_its_generation_config_removed_reads_config(tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(fixture_path("olmoe_fp32"), d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 11]}))
    assert eos_token_ids(str(d)) == (2, 11)
    (d / "generation_config.json").unlink()
    cfg["eos_token_id"] = 17
    (d / "config.json").write_text(json.dumps(cfg))
    assert eos_token_ids(str(d)) == (17,)


@pytest.mark.parametrize("value, why", [
    ("2", "must be an integer or a list of integers, got '2'"),
    (2.0, "must be an integer or a list of integers, got 2.0"),
    (True, "must be an integer or a list of integers, got True"),
    ([2, False], r"must be an integer or a list of integers, got \[2, False\]"),
    ([2, "3"], r"must be an integer or a list of integers, got \[2, '3'\]"),
    ([[2]], r"must be an integer or a list of integers, got \[\[2\]\]"),
    ({"id": 2}, r"must be an integer or a list of integers, got \{'id': 2\}"),
    (-1, r"has a negative id -1 \(value -1\)"),
    ([2, -5], r"has a negative id -5 \(value \[2, -5\]\)"),
])
@pytest.mark.parametrize("where", ["generation_config.json", "config.json"])
def test_malformed_values_name_file_field_and_value(tmp_path, value, why, where):
    if where == "config.json":
        d = _ckpt(tmp_path, {"eos_token_id": value})
    else:
        d = _ckpt(tmp_path, {"eos_token_id": 2}, {"eos_token_id": value})
    with pytest.raises(CheckpointError, match="^" + re.escape(f"{tmp_path}/{where}: 'eos_token_id' ") + why):
        eos_token_ids(d)
    assert issubclass(CheckpointError, ValueError)


def test_ids_outside_the_vocabulary_are_ignored_with_a_warning(tmp_path):
    """As transformers does: an id >= vocab_size (a real model's generation_config.json kept in a
    small test checkpoint) can never be generated, so it is left out, with a warning naming it."""
    a, b, c = (tmp_path / n for n in "abc")
    for d in (a, b, c):
        d.mkdir()
    with pytest.warns(CheckpointWarning, match="^" + re.escape(f"{a}/generation_config.json: 'eos_token_id' id 384 is "
                                                               "outside the vocabulary [0, 384) (value 384); ignored")):
        assert eos_token_ids(_ckpt(a, {"eos_token_id": 2}, {"eos_token_id": 384})) == ()  # config.json not read
    with pytest.warns(CheckpointWarning, match=re.escape(f"{b}/config.json: 'eos_token_id' id 151645 is outside")):
        assert eos_token_ids(_ckpt(b, {"eos_token_id": [1, 151645, 1]})) == (1,)
    with pytest.warns(CheckpointWarning, match=r"id 50 is outside .*\[0, 50\)"):
        assert eos_token_ids(_ckpt(c, {}, {"eos_token_id": [7, 50]}, vocab=50)) == (7,)


def test_vocab_bound_only_when_config_gives_one(tmp_path):
    assert eos_token_ids(_ckpt(tmp_path, {"eos_token_id": 10**6}, vocab=None)) == (10**6,)


def test_unreadable_files_named(tmp_path):
    with pytest.raises(CheckpointError, match=r"generation_config.json: cannot read JSON"):
        eos_token_ids(_ckpt(tmp_path, {}, "RAW:{not json"))
    with pytest.raises(CheckpointError, match=r"generation_config.json: expected a JSON object, got list"):
        eos_token_ids(_ckpt(tmp_path, {}, [2]))
    (tmp_path / "generation_config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config.json: expected a JSON object, got int"):
        eos_token_ids(_ckpt(tmp_path, "RAW:2"))


# ---- sampling defaults -----------------------------------------------------------------------------
def test_sampling_defaults_read_from_generation_config(tmp_path):
    gen = {"eos_token_id": 2, "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert sampling_defaults(_ckpt(tmp_path, {}, gen)) == SamplingDefaults(True, 0.6, 0.95, 20)
    got = sampling_defaults(_ckpt(tmp_path, {}, {"temperature": 1, "top_p": None}))
    assert got == SamplingDefaults(temperature=1.0) and isinstance(got.temperature, float)
    assert sampling_defaults(fixture_path("olmoe_fp32")) == SamplingDefaults()  # the fixtures state none
    assert random_model(preset("tiny"), "float32").sampling_defaults == SamplingDefaults()


@pytest.mark.parametrize("field, value, why", [("do_sample", "yes", "do_sample must be true or false"),
                                               ("temperature", -1.0, "temperature must be a finite number"),
                                               ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
                                               ("top_k", 1.5, r"top_k must be an integer in \[0, 2\*\*31\)")])
def test_malformed_sampling_defaults_name_the_file(tmp_path, field, value, why):
    with pytest.raises(CheckpointError, match="^" + re.escape(f"{tmp_path}/generation_config.json: ") + why):
        sampling_defaults(_ckpt(tmp_path, {}, {field: value}))


def test_generate_says_which_defaults_it_applied(tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(fixture_path("qwen3_moe_fp32"), d)
    gen = json.loads((d / "generation_config.json").read_text())
    gen.update(do_sample=True, temperature=0.6, top_p=0.95, top_k=20)
    (d / "generation_config.json").write_text(json.dumps(gen))
    r = run_generate(f"--checkpoint={d}", "--prompt_ids=1,2,3", "--max_new_tokens=2", "--top_k=1",
                     f"--metrics_json={tmp_path / 'm.json'}")
    assert r.returncode == 0, r.stderr
    assert ("sampling: temperature=0.6 top_p=0.95 top_k=1 (checkpoint generation_config.json defaults applied: "
            "do_sample, temperature, top_p; overridden: top_k)") in r.stdout
    m = json.loads((tmp_path / "m.json").read_text())["sampling"]
    assert m["top_k"] == 1 and m["checkpoint_defaults"] == {"do_sample": True, "temperature": 0.6, "top_p": 0.95,
                                                             "top_k": 20}
