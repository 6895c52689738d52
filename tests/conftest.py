"""Shared test fixtures: the transformers-made checkpoints under tests/fixtures/, and a fresh
program cache for tests that change the kernel selection."""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest

FIXTURES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
FIXTURE_NAMES = ("qwen3_moe_fp32", "qwen3_moe_bf16", "olmoe_fp32", "mixtral_fp32", "qwen3_moe_sharded")
HYBRID_FIXTURE_NAMES = ("qwen3_5_moe_fp32", "qwen3_5_moe_bf16")


def oracle_tol(expected: np.ndarray, name: str = "") -> float:
    """Bound on |ours - transformers| for float32 logits: 2e-5 * max|logit| + 1e-5, and 5e-5 *
    max|logit| + 1e-5 for the hybrid fixtures (``name`` in :data:`HYBRID_FIXTURE_NAMES`; the
    docstrings of tests/test_oracle.py and tests/test_hybrid.py say why)."""
    rel = 5e-5 if name in HYBRID_FIXTURE_NAMES else 2e-5
    return rel * float(np.abs(expected).max()) + 1e-5


def fixture_path(name: str) -> str:
    return os.path.join(FIXTURES_DIR, name)


@functools.lru_cache(maxsize=None)
def load_fixture(name: str, dtype: str = "float32"):
    """(LoadedModel, expected npz dict) for a fixture; cached across tests."""
    from ftjax.checkpoint import load_checkpoint
    model = load_checkpoint(fixture_path(name), dtype, progress=False)
    with np.load(os.path.join(fixture_path(name), "expected.npz")) as z:
        expected = {k: z[k] for k in z.files}
    return model, expected


@pytest.fixture(params=FIXTURE_NAMES)
def fixture_name(request):
    return request.param


def drop_compiled_programs() -> None:
    """Empties the engine's table of compiled programs and JAX's in-memory caches (traces,
    executables), as a new process starts: the on-disk compilation cache, if any, stays."""
    import jax

    from ftjax import engine as engine_lib
    engine_lib._COMPILED.clear()
    jax.clear_caches()


@pytest.fixture(autouse=True, scope="module")
def _fresh_compile_caches():
    """Each test module starts and ends with empty compile caches (the engine's AOT programs and
    JAX's). Hundreds of compiled steps kept across the whole suite on one 2-core, 24 GB machine
    ended in a segfault inside XLA:CPU's compiler in a late module, a module that passes alone."""
    yield
    import gc

    drop_compiled_programs()
    load_fixture.cache_clear()
    gc.collect()


@pytest.fixture
def fresh_programs():
    """Drops the engine's compiled programs and jax's traces after the test: they keep the kernel
    choice (``FTJAX_KERNELS``) made at trace time."""
    yield
    drop_compiled_programs()
