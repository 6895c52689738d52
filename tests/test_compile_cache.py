"""JAX's persistent compilation cache of the command lines and scripts (ftjax/compile_cache.py): the default
directory, the flag's three cases (unset, a directory, empty = off), and that a directory already in JAX's
config (the suite's own, tests/conftest.py) is kept. JAX's config is put back after each test."""

from __future__ import annotations

import jax
import pytest
from absl import flags
from jax.experimental.compilation_cache import compilation_cache

from cli_helpers import run_generate
from ftjax import compile_cache


@pytest.fixture(autouse=True)
def _restore_jax_config():
    saved = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
    yield
    jax.config.update("jax_compilation_cache_dir", saved[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", saved[1])
    compilation_cache.reset_cache()


def test_default_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.default_dir() == str(tmp_path / "xdg" / "ftjax" / "jax")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache.default_dir() == str(tmp_path / "home" / ".cache" / "ftjax" / "jax")
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "mine"))
    assert compile_cache.default_dir() == str(tmp_path / "mine")
    for off in ("", "off", "OFF"):
        monkeypatch.setenv(compile_cache.ENV, off)
        assert compile_cache.default_dir() is None


def test_flag_sets_a_directory_and_empty_turns_it_off(monkeypatch, tmp_path):
    monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", raising=False)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    fv = flags.FlagValues()
    compile_cache.define_flag(fv, module_name="prog")
    compile_cache.define_flag(fv, module_name="prog")  # a second definition is a no-op
    fv(["prog", f"--compilation_cache_dir={tmp_path}"])
    assert compile_cache.configure(fv.compilation_cache_dir) == str(tmp_path)
    assert jax.config.jax_compilation_cache_dir == str(tmp_path)
    assert jax.config.jax_persistent_cache_min_compile_time_secs == compile_cache.MIN_COMPILE_TIME_S
    fv.unparse_flags()
    fv(["prog", "--compilation_cache_dir="])
    assert compile_cache.configure(fv.compilation_cache_dir) is None
    assert jax.config.jax_compilation_cache_dir is None


def test_unset_flag_keeps_a_directory_already_set_else_takes_the_default(monkeypatch, tmp_path):
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "suite"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "default"))
    assert compile_cache.configure(None) == str(tmp_path / "suite")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "suite")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0  # the suite's setting, untouched
    jax.config.update("jax_compilation_cache_dir", None)
    assert compile_cache.configure(None) == str(tmp_path / "default")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "default")
    jax.config.update("jax_compilation_cache_dir", None)
    monkeypatch.setenv(compile_cache.ENV, "off")
    assert compile_cache.configure(None) is None and jax.config.jax_compilation_cache_dir is None


@pytest.mark.parametrize("value", ["DIR", ""])
def test_generate_flag_configures_the_cache_before_anything_runs(tmp_path, value):
    """The flag reaches JAX's config in ``python -m ftjax.generate`` before the flags are checked (a bad
    --max_new_tokens then stops the run before any model is loaded or compiled)."""
    path = str(tmp_path / "cache") if value == "DIR" else ""
    r = run_generate(f"--compilation_cache_dir={path}", "--max_new_tokens=0")
    assert r.returncode == 1 and "--max_new_tokens must be >= 1" in r.stderr, r.stderr
    assert jax.config.jax_compilation_cache_dir == (path or None)
