"""Expert FFNs computed on the host CPU, from the host banks, inside the jitted decode step.

Source of the idea: FreeToken (and Fiddler before it) compute some cache misses on the CPU where
the expert weights already sit, so only the token activations cross PCIe (DESIGN.md 1.2).

The device sends ``x`` [N, D] and a compact list of ``C`` flat expert ids (the first ``count``
valid); the host returns ``y`` [C, N, D] with ``y[j] = FFN_{flat_ids[j]}(x)`` (rows ``j >= count``
are zeros or unspecified and must be ignored). FFN is the SwiGLU expert of
``ftjax.experts.compute``: ``h = x @ gate_up``, ``y = (silu(h[:, :F]) * h[:, F:]) @ down``, in x's
dtype. ``gate_up`` is ``[L*E, D, 2F]`` and ``down`` ``[L*E, F, D]``, the host banks. Quantized
banks (``ftjax.experts.quant``) are dequantized on the host, one computed expert at a time,
from the bank rows and their scale rows.

Mechanisms (``IMPLS``; selected by ``--cpu_expert_impl``):

* ``callback``: ``jax.pure_callback`` into :class:`HostExpertKernel`, which runs an XLA:CPU-jitted
  one-expert FFN per miss over zero-copy numpy views of the host banks, several experts at once in
  a thread pool. The callback blocks the device stream while the CPU works.
* ``callback_async``: the same kernel, split into two ``io_callback`` calls: *submit* (hands ``x``
  and the ids to the thread pool, returns a ticket at once) before the layer's PCIe fetch, and
  *result* (waits for the ticket) after it, so the CPU work overlaps the copy.
* ``numpy_rows_async``: the two ``io_callback`` calls of ``callback_async`` into
  ``ftjax.experts.cpu_rows.RowSplitKernel``: every thread works on every expert (blocks of contiguous
  input rows, decoded to float32 in the core's cache, one-thread BLAS products, float32
  accumulation), all cores by default. FreeToken's CPU executor also runs each expert on all cores.
* ``native_async``: the same two calls into ``ftjax.experts.cpu_native.NativeKernel``, a C/OpenMP
  kernel built on first use with the system C compiler: the row blocks of ``numpy_rows_async`` with
  each row decoded in registers and one C call per layer (no Python per block). On the H200's host
  it read 52 GB/s of bf16 weights with ~0.05 ms fixed cost per layer (docs/MISS_POLICY.md).
* ``compute_on``: ``jax.experimental.compute_on(..., compute_type='device_host')``: XLA compiles
  the FFN loop for the host and reads the banks directly (no Python, no thread pool).
* ``compute_on_static``: the same without the dynamic loop (always ``C`` experts, padding ids
  clamped): a fallback in case a ``while`` inside host compute does not compile on a backend.

On the CPU backend (tests) every mechanism works and host memory is the same RAM; the figures
that choose between them on the GPU come from ``ftjax.calibrate`` and
``experiments/bench_miss_policy.py`` (DESIGN.md section 3 and docs/MISS_POLICY.md have them).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import functools
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jax.experimental.compute_on import compute_on

from ftjax.experts import quant
from ftjax.experts.host_async import DriverThreadKernel
from ftjax.experts.compute import _swiglu

IMPLS = ("callback", "callback_async", "numpy_rows_async", "native_async", "compute_on", "compute_on_static")
#: Mechanisms that call a host kernel from the step (they need a zero-copy bank view, and synchronous
#: CPU dispatch on the CPU backend).
CALLBACK_IMPLS = ("callback", "callback_async", "numpy_rows_async", "native_async")
#: Callback mechanisms that submit before the layer's copies and wait after them.
ASYNC_IMPLS = ("callback_async", "numpy_rows_async", "native_async")
#: The host kernel class each callback mechanism drives: "xla" (:class:`HostExpertKernel`), "rows"
#: (``ftjax.experts.cpu_rows.RowSplitKernel``) or "native" (``ftjax.experts.cpu_native.NativeKernel``).
KERNEL_KIND = {"callback": "xla", "callback_async": "xla", "numpy_rows_async": "rows", "native_async": "native"}


class HostViewError(RuntimeError):
    """A host-memory jax array could not be viewed from numpy without a copy."""


# --------------------------------------------------------------------------------------------
# Zero-copy numpy views of the host banks
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class HostBankView:
    """A read-only numpy view of a host-memory jax array's buffer (no copy).

    array: the numpy view (same shape and dtype); source: the jax array (kept alive, the view
    borrows its memory); how: "pointer" | "copy" (copy only when allowed).
    """

    array: np.ndarray
    source: jax.Array
    how: str


def _readable_mapping(ptr: int, nbytes: int) -> bool:
    """True when [ptr, ptr + nbytes) lies in readable mappings of this process (Linux)."""
    try:
        with open("/proc/self/maps") as f:
            spans = []
            for line in f:
                addr, perms = line.split()[:2]
                lo, hi = (int(a, 16) for a in addr.split("-"))
                spans.append((lo, hi, perms[0] == "r"))
    except OSError:
        return False
    spans.sort()
    pos, end = ptr, ptr + nbytes
    for lo, hi, readable in spans:
        if hi <= pos:
            continue
        if lo > pos or not readable:
            return False
        pos = hi
        if pos >= end:
            return True
    return False


_fetch_row = jax.jit(lambda bank, i: jax.device_put(jax.lax.dynamic_index_in_dim(bank, i, keepdims=False),
                                                    jax.memory.Space.Device))


def _validate(view: np.ndarray, arr: jax.Array) -> None:
    rows = sorted({0, arr.shape[0] // 2, arr.shape[0] - 1})
    for r in rows:
        want = np.asarray(_fetch_row(arr, jnp.int32(r)))
        if not np.array_equal(view[r].view(np.uint8), want.view(np.uint8)):
            raise HostViewError(f"numpy view of the host bank differs from the bank at row {r}")


def host_bank_view(arr: jax.Array, allow_copy: bool = False) -> HostBankView:
    """A numpy view of a host-memory jax array (``pinned_host`` / ``unpinned_host``), no copy.

    Uses the raw buffer pointer (``unsafe_buffer_pointer``) after checking on Linux that the whole
    range is mapped readable in this process (a device address would not be), then compares
    three rows of the view bytewise with the same rows copied out of the bank by JAX.
    (``np.from_dlpack`` is not used: numpy asks for a CPU device, and for an accelerator's array
    JAX honours that with a full copy, 58 GB for the qwen3-30b-a3b pool.)

    Args:
      arr: a single-device jax array; on an accelerator, in a host memory kind.
      allow_copy: when no view works, copy the array to numpy (doubles its host memory).
    Raises:
      HostViewError: no zero-copy view (and ``allow_copy`` is False), or the view's contents do
        not match the bank.
    """
    if len(arr.sharding.device_set) != 1:
        raise HostViewError("host bank must live on one device")
    platform = next(iter(arr.sharding.device_set)).platform
    kind = arr.sharding.memory_kind
    if platform != "cpu" and kind not in ("pinned_host", "unpinned_host"):
        raise HostViewError(f"bank is in memory kind {kind!r} of a {platform} device, not host memory")
    dtype, nbytes = np.dtype(arr.dtype), int(arr.nbytes)
    why = ""
    try:
        ptr = int(arr.unsafe_buffer_pointer())
    except Exception as e:  # noqa: BLE001 - backends raise various types
        ptr, why = None, f"unsafe_buffer_pointer: {type(e).__name__}: {e}"
    if ptr is not None:
        if sys.platform.startswith("linux") and not _readable_mapping(ptr, nbytes):
            why = f"pointer 0x{ptr:x} (+{nbytes} bytes) is not readable host memory of this process"
        else:
            buf = (ctypes.c_ubyte * nbytes).from_address(ptr)
            v = np.frombuffer(buf, dtype=dtype).reshape(arr.shape)
            v.flags.writeable = False
            _validate(v, arr)
            return HostBankView(v, arr, "pointer")
    if allow_copy:
        return HostBankView(np.asarray(arr), arr, "copy")
    raise HostViewError("no zero-copy numpy view of the host bank: " + why)


def is_host_typed(arr: jax.Array) -> bool:
    """True when JAX traces ``arr`` as host memory (its aval's memory space is Host)."""
    return getattr(arr.aval, "memory_space", None) == jax.memory.Space.Host


def ensure_host_typed(arr: jax.Array) -> jax.Array:
    """The same values in host memory, typed as host memory when traced.

    Quirk (jax 0.11.2): an array made by ``jax.jit(..., out_shardings=<pinned_host sharding>)``
    (as ``ftjax.checkpoint.random_model`` makes its banks) has memory kind ``pinned_host`` but an
    aval in the Device memory space, so a jit that takes it traces a device array. The fetch path
    lowers the same either way (the argument keeps ``mhlo.memory_kind = "pinned_host"``), but
    ``compute_on('device_host')`` then fails with "memory_space of all inputs passed to
    `dot_general` must be the same". ``jax.device_put(x, Space.Host)`` of a device array gives the
    right type. This moves the bank through device memory (H2D + D2H, the old host copy freed in
    between, so host memory peaks at one bank); when the device cannot hold it, it copies host to
    host (host memory peaks at two banks).

    **Deletes** ``arr`` when a new array is made: replace every reference (e.g.
    ``model.host_gate_up``). Returns ``arr`` itself when it is already host-typed.
    """
    if is_host_typed(arr):
        return arr
    try:
        dev = jax.device_put(arr, jax.memory.Space.Device)
        dev.block_until_ready()
    except Exception:  # noqa: BLE001 - out of device memory: copy on the host instead
        out = jax.device_put(arr, jax.memory.Space.Host)
        out.block_until_ready()
        arr.delete()
        return out
    arr.delete()
    out = jax.device_put(dev, jax.memory.Space.Host)
    out.block_until_ready()
    dev.delete()
    return out


# --------------------------------------------------------------------------------------------
# The host kernel (used by the callback mechanisms)
# --------------------------------------------------------------------------------------------
def _ffn(x: jax.Array, gate_up: jax.Array, down: jax.Array, s_gu: jax.Array | None = None,
         s_dn: jax.Array | None = None, fmt: str = "dense") -> jax.Array:
    """One SwiGLU expert: x [N, D], gate_up [D, 2F], down [F, D] (stored in format ``fmt`` with
    scales ``s_gu``, ``s_dn``; dequantized here) -> [N, D] in x's dtype."""
    gu = quant.dequantize_expert(fmt, "gate_up", gate_up, s_gu, x.dtype)
    dn = quant.dequantize_expert(fmt, "down", down, s_dn, x.dtype)
    return (_swiglu(x @ gu) @ dn).astype(x.dtype)


def default_threads(kind: str = "xla") -> int:
    """Thread-pool size of a host kernel, >= 1: "xla": half the cores (XLA:CPU also threads each dot);
    "rows": every core (each thread runs one-thread BLAS on its rows); "native": every core (OpenMP
    threads of the C kernel)."""
    cores = os.cpu_count() or 2
    return max(1, cores if kind in ("rows", "native") else cores // 2)


def check_callback_backend(bank: jax.Array) -> None:
    """Refuses the callback mechanisms where they would deadlock.

    On the CPU backend with asynchronous dispatch (JAX's default), the engine's next dispatch
    blocks (holding the GIL) behind the step that is running the callback, while the callback
    needs the GIL: a hang after a few dozen steps (seen in tests; cf. jax-ml/jax#24255). With
    synchronous CPU dispatch (:func:`use_sync_cpu_dispatch` before JAX starts its backends; the
    CLIs do) it runs, and the callback's own XLA:CPU calls are then safe too. On an accelerator
    the CPU client is separate and only the host kernel uses it.

    Raises:
      ValueError: CPU backend with asynchronous dispatch on.
    """
    platform = next(iter(bank.sharding.device_set)).platform
    if platform == "cpu" and jax.config.read("jax_cpu_enable_async_dispatch"):
        raise ValueError("the callback CPU-expert mechanisms deadlock on the CPU backend with asynchronous "
                         "dispatch; call ftjax.experts.cpu_experts.use_sync_cpu_dispatch() before JAX starts "
                         "(the CLIs do), or use --cpu_expert_impl=compute_on")


def use_sync_cpu_dispatch() -> None:
    """Turns off JAX's asynchronous dispatch on the CPU client. Takes effect only if called before
    JAX creates its backends (the flag is read then; the ``JAX_...`` environment variable is not
    honoured for it in jax 0.11.2). Needed by the callback mechanisms on the CPU backend; on an
    accelerator it only affects the host kernel's own calls (run inline in its worker threads)."""
    jax.config.update("jax_cpu_enable_async_dispatch", False)


class HostExpertKernel(DriverThreadKernel):
    """Computes expert FFNs on the CPU from zero-copy views of the host banks.

    Each expert is one call of an XLA:CPU-jitted :func:`_ffn` on the CPU device, its weight rows
    handed over without a copy (the banks' rows are 64-byte aligned, which XLA:CPU needs to alias
    a numpy buffer; ``zero_copy`` records whether it did); ``threads`` experts run at once in a
    thread pool. The asynchronous interface (``submit`` / ``result`` / ``compute``) is
    ``host_async.DriverThreadKernel``'s.

    Args:
      gate_up, down: :class:`HostBankView` of the banks [L*E, D, 2F] and [L*E, F, D].
      threads: worker threads (experts computed concurrently); default :func:`default_threads`.
      scales: views of a quantized format's scale banks (gate_up, down), None for dense.
      fmt: the banks' format (``ftjax.experts.quant``); the kernel dequantizes each expert it computes.
    """

    def __init__(self, gate_up: HostBankView, down: HostBankView, threads: int | None = None,
                 scales: tuple[HostBankView, HostBankView] | None = None, fmt: str = "dense"):
        self.gate_up, self.down = gate_up, down
        self.scales, self.fmt = scales, fmt
        self.threads = int(threads or default_threads())
        self.cpu = jax.devices("cpu")[0]
        self._ffn = jax.jit(_ffn, static_argnames=("fmt",))
        self._pool = concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix="ftjax-cpu-expert")
        self._start_driver("ftjax-cpu-expert-driver")
        row = self.gate_up.array[0]
        self.zero_copy = jax.device_put(row, self.cpu).unsafe_buffer_pointer() == row.ctypes.data

    def _one(self, x_cpu: jax.Array, fid: int) -> np.ndarray:
        gu = jax.device_put(self.gate_up.array[fid], self.cpu)
        dn = jax.device_put(self.down.array[fid], self.cpu)
        sg = sd = None
        if self.scales is not None:
            sg, sd = (jax.device_put(v.array[fid], self.cpu) for v in self.scales)
        return np.asarray(self._ffn(x_cpu, gu, dn, sg, sd, fmt=self.fmt))

    def _call(self, x: np.ndarray, fids: np.ndarray, shape: tuple, dtype) -> np.ndarray:
        out = np.zeros(shape, dtype)
        x_cpu = jax.device_put(x, self.cpu)
        for j, y in enumerate(self._pool.map(lambda fid: self._one(x_cpu, int(fid)), fids)):
            out[j] = y
        return out


_KERNELS: dict[tuple, Any] = {}


def kernel_class(kind: str):
    """The host kernel class of a kind of :data:`KERNEL_KIND` ("xla", "rows" or "native").

    Raises:
      ValueError: an unknown kind.
    """
    if kind == "xla":
        return HostExpertKernel
    if kind == "rows":
        from ftjax.experts.cpu_rows import RowSplitKernel
        return RowSplitKernel
    if kind == "native":
        from ftjax.experts.cpu_native import NativeKernel
        return NativeKernel
    raise ValueError(f"unknown host kernel kind {kind!r}; expected 'xla', 'rows' or 'native'")


def get_kernel(host_gate_up: jax.Array, host_down: jax.Array, threads: int | None = None,
               allow_copy: bool = False, scales: tuple | None = None, fmt: str = "dense", kind: str = "xla"):
    """The (memoised) host kernel of kind ``kind`` (:func:`kernel_class`) over a pair of host banks
    (and, for a quantized format ``fmt``, their scale banks ``scales``).

    Raises:
      HostViewError: the banks cannot be viewed from numpy without a copy.
      ValueError: an unknown kind, or a format the kernel cannot decode.
      cpu_native.NativeBuildError: kind "native" and no C compiler, or a failed build.
    """
    cls = kernel_class(kind)
    threads = int(threads or default_threads(kind))
    scales = tuple(scales) if scales else None
    key = (kind, id(host_gate_up), id(host_down), threads, fmt) + tuple(id(s) for s in scales or ())
    k = _KERNELS.get(key)
    stale = k is not None and (k.gate_up.source is not host_gate_up or k.down.source is not host_down or (
        scales is not None and any(v.source is not s for v, s in zip(k.scales, scales))))
    if k is None or stale:
        views = None if scales is None else tuple(host_bank_view(s, allow_copy) for s in scales)
        k = cls(host_bank_view(host_gate_up, allow_copy), host_bank_view(host_down, allow_copy), threads, views, fmt)
        _KERNELS[key] = k
    return k


# --------------------------------------------------------------------------------------------
# In-jit launch / collect
# --------------------------------------------------------------------------------------------
def _host_expert(x, fid, fmt, gate_up_bank, down_bank, *scale_banks):
    """One expert's FFN on the host from the bank rows (and scale rows) of flat id ``fid``."""
    row = lambda b: jax.lax.dynamic_index_in_dim(b, fid, keepdims=False)  # noqa: E731
    scales = [row(b) for b in scale_banks] or [None, None]
    return _ffn(x, row(gate_up_bank), row(down_bank), *scales, fmt=fmt)


def _host_ffn_loop(fmt, x, flat_ids, count, *banks):
    """Host computation of compute_on: a loop over the first ``count`` ids. Returns [C, N, D].
    banks: gate_up, down and, for a quantized ``fmt``, their scale banks."""
    def body(j, acc):
        return acc.at[j].set(_host_expert(x, flat_ids[j], fmt, *banks))
    init = jnp.zeros((flat_ids.shape[0],) + x.shape, x.dtype)
    return jax.lax.fori_loop(0, count, body, init)


def _host_ffn_static(fmt, x, flat_ids, count, *banks):
    """Host computation without a loop: all C entries, padding ids clamped to 0. Returns [C, N, D]."""
    del count
    return jnp.stack([_host_expert(x, jnp.maximum(flat_ids[j], 0), fmt, *banks) for j in range(flat_ids.shape[0])])


@dataclasses.dataclass(frozen=True, eq=False)
class CpuExperts:
    """A CPU mechanism bound to its banks; hashable by identity (part of a static jit argument).

    impl: one of :data:`IMPLS`; kernel: the host kernel (callback mechanisms: a :class:`HostExpertKernel`,
    a ``cpu_rows.RowSplitKernel`` or a ``cpu_native.NativeKernel``, :data:`KERNEL_KIND`), else None.
    """

    impl: str
    kernel: Any = None

    @property
    def asynchronous(self) -> bool:
        """Submits in :meth:`launch` and waits in :meth:`collect` (the CPU works while the copies run)."""
        return self.impl in ASYNC_IMPLS

    def __post_init__(self):
        if self.impl not in IMPLS:
            raise ValueError(f"unknown CPU expert mechanism {self.impl!r}; expected one of {IMPLS}")
        if self.impl in CALLBACK_IMPLS and self.kernel is None:
            raise ValueError(f"CPU expert mechanism {self.impl!r} needs a host kernel")

    def describe(self) -> dict:
        d: dict[str, Any] = {"impl": self.impl}
        if self.kernel is not None:
            d.update(threads=self.kernel.threads, bank_view=self.kernel.gate_up.how,
                     zero_copy_rows=self.kernel.zero_copy, kernel=KERNEL_KIND[self.impl])
            if hasattr(self.kernel, "describe"):  # the native kernel's build (OpenMP, library)
                d.update(self.kernel.describe())
        return d

    # ---- in-jit --------------------------------------------------------------------------
    def launch(self, x: jax.Array, flat_ids: jax.Array, count: jax.Array, banks) -> Any:
        """Issues the CPU work for ``count`` experts; returns a handle for :meth:`collect`.

        x: [N, D] (device); flat_ids: int32 [C], the first ``count`` valid; count: int32 [];
        banks: the host ``ExpertBanks`` (read in-graph by the compute_on mechanisms).
        Call it before the layer's fetch so that asynchronous mechanisms overlap the copy.
        """
        c = flat_ids.shape[0]
        out = jax.ShapeDtypeStruct((c,) + x.shape, x.dtype)
        zeros = lambda: jnp.zeros(out.shape, out.dtype)  # noqa: E731
        if self.impl == "callback":
            k = self.kernel
            return jax.lax.cond(count > 0, lambda: jax.pure_callback(k.compute, out, x, flat_ids, count), zeros)
        if self.asynchronous:
            k = self.kernel
            tick = jax.ShapeDtypeStruct((), jnp.int32)
            submit = lambda: io_callback(lambda *a: np.int32(k.submit(*a)), tick, x, flat_ids, count)  # noqa: E731
            return jax.lax.cond(count > 0, submit, lambda: jnp.int32(-1))
        host = jax.memory.Space.Host
        fn = functools.partial(_host_ffn_loop if self.impl == "compute_on" else _host_ffn_static, banks.fmt)
        return compute_on(fn, compute_type="device_host", out_memory_spaces=host)(
            jax.device_put(x, host), jax.device_put(flat_ids, host), jax.device_put(count, host),
            banks.gate_up, banks.down, *(banks.scales or ()))

    def collect(self, handle: Any, x: jax.Array, num: int) -> jax.Array:
        """The CPU results on the device: [num, N, D] in x's dtype (rows >= count unspecified)."""
        if self.impl == "callback":
            return handle
        if self.asynchronous:
            k = self.kernel
            out = jax.ShapeDtypeStruct((num,) + x.shape, x.dtype)
            return jax.lax.cond(handle >= 0, lambda: io_callback(k.result, out, handle),
                                lambda: jnp.zeros(out.shape, out.dtype))
        return jax.device_put(handle, jax.memory.Space.Device)


def make_cpu_experts(impl: str, host_gate_up: jax.Array, host_down: jax.Array, threads: int | None = None,
                     allow_copy: bool = False, scales: tuple | None = None, fmt: str = "dense",
                     from_program: bool = True) -> CpuExperts:
    """Builds the mechanism ``impl`` for these host banks (``scales``, ``fmt``: those of a
    quantized format, ``ExpertBanks.scales`` / ``.fmt``). ``from_program``: a program calls the host kernel
    (through callbacks); False where only Python does (``ftjax.runtime.host_split``).

    Raises:
      ValueError: unknown impl; a callback mechanism called from a program on the CPU backend with asynchronous
        dispatch (:func:`check_callback_backend`); ``numpy_rows_async`` or ``native_async`` with a format it
        cannot decode; a compute_on mechanism with banks not typed as host memory (:func:`ensure_host_typed`).
      HostViewError: a callback mechanism and no zero-copy bank view.
      cpu_native.NativeBuildError: ``native_async`` and no C compiler, or a failed build.
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown CPU expert mechanism {impl!r}; expected one of {IMPLS}")
    kernel = None
    if impl not in CALLBACK_IMPLS and not all(is_host_typed(b) for b in (host_gate_up, host_down, *(scales or ()))):
        raise ValueError(f"{impl} needs host banks that JAX traces as host memory; pass them through "
                         "ftjax.experts.cpu_experts.ensure_host_typed first (jit out_shardings quirk)")
    if impl in CALLBACK_IMPLS:
        if from_program:
            check_callback_backend(host_gate_up)
        kernel = get_kernel(host_gate_up, host_down, threads, allow_copy, scales, fmt, KERNEL_KIND[impl])
    return CpuExperts(impl, kernel)
