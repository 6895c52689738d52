"""Host transfers of the runtime: zero-copy views of pinned host arrays, and the per-layer pieces the
layer-pipelined driver copies while earlier layers compute (docs/OVERLAP.md has the measurements that
chose them).

Inside one compiled program, XLA (jax 0.11.2) lowers every copy of a slice of a host array to a
synchronous ``dynamic-slice`` on the compute stream, so a layer scan cannot hide its host copies
behind compute (DESIGN.md section 3). Copies that the runtime makes on its own transfer stream do
overlap: a ``jax.device_put`` of a whole pinned JAX array issued from Python. So the pieces here are
whole contiguous slices of the host arrays, read through zero-copy numpy views of their pinned
buffers (:func:`host_view`) and presented to JAX as whole ``pinned_host`` arrays aliasing that memory
(:func:`pinned_alias`, through DLPack, no copy):

* :class:`ExpertLayerSource`: a streamed layer's E experts (``flat_id`` rows ``[l*E, (l+1)*E)`` of each
  bank, scales too), or blocks of the experts missing from the slot cache; :class:`ExpertCopies`
  assembles a layer's buffer from PCIe blocks and device-to-device copies of the cached experts.
* :class:`PrefixLayerSource`: a reused prefix's rows of a group of layers in every stored KV chunk.
"""

from __future__ import annotations

import ctypes
import functools
import time
import weakref
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ftjax import memory
from ftjax.experts.state import ExpertBanks

def host_view(x: jax.Array) -> np.ndarray:
    """A numpy array of ``x``'s shape and dtype over ``x``'s own buffer (no copy).

    x: a single-device array in host memory (``pinned_host`` / ``unpinned_host``, or any array
    on the CPU backend). The view is valid while ``x`` is alive and not donated; the caller keeps
    ``x``. It does not wait for ``x``: while the work that writes ``x`` (a device-to-host copy, a
    computation) is still running, the view's memory holds whatever was there before, and so
    does a copy or :func:`pinned_alias` read through it (no dependency on that work). Whoever reads
    it first waits for ``x`` (``x.block_until_ready()``; :class:`ExpertLayerSource` and
    :class:`PrefixLayerSource` do); taking the view, or an alias of it, needs no wait.
    Raises:
      ValueError: ``x`` lives in device memory of an accelerator, or spans several devices.
    """
    if len(x.sharding.device_set) != 1:
        raise ValueError(f"host_view needs a single-device array, got sharding {x.sharding}")
    kind = x.sharding.memory_kind
    if memory.backend() != "cpu" and kind not in ("pinned_host", "unpinned_host"):
        raise ValueError(f"host_view needs an array in host memory, got memory kind {kind!r}")
    buf = x.addressable_data(0)
    dtype = np.dtype(x.dtype)
    raw = (ctypes.c_uint8 * (x.size * dtype.itemsize)).from_address(buf.unsafe_buffer_pointer())
    return np.frombuffer(raw, dtype=dtype).reshape(x.shape)


_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class _PinnedHostTensor:
    """DLPack producer that presents a numpy view of pinned memory as CUDA-host (pinned) memory."""

    def __init__(self, view: np.ndarray):
        self.view = view

    def __dlpack_device__(self):
        from jax._src.typing import DLDeviceType
        return DLDeviceType.kDLCUDAHost, 0

    def __dlpack__(self, stream=None, **kw):
        del stream, kw
        return self.view.__dlpack__()


def pinned_alias(view: np.ndarray) -> jax.Array | None:
    """A ``pinned_host`` JAX array over the same memory as ``view`` (a contiguous numpy view of a
    pinned host array, see :func:`host_view`), made through DLPack without a copy; None where that
    is not possible (the CPU backend, a JAX that copies). Its dtype is the unsigned integer of the
    view's item size (DLPack carries no bfloat16 / float8): the program that reads the device copy
    bitcasts it back.

    Why: ``jax.device_put`` of a whole pinned JAX array runs on the runtime's transfer stream and
    overlaps compute (84% of the copy hidden on the H200), while ``device_put`` of a numpy array waits
    for the work already queued on the compute stream first (nothing hidden; docs/OVERLAP.md).
    """
    if memory.backend() != "gpu":
        return None
    flat = np.ascontiguousarray(view).view(_UINT[view.dtype.itemsize])
    if flat.ctypes.data != view.ctypes.data:
        return None
    try:
        arr = jax.dlpack.from_dlpack(_PinnedHostTensor(flat), copy=False)
    except Exception:  # noqa: BLE001 - an unsupported import means: use the numpy path
        return None
    if arr.addressable_data(0).unsafe_buffer_pointer() != view.ctypes.data or \
            arr.sharding.memory_kind != "pinned_host":
        return None
    return arr


def _as_dtypes(arrays: Sequence[jax.Array], dtypes: Sequence) -> tuple:
    """Bitcasts device copies of :func:`pinned_alias` arrays back to their real dtypes (inside a program)."""
    return tuple(a if a.dtype == d else jax.lax.bitcast_convert_type(a, d) for a, d in zip(arrays, dtypes))


class _LayerPieces:
    """Per-layer pieces of host arrays whose leading axis is ``layers x rows``: each piece is
    either a zero-copy pinned JAX alias (the fast path on a GPU) or a numpy view."""

    def __init__(self, arrays: Sequence[jax.Array], rows: int, layers: int, eager: bool, keep: bool = True):
        # keep: hold the viewed arrays alive (the banks' source); False: the owner keeps them (a cache
        # entry that must die with its chunk)
        self.arrays = tuple(arrays) if keep else ()
        self.views = [host_view(a) for a in arrays]
        self.rows = rows
        self._alias: dict[tuple[int, int], jax.Array | None] = {}
        self._paths: set[str] = set()
        if eager:
            for l in range(layers):
                self.pieces(l)

    @property
    def path(self) -> str | None:
        """"pinned_alias", "numpy_view", "mixed" (both), or None before any piece was made."""
        return (next(iter(self._paths)) if len(self._paths) == 1 else "mixed") if self._paths else None

    def piece_of(self, view: np.ndarray, alias: jax.Array | None):
        """The piece to copy for ``view`` (a contiguous slice of one of :attr:`views`) given its
        :func:`pinned_alias` (None: the view itself), recorded in :attr:`path`."""
        self._paths.add("numpy_view" if alias is None else "pinned_alias")
        return view if alias is None else alias

    def _piece(self, i: int, l: int):
        view = self.views[i][l * self.rows:(l + 1) * self.rows]
        if (i, l) not in self._alias:
            self._alias[i, l] = pinned_alias(view)
        return self.piece_of(view, self._alias[i, l])

    def pieces(self, l: int) -> list:
        return [self._piece(i, l) for i in range(len(self.views))]

    def put(self, l: int) -> tuple:
        return tuple(jax.device_put(self.pieces(l), memory.device_sharding()))


def miss_blocks(slots: np.ndarray) -> list[tuple[int, int]]:
    """The experts of one layer that are not in the slot cache, as aligned power-of-two blocks.

    slots: int [E], the slot of each of the layer's experts, -1 where it is not resident (a row of
    the slot table's ``slot_of``). Returns (offset, size) pairs in ascending offset that cover
    exactly the experts with slot -1: each maximal run of them is cut into blocks whose size is a
    power of two dividing their offset (nodes of a segment tree over [0, E)). So a layer has at
    most 2E - 1 distinct blocks whatever the pattern (their pinned aliases are made once and
    cached), a run of n experts is at most 2 log2(n) blocks, and one program per block size places
    them (:func:`place_block`).
    """
    miss = np.asarray(slots) < 0
    edges = np.flatnonzero(np.diff(np.concatenate(([0], miss.astype(np.int8), [0]))))
    blocks = []
    for start, stop in zip(edges[0::2].tolist(), edges[1::2].tolist()):
        while start < stop:
            size = 1 << ((stop - start).bit_length() - 1)  # the largest power of two that fits ...
            if start:
                size = min(size, start & -start)  # ... and divides the offset
            blocks.append((start, size))
            start += size
    return blocks


class ExpertLayerSource:
    """Per-layer pieces of the routed-expert banks: :meth:`put` copies layer l's E experts (weights
    and scales) to the device as whole contiguous slices; :meth:`put_blocks` copies blocks of
    experts of one layer (the ones missing from the slot cache, :func:`miss_blocks`). banks:
    ``ExpertBanks`` [L*E, ...]."""

    def __init__(self, banks: ExpertBanks, num_experts: int):
        arrays = (banks.gate_up, banks.down) + tuple(banks.scales or ())
        jax.block_until_ready(arrays)  # the views' copies read the bytes: they must be there (host_view)
        layers = banks.gate_up.shape[0] // num_experts
        self.num_experts = num_experts
        self.num_layers = layers
        self._pieces = _LayerPieces(arrays, num_experts, layers, eager=True)
        self.layer_bytes = sum(v[:num_experts].nbytes for v in self._pieces.views)
        # (layer, offset, size) -> that block's host piece of every array, made on first use (a pinned
        # alias costs ~0.1-0.4 ms to make; at most 2E - 1 blocks per layer, see miss_blocks)
        self._blocks: dict[tuple[int, int, int], list] = {}
        self._host_slots = None  # (weakref to a slot table's slot_of, its host copy): host_slots

    @property
    def path(self) -> str:
        """"pinned_alias" (async copies that overlap compute), "numpy_view" (copies that wait), or
        "mixed" (some layers or blocks fell back to numpy views)."""
        return self._pieces.path

    def host_slots(self, slot_of: jax.Array) -> np.ndarray:
        """int32 [L, E] host copy of a slot table's ``slot_of`` (-1: not resident). One small
        device-to-host copy, which waits for the work that produces the table, unless this source
        remembers this very (immutable) array (:meth:`remember_slots`): then no copy and no wait, so
        a streamed call that follows another (the chunks of a long prompt) or ``prepare_prefill``
        does not wait for the work queued before it."""
        known = self._host_slots
        if known is not None and known[0]() is slot_of:
            return known[1]
        host = _read_slots(slot_of).reshape(self.num_layers, self.num_experts)
        self.remember_slots(slot_of, host)
        return host

    def remember_slots(self, slot_of: jax.Array, host: np.ndarray) -> None:
        """Records ``host`` as the host copy of the table array ``slot_of``."""
        try:
            self._host_slots = (weakref.ref(slot_of), host)
        except TypeError:  # not weak-referenceable: nothing remembered
            self._host_slots = None

    def block_pieces(self, layer: int, offset: int, size: int) -> list:
        """Host pieces of experts [offset, offset + size) of ``layer`` (rows ``layer*E + offset`` on)
        of every bank array, weights then scales: pinned aliases on a GPU (unsigned integers of
        the same width, see :func:`pinned_alias`), else numpy views. Made once per block."""
        key = (layer, offset, size)
        pieces = self._blocks.get(key)
        if pieces is None:
            lo = layer * self.num_experts + offset
            views = [v[lo:lo + size] for v in self._pieces.views]
            pieces = self._blocks[key] = [self._pieces.piece_of(v, pinned_alias(v)) for v in views]
        return pieces

    def put_blocks(self, layer: int, blocks: Sequence[tuple[int, int]]) -> list[tuple]:
        """Copies ``blocks`` ((offset, size) of :func:`miss_blocks`) of ``layer`` to the device in
        one ``device_put``: per block, (gate_up [size, D, 2F], down [size, F, D], *scales)."""
        flat = [p for off, size in blocks for p in self.block_pieces(layer, off, size)]
        with jax.named_scope("stream_prefetch"):
            out = jax.device_put(flat, memory.device_sharding())
        n = len(self._pieces.views)
        return [tuple(out[i * n:(i + 1) * n]) for i in range(len(blocks))]

    def spec(self) -> tuple:
        """Shapes of :meth:`put`'s outputs (for compiling ahead)."""
        return tuple(jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=memory.device_sharding())
                     for p in self._pieces.pieces(0))

    def put(self, layer: int) -> tuple:
        """(gate_up [E, D, 2F], down [E, F, D], *scales) of ``layer`` on the device (possibly as
        unsigned integers of the same width: see :func:`pinned_alias`)."""
        with jax.named_scope("stream_prefetch"):
            return self._pieces.put(layer)


@functools.partial(jax.jit, static_argnames=("num_experts", "dtypes"))
def gather_resident(pools, slot_of, layer, *, num_experts: int, dtypes: tuple[str, ...]):
    """A new full-layer buffer whose rows of resident experts are gathered from the slot pools:
    the device-to-device part of a streamed layer with hits (``EngineConfig.stream_d2d_hits``).

    pools: the expert state's (gate_up [S, D, 2F], down [S, F, D], *scales [S, ...]); slot_of:
    int32 [L*E], the slot table's; layer: int32 []; dtypes: the buffer's dtype names, one per pool
    (those of :meth:`ExpertLayerSource.spec`: the banks' or, on a GPU, unsigned integers of the
    same width). Returns one [E, ...] array per pool: row e is the pool row
    ``slot_of[layer*E + e]`` (bitcast, bit for bit), where that is >= 0; the other rows hold pool
    row 0 until :func:`place_block` writes the PCIe copies over them. All E rows are gathered (one
    program for every pattern; ~2.4 GB of HBM traffic per qwen3-30b-a3b layer, on the compute
    stream, whose streamed layers wait for PCIe).
    """
    slots = jax.lax.dynamic_slice(slot_of, (layer * num_experts,), (num_experts,))
    rows = jnp.maximum(slots, 0)
    return _as_dtypes([p[rows] for p in pools], [jnp.dtype(d) for d in dtypes])


@functools.partial(jax.jit, static_argnames=("num_experts", "dtypes"), donate_argnums=(0,), keep_unused=True)
def gather_resident_into(spare, pools, slot_of, layer, *, num_experts: int, dtypes: tuple[str, ...]):
    """:func:`gather_resident` written over ``spare``: the previous layer's buffer (of the same
    shapes and dtypes), donated. Dispatched after that layer's program, it reuses its memory, so a
    layer with hits needs no third full-layer buffer next to the one in use and its PCIe blocks
    (the planner counts two: ``ftjax.runtime.planner``)."""
    del spare  # only its memory: the output aliases it
    return gather_resident(pools, slot_of, layer, num_experts=num_experts, dtypes=dtypes)


@functools.partial(jax.jit, donate_argnums=(0,))
def place_block(buffer, block, offset):
    """``buffer`` (a full-layer buffer, donated: updated in place) with rows [offset, offset + n)
    replaced by ``block``, n experts copied over PCIe (:meth:`ExpertLayerSource.put_blocks`,
    bitcast to the buffer's dtypes). offset: int32 []. One program per block size n."""
    return tuple(jax.lax.dynamic_update_slice_in_dim(b, _as_dtypes([p], [b.dtype])[0], offset, 0)
                 for b, p in zip(buffer, block))


def _read_slots(slot_of: jax.Array) -> np.ndarray:
    """The device-to-host copy of a slot table's ``slot_of`` (a copy, not a view of the buffer)."""
    return np.array(slot_of, np.int32)


class _PendingLayer(NamedTuple):
    """A streamed layer with hits whose PCIe blocks are in flight: (offset, size) and the device
    arrays of each block (:meth:`ExpertLayerSource.put_blocks`)."""

    blocks: list
    arrays: list


class ExpertCopies:
    """One streamed call's expert copies on the layer-pipelined driver (:func:`run`).

    Without ``slot_of``, and for a layer none of whose experts is in the slot cache, a layer's E
    experts are one whole copy per bank array (:meth:`ExpertLayerSource.put`). With ``slot_of``
    (``stream_d2d_hits``), a layer with hits is made in two steps: :meth:`issue` copies only its
    missing experts over PCIe (aligned blocks, :func:`miss_blocks`); :meth:`ready`, dispatched
    after the previous layer's program, gathers the resident experts from the slot pools into the
    previous layer's buffer, donated (:func:`gather_resident_into`; a new buffer for a call's first
    layer: :func:`gather_resident`), device to device, and places the blocks over the other rows
    (:func:`place_block`). So the blocks in flight and the buffers stay within the two full-layer
    buffers the planner counts. The buffer holds the same bytes as the whole copy, so the layer computes
    the same logits. The stream does not change the slot table, so one host copy of it serves the
    whole call.

    compiled: the engine's compile cache (``Engine.compiled``); source: the banks' pieces;
    slot_of: int [L, E] host copy of the slot table's ``slot_of`` (-1 = not resident), or None.
    """

    def __init__(self, compiled: Callable, source: ExpertLayerSource, slot_of: np.ndarray | None = None):
        self.compiled, self.source, self.slot_of = compiled, source, slot_of
        self._dtypes = tuple(str(x.dtype) for x in source.spec())
        self._exe: dict[tuple, Any] = {}

    def blocks(self, layer: int) -> list[tuple[int, int]] | None:
        """The PCIe blocks of ``layer`` when it has hits to copy device to device, else None."""
        if self.slot_of is None:
            return None
        row = self.slot_of[layer]
        return miss_blocks(row) if (row >= 0).any() else None

    def issue(self, layer: int):
        """Starts ``layer``'s host-to-device copies: the buffer tuple of a whole-layer copy, or a
        :class:`_PendingLayer` that :meth:`ready` completes."""
        blocks = self.blocks(layer)
        if blocks is None:
            return self.source.put(layer)
        return _PendingLayer(blocks, self.source.put_blocks(layer, blocks) if blocks else [])

    def _program(self, key: tuple, fn, args, **static):
        """``fn`` compiled for ``args`` (through the engine's cache once per ``key``: the dispatch of
        many small programs per layer skips the engine's key building)."""
        exe = self._exe.get(key)
        if exe is None:
            exe = self._exe[key] = self.compiled(fn, args, **static)
        return exe

    def _gather(self, args):
        return self._program(("gather",), gather_resident, args, num_experts=self.source.num_experts,
                             dtypes=self._dtypes)

    def _gather_into(self, args):
        return self._program(("gather_into",), gather_resident_into, args, num_experts=self.source.num_experts,
                             dtypes=self._dtypes)

    def _fits(self, spare) -> bool:
        """Whether ``spare`` (a layer buffer) has the shapes and dtypes of the buffers this call builds."""
        spec = self.source.spec()
        return spare is not None and len(spare) == len(spec) and all(
            a.shape == b.shape and a.dtype == b.dtype for a, b in zip(spare, spec))

    def _place(self, args):
        return self._program(("place",) + tuple((x.shape, x.dtype) for x in args[1]), place_block, args)

    def ready(self, part, layer: int, state, spare=None):
        """The layer's buffer (gate_up [E, D, 2F], down [E, F, D], *scales, in :meth:`ExpertLayerSource.spec`'s
        dtypes) from what :meth:`issue` returned; state: the expert state the layer program will
        get (its pools hold the hits). spare: the buffer of a layer whose program is already
        dispatched, or None: a layer with hits is gathered into it (donated: the caller drops it),
        not into new memory (:func:`gather_resident_into`)."""
        if not isinstance(part, _PendingLayer):
            return part
        pools = (state.gate_up, state.down) + tuple(state.scales or ())
        args = (pools, state.table.slot_of, layer_index(layer))
        if self._fits(spare):
            args = (tuple(spare),) + args
            buf = self._gather_into(args)(*args)
        else:
            buf = self._gather(args)(*args)
        for (off, _), block in zip(part.blocks, part.arrays):
            args = (buf, block, layer_index(off))
            buf = self._place(args)(*args)
        return buf

    def precompile(self, state) -> None:
        """Compiles :func:`gather_resident` and :func:`place_block` for every block size a layer with
        hits can have (powers of two below E; nothing runs) and makes the block pieces of this slot
        table's pattern (outside any timing)."""
        e = self.source.num_experts
        spec = self.source.spec()
        pools = (state.gate_up, state.down) + tuple(state.scales or ())
        index = jax.ShapeDtypeStruct((), jnp.int32, sharding=memory.device_sharding())
        self._gather((pools, state.table.slot_of, index))
        self._gather_into((spec, pools, state.table.slot_of, index))
        size = 1
        while size < e:
            block = tuple(jax.ShapeDtypeStruct((size,) + x.shape[1:], x.dtype, sharding=x.sharding) for x in spec)
            self._place((spec, block, index))
            size *= 2
        for l in range(self.source.num_layers):
            for off, n in self.blocks(l) or ():
                self.source.block_pieces(l, off, n)
        for i in range(e):
            layer_index(i)


_CHUNK_PIECES: dict[tuple[int, int], tuple[weakref.ref, _LayerPieces]] = {}


def copy_group_layers(num_layers: int, requested: int) -> int:
    """Layers per prefix copy (``EngineConfig.prefix_copy_layers``): the largest divisor of
    ``num_layers`` not above ``requested`` (so every group has the same shape: one program).
    Raises:
      ValueError: ``requested`` < 1."""
    if requested < 1:
        raise ValueError(f"prefix_copy_layers must be >= 1, got {requested}")
    return max(d for d in range(1, min(requested, num_layers) + 1) if num_layers % d == 0)


def _chunk_pieces(chunk: jax.Array, eager: bool = False, rows: int = 1) -> _LayerPieces:
    """The pieces of one stored KV chunk, ``rows`` consecutive layers each (piece g: layers
    g*rows .. g*rows+rows-1, contiguous in the layer-major chunk), made once per chunk and group
    size (making a pinned alias costs ~0.4 ms; a 16k-token prefix has 62 chunks x 48 layers of
    them at one layer per piece, a quarter of that at four) and dropped with the chunk. eager:
    make every piece's alias now (:func:`warm_prefix_chunks`), not at its first copy."""
    key = (id(chunk), rows)
    entry = _CHUNK_PIECES.get(key)
    if entry is not None and entry[0]() is chunk:
        return entry[1]
    pieces = _LayerPieces([chunk], rows, chunk.shape[0] // rows, eager=eager, keep=False)  # must not keep it
    try:
        ref = weakref.ref(chunk)
    except TypeError:  # not weak-referenceable: no cache entry
        return pieces
    _CHUNK_PIECES[key] = (ref, pieces)
    weakref.finalize(chunk, _drop_chunk_pieces, key, ref)
    return pieces


def _drop_chunk_pieces(key: tuple[int, int], ref: weakref.ref) -> None:
    """Finalizer of a chunk: drops its entry, and only its own (a later chunk may reuse the id)."""
    entry = _CHUNK_PIECES.get(key)
    if entry is not None and entry[0] is ref:
        del _CHUNK_PIECES[key]


def warm_prefix_chunks(chunks: Sequence[jax.Array], rows: int = 1) -> float:
    """Makes the pinned aliases of stored KV chunks (each ``[L, 2, C, Hkv, hd]`` in host memory),
    ``rows`` layers each (:func:`copy_group_layers`), now, so that a later request reusing them pays
    no alias making inside its TTFT (62 chunks x 48 layers x ~0.4 ms = ~1.2 s at 16k tokens
    otherwise). The engine calls it for the chunks a prefill stores when prefix loads run on this
    driver. Returns the seconds spent."""
    t0 = time.perf_counter()
    for c in chunks:
        if memory.memory_kind(c) in ("pinned_host", "unpinned_host"):
            _chunk_pieces(c, eager=True, rows=rows)
    return time.perf_counter() - t0


class PrefixLayerSource:
    """Per-layer pieces of a reused prefix: ``n`` stored chunks, each ``[L, 2, C, Hkv, hd]`` in host
    memory (``ftjax.kv.host_store``); :meth:`put` copies the rows of every chunk for a group of
    ``rows`` consecutive layers (:func:`copy_group_layers`) to the device (n arrays
    ``[rows, 2, C, Hkv, hd]``); the layer program picks its own row, and the KV hook writes it into
    the cache (``variant`` "xs"). prefetch: once group g has started, a put also issues group
    g+1's, so that its copy runs while group g computes (the overlapped driver; with one layer per
    group nothing is prefetched: :func:`run`'s one-layer-ahead put does that); at most two groups
    are held (:meth:`put`)."""

    def __init__(self, chunks: Sequence[jax.Array], rows: int = 1, prefetch: bool = False):
        self.chunks = tuple(chunks)  # keeps the viewed chunks alive: the cached pieces do not
        # The copies read the chunks' bytes through views and aliases that do not wait for the work
        # writing them (host_view): a chunk stored by an earlier request is normally long written
        # (then this costs nothing), one still being copied to host memory must be waited for here.
        jax.block_until_ready(self.chunks)
        self.rows, self.prefetch = rows, prefetch
        num_layers = self.chunks[0].shape[0] if self.chunks else 0
        if num_layers % rows:
            raise ValueError(f"prefix copy groups of {rows} layers do not divide the chunks' {num_layers} layers")
        self.num_groups = num_layers // rows
        # padding repeats the last chunk: same pieces
        self._pieces = [_chunk_pieces(c, rows=rows) for c in self.chunks]
        self._singles = self._pieces if rows == 1 else None  # per-layer pieces, made if host_pieces asks
        self._groups: dict[int, tuple] = {}

    def _put_group(self, g: int) -> tuple:
        with jax.named_scope("kv_prefix_load"):
            return tuple(jax.device_put([p.pieces(g)[0] for p in self._pieces], memory.device_sharding()))

    def put(self, layer: int) -> tuple:
        """The device copies of layer ``layer``'s group (n arrays [rows, 2, C, Hkv, hd]): put now
        unless already put. Under ``prefetch`` the next group's put is issued by the put of a
        later layer than the first of group g: :func:`run` asks for layer l+1 before dispatching
        layer l, so that is once group g has started and group g-1 is no longer held (issued on
        the put of group g's first layer, it would be a third group on the device, beside group
        g-1 that the last layer before it still reads)."""
        g = layer // self.rows
        if g not in self._groups:
            self._groups[g] = self._put_group(g)
        for old in [k for k in self._groups if k < g]:  # done with: its device memory goes
            del self._groups[old]
        if self.prefetch and layer % self.rows and g + 1 < self.num_groups and g + 1 not in self._groups:
            self._groups[g + 1] = self._put_group(g + 1)
        return self._groups[g]

    def host_pieces(self, layer: int) -> tuple:
        """Layer ``layer``'s rows of every chunk as JAX arrays in host memory ([1, 2, C, Hkv, hd]
        each), for a layer program that copies them itself (``EngineConfig.prefix_copy``
        "in_program"): the pinned aliases on a GPU; elsewhere (the CPU backend, or an
        alias that could not be made) ``device_put`` of the numpy view to host memory, zero-copy
        on the CPU backend too (the chunk's own buffer). Either way the arrays read the chunks'
        memory without keeping the chunks alive: the chunks must outlive the programs that read
        them (this source holds them during :func:`run`; the store pins a request's hit chunks
        until it finishes)."""
        if self._singles is None:
            self._singles = [_chunk_pieces(c) for c in self.chunks]
        return tuple(p if isinstance(p, jax.Array) else jax.device_put(p, memory.host_sharding())
                     for p in (c.pieces(layer)[0] for c in self._singles))



@functools.cache
def layer_index(l: int) -> jax.Array:
    """int32 [] device scalar ``l``, made once: a fresh ``jnp.int32(l)`` per layer is a small host
    copy that blocks Python until the compute already queued is done, which would stop a driver
    from running ahead of the GPU."""
    return memory.to_device(np.int32(l))
