"""The slot-copy kernel's choice and build (``ftjax.experts.slot_copy``, ``KernelConfig.miss_copy``) on a machine
without a GPU: ``auto`` keeps XLA's miss loop, ``kernel`` is refused with the reason, and the nvcc build finds,
caches and reports as documented (a stand-in nvcc). The kernel itself runs only on a CUDA GPU: the last test
(skipped elsewhere; ``pytest --backend=default -n 0 tests/test_slot_copy.py`` on a GPU, tests/conftest.py) checks its
pools against numpy; ``experiments/check_identity_gpu.py --miss_copy=kernel`` checks
the engine's logits (results under experiments/results/checks/)."""

from __future__ import annotations

import os
import stat

import jax
import numpy as np
import pytest

from ftjax import memory
from ftjax.experts import fetch, slot_copy
from ftjax.experts.state import ExpertBanks, ExpertState
from ftjax.kernels import registry
from ftjax.kernels.registry import KernelConfig


def _banks_and_state(split: bool = False, pool_dtype=np.float32):
    lead = (2, 4) if split else (8,)
    gu = memory.to_host(np.arange(np.prod(lead) * 6, dtype=np.float32).reshape(lead + (2, 3)))
    dn = memory.to_host(np.ones(lead + (3, 2), np.float32))
    state = ExpertState(jax.numpy.zeros((4, 2, 3), pool_dtype), jax.numpy.zeros((4, 3, 2), pool_dtype), None)
    return ExpertBanks(gu, dn), state


def test_bad_miss_copy_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"KernelConfig\.miss_copy: unknown value 'dma'; expected one of auto, kernel"):
        KernelConfig(miss_copy="dma")


ON_GPU = jax.default_backend() == "gpu"
no_gpu = pytest.mark.cpu_only("checks the choice where the kernel cannot run")


@pytest.mark.parametrize("blocks", [0, slot_copy.MAX_BLOCKS_PER_MISS + 1, 2.5, True])
def test_a_grid_outside_its_range_is_refused_before_any_build(blocks):
    bank = pool = np.zeros((4, 8), np.float32)
    ids = np.zeros(2, np.int32)
    with pytest.raises(ValueError, match=f"blocks_per_miss={blocks!r}, expected an integer 1 to 65535"):
        slot_copy.copy_into_slots(bank, pool, ids, ids, np.int32(1), blocks_per_miss=blocks)
    with pytest.raises(ValueError, match=f"copy_into_slots_start: blocks_per_miss={blocks!r}, expected"):
        slot_copy.copy_into_slots_start(bank, pool, ids, ids, np.int32(1), blocks_per_miss=blocks)


@no_gpu
def test_the_copy_on_its_own_stream_is_refused_off_the_gpu_with_the_reason():
    bank = pool = np.zeros((4, 8), np.float32)
    ids = np.zeros(2, np.int32)
    with pytest.raises(ValueError, match=r"copy_into_slots_start: bank rows \(8,\) float32 differ from pool rows"):
        slot_copy.copy_into_slots_start(bank, np.zeros((4, 8), np.float16), ids, ids, np.int32(1))
    for call in (lambda: slot_copy.copy_into_slots_start(bank, pool, ids, ids, np.int32(1)),
                 lambda: slot_copy.wait_slots(pool, ids, ids, np.int32(1))):
        with pytest.raises(slot_copy.SlotCopyUnavailable, match="needs a GPU backend, not cpu"):
            call()


@no_gpu
@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_auto_keeps_the_xla_loop_where_the_kernel_cannot_run(backend):
    """On the CPU auto never asks for the kernel; traced as for a GPU on a machine without one, it asks, hears why
    not, and keeps XLA's loop (so lowering a GPU program here holds no custom call)."""
    banks, state = _banks_and_state()
    src, pools = fetch._bank_arrays(banks), fetch._pool_arrays(state)
    with registry.lowering_for(backend):
        assert fetch.uses_slot_kernel(src, pools) is False
    assert (slot_copy.unavailable() is not None) == (jax.default_backend() != "gpu")


@no_gpu
def test_kernel_asked_for_off_the_gpu_is_refused_with_the_reason():
    banks, state = _banks_and_state()
    ids = np.array([3, 5], np.int32)
    with registry.using(KernelConfig(miss_copy="kernel")), \
            pytest.raises(slot_copy.SlotCopyUnavailable, match="needs a GPU backend, not cpu"):
        fetch.fetch_experts(banks, state, ids, np.array([0, 1], np.int32), np.int32(2))
    with registry.using(KernelConfig(miss_copy="xla")):  # the same call on XLA's loop copies rows 3 and 5
        got = fetch.fetch_experts(banks, state, ids, np.array([0, 1], np.int32), np.int32(2))
    np.testing.assert_array_equal(np.asarray(got.gate_up[:2]), np.asarray(banks.gate_up)[[3, 5]])


@pytest.mark.parametrize("split, dtype", [(True, np.float32), (False, np.float16)])
def test_kernel_asked_for_where_it_cannot_apply_names_why(split, dtype):
    banks, state = _banks_and_state(split, dtype)
    with registry.using(KernelConfig(miss_copy="kernel")), \
            pytest.raises(ValueError, match="needs whole banks whose rows match their pools'"):
        fetch.uses_slot_kernel(fetch._bank_arrays(banks), fetch._pool_arrays(state))


def _fake_nvcc(folder, exit_code: int = 0) -> str:
    """A stand-in nvcc: prints a version; otherwise writes its -o file (or fails with ``exit_code``)."""
    path = os.path.join(folder, "nvcc")
    with open(path, "w") as f:
        f.write("#!/bin/sh\n"
                'if [ "$1" = "--version" ]; then echo "fake nvcc 9.9"; exit 0; fi\n'
                f'if [ {exit_code} -ne 0 ]; then echo "slot_copy.cu(1): error: boom" >&2; exit {exit_code}; fi\n'
                'while [ $# -gt 0 ]; do if [ "$1" = "-o" ]; then echo built >> "$2"; fi; shift; done\n'
                f'echo run >> "{folder}/calls"\n')
    os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)
    return path


def test_split_engines_and_the_cpu_keep_the_xla_loop_under_auto():
    """Experts split over devices keep XLA's loop under auto (the kernel was measured on one device); the
    calibration's key follows the same choice."""
    from ftjax.runtime.step import StepOptions
    with StepOptions("cached", devices=2).tracing():
        assert registry.active().miss_copy == "xla"
    with StepOptions("cached", devices=2, kernels=KernelConfig(miss_copy="kernel")).tracing():
        assert registry.active().miss_copy == "kernel"  # asked for by name: kept
    assert [fetch.miss_copy_choice(c, n) for c, n in (("auto", 2), ("auto", 1), ("kernel", 2), ("xla", 1))] == [
        "xla", "auto", "kernel", "xla"]
    with registry.lowering_for("gpu"):
        assert fetch.miss_copy_mode("auto", devices=2) == "xla"
    assert fetch.miss_copy_mode("xla") == "xla"
    if not ON_GPU:
        assert fetch.miss_copy_mode("auto") == "xla"


def test_the_engine_reports_how_its_misses_are_copied():
    """``Engine.describe`` (the metrics JSON's ``engine``) resolves auto: XLA's loop here, None with no misses."""
    from ftjax import Engine
    from ftjax.checkpoint import random_model
    from ftjax.config import EngineConfig, preset
    model = random_model(preset("tiny"), "float32", seed=0)
    want = "kernel" if ON_GPU and slot_copy.unavailable() is None else "xla"
    assert Engine(model, EngineConfig("cached", num_slots=16, max_seq_len=32)).describe()["miss_copy_resolved"] == want
    assert Engine(model, EngineConfig("resident", max_seq_len=32)).describe()["miss_copy_resolved"] is None


def test_build_compiles_once_per_key_and_reports_a_failed_compile(tmp_path):
    nvcc = _fake_nvcc(str(tmp_path))
    cache = tmp_path / "cache"
    first = slot_copy.build(str(cache), nvcc)
    assert os.path.basename(first).startswith("slot_copy-") and open(first).read() == "built\n"
    assert slot_copy.build(str(cache), nvcc) == first  # cached: nvcc not run again
    assert open(tmp_path / "calls").read() == "run\n"
    assert [p.name for p in cache.iterdir()] == [os.path.basename(first)]  # no temporary left behind
    bad = tmp_path / "bad"
    bad.mkdir()
    with pytest.raises(slot_copy.SlotCopyUnavailable, match=r"exited 1: slot_copy.cu\(1\): error: boom"):
        slot_copy.build(str(tmp_path / "cache2"), _fake_nvcc(str(bad), exit_code=1))
    assert list((tmp_path / "cache2").iterdir()) == []
    edited = tmp_path / "slot_copy.cu"  # another source: another key, built again
    edited.write_text(open(slot_copy.SOURCE).read() + "// edited\n")
    second = slot_copy.build(str(cache), nvcc, source=str(edited))
    assert second != first and open(tmp_path / "calls").read() == "run\nrun\n"


def test_no_nvcc_is_reported_with_where_it_was_looked_for(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.setattr(slot_copy, "NVCC_PLACES", (str(tmp_path / "missing" / "nvcc"),))
    with pytest.raises(slot_copy.SlotCopyUnavailable, match=r"no nvcc for the slot-copy kernel: looked on PATH"):
        slot_copy.find_nvcc()
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    (tmp_path / "bin").mkdir()
    fake = _fake_nvcc(str(tmp_path / "bin"))
    assert slot_copy.find_nvcc() == fake


def test_auto_on_a_gpu_without_the_kernel_warns_once(monkeypatch):
    import warnings
    monkeypatch.setattr(slot_copy, "_STATE", {})
    with pytest.warns(RuntimeWarning, match=r"cannot run here \(no nvcc\); cache misses take XLA's loop"):
        slot_copy.warn_once("no nvcc")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        slot_copy.warn_once("no nvcc")  # the second time: silent


@pytest.mark.gpu("the slot-copy kernel runs on a CUDA GPU")
@pytest.mark.parametrize("row, dtype", [((6, 8), np.float32), ((3,), np.float32), ((3,), jax.numpy.bfloat16)])
@pytest.mark.parametrize("address", [False, True])
def test_kernel_writes_the_rows_numpy_says(row, dtype, address):
    """16-byte, 4-byte and 2-byte rows (the kernel's three vector widths), the bank as an operand and by address:
    rows ids[:count] land in slots[:count]; count 0, below M, past M, negative; out-of-range ids are skipped."""
    n, s_, m = 12, 7, 5
    bank_np = (np.arange(n * int(np.prod(row))) % 251).reshape((n,) + row).astype(dtype)
    bank = memory.to_host(bank_np)
    ids = np.array([3, 11, 0, 20, 7], np.int32)  # 20: out of range, skipped
    slots = np.array([6, 0, 2, 4, 5], np.int32)
    for count in (0, 2, 5, 9, -1):
        pool = jax.numpy.full((s_,) + row, -1, dtype)
        fn = jax.jit(lambda b, p, i, s, c: slot_copy.copy_into_slots(
            b, p, i, s, c, bank.unsafe_buffer_pointer() if address else None))
        got = np.asarray(fn(bank, pool, ids, slots, np.int32(count)))
        want = np.full((s_,) + row, -1, dtype)
        for j in range(min(max(count, 0), m)):
            if 0 <= ids[j] < n:
                want[slots[j]] = bank_np[ids[j]]
        np.testing.assert_array_equal(got, want)


@pytest.mark.gpu("the slot-copy kernel runs on a CUDA GPU")
def test_the_copy_on_its_own_stream_lands_what_numpy_says_once_waited_for():
    """Two pools started on two tags, both copies in flight, then joined in the other order, each read at once after
    its wait (the rows doubled in the same program): both pools hold the rows numpy says. The rows are 4 MiB, so a
    wait that returned early (a tag joined to the other tag's copy, which the library's in-order stream finishes
    first) would let the read see rows still being written."""
    n, s_, width = 12, 6, 1 << 20
    bank_np = (np.arange(n * width) % 251).reshape(n, width).astype(np.float32)
    bank = memory.to_host(bank_np)
    ids_a, slots_a = np.array([3, 9, 11], np.int32), np.array([0, 5, 2], np.int32)
    ids_b, slots_b = np.array([1, 4, 7], np.int32), np.array([4, 3, 1], np.int32)

    def step(b, pa, pb):
        pa = slot_copy.copy_into_slots_start(b, pa, ids_a, slots_a, np.int32(3), tag=1)
        pb = slot_copy.copy_into_slots_start(b, pb, ids_b, slots_b, np.int32(3), tag=2)
        pb = slot_copy.wait_slots(pb, ids_b, slots_b, np.int32(3), tag=2)
        read_b = pb * 2
        pa = slot_copy.wait_slots(pa, ids_a, slots_a, np.int32(3), tag=1)
        return pa * 2, read_b

    fn = jax.jit(step, donate_argnums=(1, 2))
    want_a, want_b = (np.full((s_, width), -1, np.float32) for _ in range(2))
    want_a[slots_a], want_b[slots_b] = bank_np[ids_a], bank_np[ids_b]
    for _ in range(3):
        fresh = lambda: jax.numpy.full((s_, width), -1, np.float32)  # noqa: E731
        got_a, got_b = fn(bank, fresh(), fresh())
        np.testing.assert_array_equal(np.asarray(got_a), want_a * 2)
        np.testing.assert_array_equal(np.asarray(got_b), want_b * 2)
