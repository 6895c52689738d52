"""Shared test fixtures: the transformers-made checkpoints under tests/fixtures/, and fresh program
caches per test module."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile

import numpy as np
import pytest


def _force_host_devices(n: int = 4) -> None:
    """Four CPU devices in every test process (``XLA_FLAGS=--xla_force_host_platform_device_count``, unless the
    flag is set already), so that the expert-parallel tests (tests/test_expert_parallel.py) split experts over
    2 and 4 devices. Set before jax starts; other tests run on the first device as before.

    XLA's optimisation level stays the default, as users run: a lower LLVM level for XLA:CPU
    (``--xla_backend_optimization_level=0`` or ``1``) cut the default selection from 15:50 to 11:32 or 14:14 on 2
    cores (2026-12-06) but changed floating-point results between programs the suite requires to be bit-identical
    (8 tests of the CPU-miss path at 0, 7 of the layer-pipelined prefix copies at 1)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


_force_host_devices()


def _use_compilation_cache() -> str | None:
    """JAX's persistent compilation cache for the whole test run, this process and its children
    (``python -m ftjax.generate``, experiments/ scripts: through the ``JAX_...`` variables).

    Each module starts with empty in-memory caches (``_fresh_compile_caches`` below), and many
    compile the same programs (the tiny preset, the fixtures' engines): with the executables on
    disk, a program compiled once in the run is loaded, not compiled again. By default the cache is
    a new temporary directory, removed at exit: every run starts cold, as CI's does.
    ``FTJAX_TEST_COMPILATION_CACHE=DIR`` keeps it in DIR across runs (faster reruns; JAX keys each
    entry by the program, the compile options and the jax/jaxlib versions), ``=off`` turns it off.
    A ``JAX_COMPILATION_CACHE_DIR`` already set is left as it is. The command lines and scripts keep a
    directory set here (``ftjax.compile_cache``); with ``=off`` their own default cache is off too
    (``FTJAX_COMPILATION_CACHE=off``), so that no test writes to ``~/.cache``. Returns the directory, or None."""
    setting = os.environ.get("FTJAX_TEST_COMPILATION_CACHE", "").strip()
    if setting.lower() in ("off", "0", "no", "false"):
        os.environ["FTJAX_COMPILATION_CACHE"] = "off"
        return None
    path = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if not path:
        path = setting or tempfile.mkdtemp(prefix="ftjax-test-jax-cache-")
        if not setting:
            atexit.register(shutil.rmtree, path, ignore_errors=True)
        os.environ["JAX_COMPILATION_CACHE_DIR"] = path
    # every program, however small or fast to compile (the defaults skip those under 1 s)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
    import jax
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes",
                      int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]))
    return path


def _use_native_cache() -> str:
    """The native CPU expert kernel's build cache (``ftjax.experts.cpu_native``) for the whole test run, this
    process and its children: ``$FTJAX_NATIVE_CACHE`` when set, else a new temporary directory removed at
    exit, so that no test writes to ``~/.cache``. Returns the directory."""
    path = os.environ.get("FTJAX_NATIVE_CACHE", "").strip()
    if not path:
        path = tempfile.mkdtemp(prefix="ftjax-test-native-")
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        os.environ["FTJAX_NATIVE_CACHE"] = path
    return path


NATIVE_CACHE_DIR = _use_native_cache()

#: Tests that build the native CPU expert kernel need a C compiler (``ftjax.experts.cpu_native``); where the
#: machine has none they are skipped, and ``test_clear_errors_without_a_compiler`` checks the refusal instead.
needs_c_compiler = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                      reason="no C compiler (cc, gcc) on PATH: the native kernel cannot be built")

# XLA:CPU's LLVM optimization level stays at its default. Levels 0 and 1 compile a third to a half
# faster, but change the rounding of some programs against others (the CPU-miss and pipelined-prefix
# bit-identity tests fail at them), so the suite would prove a configuration that nothing runs.
COMPILATION_CACHE_DIR = _use_compilation_cache()

# What this process compiled and what the on-disk cache saved (the summary at the end of the run).
_COMPILE_STATS = {"cache_hits": 0, "cache_misses": 0, "backend_compile_s": 0.0, "compile_time_saved_s": 0.0}


def _count_compile_events() -> None:
    import jax.monitoring

    def on_event(event, **kw):
        if event.startswith("/jax/compilation_cache/cache_"):
            key = event.rsplit("/", 1)[1]
            if key in _COMPILE_STATS:
                _COMPILE_STATS[key] += 1

    def on_duration(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            _COMPILE_STATS["backend_compile_s"] += duration
        elif event == "/jax/compilation_cache/compile_time_saved_sec":
            _COMPILE_STATS["compile_time_saved_s"] += duration

    jax.monitoring.register_event_listener(on_event)
    jax.monitoring.register_event_duration_secs_listener(on_duration)


_count_compile_events()


def pytest_addoption(parser):
    parser.addoption("--backend", choices=("cpu", "default"), default="cpu",
                     help="JAX backend of the run: cpu (the default, as CI, also on a GPU machine: the suite's "
                          "float32 tolerances and kernel choices are the CPU's) or default (JAX's own choice, the "
                          "GPU where there is one: for the GPU-only cases, e.g. tests/test_slot_copy.py)")


def pytest_configure(config):
    """``--backend=cpu``: JAX (and the command lines the tests start) on the CPU backend, whatever the machine has.
    Set before any test module asks JAX for its backend (collection imports them after this)."""
    if config.getoption("backend") == "cpu":
        import jax
        os.environ["JAX_PLATFORMS"] = "cpu"
        jax.config.update("jax_platforms", "cpu")


def pytest_runtest_setup(item):
    """A test marked ``cpu_only("why")`` skips on any other backend (``--backend=default`` on a GPU machine): the
    CPU's interpret-mode kernel checks, whose float32 tolerances, bf16 summation order or kernel choices are the
    CPU's (19 such cases failed on an H100, 2026-12-06, experiments/results/checks/). A test marked
    ``gpu("why")`` skips unless JAX runs on a GPU, and says how to run it on one. Unmarked tests do not ask JAX
    for its backend here (that would start it for tests that never use it)."""
    cpu_only, gpu = item.get_closest_marker("cpu_only"), item.get_closest_marker("gpu")
    if cpu_only is None and gpu is None:
        return
    import jax
    backend = jax.default_backend()
    if cpu_only is not None and backend != "cpu":
        pytest.skip(f"CPU backend only: {cpu_only.args[0] if cpu_only.args else 'written for the CPU backend'}")
    if gpu is not None and backend != "gpu":
        why = gpu.args[0] if gpu.args else "needs a GPU"
        pytest.skip(f"{why} (on a GPU machine: pytest --backend=default -n 0)")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line: this process's XLA compiles and the persistent cache's hits (none under xdist's
    controller, which runs no test)."""
    st = _COMPILE_STATS
    if st["cache_hits"] or st["cache_misses"] or st["backend_compile_s"]:
        terminalreporter.write_line(
            f"XLA compiles in this process: {st['backend_compile_s']:.1f} s backend compile; persistent cache "
            f"{'off' if COMPILATION_CACHE_DIR is None else COMPILATION_CACHE_DIR}: {st['cache_hits']} hits "
            f"(~{st['compile_time_saved_s']:.1f} s of compile saved), {st['cache_misses']} misses")

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


def head_programs_precision(eng) -> list[tuple[str, bool]]:
    """(the static options' precision, whether the compiled program's text asks for HIGHEST operands) of each
    ``head_program`` an engine's own calls compiled or looked up (a layer-by-layer driver's final norm and logits)."""
    from ftjax.runtime import programs
    out = []
    for key in eng.programs.keys:
        if key[0] == "head_program":
            opts = dict(key[1])["opts"]
            text = programs._COMPILED[key].executable.as_text()
            out.append((opts.precision, "operand_precision={highest,highest}" in text))
    return out


def drop_compiled_programs() -> None:
    """Empties the engine's table of compiled programs and JAX's in-memory caches (traces,
    executables), as a new process starts: the on-disk compilation cache, if any, stays."""
    from ftjax.runtime import programs
    programs.clear()


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
def no_compilation_cache():
    """JAX's persistent compilation cache off for the test (and back on after): every program is
    compiled by the backend, as in a process without the cache (for checks that watch compiles)."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()  # JAX decides once per process whether the cache is used
    yield
    jax.config.update("jax_enable_compilation_cache", enabled)
    compilation_cache.reset_cache()


# Under pytest-xdist (``-n 2 --dist loadfile``, pyproject's addopts) each worker runs whole modules,
# handed out in collection order (``--no-loadscope-reorder``): the longest modules go first, so that
# neither worker is left with a long one at the end. The order is only a schedule; each module
# still starts from empty compile caches (``_fresh_compile_caches``).
_LONGEST_MODULES_FIRST = ("test_experiments.py", "test_layer_pipeline.py", "test_offload.py", "test_slot_table.py",
                          "test_prefill.py", "test_kv_offload.py", "test_hybrid.py", "test_quant.py")


def pytest_collection_modifyitems(session, config, items):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    counts: dict[str, int] = {}
    for item in items:
        counts[item.path.name] = counts.get(item.path.name, 0) + 1

    def rank(name: str) -> tuple:
        known = _LONGEST_MODULES_FIRST.index(name) if name in _LONGEST_MODULES_FIRST else len(_LONGEST_MODULES_FIRST)
        return known, -counts[name], name

    order = {name: i for i, name in enumerate(sorted(counts, key=rank))}
    items.sort(key=lambda item: order[item.path.name])  # stable: each module keeps its own order
