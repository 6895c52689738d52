"""The native CPU expert kernel (``ftjax.experts.cpu_native``, the ``native_async`` mechanism): its FFN
against a float64 reference in every format it reads, calls in flight, the build cache, and the errors.

Tolerance: the kernel decodes each weight exactly as the format's ``dequantize`` (``decode(q) * scale`` in
float32) and accumulates in float32, so its float32 output is within float32 summation error (1e-5 of
the largest output) of a float64 FFN on the same dequantized weights; outputs cast to bf16 round at 2**-8.
The engine-level check (greedy tokens and logits of a cached decode) is in tests/test_miss_policy.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import jax.numpy as jnp
import numpy as np
import pytest

from bank_helpers import random_banks
from conftest import needs_c_compiler
from ftjax.experts import cpu_experts, cpu_native, formats

#: D and F with partial scale blocks: int4's 64-row groups (160 = 2.5 groups, 96 = 1.5) and fp8's 128 x 128.
D, F = 160, 96


def _view(a):
    return cpu_experts.HostBankView(a, None, "numpy")


def _kernel(gu, dn, scales, tag, threads, **kw):
    return cpu_native.NativeKernel(_view(gu), _view(dn), threads, None if scales is None else tuple(map(_view, scales)),
                                   tag, **kw)


def _reference(gu, dn, scales, tag, x, fid):
    """float64 [N, D]: expert ``fid``'s SwiGLU FFN on x, weights dequantized by the format (float32)."""
    fmt = formats.get(tag)
    if scales is None:
        g, w = gu[fid].astype(np.float64), dn[fid].astype(np.float64)
    else:
        g = np.asarray(fmt.dequantize(gu[fid], scales[0][fid], jnp.float32, 2), np.float64)
        w = np.asarray(fmt.dequantize(dn[fid], scales[1][fid], jnp.float32, 1), np.float64)
    h = np.asarray(x, np.float64) @ g
    f = dn.shape[1]
    return (h[:, :f] / (1.0 + np.exp(-h[:, :f])) * h[:, f:]) @ w


@needs_c_compiler
@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "int4", "float32", "fp8"])
@pytest.mark.parametrize("threads", [1, 3])
def test_native_ffn_equals_the_float64_reference(fmt, threads):
    """1 to 4 experts of a call, 1 to 5 tokens (int4 on AVX-512: 1-4 in i4_rows' chunks of 64 and 32 bytes, with
    the columns past the last chunk, 5 in the four-row passes), 1 and 3 threads (row blocks of 16 to 160 rows;
    int4's last 64-row group and fp8's last 128 x 128 block partial): the float32 FFN within float32 summation
    error of float64; through ``compute``, rows past ``count`` zero and the outputs in x's dtype."""
    gu, dn, scales, tag = random_banks(fmt, 12, D, F)
    k = _kernel(gu, dn, scales, tag, threads)
    try:
        assert (k.threads, k.hidden, k.ffn, k.experts, k.openmp) == (threads, D, F, 12, True)
        rng = np.random.default_rng(1)
        xdt = np.float32 if fmt == "float32" else np.dtype(jnp.bfloat16)
        for n in (1, 2, 3, 4, 5):
            x = rng.standard_normal((n, D)).astype(xdt)
            for count in (1, 2, 4):
                ids = np.array([7, 0, 11, 3][:count] + [-1] * (5 - count), np.int32)
                want = np.stack([_reference(gu, dn, scales, tag, x, i) for i in ids[:count]])
                scale = np.abs(want).max()
                y32 = k.run(x, ids[:count])
                assert y32.shape == (count, n, D) and y32.dtype == np.float32
                assert np.abs(y32 - want).max() <= 1e-5 * scale, (fmt, threads, n, count)
                y = k.compute(x, ids, count)
                assert y.shape == (5, n, D) and y.dtype == x.dtype
                assert not y[count:].astype(np.float32).any()
                tol = 1e-5 if fmt == "float32" else 2 ** -8
                assert np.abs(y[:count].astype(np.float64) - want).max() <= tol * scale, (fmt, threads, n, count)
    finally:
        k.close()


@needs_c_compiler
def test_native_calls_in_flight_and_errors():
    """Two submitted calls collected in either order equal the synchronous ones; an id out of range, a bad
    x and a format the kernel cannot decode are refused with ValueError; the mechanism's registry entries."""
    gu, dn, scales, tag = random_banks("int4", 8, D, F)
    k = _kernel(gu, dn, scales, tag, 2)
    try:
        x = np.random.default_rng(2).standard_normal((2, D)).astype(jnp.bfloat16)
        t1 = k.submit(x, np.array([1, 2, -1], np.int32), 2)
        t2 = k.submit(x, np.array([4], np.int32), 1)
        np.testing.assert_array_equal(k.result(t2), k.compute(x, np.array([4], np.int32), 1))
        np.testing.assert_array_equal(k.result(t1), k.compute(x, np.array([1, 2, -1], np.int32), 2))
        assert not k.compute(x, np.array([-1, -1], np.int32), 0).astype(np.float32).any()
        with pytest.raises(ValueError, match=r"expert ids must be in \[0, 8\)"):
            k.run(x, np.array([8]))
        with pytest.raises(ValueError, match="x must be"):
            k.run(x[:, :10], np.array([1]))
    finally:
        k.close()
    f16 = random_banks("float32", 2, D, F)
    with pytest.raises(ValueError, match="cannot decode 'dense' banks of float16"):
        _kernel(f16[0].astype(np.float16), f16[1].astype(np.float16), None, "dense", 1)
    with pytest.raises(ValueError, match="without its scales"):
        _kernel(gu, dn, None, tag, 1)
    assert cpu_experts.KERNEL_KIND["native_async"] == "native" and "native_async" in cpu_experts.ASYNC_IMPLS
    assert cpu_experts.kernel_class("native") is cpu_native.NativeKernel
    assert cpu_experts.default_threads("native") == (os.cpu_count() or 2)


@needs_c_compiler
def test_build_cache_is_reused(tmp_path, monkeypatch):
    """The first build compiles into the cache directory (atomically: no temporary file left); a second
    build with the same source, compiler, flags and CPU loads that library without compiling."""
    compiles = []
    run = subprocess.run

    def spy(cmd, *a, **kw):
        if "-shared" in cmd:
            compiles.append(cmd)
        return run(cmd, *a, **kw)

    monkeypatch.setattr(cpu_native.subprocess, "run", spy)
    first = cpu_native.build(cache_dir=str(tmp_path))
    assert first.built and first.openmp and "-fopenmp" in first.flags and len(compiles) == 1
    assert os.listdir(tmp_path) == [os.path.basename(first.path)] and first.path.endswith(".so")
    second = cpu_native.build(cache_dir=str(tmp_path))
    assert not second.built and second.path == first.path and len(compiles) == 1
    # another source is another key: compiled again
    src = tmp_path / "src" / "expert_ffn.c"
    src.parent.mkdir()
    src.write_text(open(cpu_native.SOURCE).read() + "\n/* changed */\n")
    third = cpu_native.build(cache_dir=str(tmp_path), source=str(src))
    assert third.built and third.path != first.path and len(compiles) == 2


@needs_c_compiler
def test_build_without_openmp_runs_on_one_thread(tmp_path):
    """``openmp=False`` (what a compiler without OpenMP gets): a serial build whose kernel warns that it
    runs on one thread and computes the same FFN."""
    lib = cpu_native.build(cache_dir=str(tmp_path), openmp=False)
    assert not lib.openmp and "-fopenmp" not in lib.flags
    gu, dn, scales, tag = random_banks("int8", 4, D, F)
    with pytest.warns(RuntimeWarning, match="without OpenMP"):
        k = _kernel(gu, dn, scales, tag, 3, library=lib)
    try:
        assert k.threads == 1 and k.describe()["openmp"] is False
        x = np.random.default_rng(3).standard_normal((1, D)).astype(np.float32)
        want = _reference(gu, dn, scales, tag, x, 2)
        assert np.abs(k.run(x, np.array([2]))[0] - want).max() <= 1e-5 * np.abs(want).max()
    finally:
        k.close()


def test_clear_errors_without_a_compiler(tmp_path, monkeypatch):
    """No ``cc`` / ``gcc`` on PATH: an error naming what was looked for and what to do; a compiler that
    fails: an error with its command line."""
    real_which = shutil.which
    monkeypatch.setattr(cpu_native.shutil, "which", lambda name, *a, **kw: None)
    with pytest.raises(cpu_native.NativeBuildError, match="no C compiler .* looked for cc, gcc on PATH"):
        cpu_native.build(cache_dir=str(tmp_path))
    monkeypatch.setattr(cpu_native.shutil, "which", real_which)
    with pytest.raises(cpu_native.NativeBuildError, match="did not build: `.*false -O3 -march=native"):
        cpu_native.build(cache_dir=str(tmp_path), compiler="false", openmp=False)
    assert os.listdir(tmp_path) == []  # nothing half-written left behind


@needs_c_compiler
def test_int4_rows_without_avx512(tmp_path):
    """The kernel built with ``FTJAX_NO_AVX512`` (i4_rows' AVX2 form on an x86 CPU with AVX2 and FMA, the four-row
    passes elsewhere): int4 FFNs of 1 to 5 tokens within float32 summation error of float64, at D, F, at
    qwen3-30b-a3b's F (768: whole chunks only) and at widths of 35 and 38 stored bytes (columns past the last chunk
    for every token count)."""
    src = tmp_path / "expert_ffn.c"
    src.write_text("#define FTJAX_NO_AVX512 1\n" + open(cpu_native.SOURCE).read())
    lib = cpu_native.build(cache_dir=str(tmp_path / "cache"), source=str(src))
    rng = np.random.default_rng(5)
    for d, f in ((D, F), (128, 768), (70, 38)):
        gu, dn, scales, tag = random_banks("int4", 4, d, f)
        k = _kernel(gu, dn, scales, tag, 2, library=lib)
        try:
            for n in (1, 2, 3, 4, 5):
                x = rng.standard_normal((n, d)).astype(jnp.bfloat16)
                ids = np.array([3, 0], np.int32)
                want = np.stack([_reference(gu, dn, scales, tag, x, i) for i in ids])
                assert np.abs(k.run(x, ids) - want).max() <= 1e-5 * np.abs(want).max(), (d, f, n)
        finally:
            k.close()


@needs_c_compiler
@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "int4"])
def test_rows_left_after_the_four_row_passes_are_summed(fmt):
    """Matrices whose rows are not a multiple of the kernel's four-row pass (70 and 38 rows: two left over, one of
    them inside int4's second 64-row scale group): the float32 FFN still within float32 summation error."""
    d, f = 70, 38
    gu, dn, scales, tag = random_banks(fmt, 6, d, f)
    k = _kernel(gu, dn, scales, tag, 2)
    try:
        x = np.random.default_rng(3).standard_normal((3, d)).astype(jnp.bfloat16)
        ids = np.array([5, 0, 2], np.int32)
        want = np.stack([_reference(gu, dn, scales, tag, x, i) for i in ids])
        assert np.abs(k.run(x, ids) - want).max() <= 1e-5 * np.abs(want).max()
    finally:
        k.close()
