"""Expert FFNs on the CPU through a small C/OpenMP kernel, built on first use with the system C compiler.

Source of the idea: FreeToken's CPU executor (and Fiddler before it) computes a layer's cache misses
on the host cores where the expert weights already sit, so only the token activations cross PCIe
(DESIGN.md 1.2; issue 33 item 3). For one token an expert FFN is a matrix-vector product bound by how
fast the cores read the expert's weights from DRAM. ``experiments/bench_cpu_experts.py`` measured this
kernel (its ``native_omp`` mechanism) on the H200's 16-core host at 52.1 GB/s of bf16 and 58.8 GB/s of
int8 expert weights with ~0.05 ms fixed cost per layer, against 20 GB/s and 1.8 ms for the XLA:CPU
kernel of ``callback_async`` and 4.6 ms fixed for ``numpy_rows_async`` (docs/MISS_POLICY.md).

The one source is ``ftjax/experts/native/expert_ffn.c`` (package data); its header comment gives the
algorithm: every thread on every expert (blocks of contiguous input rows of each expert, one work unit
per block), each row decoded to float32 in registers (or once into the core's cache for several tokens),
float32 sums scaled per scale block, the SiLU gate between the two matrices, one C call per layer.
:func:`build` compiles it into a shared library

    <compiler> -O3 -march=native [-mprefer-vector-width=512] -fno-math-errno -shared -fPIC [-fopenmp] \
        expert_ffn.c -o <lib> -lm

(``<lib>``: ``<cache dir>/expert_ffn-<key>.so``; the vector width flag on x86 only). ``<compiler>`` is ``cc`` or
``gcc`` on PATH (or the ``compiler`` argument) and ``<key>`` hashes the source, the compiler (path and ``--version``),
the flags and the host CPU (``-march=native`` code runs only on CPUs like the one that built it). A second build with
the same key loads the cached library without compiling. The library is written to a temporary name and renamed, so
concurrent builds never see half a file. Without OpenMP (``-fopenmp`` fails, e.g. Apple clang) it is built without it
and runs on one thread.

Cache directory (as ``ftjax.compile_cache`` names JAX's): the ``cache_dir`` argument, else
``$FTJAX_NATIVE_CACHE`` when set, else ``$XDG_CACHE_HOME/ftjax/native``, else ``~/.cache/ftjax/native``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import math
import os
import platform
import shutil
import subprocess
import threading
import warnings

import numpy as np

from ftjax import compile_cache
from ftjax.experts import formats
from ftjax.experts.host_async import DriverThreadKernel

#: The kernel's one C source (package data).
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native", "expert_ffn.c")
#: x86 only: 512-bit vectors where the CPU has them (``-march=native`` alone keeps GCC at 256 bits). On one core of a
#: 2-core AVX-512 VM, a matrix hot in cache (2026-12-07): int4 and int8 rows decoded 1.5x faster with them, bf16 alike.
X86_FLAGS = ("-mprefer-vector-width=512",) if platform.machine().lower() in ("x86_64", "amd64") else ()
#: Compiler flags of every build; :data:`OPENMP_FLAGS` are added when the compiler supports them.
CFLAGS = ("-O3", "-march=native", *X86_FLAGS, "-fno-math-errno", "-shared", "-fPIC")
OPENMP_FLAGS = ("-fopenmp",)
#: Compilers looked for on PATH, in order, when none is given.
COMPILERS = ("cc", "gcc")
#: Environment variable naming the default cache directory.
ENV = compile_cache.NATIVE_ENV
#: The C source's ``FTJAX_NATIVE_ABI``; a library that reports another is refused.
ABI = 1
#: Input rows of a work unit are a multiple of this (and of the format's scale block rows).
ROW_ALIGN = 16
#: Format kinds of the C kernel (``enum`` in expert_ffn.c).
KIND_BF16, KIND_F32, KIND_I8, KIND_I4, KIND_LUT8 = range(5)


class NativeBuildError(RuntimeError):
    """The native kernel cannot be built or loaded: no C compiler, a failed compile, or a bad library."""


def default_cache_dir() -> str:
    """``$FTJAX_NATIVE_CACHE`` when set, else ``$XDG_CACHE_HOME/ftjax/native``, else ``~/.cache/ftjax/native``."""
    return compile_cache.native_dir()


def find_compiler(compiler: str | None = None) -> str:
    """The C compiler's path: ``compiler`` (a name on PATH or a path), else the first of :data:`COMPILERS`.

    Raises:
      NativeBuildError: none found (the message names what was looked for).
    """
    names = (compiler,) if compiler else COMPILERS
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    raise NativeBuildError(f"no C compiler for the native CPU expert kernel: looked for {', '.join(names)} on PATH "
                           "(install one, e.g. `apt-get install gcc`, and put it on PATH), or use another "
                           "--cpu_expert_impl (numpy_rows_async needs no compiler)")


def _host_cpu() -> str:
    """What ``-march=native`` depends on: the machine and, on Linux, the CPU model and feature flags."""
    ident = [platform.machine(), platform.processor()]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor describes them all
                if line.split(":", 1)[0].strip() in ("model name", "flags", "Features", "CPU part"):
                    ident.append(line.strip())
    except OSError:
        pass
    return "\n".join(ident)


def _compiler_version(cc: str) -> str:
    try:
        p = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60)
        return p.stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeBuildError(f"cannot run the C compiler {cc}: {e}") from None


@dataclasses.dataclass(frozen=True)
class NativeLibrary:
    """A loaded build of the kernel.

    lib: the ``ctypes.CDLL`` (argument types set); path: the shared library; compiler: its path; flags:
    the compiler flags used; openmp: built with OpenMP (else one thread); built: compiled by this call
    (False: loaded from the cache).
    """

    lib: ctypes.CDLL
    path: str
    compiler: str
    flags: tuple[str, ...]
    openmp: bool
    built: bool


def _load(path: str, cc: str, flags: tuple, built: bool) -> NativeLibrary:
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise NativeBuildError(f"cannot load the native CPU expert kernel {path}: {e}") from None
    lib.ftjax_native_abi.restype = ctypes.c_int
    lib.ftjax_native_openmp.restype = ctypes.c_int
    if lib.ftjax_native_abi() != ABI:
        raise NativeBuildError(f"{path} reports ABI {lib.ftjax_native_abi()}, expected {ABI}; remove it")
    mat = ctypes.POINTER(_Mat)
    lib.ftjax_expert_ffn_work.restype = ctypes.c_int64
    lib.ftjax_expert_ffn_work.argtypes = [mat, mat] + [ctypes.c_int] * 5
    lib.ftjax_expert_ffn.restype = ctypes.c_int
    lib.ftjax_expert_ffn.argtypes = [mat, mat, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                     ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    return NativeLibrary(lib, path, cc, flags, bool(lib.ftjax_native_openmp()), built)


def build(cache_dir: str | None = None, compiler: str | None = None, openmp: bool | None = None,
          source: str = SOURCE) -> NativeLibrary:
    """Builds the kernel (or loads the cached build with the same key) and loads it.

    Args:
      cache_dir: where the shared library is kept; None: :func:`default_cache_dir`. Created if missing.
      compiler: the C compiler (name on PATH or path); None: the first of :data:`COMPILERS`.
      openmp: True: with OpenMP or fail; False: without (one thread); None: with OpenMP where the compiler
        supports it, else without.
      source: the C source file (tests).
    Returns:
      the loaded :class:`NativeLibrary`.
    Raises:
      NativeBuildError: no compiler, an unwritable cache directory, a failed compile (the message has the
        command and the compiler's error), or a library that does not load.
    """
    cc = find_compiler(compiler)
    cache_dir = os.path.abspath(os.path.expanduser(cache_dir or default_cache_dir()))
    try:
        os.makedirs(cache_dir, exist_ok=True)
    except OSError as e:
        raise NativeBuildError(f"cannot create the native kernel cache directory {cache_dir}: {e} "
                               "(pass cache_dir=... or set $" + ENV + ")") from None
    with open(source, "rb") as f:
        src = f.read()
    common = hashlib.sha256()
    for part in (src, os.path.realpath(cc).encode(), _compiler_version(cc).encode(), _host_cpu().encode()):
        common.update(hashlib.sha256(part).digest())
    errors = []
    for omp in ((True, False) if openmp is None else (openmp,)):
        flags = CFLAGS + (OPENMP_FLAGS if omp else ())
        key = common.copy()
        key.update(" ".join(flags).encode())
        path = os.path.join(cache_dir, f"expert_ffn-{key.hexdigest()[:20]}.so")
        if os.path.exists(path):
            return _load(path, cc, flags, built=False)
        error = compile_cache.build_native(path, lambda tmp: [cc, *flags, source, "-o", tmp, "-lm"], 300)
        if error is None:
            return _load(path, cc, flags, built=True)
        errors.append(error)
    raise NativeBuildError("the native CPU expert kernel did not build: " + "; ".join(errors))


_LOADED: dict[tuple, NativeLibrary] = {}
_LOAD_LOCK = threading.Lock()


def load(cache_dir: str | None = None, compiler: str | None = None, openmp: bool | None = None) -> NativeLibrary:
    """:func:`build`, once per process and arguments (later calls return the same library).

    Raises:
      NativeBuildError: as :func:`build`.
    """
    key = (cache_dir or default_cache_dir(), compiler, openmp)
    with _LOAD_LOCK:
        if key not in _LOADED:
            _LOADED[key] = build(cache_dir, compiler, openmp)
        return _LOADED[key]


# --------------------------------------------------------------------------------------------
# The kernel
# --------------------------------------------------------------------------------------------
class _Mat(ctypes.Structure):
    """``ftjax_mat`` of expert_ffn.c: one bank, its scales and how to decode it."""

    _fields_ = [("w", ctypes.c_void_p), ("s", ctypes.c_void_p), ("lut", ctypes.c_void_p), ("sidx", ctypes.c_void_p),
                ("w_stride", ctypes.c_int64), ("s_stride", ctypes.c_int64),
                ("kind", ctypes.c_int32), ("rows", ctypes.c_int32), ("cols", ctypes.c_int32),
                ("bi", ctypes.c_int32), ("bo", ctypes.c_int32), ("parts", ctypes.c_int32), ("nsc", ctypes.c_int32)]


def _kind(fmt: formats.ExpertFormat, dtype: np.dtype) -> int:
    """The C kernel's decode rule for a bank of ``dtype`` stored in ``fmt``.

    Raises:
      ValueError: a format or dtype the kernel cannot decode.
    """
    if not fmt.has_scales:
        if dtype == np.float32:
            return KIND_F32
        if dtype.itemsize == 2 and dtype.name == "bfloat16":
            return KIND_BF16
    elif type(fmt).scale_values is not formats.ExpertFormat.scale_values:
        pass  # scales that are not the multipliers themselves: refused below
    elif fmt.name == "int4" and dtype == np.uint8 and fmt.pack == 2:
        return KIND_I4
    elif fmt.pack == 1 and dtype.itemsize == 1:
        return KIND_I8 if dtype == np.int8 and fmt.name == "int8" else KIND_LUT8
    raise ValueError(f"the native CPU expert kernel cannot decode {fmt.name!r} banks of {dtype}; it reads dense "
                     "bfloat16 / float32, int8, int4 and one-byte formats (fp8); use "
                     "--cpu_expert_impl=numpy_rows_async")


def _contiguous(a: np.ndarray, what: str) -> np.ndarray:
    if not a.flags.c_contiguous:
        raise ValueError(f"the native CPU expert kernel needs a C-contiguous {what} bank, got strides {a.strides}")
    return a


class _Matrix:
    """One bank as the C kernel reads it: the ``_Mat`` struct, the arrays it points into, the row alignment.

    bank: [R, in, out / pack]; scales: [R, nbi, nsc] float32 or None; parts: 2 for gate_up, 1 for down.
    """

    def __init__(self, bank: np.ndarray, scales: np.ndarray | None, fmt: formats.ExpertFormat, parts: int,
                 what: str):
        bank = _contiguous(bank, what)
        if bank.ndim != 3:
            raise ValueError(f"{what} bank must be [experts, in, out], got shape {bank.shape}")
        kind = _kind(fmt, bank.dtype)
        rows, cols = bank.shape[1], bank.shape[2] * fmt.pack
        self.bank, self.scales, self.lut, self.sidx = bank, None, None, None
        bi, bo, nsc = rows, 1, 0
        if fmt.has_scales:
            if scales is None:
                raise ValueError(f"{fmt.name} {what} bank without its scales")
            scales = _contiguous(scales, what + " scale")
            bi, bo = fmt.block(rows)
            want = (bank.shape[0],) + fmt.scale_shape(rows, cols, parts)
            if scales.dtype != np.float32 or scales.shape != want:
                raise ValueError(f"{fmt.name} {what} scales: expected float32 {want}, "
                                 f"got {scales.dtype} {scales.shape}")
            self.scales, nsc = scales, scales.shape[2]
            c, per = np.arange(cols), cols // parts
            sidx = (c // per * (nsc // parts) + c % per // bo).astype(np.int32)  # each column's scale column
            if kind == KIND_I4:  # the kernel's decoded column order: even columns, then odd ones
                sidx = np.concatenate([sidx[0::2], sidx[1::2]])
            if not np.array_equal(sidx, c):
                self.sidx = np.ascontiguousarray(sidx)
        if kind == KIND_LUT8:  # the format's own decode of every byte value
            self.lut = np.ascontiguousarray(fmt.decode(np.arange(256, dtype=np.uint8).view(bank.dtype)), np.float32)
        self.rows, self.cols = rows, cols
        self.align = ROW_ALIGN if bi >= rows else math.lcm(ROW_ALIGN, bi)
        self.mat = _Mat(bank.ctypes.data, 0 if self.scales is None else self.scales.ctypes.data,
                        0 if self.lut is None else self.lut.ctypes.data,
                        0 if self.sidx is None else self.sidx.ctypes.data, bank.strides[0],
                        0 if self.scales is None else self.scales.strides[0] // 4,
                        kind, rows, cols, bi, bo, parts, nsc)

    def rows_per_block(self, threads: int, count: int) -> int:
        """Input rows of one work unit: ``ceil(threads / count)`` blocks per expert (at most one per
        :attr:`align` rows), each a multiple of :attr:`align` rows."""
        nb = max(1, min(math.ceil(threads / count), math.ceil(self.rows / self.align)))
        return math.ceil(math.ceil(self.rows / nb) / self.align) * self.align


class _Work(threading.local):
    """A per-thread float32 work buffer starting on a 64-byte boundary (the C kernel's vector stores into
    it run a third slower misaligned), grown on demand."""

    def __init__(self):
        self.buf = np.empty(0, np.float32)

    def get(self, n: int) -> np.ndarray:
        if self.buf.size < n:
            raw = np.empty(n + 16, np.float32)
            off = (-raw.ctypes.data) % 64 // 4
            self.buf = raw[off:off + n]
        return self.buf


class NativeKernel(DriverThreadKernel):
    """Computes expert FFNs on the CPU with the C kernel, from zero-copy numpy views of the host banks.

    The interface of ``cpu_experts.HostExpertKernel`` and ``cpu_rows.RowSplitKernel`` (``submit`` /
    ``result`` / ``compute``), so the callback mechanisms drive it (``native_async``). :meth:`submit` hands
    the call to one driver thread (the C call releases the GIL; the OpenMP threads do the work) and returns
    a ticket; :meth:`compute` runs the call in the calling thread.

    Args:
      gate_up, down: ``cpu_experts.HostBankView`` (or any object with ``.array``, ``.how``) of the banks
        [R, D, 2F / pack] and [R, F, D / pack], C-contiguous.
      threads: OpenMP threads (default: every core, ``os.cpu_count()``); 1 when the library was built
        without OpenMP (a warning says so when more were asked for).
      scales: views of a quantized format's float32 scale banks (gate_up [R, nbi, nsc], down [R, nbi, nsc]),
        None for dense.
      fmt: the banks' format tag (``ExpertBanks.fmt``).
      library: a :class:`NativeLibrary`; None: :func:`load` (builds on first use in the default cache).
    Raises:
      ValueError: a format or dtype the kernel cannot decode (dense float16, packed formats other than
        int4), missing or misshapen scales, bank shapes that disagree, or non-contiguous banks.
      NativeBuildError: no C compiler or a failed build (``library`` None).
    """

    def __init__(self, gate_up, down, threads: int | None = None, scales=None, fmt: str = "dense",
                 library: NativeLibrary | None = None):
        self.gate_up, self.down = gate_up, down
        self.scales, self.fmt = scales, fmt
        f = formats.get(fmt)
        sg, sd = (None, None) if scales is None else (scales[0].array, scales[1].array)
        self._gu = _Matrix(gate_up.array, sg, f, 2, "gate_up")
        self._dn = _Matrix(down.array, sd, f, 1, "down")
        self.hidden, self.ffn, self.experts = self._gu.rows, self._dn.rows, gate_up.array.shape[0]
        if self._gu.cols != 2 * self.ffn or self._dn.cols != self.hidden or down.array.shape[0] != self.experts:
            raise ValueError(f"bank shapes disagree: gate_up {gate_up.array.shape}, down {down.array.shape} ({fmt})")
        self.library = library or load()
        self.openmp = self.library.openmp
        self.threads = int(threads or os.cpu_count() or 1)
        if not self.openmp and self.threads > 1:
            warnings.warn(f"the native CPU expert kernel was built without OpenMP ({self.library.compiler}): "
                          f"it runs on 1 thread, not {self.threads}", RuntimeWarning, stacklevel=2)
            self.threads = 1
        self.zero_copy = True  # the views are read in place
        self._lib = self.library.lib
        self._work = _Work()
        self._start_driver("ftjax-cpu-native")

    def describe(self) -> dict:
        """What the engine's metrics record about the build (beside threads and bank view)."""
        return {"openmp": self.openmp, "library": os.path.basename(self.library.path)}

    # ---- one call -------------------------------------------------------------------------
    def run(self, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """float32 [k, N, D]: the FFNs of experts ``ids`` (int, [k], each in [0, R)) on x [N, D] (any float
        dtype, computed in float32).

        Raises:
          ValueError: an id out of range, or x not [N, D].
        """
        x = np.ascontiguousarray(x, np.float32)
        ids = np.ascontiguousarray(ids, np.int32)
        k, n = ids.shape[0], x.shape[0]
        if x.ndim != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"x must be [tokens, {self.hidden}], got {x.shape}")
        if k and (ids.min() < 0 or ids.max() >= self.experts):
            raise ValueError(f"expert ids must be in [0, {self.experts}), got {ids.tolist()}")
        y = np.empty((k, n, self.hidden), np.float32)
        if k == 0 or n == 0:
            return y
        rb1, rb2 = self._gu.rows_per_block(self.threads, k), self._dn.rows_per_block(self.threads, k)
        gu, dn = ctypes.byref(self._gu.mat), ctypes.byref(self._dn.mat)
        work = self._work.get(int(self._lib.ftjax_expert_ffn_work(gu, dn, k, n, rb1, rb2, self.threads)))
        rc = self._lib.ftjax_expert_ffn(gu, dn, ids.ctypes.data, k, n, x.ctypes.data, y.ctypes.data, rb1, rb2,
                                        work.ctypes.data, self.threads)
        if rc != 0:
            raise ValueError(f"native CPU expert kernel refused its arguments (k={k}, n={n}, rows per block "
                             f"{rb1}, {rb2})")
        return y

    def _call(self, x: np.ndarray, fids: np.ndarray, shape: tuple, dtype) -> np.ndarray:
        out = np.zeros(shape, dtype)
        if fids.size:
            out[:fids.size] = self.run(x, fids)
        return out

