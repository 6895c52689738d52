"""Shared pieces of the GPU scripts: run metadata, H2D bandwidth, medians, JSON output.

Every script writes one JSON file through :func:`write_json`, the one result writer: ``meta``
(git commit, device, jax version, date, host), the script's ``flags``, the measured host-to-device
bandwidth ``B_P`` of that run, its figures, and per run the engine config
(``Engine.describe()``). One naming throughout: ``ttft_s``, ``tpot_s`` (a :func:`spread` of
per-step seconds), ``tokens_per_s``, ``bytes_h2d``, ``hit_rate``. ``experiments/plots.py`` draws a
PNG from any of these files. Absolute times on shared machines are noisy, so scripts report
medians, spreads and ratios measured in the same run.

Flags shared by the scripts: :func:`define_kernel_flags` gives a script ``ftjax.generate``'s kernel
flags (``--kernels``, ``--kernel_tiles``, ``--grouped_matmul``, ``--flash_prefill``, ``--slot_order``,
``--min_dot_rows``, ``--decode_gemm``, ``--decode_graphs``, ``--decode_loop``, ``--fetch_group``, ``--miss_copy``) and
:func:`kernel_config` the ``KernelConfig`` they say, passed into each engine (``EngineConfig.kernels``; nothing reads
the environment). Bad user input stops a script with one line and exit status 1: parse-time checks of a
flag (:func:`validate`, :func:`check_names`, :func:`check_numbers`: ``FATAL Flags parsing error:
...``) or ``app.UsageError`` raised in ``main`` under :func:`run` (``error: ...``). :func:`run` also gives
every script ``--compilation_cache_dir`` (JAX's persistent compilation cache, on by default:
``ftjax.compile_cache``).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import sys
import time
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ftjax import memory
from ftjax.provenance import run_meta

#: The transformers-made test fixtures (tests/fixtures/, each with expected.npz), read by the GPU checks.
FIXTURES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures")


# ---- flags and bad input -------------------------------------------------------------------
#: Flags that name a folder a script writes into (checked by :func:`guard` before ``main`` runs).
OUTPUT_DIR_FLAGS = ("out_dir", "hlo_dir", "trace_dir")


def check_output_dirs(names=OUTPUT_DIR_FLAGS) -> None:
    """Checks, before anything runs, that each folder flag of ``names`` the script defines and sets can
    be written: an existing folder, or one that can be made under its nearest existing parent.
    Raises:
      app.UsageError: ``--NAME=PATH: ...`` (a file, or a parent that is not a writable folder)."""
    from absl import app, flags
    for name in names:
        value = flags.FLAGS[name].value if name in flags.FLAGS else None
        if not value:
            continue
        path = os.path.abspath(value)
        parent = path
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            what = "is a file" if parent == path else f"cannot be made: {parent} is a file"
            raise app.UsageError(f"--{name}={value}: expected a folder, but it {what}")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise app.UsageError(f"--{name}={value}: {parent} is not writable")


def guard(main: Callable) -> Callable:
    """``main`` after :func:`check_output_dirs`, where an ``app.UsageError`` (bad user input found after
    the flags parsed) prints one line, ``error: <message>``, and exits with status 1 (absl would print
    the whole module docstring and flag help)."""
    from absl import app

    def guarded(argv):
        try:
            check_output_dirs()
            return main(argv)
        except app.UsageError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(1)
    return guarded


def run(main) -> None:
    """``app.run(main)`` under :func:`guard` (bad input: one ``error:`` line, status 1), with
    ``--compilation_cache_dir`` defined for the script: JAX's persistent compilation cache is on before
    ``main`` runs (``ftjax.compile_cache``: ``~/.cache/ftjax/jax`` by default; empty: off)."""
    from absl import flags

    from ftjax import absl_app, compile_cache
    compile_cache.define_flag(module_name=_caller_module(1))
    guarded = guard(main)

    def cached(argv):
        from absl import logging
        if logging.get_verbosity() == logging.INFO:  # absl's default: hide JAX's backend probing notes
            logging.set_verbosity(logging.WARNING)
        compile_cache.configure(flags.FLAGS.compilation_cache_dir)
        return guarded(argv)
    absl_app.run(cached)


def validate(name: str, check: Callable[[Any], str | None]) -> None:
    """A parse-time check of flag ``name``: ``check(value)`` returns an error message or None. A bad value
    stops the script before anything runs, with one line (``FATAL Flags parsing error: ...``), status 1."""
    from absl import flags

    def checker(value):
        msg = check(value)
        if msg:
            raise flags.ValidationError(msg)
        return True
    flags.register_validator(name, checker)


def check_names(name: str, choices, allow_empty: bool = False) -> None:
    """Parse-time check that list flag ``name`` holds only names of ``choices`` (and at least one,
    unless ``allow_empty``); None (an unset flag without a default) passes."""
    choices = tuple(choices)

    def check(values):
        if values is None:
            return None
        bad = [v for v in values if v not in choices]
        if bad:
            return f"unknown {', '.join(map(repr, bad))}; expected some of {', '.join(choices)}"
        if not values and not allow_empty:
            return f"give at least one of {', '.join(choices)}"
        return None
    validate(name, check)


def check_numbers(name: str, kind: type = int, low: float | None = None, high: float | None = None,
                  allow_empty: bool = False) -> None:
    """Parse-time check that list flag ``name`` holds numbers of ``kind`` (int or float) in [low, high]
    (and at least one, unless ``allow_empty``); None passes."""
    what = "integers" if kind is int else "numbers"

    def check(values):
        if values is None:
            return None
        try:
            xs = [kind(v) for v in values]
        except ValueError:
            return f"expected {what}, got {','.join(values)}"
        if not xs and not allow_empty:
            return f"give at least one value ({what})"
        if any(x != x or x in (float("inf"), float("-inf")) for x in xs):  # float("nan") and "inf" parse
            return f"expected finite {what}, got {','.join(values)}"
        if any((low is not None and x < low) or (high is not None and x > high) for x in xs):
            bounds = " and ".join(b for b in (f">= {low:g}" if low is not None else "",
                                              f"<= {high:g}" if high is not None else "") if b)
            return f"expected {what} {bounds}, got {','.join(values)}"
        return None
    validate(name, check)


def check_choice(name: str, choices) -> None:
    """Parse-time check that string flag ``name`` is one of ``choices`` (None passes)."""
    choices = tuple(choices)
    validate(name, lambda v: None if v is None or v in choices else
             f"unknown {v!r}; expected one of {', '.join(choices)}")


def check_preset(name: str = "preset", allow_empty: bool = False) -> None:
    """Parse-time check that flag ``name`` names a preset of ``ftjax.config.PRESETS`` (a list flag: each;
    ``allow_empty``: an empty string passes, for a flag whose preset is optional)."""
    from ftjax.config import PRESETS

    def check(v):
        if allow_empty and v == "":
            return None
        bad = [x for x in ([v] if isinstance(v, str) else v or []) if x not in PRESETS]
        return f"unknown preset {', '.join(map(repr, bad))}; known: {', '.join(PRESETS)}" if bad else None
    validate(name, check)


#: The kernel flags of :func:`define_kernel_flags` (``ftjax.generate``'s), each a ``KernelConfig`` field
#: (``kernels`` is ``KernelConfig.use``, ``kernel_tiles`` its ``tiles``).
KERNEL_FLAGS = ("kernels", "kernel_tiles", "grouped_matmul", "flash_prefill", "slot_order", "min_dot_rows",
                "decode_gemm", "decode_graphs", "decode_loop", "fetch_group", "miss_copy", "prefetch_blocks")
#: Environment variables that chose kernels before ``KernelConfig``: nothing reads them now.
STALE_ENV = {"FTJAX_KERNELS": "--kernels", "FTJAX_DENSE_DECODE_TILES": "--kernel_tiles=dense_decode:...",
             "FTJAX_MOE_DECODE_TILES": "--kernel_tiles=moe_decode:...", "FTJAX_GROUPED_MATMUL": "--grouped_matmul",
             "FTJAX_FLASH_PREFILL": "--flash_prefill", "FTJAX_MIN_DOT_ROWS": "--min_dot_rows"}
_DEFINED_KERNEL_FLAGS: list[str] = []
_NOTED_ENV = False


def _caller_module(depth: int) -> str:
    """absl's name of the module ``depth`` frames up (the running script is keyed by its path)."""
    name = sys._getframe(depth + 1).f_globals.get("__name__", "")
    return sys.argv[0] if name == "__main__" else name


def parse_tiles(entries) -> dict:
    """``--kernel_tiles`` entries ``name:int/int/...`` as ``KernelConfig.tiles`` ({name: ints}).
    Raises:
      ValueError: a malformed entry."""
    tiles = {}
    for entry in entries or ():
        name, sep, ints = entry.partition(":")
        try:
            if not sep or not name.strip():
                raise ValueError
            tiles[name.strip()] = tuple(int(v) for v in ints.split("/"))
        except ValueError:
            raise ValueError(f"--kernel_tiles entry {entry!r}: expected name:int/int/... "
                             "(e.g. dense_decode:64/128/0/0)") from None
    return tiles


def define_kernel_flags(skip: tuple[str, ...] = (), multi_use: bool = False) -> None:
    """Defines ``ftjax.generate``'s kernel flags (:data:`KERNEL_FLAGS` less ``skip``: the choices a script
    sweeps itself) as flags of the calling script (so its JSON's ``flags`` lists them), checked when the
    flags are parsed. ``multi_use``: ``--kernels`` may be repeated, one run of everything per value
    (``FLAGS.kernels`` is then a list, default [] = auto). :func:`kernel_config` builds the config."""
    from absl import flags

    from ftjax.kernels.registry import (DECODE_GEMMS, DECODE_GRAPHS, DECODE_LOOPS, FLASH_PREFILLS, GROUPED_MATMULS,
                                        MAX_PREFETCH_BLOCKS, MISS_COPIES, SLOT_ORDERS)
    from ftjax.engine_flags import MISS_COPY_HELP, PREFETCH_BLOCKS_HELP
    unknown = set(skip) - set(KERNEL_FLAGS)
    if unknown:
        raise ValueError(f"unknown kernel flags {sorted(unknown)}")
    mod = {"module_name": _caller_module(1)}
    use_help = ("Pallas kernels to run: auto (each where it applies and was measured faster: on a GPU), xla (the "
                "plain-JAX references everywhere), interpret (every kernel in Pallas interpret mode), a comma "
                "list of kernel names (ftjax.kernels.registry.names(); KernelConfig.use), or auto with kernels "
                "added or taken away (auto+gated_deltanet_decode, auto-grouped_swiglu_triton).")
    defs = {
        "kernels": lambda: (flags.DEFINE_multi_string("kernels", [], use_help + " Repeat the flag to run everything "
                                                      "once per value, in this process (an A/B of kernel choices); "
                                                      "none: auto.", **mod) if multi_use else
                            flags.DEFINE_string("kernels", "auto", use_help, **mod)),
        "kernel_tiles": lambda: flags.DEFINE_list(
            "kernel_tiles", [], "Tile overrides, name:ints with the ints separated by '/', e.g. "
            "dense_decode:64/128/0/0,moe_decode:64/64/0/0 (KernelConfig.tiles).", **mod),
        "grouped_matmul": lambda: flags.DEFINE_enum(
            "grouped_matmul", "auto", list(GROUPED_MATMULS), "The prefill expert matmul: on a GPU the "
            "grouped_matmul_triton kernel where --kernels selects it (auto: 256 experts or more), else the Mosaic GPU "
            "kernel where it runs (auto); the Mosaic kernel always (mgpu); or ragged_dot (xla) "
            "(KernelConfig.grouped_matmul).", **mod),
        "flash_prefill": lambda: flags.DEFINE_enum(
            "flash_prefill", "auto", list(FLASH_PREFILLS), "Flash attention of prefill, where --kernels selects "
            "flash_prefill (auto: on a GPU): jax's Mosaic GPU attention for calls starting at 0 on a Hopper GPU and "
            "the Pallas kernel for the others (auto), the Pallas kernel always (pallas), or the Mosaic kernel and "
            "the jnp attention elsewhere (mgpu) (KernelConfig.flash_prefill).", **mod),
        "slot_order": lambda: flags.DEFINE_enum(
            "slot_order", "auto", list(SLOT_ORDERS), "How the slot table finds the slots misses take (every one "
            "gives the same table; auto: rank on an accelerator, sort on the CPU; KernelConfig.slot_order).", **mod),
        "min_dot_rows": lambda: flags.DEFINE_integer(
            "min_dot_rows", None, "Rows a one-row dense projection is padded to (default 4 on a GPU, 0 elsewhere; "
            "KernelConfig.min_dot_rows).", lower_bound=0, **mod),
        "fetch_group": lambda: flags.DEFINE_integer(
            "fetch_group", None, "The most cache misses copied per iteration of a layer's miss loop (default 1 "
            "everywhere: larger groups measured no faster on an H200; KernelConfig.fetch_group).", lower_bound=1,
            **mod),
        "miss_copy": lambda: flags.DEFINE_enum("miss_copy", "auto", list(MISS_COPIES), MISS_COPY_HELP, **mod),
        "prefetch_blocks": lambda: flags.DEFINE_integer(
            "prefetch_blocks", None, PREFETCH_BLOCKS_HELP, lower_bound=1, upper_bound=MAX_PREFETCH_BLOCKS, **mod),
        "decode_gemm": lambda: flags.DEFINE_enum(
            "decode_gemm", "auto", list(DECODE_GEMMS), "GEMMs of the decode programs on a GPU: xla, cublas, or auto "
            "(KernelConfig.decode_gemm).", **mod),
        "decode_graphs": lambda: flags.DEFINE_enum(
            "decode_graphs", "auto", list(DECODE_GRAPHS), "Decode programs on a GPU as CUDA graphs: on, off, or auto "
            "(KernelConfig.decode_graphs).", **mod),
        "decode_loop": lambda: flags.DEFINE_enum(
            "decode_loop", "auto", list(DECODE_LOOPS), "How the loop of a generate's decode block ends: fixed "
            "(decode_block iterations, a trip count XLA knows), dynamic, or auto = on a GPU fixed for the full "
            "blocks of a generate without EOS ids, else dynamic (KernelConfig.decode_loop).", **mod),
    }
    names = [n for n in KERNEL_FLAGS if n not in skip]
    for n in names:
        defs[n]()
    _DEFINED_KERNEL_FLAGS[:] = names

    def check_use(uses):
        from ftjax.kernels.registry import KernelConfig
        for use in (uses or ["auto"]) if isinstance(uses, list) else [uses]:
            try:
                KernelConfig(use=use)
            except ValueError as e:
                return str(e)
        return None

    def check_tiles(entries):
        from ftjax.kernels.registry import KernelConfig
        try:
            KernelConfig(tiles=parse_tiles(entries))
        except ValueError as e:
            return str(e)
        return None
    if "kernels" in names:
        validate("kernels", check_use)
    if "kernel_tiles" in names:
        validate("kernel_tiles", check_tiles)


def _kernel_config(values: dict, use=None, **override):
    from ftjax.kernels.registry import KernelConfig
    fields = {"use": use if use is not None else values.get("kernels", "auto"),
              "tiles": parse_tiles(values.get("kernel_tiles"))}
    for n in KERNEL_FLAGS[2:]:  # the flags named as their KernelConfig fields
        if n in values:
            fields[n] = values[n]
    if isinstance(fields["use"], list):  # the repeated flag, no value picked: auto
        fields["use"] = "auto"
    fields.update(override)
    return KernelConfig(**fields)


def kernel_config(use=None, **override):
    """The ``KernelConfig`` of the script's kernel flags (:func:`define_kernel_flags`; a skipped flag keeps
    its default): ``use`` replaces ``--kernels`` (one value of a repeated flag), ``override`` other fields
    (e.g. ``decode_graphs="off"`` of a script's own variant). The first call notes on stderr any
    ``FTJAX_*`` variable of :data:`STALE_ENV` that is set: nothing reads them any more.
    Raises:
      app.UsageError: an invalid config (a bad override)."""
    global _NOTED_ENV
    from absl import app, flags
    if not _NOTED_ENV:
        _NOTED_ENV = True
        for var, flag in STALE_ENV.items():
            if os.environ.get(var):
                print(f"note: {var}={os.environ[var]} is ignored (nothing reads it any more); use {flag}",
                      file=sys.stderr, flush=True)
    values = {n: flags.FLAGS[n].value for n in _DEFINED_KERNEL_FLAGS}
    try:
        return _kernel_config(values, use, **override)
    except ValueError as e:
        raise app.UsageError(str(e)) from None


def kernel_flag_args() -> list[str]:
    """The kernel flags given on the command line, as arguments for a child process of the script."""
    from absl import flags
    return [flags.FLAGS[n].serialize() for n in _DEFINED_KERNEL_FLAGS if flags.FLAGS[n].present]


def engine_programs(engine, fn_name: str | None = None):
    """Yields (step name, static options dict, argument signatures, executable) of the compiled programs
    ``engine`` ran or compiled (``engine.programs.keys``), as ``ftjax.runtime.programs.compiled_programs``
    does for all of them, in compile order; ``fn_name`` (e.g. "forward_step", "layer_program") filters.
    The shared cache outlives engines: filtering by engine keeps another engine's programs (another
    kernel config, say) out."""
    from ftjax.runtime import programs
    mine = engine.programs.keys
    for key, entry in list(programs._COMPILED.items()):
        if key in mine and (fn_name is None or key[0] == fn_name):
            yield key[0], {**dict(key[1]), "compiler_options": dict(key[3]), "kernels": sorted(entry.kernels)}, \
                key[2], entry.executable


def scan_executable(engine, plan, tokens, start, valid, cache, prefix=()):
    """The compiled layer-scan program (``ftjax.runtime.step.forward_step``) of one call of ``engine``
    planned as ``plan`` (``engine.planner.plan(...)``, driver "scan") on these arguments: what
    ``engine._run(plan, tokens, start, valid, cache, prefix)`` runs (compiled here if it is not yet;
    nothing runs).
    Raises:
      ValueError: a plan for the layer-pipelined driver (one program per layer, not one)."""
    from ftjax.runtime import drivers
    from ftjax.runtime.step import forward_step
    if plan.driver != "scan":
        raise ValueError(f"a {plan.driver} call is not one program")
    ctx = engine._context()
    a = drivers.CallArgs(np.asarray(tokens, np.int32), np.asarray(start, np.int32), np.asarray(valid, np.int32),
                         cache, engine.state, tuple(prefix))
    args = (ctx.params, ctx.banks, a.cache, a.state, a.tokens, a.start, a.valid, a.prefix)
    return ctx.compile(forward_step, args, compiler_options=plan.compiler_options, cfg=ctx.cfg, opts=plan.opts)


def device_bytes_in_use() -> int:
    """Bytes in use in the default device's memory now: its allocator's ``bytes_in_use`` where the
    backend reports ``memory_stats`` (GPU), else the bytes of the live arrays in device memory (not
    those in pinned host memory; the CPU). After an engine is deleted and collected this is what the
    next run starts from: a figure that grows from one run to the next is memory an engine kept."""
    stats = memory.default_device().memory_stats()
    if stats and "bytes_in_use" in stats:
        return int(stats["bytes_in_use"])
    return sum(a.nbytes for a in jax.live_arrays() if a.sharding.memory_kind in (None, "device"))


def meta() -> dict:
    """Git commit, device name, backend, jax version, UTC date, host CPU count, Python version."""
    return run_meta()


def spread(xs) -> dict:
    """Median, 10th / 90th percentiles, min, max and count of measurements (seconds or rates);
    {} when empty."""
    xs = np.asarray([float(x) for x in xs])
    if not xs.size:
        return {}
    return {"median": float(np.median(xs)), "p10": float(np.percentile(xs, 10)), "p90": float(np.percentile(xs, 90)),
            "min": float(xs.min()), "max": float(xs.max()), "n": int(xs.size)}


def time_calls(fn, *args, repeats: int) -> dict:
    """``fn(*args)`` once (its compile seconds, ``compile_s``), then the :func:`spread` of ``repeats`` timed calls
    (``s``, seconds), each waited for with ``jax.block_until_ready``."""
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    compile_s = time.perf_counter() - t
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return {"compile_s": compile_s, "s": spread(ts)}


def rel_err(x, ref) -> float:
    """max |x - ref| / max |ref| in float64 (the kernels' error against their references)."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), 1e-30))


def script_flags() -> dict:
    """The values of the running absl app's flags (those of its main module), {} outside one."""
    from absl import flags
    main = sys.modules.get("__main__")
    try:
        return {f.name: f.value for f in flags.FLAGS.get_key_flags_for_module(main)} if main else {}
    except Exception:  # flags not parsed (imported from a test)
        return {}


def define_expert_dtypes() -> None:
    """Defines ``--expert_dtypes``: a comma list of expert storage formats to compare, checked against
    the ``ftjax.experts.formats`` registry (so a new format file is a valid choice at once)."""
    from absl import flags

    from ftjax.experts import quant
    flags.DEFINE_list("expert_dtypes", None, f"Expert storage formats to compare ({', '.join(quant.FORMATS)}); "
                      "default: the banks as built (--dtype).")
    flags.register_validator("expert_dtypes", lambda v: v is None or set(v) <= set(quant.FORMATS),
                             f"--expert_dtypes: each must be one of {', '.join(quant.FORMATS)}")


def preset_cut(preset_name: str, layers: int = 0, flag: str = "layers"):
    """A preset's config cut to its first ``layers`` layers (0: all of them; a hybrid keeps those layers' kinds).
    Raises:
      app.UsageError: ``layers`` above the preset's (``--<flag>=N: ...``, a script's one-line error)."""
    from absl import app

    from ftjax.config import preset
    cfg = preset(preset_name)
    if not layers:
        return cfg
    if layers > cfg.num_layers:
        raise app.UsageError(f"--{flag}={layers}: {preset_name} has {cfg.num_layers} layers")
    return dataclasses.replace(cfg, num_layers=layers, layer_types=cfg.layer_types[:layers])


def build_random_model(preset_name: str, dtype: str, layers: int = 0):
    """Random weights at a preset's shape cut to ``layers`` (:func:`preset_cut`); returns (cfg, model, build
    seconds, B_P dict).
    Raises:
      app.UsageError: ``layers`` above the preset's."""
    from ftjax.checkpoint import random_model
    cfg = preset_cut(preset_name, layers)
    t0 = time.perf_counter()
    model = random_model(cfg, dtype)
    model.host_down.block_until_ready()
    return cfg, model, time.perf_counter() - t0, measure_h2d()


def measure_h2d(nbytes: int = 512 * 2**20, repeats: int = 7) -> dict:
    """Host-to-device (pinned_host -> device) and device-to-host bandwidth of whole-array
    ``jax.device_put``, in GB/s (1e9 bytes/s): B_P of DESIGN.md 1.2."""
    host = jax.jit(lambda: jnp.ones((nbytes // 2,), jnp.bfloat16), out_shardings=memory.host_sharding())()
    dev_s = memory.device_sharding()
    h2d, d2h = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        x = jax.device_put(host, dev_s).block_until_ready()
        h2d.append(nbytes / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        jax.device_put(x, memory.host_sharding()).block_until_ready()
        d2h.append(nbytes / (time.perf_counter() - t) / 1e9)
        del x
    return {"bytes": nbytes, "h2d_GBps": spread(h2d[1:]), "d2h_GBps": spread(d2h[1:])}


def measure_hbm(nbytes: int = 2 << 30, repeats: int = 10) -> dict:
    """Device memory bandwidth of a large elementwise op (negate of an ``nbytes`` bfloat16 array:
    reads and writes every byte once), in GB/s (1e9 bytes/s) of bytes read + written, from the
    median of ``repeats`` timed calls after two warm-ups. Returns {bytes (read + written), us
    (spread of the call time, microseconds), GBps}."""
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    fn = jax.jit(lambda a: -a)
    for _ in range(2):
        fn(x).block_until_ready()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn(x).block_until_ready()
        ts.append((time.perf_counter() - t) * 1e6)
    us = spread(ts)
    del x
    return {"bytes": 2 * nbytes, "us": us, "GBps": 2 * nbytes / (us["median"] * 1e-6) / 1e9}


def pinned_array(shape: tuple, dtype, salt: int) -> jax.Array:
    """A pinned host array (memory kind ``pinned_host``) whose every row differs: row r, element c holds
    ``(r * 7 + c + salt) % 251`` (so a copied row can be checked against its source)."""
    def fill():
        r = jax.lax.broadcasted_iota(jnp.int32, shape, 0)
        c = jax.lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1)
        return ((r * 7 + c + salt) % 251).astype(dtype)
    return jax.jit(fill, out_shardings=memory.host_sharding())()


def timed(fn, repeats: int, warm: int = 2) -> list[float]:
    """Seconds of ``repeats`` calls of ``fn(i)`` (``i`` the call's index; each waited for with
    ``jax.block_until_ready``) after ``warm`` untimed ones."""
    out = []
    for i in range(warm + repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(i))
        if i >= warm:
            out.append(time.perf_counter() - t)
    return out


def same_arrays(a: tuple | None, b: tuple | None) -> bool | None:
    """Whether two results (tuples of arrays) are equal element for element; None when either is missing."""
    return None if a is None or b is None else all(bool(jnp.array_equal(x, y)) for x, y in zip(a, b))


def graph_options(graphs: str) -> dict:
    """The XLA compile options of a program: the cached decode step's command buffers
    (``ftjax.runtime.programs.GRAPH_DECODE_OPTIONS``) for ``on`` on a GPU, else none."""
    from ftjax.runtime import programs
    return dict(programs.GRAPH_DECODE_OPTIONS) if graphs == "on" and memory.backend() == "gpu" else {}


def hlo_op_names(text: str) -> list[str]:
    """The op name of every instruction of an HLO text, in order (``copy-start``, ``fusion``, ...)."""
    return re.findall(r"(?<=\s)([a-z][a-z0-9\-]*)\(", text)


def hlo_ops(text: str) -> dict:
    """Counts of the HLO ops that tell whether host copies are asynchronous."""
    ops: dict[str, int] = {}
    for op in hlo_op_names(text):
        if any(w in op for w in ("copy", "slice", "start", "done", "custom-call", "while")):
            ops[op] = ops.get(op, 0) + 1
    ops["host_memory_space_S(5)"] = text.count("S(5)")
    return ops


# ---- an engine's GPU programs, lowered on a machine without a GPU ---------------------------------
#: A custom call of a StableHLO module text and its target (a Triton or Mosaic GPU kernel is one).
_CUSTOM_CALL = re.compile(r"stablehlo\.custom_call @([\w$.\-]+)")


def call_tokens(fn, args) -> int | None:
    """The token count of a step call (its ``tokens`` argument's second axis: 1 for a decode step), or None for a
    step without one (a decode block)."""
    import inspect
    try:
        tokens = inspect.signature(fn).bind_partial(*args).arguments.get("tokens")
    except (TypeError, ValueError):
        return None
    return None if tokens is None or getattr(tokens, "ndim", 0) != 2 else int(tokens.shape[1])


def custom_calls(text: str) -> dict[str, int]:
    """Custom-call targets of a StableHLO module text, with their counts."""
    return dict(collections.Counter(_CUSTOM_CALL.findall(text)))


def capture_programs(engine_fn):
    """Runs ``engine_fn()`` (an engine's ``precompile``: nothing executes) while recording every program the engine
    would compile, instead of compiling it: a list of (step function, arguments, static options), one per distinct
    program, in order. Every engine of the process is recorded, not compiled, while it runs."""
    from ftjax.runtime import programs
    seen, out = set(), []
    orig = programs.Programs.compile

    def recording_compile(self, fn, args, compiler_options=(), **static):
        key = (fn.__name__,) + programs._compile_key(args, **static)
        if key not in seen:
            seen.add(key)
            out.append((fn, args, static))

    programs.Programs.compile = recording_compile
    try:
        engine_fn()
    finally:
        programs.Programs.compile = orig
    return out


def lower_for_cuda(fn, args, static, device_kind: str) -> dict:
    """Traces ``fn`` at the shapes of ``args`` with the GPU's kernel choices and lowers it for CUDA; returns
    {trace_s, lower_s, chars, lines, while_loops, custom_calls, kernels}. Needs no GPU: an abstract
    ``device_kind`` device and ``ftjax.kernels.registry.lowering_for("gpu")``; XLA's compile is not run.
    jax's caches are cleared before (a trace of ``fn`` made here earlier, e.g. under another config, would be
    reused) and after (this trace holds GPU kernels: a later call on this machine must not reuse it).
    Only a resident engine's programs: an offloading one's plan was made for this machine (e.g. its
    ``cheap_conds``), and its host-memory operands would lower as device ones (an abstract argument does not keep
    its memory kind; the resident programs read no host operand).
    Raises:
      ValueError: a program of another experts mode."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

    from ftjax.kernels import registry
    mode = getattr(static.get("opts"), "mode", "resident")
    if mode != "resident":
        raise ValueError(f"{fn.__name__}: experts mode {mode!r}; only a resident engine's programs lower here")
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x, args)
    dev = AbstractDevice(device_kind=device_kind, num_cores=132, platform="gpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Auto,), abstract_device=dev)
    jax.clear_caches()
    try:
        with registry.lowering_for("gpu"), use_abstract_mesh(mesh), registry.recording() as applied, \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the Triton backend's deprecation warning
            t0 = time.perf_counter()
            traced = fn.trace(*shapes, **static)
            t1 = time.perf_counter()
            text = traced.lower(lowering_platforms=("cuda",)).as_text()
            t2 = time.perf_counter()
    finally:
        jax.clear_caches()
    return {"trace_s": t1 - t0, "lower_s": t2 - t1, "chars": len(text), "lines": text.count("\n"),
            "while_loops": text.count("stablehlo.while"), "custom_calls": custom_calls(text),
            "kernels": sorted(applied)}


def _jsonable(o):
    """numpy arrays as lists, dataclasses (EngineConfig, ...) as dicts, anything else as its str."""
    if isinstance(o, np.ndarray):
        return o.tolist()
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        return dataclasses.asdict(o)
    return str(o)


def write_json(out_dir: str, name: str, payload: dict) -> str:
    """The one result writer: ``payload`` plus ``meta`` (when absent), its own file name and the script's ``flags``,
    written to out_dir/name atomically; returns the path."""
    payload = {**payload, "meta": payload.get("meta") or meta(), "file": name,
               "flags": {**script_flags(), **payload.get("flags", {})}}
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1, default=_jsonable)
    os.replace(tmp, path)
    return path


def table(rows: list[dict], cols: list[str]) -> str:
    """A plain text table of ``rows`` restricted to ``cols``."""
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else ("" if v is None else str(v))  # noqa: E731
    cells = [[fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]  # no rows: the header
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths))  # noqa: E731
    return "\n".join([line(cols)] + [line(r) for r in cells])
