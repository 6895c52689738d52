"""The program cache: every jitted step compiled once per key, shared by all engines, and the XLA
options of decode programs.

A program's key is the step function, its static options (the ``StepOptions``, whose kernel config
``KernelConfig`` picks the kernels), the shapes, dtypes and memory kinds of its arguments, and its XLA
``compiler_options``. Compiling happens here, outside any timing: :class:`Programs` adds the seconds
to its owner's ``compile_s`` and remembers the keys its owner used (for the workspace it measures) and
the kernels that applied while tracing them. :func:`clear` drops every compiled program (and jax's
traces); nothing else needs to: a changed kernel config is a new key.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Iterator

import jax
import jax.numpy as jnp

from ftjax.kernels import registry
from ftjax.kernels.registry import DECODE_GEMMS, DECODE_GRAPHS


@dataclasses.dataclass
class _Entry:
    executable: Any
    kernels: frozenset[str]  # kernels selected (not "xla") while the program was traced


_COMPILED: dict[tuple, _Entry] = {}
# kernels seen while tracing, by key without the XLA options: jax reuses a trace for a second set of options
_TRACED: dict[tuple, frozenset[str]] = {}


def clear() -> None:
    """Drops every compiled program of every engine, and jax's caches (e.g. to free their memory, or
    before timing a first compile)."""
    _COMPILED.clear()
    _TRACED.clear()
    jax.clear_caches()


def _compile_key(args, **static) -> tuple:
    # numpy dtypes hash as they are: str(dtype) cost ~15 us a leaf, ~2 ms for a layer program with a
    # 62-chunk prefix, looked up once per layer (more than the layer's GPU time)
    leaves = jax.tree.leaves(args)
    # a numpy argument is put in device memory by the call: the same program as a device array's
    return (tuple(sorted(static.items())),
            tuple((x.shape, x.dtype, getattr(getattr(x, "sharding", None), "memory_kind", "device"))
                  for x in leaves))


def compiled_programs(fn_name: str | None = None) -> Iterator[tuple[str, dict, tuple, Any]]:
    """Yields (step name, static options dict, argument signatures, compiled executable) of every
    compiled program (e.g. to read its HLO with ``exe.as_text()``); ``fn_name`` filters by step. The
    options dict also holds the XLA ``compiler_options`` (a dict; empty for XLA's defaults) and the
    ``kernels`` that applied."""
    for key, entry in _COMPILED.items():
        if fn_name is None or key[0] == fn_name:
            yield key[0], {**dict(key[1]), "compiler_options": dict(key[3]), "kernels": sorted(entry.kernels)}, \
                key[2], entry.executable


class Programs:
    """One owner's (an engine's) view of the shared program cache.

    Attributes:
      compile_s: seconds this owner spent compiling (timings exclude them): tracing and lowering to
        StableHLO plus XLA's compilation.
      lower_s: the part of ``compile_s`` spent tracing and lowering (the rest is XLA's).
      log: one ``(step name, lower seconds, XLA compile seconds)`` per program this owner compiled, in
        order (where a slow compile comes from).
      keys: the keys of the programs it compiled or looked up.
    """

    def __init__(self):
        self.compile_s = 0.0
        self.lower_s = 0.0
        self.log: list[tuple[str, float, float]] = []
        self.keys: set[tuple] = set()

    def compile(self, fn, args, compiler_options: tuple | dict = (), **static):
        """``fn`` (a jitted function) compiled for these arguments and static options, from the shared
        cache (compiled once per fn, shapes, dtypes, memory kinds, options and XLA ``compiler_options``,
        ``(name, value)`` pairs)."""
        options = tuple(sorted(dict(compiler_options).items()))  # pairs or a dict; one key per set of values
        key = (fn.__name__,) + _compile_key(args, **static) + (options,)
        entry = _COMPILED.get(key)
        if entry is None:
            t0 = time.perf_counter()
            with registry.recording() as applied:
                lowered = fn.lower(*args, **static)
            t1 = time.perf_counter()
            exe = lowered.compile(compiler_options=dict(options) or None)
            t2 = time.perf_counter()
            kernels = _TRACED.setdefault(key[:-1], frozenset(applied)) | frozenset(applied)
            entry = _COMPILED[key] = _Entry(exe, kernels)
            self.compile_s += t2 - t0
            self.lower_s += t1 - t0
            self.log.append((fn.__name__, t1 - t0, t2 - t1))
        self.keys.add(key)
        return entry.executable

    __call__ = compile

    def add_jit_compile(self, name: str, seconds: float) -> None:
        """Counts ``seconds`` spent compiling plain ``jax.jit`` functions outside the shared cache (e.g. the
        sampler's warm-up) in ``compile_s`` and in ``log`` as ``(name, 0.0, seconds)`` (not split)."""
        self.compile_s += seconds
        self.log.append((name, 0.0, seconds))

    def workspace_bytes(self) -> int:
        """The largest temporary-buffer size (bytes, XLA's ``memory_analysis``) of this owner's programs:
        the device memory a step needs beyond its arguments and outputs."""
        sizes = [_COMPILED[k].executable.memory_analysis().temp_size_in_bytes for k in self.keys if k in _COMPILED]
        return int(max(sizes, default=0))

    def kernels_applied(self) -> set[str]:
        """The kernels that applied to at least one of this owner's programs."""
        return set().union(*(_COMPILED[k].kernels for k in self.keys if k in _COMPILED))


#: The XLA options of a decode program under ``KernelConfig.decode_gemm`` "cublas": no Triton GEMM
#: fusions (their operands are copies of each layer's weight slices), no dot merger (it fuses the
#: q/k/v products by concatenating their weight slices every step).
CUBLAS_DECODE_OPTIONS = (("xla_disable_hlo_passes", "dot-merger"), ("xla_gpu_enable_triton_gemm", False))

#: XLA's default command buffer kinds (jax 0.11's XLA) plus WHILE and CONDITIONAL: what a decode program
#: compiles with under ``KernelConfig.decode_graphs`` (the option replaces the list, so the defaults
#: are repeated).
GRAPH_DECODE_OPTIONS = (("xla_gpu_enable_command_buffer",
                         "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"),)


def decode_graphs_on(decode_graphs: str, experts: str, fetches_all: bool, backend: str | None = None) -> bool:
    """Whether a decode program compiles with :data:`GRAPH_DECODE_OPTIONS`.

    decode_graphs: ``KernelConfig.decode_graphs``; experts: the experts mode; fetches_all: the program
    fetches every miss (``MissConfig.fetches_all``); backend: the jax backend (default: jax's). "on" and
    "auto" apply on a GPU only (command buffers are XLA:GPU's); "auto" only to the cached and on_demand
    modes when the program fetches every miss: their steps copy misses in a loop of data-dependent trip
    count, which XLA otherwise drives from the host (a predicate copied back and a drained stream per
    iteration); steps with CPU experts were not measured under command buffers: neither those with host
    compute inside nor the host-split driver's per-layer programs (``ftjax.runtime.host_split``, which never
    fetch every miss), which "on" puts in command buffers too.
    Raises:
      ValueError: ``decode_graphs`` is not one of ``registry.DECODE_GRAPHS``."""
    if decode_graphs not in DECODE_GRAPHS:
        raise ValueError(f"unknown decode_graphs {decode_graphs!r}; expected one of {', '.join(DECODE_GRAPHS)}")
    if decode_graphs == "off" or (backend or jax.default_backend()) != "gpu":
        return False
    return decode_graphs == "on" or (experts != "resident" and fetches_all)


def decode_compiler_options(decode_gemm: str, tokens_per_row: int, compute_dtype="bfloat16",
                            backend: str | None = None, graphs: bool = False) -> tuple:
    """XLA compiler options (sorted ``(name, value)`` pairs, hashable) of one call of the step.

    decode_gemm: ``KernelConfig.decode_gemm``; tokens_per_row: T of the call's int32 [B, T] tokens (1: a
    decode step, the only call given options); compute_dtype: the engine's; backend: the jax backend
    (default: jax's); graphs: add :data:`GRAPH_DECODE_OPTIONS` (:func:`decode_graphs_on`). "auto" gives
    :data:`CUBLAS_DECODE_OPTIONS` to a decode step in a 16-bit dtype on a GPU (float32 runs are the
    oracle runs: they keep XLA's GEMMs); "cublas" gives them to a decode step in any dtype on any backend
    (XLA:CPU compiles the same program with them: the CPU tests check the plumbing, a GPU run checks
    cuBLAS's numerics: ``experiments/check_oracle_gpu.py --decode_gemm``); "xla": none.
    Raises:
      ValueError: ``decode_gemm`` is not one of ``registry.DECODE_GEMMS``."""
    if decode_gemm not in DECODE_GEMMS:
        raise ValueError(f"unknown decode_gemm {decode_gemm!r}; expected one of {', '.join(DECODE_GEMMS)}")
    if tokens_per_row != 1:
        return ()
    auto_ok = (backend or jax.default_backend()) == "gpu" and jnp.dtype(compute_dtype).itemsize == 2
    gemm = () if decode_gemm == "xla" or (decode_gemm == "auto" and not auto_ok) else CUBLAS_DECODE_OPTIONS
    return tuple(sorted(gemm + (GRAPH_DECODE_OPTIONS if graphs else ())))
