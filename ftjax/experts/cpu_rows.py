"""Expert FFNs on the CPU with every core on every expert: row blocks, float32 accumulation, numpy.

Source of the idea: FreeToken's CPU executor (and Fiddler before it) computes a layer's CPU misses
with all host cores; for one token an expert FFN is a matrix-vector product, bound by how fast the
cores read the expert's weights from DRAM (DESIGN.md 1.2; issue 33 item 3). The XLA:CPU kernel of
``ftjax.experts.cpu_experts.HostExpertKernel`` runs one expert per thread through a jitted call and
reads 8-13 GB/s; here each expert is cut into blocks of contiguous input rows, so ``threads`` cores
read one expert at once, and each block is decoded into a per-thread float32 scratch buffer that
stays in the core's cache before a single-threaded BLAS product reads it.

One call, ``x`` [N, D] and flat ids [C] of which the first ``count`` are computed, runs two phases
over a thread pool of ``threads`` workers (numpy releases the GIL inside its loops and BLAS), driven
by one driver thread (which also works a share of each phase):

1. gate_up: every (expert j, row block b of D) unit computes ``x[:, rows_b] @ W_gu[j][rows_b, :]``
   into a float32 partial sum [N, 2F]; the driver sums each expert's partials and computes
   ``a = silu(gate) * up`` [N, F] in float32 for all experts at once;
2. down: every (expert j, row block c of F) unit computes ``a[:, rows_c] @ W_dn[j][rows_c, :]`` into
   a partial [N, D]; the driver sums them and casts to x's dtype.

The number of row blocks per expert is ``ceil(threads / count)`` (capped by the rows and the
format's scale groups), so one expert uses every thread and eight experts on 16 threads split each
one in two. The Python work of a unit (about ten numpy calls) holds the GIL; with the thread
hand-offs it is the kernel's fixed cost per call.

Formats (``ftjax.experts.formats``): a row block is decoded to float32 before its product: dense
bfloat16 by a 16-bit shift of its bits (no rounding), float32 read in place, other dense dtypes and
int8 / fp8 by a cast (fp8 through ml_dtypes' scalar cast: correct, but slow); int4 by its two
nibbles (low nibble: even column, high: odd) with the ``-8`` offset folded into the product
(``x @ (q - 8) = x @ q - 8 * sum(x)``). Block scales multiply the
per-group partial sums ``[G, N, out]`` (a group of ``bi`` input rows shares one scale per column or
column block; where ``in`` is not a multiple of ``bi`` the last group is the partial block at the edge),
so a scale is applied once per group and column, not per weight. The result equals
the reference FFN (``cpu_experts._ffn`` on the dequantized weights) up to float32 summation order
and the reference's rounding of its intermediates to x's dtype.

The process's OpenBLAS (numpy's) is set to one thread by :func:`single_thread_blas`: its own
threads would otherwise serve one block at a time behind a lock.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import math
import os
import threading

import numpy as np

from ftjax.experts import formats
from ftjax.experts.host_async import DriverThreadKernel

#: Input rows of a row block are a multiple of this (and of the format's scale group).
ROW_ALIGN = 16


def single_thread_blas() -> bool:
    """Sets the OpenBLAS library numpy loaded to one thread (process-wide); True when it did.

    Looks through this process's mapped libraries (Linux ``/proc/self/maps``) for an OpenBLAS and calls
    its ``*openblas_set_num_threads*`` entry point; does nothing (False) where there is none (e.g. MKL
    or Accelerate builds of numpy, or another OS).
    """
    try:
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f
                    if line.split()[-1].startswith("/") and "openblas" in os.path.basename(line.split()[-1]).lower()}
    except OSError:
        return False
    names = ("openblas_set_num_threads", "openblas_set_num_threads64_", "scipy_openblas_set_num_threads64_",
             "scipy_openblas_set_num_threads", "scipy_openblas_set_num_threads_64_")
    done = False
    for path in sorted(libs):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in names:
            fn = getattr(lib, name, None)
            if fn is not None:
                fn(ctypes.c_int(1))
                done = True
                break
    return done


def row_blocks(rows: int, parts: int, align: int) -> list[tuple[int, int]]:
    """``rows`` cut into at most ``parts`` contiguous blocks whose starts are multiples of ``align``.

    Returns [(start, stop)] covering [0, rows) in order. Raises ValueError for parts < 1 or align < 1.
    """
    if parts < 1 or align < 1:
        raise ValueError(f"parts and align must be >= 1, got {parts}, {align}")
    units = math.ceil(rows / align)
    per = math.ceil(units / min(parts, units)) * align
    return [(r, min(r + per, rows)) for r in range(0, rows, per)]


def _expand_cols(s: np.ndarray, out: int, bo: int, parts: int) -> np.ndarray:
    """Scales [..., parts * nbo] -> [..., out]: each column's scale (``bo`` columns share one)."""
    if bo == 1:
        return s
    per, nbo = out // parts, s.shape[-1] // parts
    s = s.reshape(s.shape[:-1] + (parts, nbo))
    s = np.repeat(s, bo, axis=-1)[..., :per]
    return s.reshape(s.shape[:-2] + (out,))


class _Matrix:
    """How one bank's rows ([R, in, out / pack] stored) become float32 partial products.

    bank: numpy view of the bank; scales: view of its scale bank [R, nbi, nbo] or None; fmt: the
    format; parts: 2 for gate_up (gate | up), 1 for down.
    """

    def __init__(self, bank: np.ndarray, scales: np.ndarray | None, fmt: formats.ExpertFormat, parts: int):
        self.bank, self.scales, self.fmt, self.parts = bank, scales, fmt, parts
        self.rows = bank.shape[1]
        self.out = bank.shape[2] * fmt.pack
        self.bi, self.bo = fmt.block(self.rows) if fmt.has_scales else (self.rows, 1)
        self.align = ROW_ALIGN if self.bi >= self.rows else math.lcm(ROW_ALIGN, self.bi)
        self.kind = self._kind()

    def _kind(self) -> str:
        dt = self.bank.dtype
        if self.fmt.name == "int4":
            return "int4"
        if self.fmt.pack != 1:
            raise ValueError(f"format {self.fmt.name!r}: packed values other than int4 are not supported here")
        if dt == np.float32:
            return "f32"
        if dt.itemsize == 2 and dt.name == "bfloat16":
            return "bf16"
        return "cast"

    def group_scales(self, fid: int, r0: int, r1: int) -> np.ndarray | None:
        """Scales of rows [r0, r1) as [G, 1, out] (G scale groups; one group when a group spans the block)."""
        if self.scales is None:
            return None
        if self.bi >= r1 - r0:
            s = self.scales[fid, r0 // self.bi][None]
        else:
            s = self.scales[fid, r0 // self.bi: math.ceil(r1 / self.bi)]
        s = _expand_cols(np.asarray(s, np.float32), self.out, self.bo, self.parts)
        if self.kind == "int4":  # the decoded block's column order: even columns, then odd ones
            s = np.concatenate([s[:, 0::2], s[:, 1::2]], axis=-1)
        return s[:, None, :]

    def partial(self, fid: int, r0: int, r1: int, x: np.ndarray, out: np.ndarray, scratch: "_Scratch") -> None:
        """out (float32 [N, out]) = x (float32 [N, r1 - r0]) @ dequantized rows [r0, r1) of expert ``fid``."""
        w = self.bank[fid, r0:r1]
        rb = r1 - r0
        if self.kind == "f32":
            v = w
        elif self.kind == "bf16":
            v = scratch.get(rb * self.out).reshape(rb, self.out)
            u = v.view(np.uint32)
            np.copyto(u, w.view(np.uint16))  # widen, then shift in place: 3-6x faster than one casting shift
            np.left_shift(u, 16, out=u)
        elif self.kind == "cast":
            v = scratch.get(rb * self.out).reshape(rb, self.out)
            np.copyto(v, w, casting="unsafe")
        else:  # int4: [rb, out/2] bytes -> [rb, 2, out/2] nibbles (low = even columns, high = odd)
            half = self.out // 2
            nib = scratch.get_u8(rb * self.out).reshape(rb, 2, half)
            np.bitwise_and(w, 15, out=nib[:, 0])
            np.right_shift(w, 4, out=nib[:, 1])
            v = scratch.get(rb * self.out).reshape(rb, self.out)
            np.copyto(v, nib.reshape(rb, self.out))
        s = self.group_scales(fid, r0, r1)
        if s is None:
            np.matmul(x, v, out=out)
            return
        g = s.shape[0]
        if g == 1 and self.kind != "int4":  # one scale per column over the whole block (int8)
            np.matmul(x, v, out=out)
            out *= s[0]
            return
        z, xs = self._group_products(x, v, g, rb)                         # [G, N, out], [G, N, 1]
        if self.kind == "int4":
            z -= 8.0 * xs
        z *= s
        if self.kind != "int4":
            z.sum(axis=0, out=out)
            return
        y = z.sum(axis=0)  # back to the true column order: even columns first, then odd ones
        half = self.out // 2
        out[:, 0::2], out[:, 1::2] = y[:, :half], y[:, half:]


    def _group_products(self, x: np.ndarray, v: np.ndarray, g: int, rb: int) -> tuple[np.ndarray, np.ndarray]:
        """Per scale group of a block's ``rb`` rows: (x_g @ v_g float32 [G, N, out], sum(x_g) float32
        [G, N, 1]). The block starts on a group; every group has ``bi`` rows but the last, which holds
        what is left when the matrix's ``in`` is not a multiple of ``bi`` (a partial block at the edge)."""
        n = x.shape[0]
        per = rb // g if g == 1 else self.bi
        full = min(g, rb // per)                                           # groups of ``per`` rows
        xg = x[:, :full * per].reshape(n, full, per).transpose(1, 0, 2)   # [full, N, per]
        z = np.empty((g, n, self.out), np.float32)
        xs = np.empty((g, n, 1), np.float32)
        np.matmul(xg, v[:full * per].reshape(full, per, self.out), out=z[:full])
        xs[:full] = xg.sum(axis=-1, keepdims=True)
        if full < g:                                                       # the edge's partial group
            np.matmul(x[:, full * per:], v[full * per:], out=z[full])
            xs[full] = x[:, full * per:].sum(axis=-1, keepdims=True)
        return z, xs


class _Scratch(threading.local):
    """Per-thread reusable buffers (float32 and uint8), grown on demand."""

    def __init__(self):
        self.f = np.empty(0, np.float32)
        self.u = np.empty(0, np.uint8)

    def get(self, n: int) -> np.ndarray:
        if self.f.size < n:
            self.f = np.empty(n, np.float32)
        return self.f[:n]

    def get_u8(self, n: int) -> np.ndarray:
        if self.u.size < n:
            self.u = np.empty(n, np.uint8)
        return self.u[:n]


def _silu(g: np.ndarray) -> np.ndarray:
    """silu(g) = g * sigmoid(g), with sigmoid as 0.5 * (1 + tanh(g / 2)) (no overflow), float32."""
    return g * (0.5 + 0.5 * np.tanh(0.5 * g))


class RowSplitKernel(DriverThreadKernel):
    """Computes expert FFNs on the CPU from numpy views of the host banks, all threads on each expert.

    The same interface as ``cpu_experts.HostExpertKernel`` (``submit`` / ``result`` / ``compute``), so
    the callback mechanisms drive either.

    Args:
      gate_up, down: ``cpu_experts.HostBankView`` (or any object with ``.array``, ``.how``) of the banks
        [R, D, 2F / pack] and [R, F, D / pack].
      threads: workers (default: every core, ``os.cpu_count()``).
      scales: views of a quantized format's scale banks (gate_up [R, nbi, nbo], down [R, nbi, nbo]),
        None for dense.
      fmt: the banks' format tag (``ExpertBanks.fmt``).
    Raises:
      ValueError: a format this kernel cannot decode (packed other than int4), or bank shapes that
        do not agree.
    """

    def __init__(self, gate_up, down, threads: int | None = None, scales=None, fmt: str = "dense"):
        self.gate_up, self.down = gate_up, down
        self.scales, self.fmt = scales, fmt
        self.threads = int(threads or os.cpu_count() or 1)
        f = formats.get(fmt)
        sg, sd = (None, None) if scales is None else (scales[0].array, scales[1].array)
        self._gu = _Matrix(gate_up.array, sg, f, 2)
        self._dn = _Matrix(down.array, sd, f, 1)
        self.hidden, self.ffn = self._gu.rows, self._dn.rows
        if self._gu.out != 2 * self.ffn or self._dn.out != self.hidden:
            raise ValueError(f"bank shapes disagree: gate_up {gate_up.array.shape}, down {down.array.shape} ({fmt})")
        self.blas_single_thread = single_thread_blas()
        self.zero_copy = True  # the views are read in place
        self._pool = concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix="ftjax-cpu-rows")
        self._start_driver("ftjax-cpu-rows-driver")
        self._scratch = _Scratch()

    # ---- one call -------------------------------------------------------------------------
    def _blocks(self, m: _Matrix, count: int) -> list[tuple[int, int]]:
        return row_blocks(m.rows, max(1, math.ceil(self.threads / count)), m.align)

    def _run_units(self, fn, units: list) -> None:
        """Runs ``fn(*unit)`` for every unit, spread over the pool in at most ``threads`` tasks (the
        calling thread runs the first)."""
        def chunk(c):
            for u in c:
                fn(*u)
        chunks = [units[i::self.threads] for i in range(min(self.threads, len(units)))]
        futs = [self._pool.submit(chunk, c) for c in chunks[1:]]
        chunk(chunks[0])
        for fut in futs:
            fut.result()

    def _compute(self, x: np.ndarray, fids: list[int]) -> np.ndarray:
        """float32 [count, N, D] for float32 x [N, D] and the flat ids ``fids``."""
        count, n, f = len(fids), x.shape[0], self.ffn
        b1, b2 = self._blocks(self._gu, count), self._blocks(self._dn, count)
        p1 = np.empty((count, len(b1), n, 2 * f), np.float32)
        self._run_units(lambda j, b, r0, r1: self._gu.partial(fids[j], r0, r1, x[:, r0:r1], p1[j, b], self._scratch),
                        [(j, b, r0, r1) for j in range(count) for b, (r0, r1) in enumerate(b1)])
        h = p1.sum(axis=1) if len(b1) > 1 else p1[:, 0]                 # [count, N, 2F]
        a = np.ascontiguousarray(_silu(h[..., :f]) * h[..., f:])          # [count, N, F]
        p2 = np.empty((count, len(b2), n, self.hidden), np.float32)
        self._run_units(lambda j, b, r0, r1: self._dn.partial(fids[j], r0, r1, a[j, :, r0:r1], p2[j, b],
                                                              self._scratch),
                        [(j, b, r0, r1) for j in range(count) for b, (r0, r1) in enumerate(b2)])
        return p2.sum(axis=1) if len(b2) > 1 else p2[:, 0]

    def _call(self, x: np.ndarray, fids: list[int], shape: tuple, dtype) -> np.ndarray:
        out = np.zeros(shape, dtype)
        if fids:
            out[:len(fids)] = self._compute(np.asarray(x, np.float32), fids).astype(dtype)
        return out

    # ---- the kernel interface -------------------------------------------------------------
    def _ids(self, flat_ids: np.ndarray, count) -> list[int]:
        return [int(i) for i in np.asarray(flat_ids)[: int(count)]]
