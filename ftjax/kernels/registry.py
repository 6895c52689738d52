"""Which implementation each kernel-backed op runs: the kernel registry and the kernel config.

**Registry.** Every Pallas kernel module registers its kernel here (:func:`register`, at import)
with the plain-JAX reference it must match, where it applies, whether ``auto`` picks it on a GPU
and which other kernels it needs. The modules of this package are imported on the first look-up
(:func:`kernels`), so a new kernel is one new module plus its call site.

**Config.** Which kernels run is a :class:`KernelConfig`: a frozen field of ``EngineConfig``
(``EngineConfig.kernels``), carried in the static options of every compiled step, so it is part
of every program's key: two configs never share a program. While a step is traced, the step makes
its config the active one (:func:`using`); the ops ask :func:`mode` for their choice. Nothing here
reads the environment. Outside any step (a test tracing ``model.forward`` itself) the default
config applies: ``auto``.

``KernelConfig.use``:

* ``"auto"`` (default): the Pallas kernel on a GPU where it supports the operands and its entry
  says ``auto``; the jnp reference everywhere else (on the CPU every op keeps its jnp code, so the
  exactness tests of the model are unchanged).
* ``"xla"``: the jnp reference everywhere.
* ``"interpret"``: every kernel in Pallas interpret mode (any backend; CPU tests of the wiring).
* a tuple of kernel names: only those kernels, compiled on a GPU and interpreted elsewhere.
* ``"auto+a+b-c"``: auto's choices, plus kernels ``a`` and ``b`` as if named (compiled on a GPU, interpreted
  elsewhere, wherever they support the operands) and without kernel ``c`` (its reference everywhere): one
  kernel added to or taken from the default, the A/B a sweep runs. Stored with the names sorted, so
  ``"auto-c+b+a"`` keys the same programs.

What ran is recorded per trace (:func:`recording`): the engine reports a named kernel that applied
to none of its programs (:meth:`KernelConfig.check_applied`), so a run that asks for a kernel that
cannot apply says so.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib
import numbers
import pkgutil
import re
from typing import Callable

import jax

#: Values of ``KernelConfig.use`` besides a tuple of kernel names.
USES = ("auto", "xla", "interpret")
#: ``KernelConfig.grouped_matmul``: the prefill expert matmul (``ftjax.kernels.grouped_matmul``).
GROUPED_MATMULS = ("auto", "mgpu", "xla")
#: ``KernelConfig.flash_prefill``: the flash attention of prefill (``ftjax.kernels.flash_prefill``).
FLASH_PREFILLS = ("auto", "pallas", "mgpu")
#: ``KernelConfig.slot_order``: how the slot table finds the slots misses take
#: (``ftjax.experts.slot_table``; every one gives the same table).
SLOT_ORDERS = ("auto", "sort", "lexsort", "top_k", "rank")
#: ``KernelConfig.decode_gemm``: which GEMMs XLA uses in decode programs on a GPU
#: (``ftjax.runtime.programs.decode_compiler_options``).
DECODE_GEMMS = ("auto", "xla", "cublas")
#: ``KernelConfig.decode_graphs``: decode programs on a GPU as CUDA graphs whose loops stay on the
#: device (``ftjax.runtime.programs.decode_graphs_on``).
DECODE_GRAPHS = ("auto", "on", "off")
#: ``KernelConfig.decode_loop``: how the loop of ``Engine.generate``'s decode blocks ends
#: (``ftjax.runtime.step.decode_block``): "fixed" runs ``decode_block`` iterations (a trip count XLA knows;
#: those past the block's limit or after every row stopped run idle), "dynamic" stops at the limit or once every
#: row stopped (its predicate read back to the host each step); "auto": on a GPU, fixed for the full blocks
#: of a generate without EOS ids, dynamic for the others and on the CPU (``ftjax.runtime.step.fixed_loop``).
#: The serving scheduler's blocks keep "dynamic": a block run ahead ends at no step when a row stopped in the
#: block before.
DECODE_LOOPS = ("auto", "fixed", "dynamic")
#: ``KernelConfig.miss_copy``: how a layer's cache misses reach their slots (``ftjax.experts.fetch.fetch_experts``):
#: "kernel": ``ftjax.experts.slot_copy``'s CUDA kernel, every miss read from the pinned host bank straight into its
#: slot in one launch (a GPU with nvcc; an error elsewhere); "xla": XLA's loop of host reads into a temporary and
#: slot writes (``KernelConfig.fetch_group`` per iteration); "auto": the kernel on one CUDA GPU where it builds and
#: the banks are whole, else XLA's loop (experts split over devices keep the loop: not measured there). The same
#: pools either way; offload decode 1.12-1.16x faster with the kernel on an H100 (2026-12-06, docs/PROFILE.md).
MISS_COPIES = ("auto", "kernel", "xla")


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One registered kernel.

    name: the name ``KernelConfig.use`` lists; reference: the dotted name of the plain-JAX function
    it must match (tests compare them); applies: where it runs (op, shapes, dtypes); auto: whether
    ``use="auto"`` picks it on a GPU (False: measured no faster, by name only); needs: kernels that
    must be selected with it (it reads their outputs or layouts); tiles: parses a tile override
    (a tuple of ints) into the keyword arguments of the kernel, raising ValueError for a bad one,
    or None when the kernel has no tiles.
    """

    name: str
    reference: str
    applies: str
    auto: bool = True
    needs: tuple[str, ...] = ()
    tiles: Callable[[tuple[int, ...]], dict] | None = None


_KERNELS: dict[str, Kernel] = {}
_DISCOVERED = False


def register(kernel: Kernel) -> Kernel:
    """Adds ``kernel`` to the registry (called by each kernel module at import); returns it.
    Raises:
      ValueError: another kernel of that name is registered."""
    old = _KERNELS.get(kernel.name)
    if old is not None and old != kernel:
        raise ValueError(f"kernel {kernel.name!r} is registered twice")
    _KERNELS[kernel.name] = kernel
    return kernel


def kernels() -> dict[str, Kernel]:
    """Every registered kernel by name (imports this package's modules on the first call)."""
    global _DISCOVERED
    if not _DISCOVERED:
        import ftjax.kernels as pkg
        for info in pkgutil.iter_modules(pkg.__path__):
            importlib.import_module(f"{pkg.__name__}.{info.name}")
        _DISCOVERED = True
    return dict(_KERNELS)


def names() -> tuple[str, ...]:
    """Names of the registered kernels, sorted."""
    return tuple(sorted(kernels()))


def get(name: str) -> Kernel:
    """The registered kernel ``name``.
    Raises:
      ValueError: no such kernel (the message lists the known ones)."""
    known = kernels()
    if name not in known:
        raise ValueError(f"unknown kernel {name!r}; expected one of {', '.join(sorted(known))}")
    return known[name]


def _known(field: str, name) -> Kernel:
    """:func:`get` for a name given in ``KernelConfig.<field>``: its error names the field."""
    try:
        return get(name)
    except ValueError as err:
        raise ValueError(f"KernelConfig.{field}: {err}") from None


def _tile_entries(tiles) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """``KernelConfig.tiles`` (pairs or a dict) as sorted (kernel name, integers) pairs.
    Raises:
      ValueError: not pairs of a name and a sequence of integers (the message names the field)."""
    try:
        items = list(tiles.items() if isinstance(tiles, dict) else tiles)
        out = []
        for n, t in items:
            vals = tuple(t)
            if isinstance(t, (str, bytes)) or not all(isinstance(v, numbers.Integral) and not isinstance(v, bool)
                                                      for v in vals):
                raise TypeError
            out.append((str(n), tuple(int(v) for v in vals)))
    except (TypeError, ValueError):
        raise ValueError(f"KernelConfig.tiles: expected (kernel name, integers) pairs or a dict of them, "
                         f"got {tiles!r}") from None
    return tuple(sorted(out))


def auto_delta(use) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(added, removed) kernel names of a ``KernelConfig.use`` of the form ``"auto+a+b-c"`` (each sorted), or None
    for any other value ("auto" itself included).
    Raises:
      ValueError: a term without a name, or a name both added and removed (the message names the field)."""
    if not isinstance(use, str) or not use.startswith("auto") or use == "auto" or use[4] not in "+-":
        return None  # a list (unhashable) never reaches the cache
    return _auto_delta(use)


@functools.lru_cache(maxsize=256)
def _auto_delta(use: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    terms = re.findall(r"([+-])([^+-]*)", use[4:])
    if "".join(sign + n for sign, n in terms) != use[4:] or any(not n.strip() for _, n in terms):
        raise ValueError(f"KernelConfig.use: expected auto followed by +name or -name terms, got {use!r}")
    added = {n.strip() for sign, n in terms if sign == "+"}
    removed = {n.strip() for sign, n in terms if sign == "-"}
    if added & removed:
        raise ValueError(f"KernelConfig.use: {', '.join(sorted(added & removed))} both added and removed in {use!r}")
    return tuple(sorted(added)), tuple(sorted(removed))


def _choice(field: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"KernelConfig.{field}: unknown value {value!r}; expected one of {', '.join(choices)}")


#: The most misses ``ftjax.experts.fetch.fetch_experts`` copies per iteration of its loop
#: (``KernelConfig.fetch_group`` unset).
#: Measured on an H200 (2026-12-04, ``experiments/bench_miss_copy.py``; 8 misses x 48 layers of qwen3-30b-a3b
#: experts): groups of 1, 2, 4 and 8 all moved 43-45 GB/s, 0.82-0.86x of one contiguous copy, within each
#: other's spread (48 layers: 45.18 GB/s at 1, 45.27 at 8), while each copy per iteration adds compile time;
#: so one copy per iteration. The host reads themselves are the limit (0.89-0.91x of the same experts put
#: one by one outside a program).
FETCH_GROUP = 1
#: Thread blocks per miss of the prefetch's copies on the slot-copy kernel's own stream
#: (``KernelConfig.prefetch_blocks`` unset): at the kernel's in-stream 64, four misses' blocks kept a stand-in layer's
#: kernels from running beside the copy; at 2-8 the copy hid 0.94-1.11 of the shorter part at 46-48 GB/s (H100,
#: 2026-12-07, ``overlap/probe_copy_stream_h100_2026-12-07_copies-4_blocks-*.json``). In the engine (16-layer
#: qwen3.5-35b-a3b, 512 slots, 1.7 guessed misses a layer, H100, 2026-12-07) the copies at 4 ran ~33 GB/s.
PREFETCH_BLOCKS = 4
#: The most thread blocks per miss a slot-copy call may ask for, in the step's stream or the prefetch's
#: (``ftjax.experts.slot_copy.MAX_BLOCKS_PER_MISS`` is this bound): well past any row's need (a qwen3-30b-a3b gate_up
#: row, 6.3 MB, needs 384 blocks of 16 KB passes, and the kernel launches no more than a row needs), far below the
#: int the CUDA side casts it to.
MAX_PREFETCH_BLOCKS = 65535


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Kernel and program choices of an engine (``EngineConfig.kernels``). Frozen and hashable: it
    keys every compiled program. Validated on creation.

    Attributes:
      use: "auto" | "xla" | "interpret" | a tuple of kernel names (:func:`names`; a comma-separated
        string is accepted and stored as a tuple) | "auto+a-b" (auto with kernel a added and b taken away;
        stored with its terms sorted, added first): which kernels run (module docstring).
      tiles: tile overrides, ``((kernel name, (ints...)), ...)`` (a dict is accepted); each kernel's
        entry parses its own (e.g. dense_decode: block_k, block_n, num_warps, k_split). Tiles of
        ``dense_decode`` that do not fit a call's operands (where its default tiles would) raise ValueError
        at trace time; ``moe_decode`` runs the reference for operands its tiles do not fit.
      grouped_matmul: one of :data:`GROUPED_MATMULS`: on a GPU the ``grouped_matmul_triton`` kernel where
        ``use`` selects it (auto: 256 experts or more) and else the Mosaic GPU kernel where it runs ("auto"),
        the Mosaic kernel always ("mgpu"; an error where it cannot run) or ``ragged_dot`` ("xla").
      flash_prefill: one of :data:`FLASH_PREFILLS`: jax's Mosaic GPU attention for the calls whose rows all
        start at 0 on a Hopper GPU and the Pallas flash kernel for the others ("auto"), the Pallas kernel
        always ("pallas"), or the Mosaic kernel where it serves and the jnp attention elsewhere ("mgpu").
      slot_order: one of :data:`SLOT_ORDERS`: the slot table's eviction-order implementation
        ("auto": "rank" on an accelerator up to ``slot_table.RANK_MAX_SLOTS`` slots, "top_k" above,
        "sort" on the CPU).
      min_dot_rows: rows a dense projection pads a smaller matmul to (``ftjax.layers.common.project``);
        None: 4 on a GPU, 0 (no padding) elsewhere.
      decode_gemm: one of :data:`DECODE_GEMMS`.
      decode_graphs: one of :data:`DECODE_GRAPHS`.
      decode_loop: one of :data:`DECODE_LOOPS` (the same tokens either way; "fixed" measured 1.11x decode
        tokens/s on an H100, 2026-12-06, and costs the idle iterations of a block an EOS ends; "auto" takes it on a
        GPU only: ``ftjax.runtime.step.fixed_loop``).
      fetch_group: the most misses copied per iteration of the miss loop (``ftjax.experts.fetch.fetch_experts``;
        the pools written are the same for every value); None: :data:`FETCH_GROUP` (1, measured).
      miss_copy: one of :data:`MISS_COPIES` (XLA's loop is the only one that reads ``fetch_group``).
      prefetch_blocks: thread blocks per miss of the prefetch's copies on the slot-copy kernel's own stream
        (``EngineConfig.prefetch_guesses``; ``ftjax.experts.prefetch``; the pools written are the same for every
        value); None: :data:`PREFETCH_BLOCKS`.
    Raises:
      ValueError: an unknown choice or kernel name, a malformed tile override, or a named kernel
        without the kernels it needs (the message names the field).
    """

    use: str | tuple[str, ...] = "auto"
    tiles: tuple[tuple[str, tuple[int, ...]], ...] = ()
    grouped_matmul: str = "auto"
    flash_prefill: str = "auto"
    slot_order: str = "auto"
    min_dot_rows: int | None = None
    decode_gemm: str = "auto"
    decode_graphs: str = "auto"
    fetch_group: int | None = None
    decode_loop: str = "auto"
    miss_copy: str = "auto"
    prefetch_blocks: int | None = None

    def __post_init__(self):
        use = self.use
        delta = auto_delta(use)
        if delta is not None:
            for n in delta[0] + delta[1]:
                _known("use", n)
            for n in delta[0]:
                missing = [m for m in get(n).needs if m in delta[1] or (m not in delta[0] and not get(m).auto)]
                if missing:
                    raise ValueError(f"KernelConfig.use: kernel {n!r} needs {', '.join(missing)} selected too "
                                     f"(got {use!r})")
            use = "auto" + "".join("+" + n for n in delta[0]) + "".join("-" + n for n in delta[1])
        elif isinstance(use, str) and use not in USES:
            use = tuple(n.strip() for n in use.split(",") if n.strip())
        if isinstance(use, (list, tuple)):
            use = tuple(sorted(set(use)))
            for n in use:
                _known("use", n)
            for n in use:
                missing = [m for m in get(n).needs if m not in use]
                if missing:
                    raise ValueError(f"KernelConfig.use: kernel {n!r} needs {', '.join(missing)} selected too "
                                     f"(got {', '.join(use)})")
        elif use not in USES and delta is None:
            raise ValueError(f"KernelConfig.use: expected one of {', '.join(USES)}, kernel names or "
                             f"auto+name / auto-name terms, got {use!r}")
        object.__setattr__(self, "use", use)
        tiles = _tile_entries(self.tiles)
        for n, t in tiles:
            parse = _known("tiles", n).tiles
            if parse is None:
                raise ValueError(f"KernelConfig.tiles: kernel {n!r} has no tiles")
            try:
                parse(t)
            except ValueError as err:
                raise ValueError(f"KernelConfig.tiles: {err}") from None
        object.__setattr__(self, "tiles", tiles)
        _choice("grouped_matmul", self.grouped_matmul, GROUPED_MATMULS)
        _choice("flash_prefill", self.flash_prefill, FLASH_PREFILLS)
        _choice("slot_order", self.slot_order, SLOT_ORDERS)
        _choice("decode_gemm", self.decode_gemm, DECODE_GEMMS)
        _choice("decode_graphs", self.decode_graphs, DECODE_GRAPHS)
        _choice("decode_loop", self.decode_loop, DECODE_LOOPS)
        _choice("miss_copy", self.miss_copy, MISS_COPIES)
        rows = self.min_dot_rows
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 0):
            raise ValueError(f"KernelConfig.min_dot_rows: expected None or an integer >= 0, got {rows!r}")
        group = self.fetch_group
        if group is not None and (isinstance(group, bool) or not isinstance(group, int) or group < 1):
            raise ValueError(f"KernelConfig.fetch_group: expected None or an integer >= 1, got {group!r}")
        blocks = self.prefetch_blocks
        if blocks is not None and (isinstance(blocks, bool) or not isinstance(blocks, int)
                                   or not 1 <= blocks <= MAX_PREFETCH_BLOCKS):
            raise ValueError(f"KernelConfig.prefetch_blocks: expected None or an integer 1 to {MAX_PREFETCH_BLOCKS}, "
                             f"got {blocks!r}")

    @property
    def named(self) -> tuple[str, ...]:
        """The kernels asked for by name (empty under auto / xla / interpret; auto+name's added ones)."""
        delta = auto_delta(self.use)
        return delta[0] if delta is not None else self.use if isinstance(self.use, tuple) else ()

    def tile_args(self, name: str) -> dict | None:
        """The kernel's parsed tile override, or None for its defaults."""
        for n, t in self.tiles:
            if n == name:
                return get(name).tiles(t)
        return None

    def dot_rows(self, platform: str | None = None) -> int:
        """:attr:`min_dot_rows` resolved for ``platform`` (default: :func:`backend`)."""
        if self.min_dot_rows is not None:
            return self.min_dot_rows
        return 4 if (platform or backend()) == "gpu" else 0

    def miss_group(self) -> int:
        """:attr:`fetch_group`, or :data:`FETCH_GROUP` where unset (one default on every backend)."""
        return FETCH_GROUP if self.fetch_group is None else self.fetch_group

    def prefetch_blocks_per_miss(self) -> int:
        """:attr:`prefetch_blocks`, or :data:`PREFETCH_BLOCKS` where unset."""
        return PREFETCH_BLOCKS if self.prefetch_blocks is None else self.prefetch_blocks

    def check_applied(self, applied: set[str]) -> list[str]:
        """Notes for the kernels asked for by name that ran in none of the programs (``applied``: the
        names that ran, :func:`recording`), each saying why it could not apply."""
        return [f"kernel {n!r} was asked for but applied to no program ({get(n).applies})"
                for n in self.named if n not in applied]

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["tiles"] = {n: list(t) for n, t in self.tiles}
        d["use"] = self.use if isinstance(self.use, str) else list(self.use)
        return d


_ACTIVE: contextvars.ContextVar[KernelConfig | None] = contextvars.ContextVar("ftjax_kernels", default=None)
_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("ftjax_target_backend", default=None)
_RECORD: contextvars.ContextVar[set | None] = contextvars.ContextVar("ftjax_kernels_applied", default=None)


def active() -> KernelConfig:
    """The config of the step being traced (:func:`using`), else the default one."""
    cfg = _ACTIVE.get()
    return KernelConfig() if cfg is None else cfg


@contextlib.contextmanager
def _bound(var: contextvars.ContextVar, value):
    """Within it, ``var`` holds ``value`` (yielded); the old value is back after it."""
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)


def using(config: KernelConfig):
    """Within it, :func:`mode` and the other readers answer for ``config``. A jitted step enters it
    with the config from its static options, so the choice is part of the program's key.
    Raises:
      TypeError: ``config`` is not a :class:`KernelConfig`."""
    if not isinstance(config, KernelConfig):
        raise TypeError(f"expected a KernelConfig, got {type(config).__name__}")
    return _bound(_ACTIVE, config)


def backend() -> str:
    """The backend the kernel choices are made for: jax's default backend ("cpu", "gpu", ...), or the one
    :func:`lowering_for` names."""
    return _TARGET.get() or jax.default_backend()


def lowering_for(platform: str):
    """Within it, every kernel choice (:func:`mode`, :func:`backend`) is made as on ``platform`` ("gpu"):
    a program traced here and lowered with ``lowering_platforms=("cuda",)`` holds the GPU's kernels, so
    its size and lowering time can be measured on a machine without that backend
    (``experiments/lower_programs.py``). Nothing compiled inside it can run on this machine. It applies to what
    is traced inside it: jax's trace cache does not key on it, so clear jax's caches (``jax.clear_caches()``)
    before lowering a function already traced here, and after, before calling it here again.
    Raises:
      ValueError: ``platform`` is not "cpu", "gpu" or "tpu"."""
    if platform not in ("cpu", "gpu", "tpu"):
        raise ValueError(f"lowering_for: expected 'cpu', 'gpu' or 'tpu', got {platform!r}")
    return _bound(_TARGET, platform)


def recording():
    """Collects the names of the kernels that :func:`mode` selected (not "xla") while traced inside
    it: yields the set, filled as tracing goes."""
    return _bound(_RECORD, set())


def mode(name: str, supported: bool = True, auto: bool | None = None, record: bool = True) -> str:
    """How op ``name`` runs in the function being traced: "xla", "gpu" or "interpret".

    supported: whether the kernel handles these operands (shapes, dtypes); an unsupported case
    runs the reference, except under "interpret" where the caller's own check decides. auto:
    whether ``use="auto"`` picks it for these operands on a GPU (default: the registry entry's).
    record: count a choice other than "xla" as the kernel applying (:func:`recording`); False for a
    look-ahead whose caller runs the kernel only later, through another call of this function, if at all.
    Raises:
      ValueError: unknown kernel name.
    """
    entry = get(name)
    config = active()
    use, delta = config.use, auto_delta(config.use)
    on_gpu = backend() == "gpu"
    if use == "xla" or not supported:
        how = "xla"
    elif use == "interpret":
        how = "interpret"
    elif name in config.named:  # a tuple's names and auto+name's added ones
        how = "gpu" if on_gpu else "interpret"
    elif use == "auto" or (delta is not None and name not in delta[1]):  # auto's own choice
        how = "gpu" if on_gpu and (entry.auto if auto is None else auto) else "xla"
    else:  # not named, or taken away by auto-name
        how = "xla"
    seen = _RECORD.get()
    if record and seen is not None and how != "xla":
        seen.add(name)
    return how


def tiles(name: str, defaults: dict) -> dict:
    """``defaults`` updated with the active config's tile override of kernel ``name`` (a new dict)."""
    got = active().tile_args(name)
    return {**defaults, **(got or {})}


def tiles_overridden(name: str) -> bool:
    """Whether the active config overrides kernel ``name``'s tiles."""
    return active().tile_args(name) is not None
