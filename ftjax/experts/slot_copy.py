"""Cache misses copied from the pinned host banks straight into their device slots by one CUDA kernel per layer.

Source of the idea: FreeToken copies each miss from pinned host memory into its slot with one host-issued copy
(DESIGN.md 1.1); issue 33, item 2 asks for a step's misses at >= 95% of the pinned copy rate. XLA has no
operation for a host slice written at a dynamic device offset, so ftjax's XLA path (``ftjax.experts.fetch``)
reads each miss into a device temporary, copies it into the slot, and runs one loop iteration per miss
(docs/PROFILE.md: the copies at 95-96% of B_P, the loop at 88%). This module's kernel (``native/slot_copy.cu``,
an XLA FFI target) reads the miss list on the device and has its blocks read every miss's bytes from the host
bank through the bank's unified address, writing them into the slot: one launch for all misses of a layer,
no temporary, no loop, no read-back (so it also runs inside the decode step's CUDA graph).

:func:`build` compiles the source with ``nvcc`` on first use

    nvcc -O3 -std=c++17 -shared -Xcompiler -fPIC -arch=native -I<jax.ffi.include_dir()> slot_copy.cu -o <lib>

into ``<cache dir>/slot_copy-<key>.so`` (the cache directory of ``ftjax.experts.cpu_native``; ``<key>`` hashes the
source, nvcc's path and version, the flags and the GPU's name); :func:`register` loads it and registers its two
FFI targets once per process. :func:`copy_into_slots` is the jitted call. Where it cannot run (no GPU backend,
no nvcc, a failed build) :func:`unavailable` says why, and the engine keeps the XLA path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from ftjax import compile_cache
from ftjax.kernels import registry

#: The kernel's CUDA source (package data).
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native", "slot_copy.cu")
#: nvcc flags of every build (``-arch=native``: machine code for the GPUs of the building machine).
NVCC_FLAGS = ("-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-arch=native")
#: The source's ``ftjax_slot_copy_abi()``; a library that reports another is refused.
ABI = 2
#: FFI target names: the bank as an operand, and the bank as an address attribute.
TARGET, TARGET_PTR = "ftjax_slot_copy", "ftjax_slot_copy_ptr"
#: The copy on the library's own stream and the compute stream's wait for it (:func:`copy_into_slots_start`).
TARGET_START, TARGET_WAIT = "ftjax_slot_copy_start", "ftjax_slot_copy_wait"
#: Thread blocks per miss (each of 256 threads, 4 x 16-byte loads in flight): 64 blocks x 16 KiB of reads in
#: flight per pass over a 6-9 MB expert, enough to keep a PCIe 5.0 x16 link's ~1-2 us read latency covered.
BLOCKS_PER_MISS = 64
#: The most blocks per miss a call may ask for (``registry.MAX_PREFETCH_BLOCKS`` says why this bound).
MAX_BLOCKS_PER_MISS = registry.MAX_PREFETCH_BLOCKS


class SlotCopyUnavailable(RuntimeError):
    """The slot-copy kernel cannot run here: no GPU backend, no nvcc, a failed build, or a bad library."""


#: Where nvcc is looked for after PATH and ``$CUDA_HOME/bin``.
NVCC_PLACES = ("/usr/local/cuda/bin/nvcc",)


def find_nvcc() -> str:
    """nvcc's path: ``nvcc`` on PATH, else ``$CUDA_HOME/bin/nvcc``, else the first of :data:`NVCC_PLACES`.

    Raises:
      SlotCopyUnavailable: none found.
    """
    found = shutil.which("nvcc")
    home = compile_cache.cuda_home()
    places = ([found] if found else []) + ([os.path.join(home, "bin", "nvcc")] if home else []) + list(NVCC_PLACES)
    for cand in places:
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    raise SlotCopyUnavailable(f"no nvcc for the slot-copy kernel: looked on PATH, in $CUDA_HOME/bin and at "
                              f"{', '.join(NVCC_PLACES)} (XLA's miss loop runs instead)")


def _gpu_name() -> str:
    return ";".join(sorted({d.device_kind for d in jax.devices() if d.platform == "gpu"}))


def build(cache_dir: str | None = None, nvcc: str | None = None, source: str = SOURCE) -> str:
    """Compiles the kernel (or finds the cached build with the same key); returns the library's path.

    The key hashes the source, nvcc's path and version, the flags (with the FFI headers' folder), the FFI header's
    text, jax's and jaxlib's versions and the GPUs' names.

    Raises:
      SlotCopyUnavailable: no nvcc, an unreadable source, an unwritable cache directory, or a failed compile (the
        message has the command and nvcc's error).
    """
    nvcc = nvcc or find_nvcc()
    cache_dir = os.path.abspath(os.path.expanduser(cache_dir or compile_cache.native_dir()))
    try:
        os.makedirs(cache_dir, exist_ok=True)
        version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
        include = jax.ffi.include_dir()
        flags = NVCC_FLAGS + (f"-I{include}",)
        key = hashlib.sha256()
        for path in (source, os.path.join(include, "xla", "ffi", "api", "ffi.h")):
            with open(path, "rb") as f:
                key.update(hashlib.sha256(f.read()).digest())
    except (OSError, subprocess.SubprocessError) as e:
        raise SlotCopyUnavailable(f"cannot prepare the slot-copy kernel's build in {cache_dir}: {e}") from None
    import jaxlib
    for part in (os.path.realpath(nvcc), version, " ".join(flags), jax.__version__, jaxlib.__version__, _gpu_name()):
        key.update(hashlib.sha256(part.encode()).digest())
    path = os.path.join(cache_dir, f"slot_copy-{key.hexdigest()[:20]}.so")
    if os.path.exists(path):
        return path
    error = compile_cache.build_native(path, lambda tmp: [nvcc, *flags, source, "-o", tmp], 600)
    if error is not None:
        raise SlotCopyUnavailable(f"the slot-copy kernel did not build: {error}")
    return path


_STATE: dict = {}
_LOCK = threading.Lock()


def register() -> str:
    """Builds, loads and registers the FFI targets once per process; returns the library's path.

    Raises:
      SlotCopyUnavailable: not on a CUDA GPU backend, or :func:`build` / loading / registering failed, whatever
        the cause (the same error again on later calls, without a second try).
    """
    with _LOCK:
        if "error" in _STATE:
            raise SlotCopyUnavailable(_STATE["error"])
        if "path" in _STATE:
            return _STATE["path"]
        try:
            if jax.default_backend() != "gpu":
                raise SlotCopyUnavailable(f"the slot-copy kernel needs a GPU backend, not {jax.default_backend()}")
            version = str(getattr(jax.devices()[0].client, "platform_version", ""))
            if "rocm" in version.lower():
                raise SlotCopyUnavailable(f"the slot-copy kernel needs a CUDA GPU, not {version}")
            path = build()
            try:
                lib = ctypes.CDLL(path)
            except OSError as e:
                raise SlotCopyUnavailable(f"cannot load {path}: {e}") from None
            if lib.ftjax_slot_copy_abi() != ABI:
                raise SlotCopyUnavailable(f"{path} reports ABI {lib.ftjax_slot_copy_abi()}, expected {ABI}")
            jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.FtjaxSlotCopy), platform="CUDA")
            jax.ffi.register_ffi_target(TARGET_PTR, jax.ffi.pycapsule(lib.FtjaxSlotCopyPtr), platform="CUDA")
            jax.ffi.register_ffi_target(TARGET_START, jax.ffi.pycapsule(lib.FtjaxSlotCopyStart), platform="CUDA")
            jax.ffi.register_ffi_target(TARGET_WAIT, jax.ffi.pycapsule(lib.FtjaxSlotCopyWait), platform="CUDA")
        except SlotCopyUnavailable as e:
            _STATE["error"] = str(e)
            raise
        except Exception as e:  # noqa: BLE001 - any failure here means XLA's loop runs instead
            _STATE["error"] = f"the slot-copy kernel did not load: {type(e).__name__}: {e}"
            raise SlotCopyUnavailable(_STATE["error"]) from None
        _STATE["path"], _STATE["lib"] = path, lib
        return path


def unavailable() -> str | None:
    """None where :func:`register` succeeds, else why the kernel cannot run here."""
    try:
        register()
        return None
    except SlotCopyUnavailable as e:
        return str(e)


def warn_once(why: str) -> None:
    """One warning per process that ``miss_copy="auto"`` keeps XLA's miss loop on a GPU, and why."""
    with _LOCK:
        if _STATE.get("warned"):
            return
        _STATE["warned"] = True
    warnings.warn(f"miss_copy=auto: the slot-copy kernel cannot run here ({why}); cache misses take XLA's loop "
                  "(offload decode measured 1.12-1.16x faster with the kernel on an H100; docs/PROFILE.md)",
                  RuntimeWarning, stacklevel=2)


def _check(name: str, bank: jax.Array, pool: jax.Array, blocks_per_miss) -> None:
    """The copy calls' argument checks, then :func:`register`.
    Raises:
      ValueError: ``blocks_per_miss`` not an integer in [1, :data:`MAX_BLOCKS_PER_MISS`]; bank and pool rows that
        differ in shape or dtype.
      SlotCopyUnavailable: as :func:`register`."""
    if isinstance(blocks_per_miss, bool) or int(blocks_per_miss) != blocks_per_miss or \
            not 1 <= blocks_per_miss <= MAX_BLOCKS_PER_MISS:
        raise ValueError(f"{name}: blocks_per_miss={blocks_per_miss!r}, expected an integer 1 to "
                         f"{MAX_BLOCKS_PER_MISS}")
    if bank.shape[1:] != pool.shape[1:] or bank.dtype != pool.dtype:
        raise ValueError(f"{name}: bank rows {bank.shape[1:]} {bank.dtype} differ from pool rows "
                         f"{pool.shape[1:]} {pool.dtype}")
    register()


def _indices(flat_ids, slots, count) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The calls' index operands: flat_ids and slots int32 [M], count int32 []."""
    return (jnp.asarray(flat_ids, jnp.int32), jnp.asarray(slots, jnp.int32),
            jnp.asarray(count, jnp.int32).reshape(()))


def copy_into_slots(bank: jax.Array, pool: jax.Array, flat_ids: jax.Array, slots: jax.Array, count: jax.Array,
                    bank_address: int | None = None, blocks_per_miss: int = BLOCKS_PER_MISS) -> jax.Array:
    """Rows ``flat_ids[:count]`` of the host ``bank`` written into rows ``slots[:count]`` of the device ``pool``
    (traced inside jit; the pool's buffer is updated in place where the caller donates it).

    bank: [N, ...] in pinned host memory (or on the device); pool: [S, ...] on the device, the same row shape and
    dtype; flat_ids, slots: int32 [M]; count: int32 [] (the first min(count, M) rows are copied; <= 0: none).
    ``slots[:count]`` must be distinct (two misses into one slot race; the slot table never does that). Rows
    whose id or slot is out of range are skipped (XLA's loop would clamp them). ``bank_address``: the bank's
    buffer address (``bank.unsafe_buffer_pointer()`` of the concrete array) to pass as an attribute instead of
    the bank as an operand (``TARGET_PTR``); the program is then valid only for that buffer. ``blocks_per_miss``:
    thread blocks (256 threads each) that copy one miss. Returns the new pool [S, ...].

    Raises:
      ValueError: bank and pool rows differ in shape or dtype; ``blocks_per_miss`` outside [1,
        :data:`MAX_BLOCKS_PER_MISS`].
      SlotCopyUnavailable: as :func:`register`.
      (at run time) a kernel fault surfaces as XLA's runtime error of the program.
    """
    _check("copy_into_slots", bank, pool, blocks_per_miss)
    ids, sl, n = _indices(flat_ids, slots, count)
    out = jax.ShapeDtypeStruct(pool.shape, pool.dtype)
    if bank_address is None:
        call = jax.ffi.ffi_call(TARGET, out, input_output_aliases={4: 0})
        return call(bank, ids, sl, n, pool, blocks_per_miss=np.int64(blocks_per_miss))
    call = jax.ffi.ffi_call(TARGET_PTR, out, input_output_aliases={3: 0})
    return call(ids, sl, n, pool, bank_ptr=np.int64(bank_address), bank_rows=np.int64(bank.shape[0]),
                blocks_per_miss=np.int64(blocks_per_miss))


def copy_into_slots_start(bank: jax.Array, pool: jax.Array, flat_ids: jax.Array, slots: jax.Array,
                          count: jax.Array, tag: int = 0, blocks_per_miss: int = BLOCKS_PER_MISS) -> jax.Array:
    """:func:`copy_into_slots` launched on a CUDA stream of the library's own, after the compute stream's work so
    far, without waiting for it: the returned pool [S, ...] aliases ``pool`` while its ``slots[:count]`` rows are
    still being written, so XLA's next kernels run beside the copy. The program must use the returned pool only
    through :func:`wait_slots` (same ``tag``, an int, and the same ``flat_ids``, ``slots`` and ``count``, which the
    copy reads until then) -- no read, write or copy of it before -- and must wait for every start before it ends;
    the compiled program must hold no copy of the pool (check it: ``experiments/probe_copy_stream.py`` counts them).
    Not command-buffer compatible: XLA runs both calls outside its CUDA graphs. One GPU per process. Give it few
    ``blocks_per_miss`` (2-8): at the default 64, a few misses' long-lived blocks keep XLA's next kernels from running
    beside the copy (H100, 2026-12-07: 4 misses a layer hid 0.94-0.97 of the shorter part at 2-8 blocks, 0.02-0.10
    at 64, not traced further; ``experiments/probe_copy_stream.py --copy=kernel_async``). The
    engine's prefetch uses it (``ftjax.experts.prefetch``, ``EngineConfig.prefetch_guesses``).

    Raises:
      ValueError, SlotCopyUnavailable: as :func:`copy_into_slots`.
    """
    _check("copy_into_slots_start", bank, pool, blocks_per_miss)
    call = jax.ffi.ffi_call(TARGET_START, jax.ShapeDtypeStruct(pool.shape, pool.dtype), input_output_aliases={4: 0},
                            has_side_effect=True)
    return call(bank, *_indices(flat_ids, slots, count), pool, blocks_per_miss=np.int64(blocks_per_miss),
                tag=np.int64(tag))


def wait_slots(pool: jax.Array, flat_ids: jax.Array, slots: jax.Array, count: jax.Array, tag: int = 0) -> jax.Array:
    """The pool [S, ...] once the last :func:`copy_into_slots_start` of ``tag`` has finished writing it (the compute
    stream waits for the copy's stream; nothing is copied). ``flat_ids``, ``slots``, ``count``: that start's, unused
    here but operands, so that XLA keeps their buffers until the copy has read them.

    Raises:
      SlotCopyUnavailable: as :func:`register`.
    """
    register()
    call = jax.ffi.ffi_call(TARGET_WAIT, jax.ShapeDtypeStruct(pool.shape, pool.dtype), input_output_aliases={0: 0},
                            has_side_effect=True)
    return call(pool, *_indices(flat_ids, slots, count), tag=np.int64(tag))
