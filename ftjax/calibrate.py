r"""Calibrate the miss split: host-to-device copy cost and CPU expert cost, alone and together.

  python -m ftjax.calibrate --preset=qwen3-30b-a3b --dtype=bfloat16
  python -m ftjax.calibrate --checkpoint=DIR --impls=callback_async,compute_on --profile=prof.json
  python -m ftjax.calibrate --preset=qwen3-30b-a3b --impls=native_async --drivers=callback,host

Source of the idea: FreeToken's bandwidth-adaptive split (DESIGN.md 1.2): ``B_P`` (host -> device
copy bandwidth) and ``B_H`` (CPU expert throughput), preferably measured while both run at once.

What is timed is the engine's own per-layer code, ``ftjax.experts.miss_policy.fetch_and_cpu``,
inside a jitted ``lax.scan`` of several layers (16; 4 with ``--quick``), so per-layer fixed costs
such as launching the copy loop or the host round trip are included, with ``n_fetch`` experts copied from the host
bank into device slots and ``n_cpu`` experts computed on the CPU by the chosen mechanism, for
the model's expert format (hidden D, expert ffn F, dtype) and ``--tokens`` tokens:

* copy alone: ``(n, 0)`` for a few n; fit ``t = alpha_p + n * beta_p`` (``B_P = b / beta_p``);
* CPU alone: ``(0, n)``; fit ``t = alpha_h + n * beta_h`` (``B_H = b / beta_h``);
* together: ``(f, c)`` with both > 0; the overlap is how much of the shorter side was hidden,
  ``(a + c - t) / min(a, c)`` clipped to [0, 1] (1 = fully parallel, 0 = serial; host-DRAM
  contention lowers it); the median over the points is used.

With ``--drivers=host`` the same points are timed as the host-split decode driver runs a layer
(``ftjax.runtime.host_split``): the fetch program dispatched, the split read back, the host kernel called
from Python, its outputs put on the device; the result is stored as mechanism ``<impl>@host``.

All times are per layer, after subtracting the ``(0, 0)`` baseline. The fit gives a
``ftjax.experts.miss_split.SplitModel`` and its split table ``F(M)``.

The profile is a JSON file (default ``~/.cache/ftjax/calibration.json``, or ``$XDG_CACHE_HOME``)
keyed by device name, expert format and tokens per call
(``"NVIDIA H200|bfloat16|D2048|F768|T1"``); each entry holds one result per CPU mechanism. Writes
are atomic (temporary file + rename) and merge with what is already there.
``ftjax.generate --miss_policy=adaptive`` reads it, or runs a quick calibration of its mechanism on
the loaded model and adds it.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ftjax import compile_cache
from ftjax.experts.fetch import miss_copy_mode
from ftjax.kernels import registry

PROFILE_VERSION = 1


class CalibrationError(ValueError):
    """An unreadable profile, or a calibration that could not run."""


# --------------------------------------------------------------------------------------------
# Profile file
# --------------------------------------------------------------------------------------------
def default_profile_path() -> str:
    """``$XDG_CACHE_HOME/ftjax/calibration.json`` (default ``~/.cache/ftjax/calibration.json``)."""
    return compile_cache.user_cache_dir("calibration.json")


def device_name() -> str:
    """Name of the first local device (e.g. "NVIDIA H200", "cpu")."""
    return jax.local_devices()[0].device_kind


def expert_format(cfg, dtype: str, bank_fmt: str = "dense", expert_bytes: int | None = None) -> dict:
    """The expert format a profile is for: hidden D, expert ffn F, dtype (the compute dtype), bytes per expert
    as stored (default dense at ``dtype``), and for quantized banks their format (``ExpertBanks.fmt``)."""
    from ftjax.checkpoint import DTYPES
    itemsize = np.dtype(DTYPES[dtype]).itemsize
    out = {"hidden": cfg.hidden_size, "expert_ffn": cfg.expert_ffn, "dtype": dtype,
           "expert_bytes": int(expert_bytes) if expert_bytes is not None else cfg.expert_bytes(itemsize)}
    if bank_fmt != "dense":
        out["bank_format"] = bank_fmt
    return out


def profile_key(device: str, fmt: dict, tokens: int) -> str:
    """``"<device>|<dtype>|D<hidden>|F<expert_ffn>|T<tokens>"``, with ``|<bank format>`` for quantized banks
    (another format moves other bytes and decodes another way): the CPU's cost per expert grows with the
    tokens per decode call (the batch), so each batch size has its own entry."""
    key = f"{device}|{fmt['dtype']}|D{fmt['hidden']}|F{fmt['expert_ffn']}|T{tokens}"
    return key + (f"|{fmt['bank_format']}" if fmt.get("bank_format", "dense") != "dense" else "")


def load_profile(path: str) -> dict:
    """The whole profile file (``{"version": 1, "entries": {key: entry}}``); empty if absent.

    Raises:
      CalibrationError: not JSON, or not a profile of this version.
    """
    if not os.path.exists(path):
        return {"version": PROFILE_VERSION, "entries": {}}
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CalibrationError(f"{path}: cannot read calibration profile ({type(e).__name__}: {e})") from None
    if not isinstance(d, dict) or d.get("version") != PROFILE_VERSION or not isinstance(d.get("entries"), dict):
        raise CalibrationError(f"{path}: not a version-{PROFILE_VERSION} ftjax calibration profile")
    return d


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v)


def check_entry(path: str, key: str, entry) -> dict:
    """Returns ``entry`` if it has the structure this module writes, else raises.

    Raises:
      CalibrationError: naming the file, the key and the first bad field.
    """
    from ftjax.experts.miss_split import SplitModel
    where = f"{path} [{key}]"
    fields = {f.name for f in dataclasses.fields(SplitModel)}
    if not isinstance(entry, dict) or not isinstance(entry.get("impls", {}), dict):
        raise CalibrationError(f"{where}: entry must be an object with an 'impls' object")
    for impl, r in entry.get("impls", {}).items():
        if not isinstance(r, dict) or not isinstance(r.get("ok"), bool):
            raise CalibrationError(f"{where}: impls.{impl} must be an object with a boolean 'ok'")
        if not r["ok"]:
            continue
        sm = r.get("split_model")
        if not isinstance(sm, dict) or set(sm) != fields:
            raise CalibrationError(f"{where}: impls.{impl}.split_model must hold exactly {sorted(fields)}, got {sm!r}")
        try:  # SplitModel checks the values: finite numbers, in range
            SplitModel(**sm)
        except ValueError as e:
            raise CalibrationError(f"{where}: impls.{impl}.split_model: {e}") from None
        for side, names in (("fetch", ("alpha_s", "beta_s", "GBps")), ("cpu", ("alpha_s", "beta_s", "GBps")),
                            ("together", ("overlap",))):
            d = r.get(side)
            if not isinstance(d, dict) or not all(_number(d.get(n)) for n in names):
                raise CalibrationError(f"{where}: impls.{impl}.{side} must hold finite numbers {list(names)}")
        if not isinstance(r.get("mechanism", {}), dict):
            raise CalibrationError(f"{where}: impls.{impl}.mechanism must be an object")
        th = r.get("mechanism", {}).get("threads")
        if th is not None and (not isinstance(th, int) or isinstance(th, bool) or th < 1):
            raise CalibrationError(f"{where}: impls.{impl}.mechanism.threads must be an integer >= 1, got {th!r}")
    return entry


def get_entry(path: str, key: str) -> dict | None:
    """The entry for ``key``, or None. Raises CalibrationError for an unreadable profile or a
    malformed entry (:func:`check_entry`)."""
    entry = load_profile(path)["entries"].get(key)
    return None if entry is None else check_entry(path, key, entry)


def check_writable(path: str) -> None:
    """Raises CalibrationError unless ``path`` can be written as a file (its folder may be made)."""
    if os.path.isdir(path):
        raise CalibrationError(f"{path}: calibration profile path is a directory")
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise CalibrationError(f"{path}: cannot write the calibration profile there ({folder} is not a "
                               "writable folder)")


def save_entry(path: str, key: str, entry: dict) -> None:
    """Adds or updates one entry (its ``impls`` merged with those already stored), atomically.

    A mechanism whose new calibration failed keeps its earlier successful result. Creates the
    folder if needed. Raises CalibrationError if an existing file or entry is unreadable.
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    prof = load_profile(path)
    old = prof["entries"].get(key)
    old = check_entry(path, key, old) if old is not None else {}
    impls = dict(old.get("impls", {}))
    for impl, r in entry.get("impls", {}).items():
        if r.get("ok") or not impls.get(impl, {}).get("ok"):  # a failed run keeps an earlier good one
            impls[impl] = r
    merged = {**old, **entry, "impls": impls}
    prof["entries"][key] = merged
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(prof, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# --------------------------------------------------------------------------------------------
# Fitting
# --------------------------------------------------------------------------------------------
MIN_BETA_S = 1e-9


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``t = alpha + beta * n`` with ``alpha >= 0`` and ``beta >= MIN_BETA_S``.

    points: (n, seconds) with n >= 1. When the free fit gives a negative alpha, or a slope below
    ``MIN_BETA_S`` (the time did not grow with n: noise larger than the per-expert cost, as quick points on a
    busy host give), the line is refit through the origin: every second is then charged per expert, which
    overstates the per-expert cost rather than taking it for zero (a split fitted on zero sends every miss to
    that side). Raises CalibrationError for no points.
    """
    if not points:
        raise CalibrationError("no points to fit")
    n = np.array([p[0] for p in points], np.float64)
    t = np.array([p[1] for p in points], np.float64)
    if len(set(n.tolist())) >= 2:
        beta, alpha = np.polyfit(n, t, 1)
    else:
        alpha, beta = 0.0, float(np.mean(t / n))
    if alpha < 0 or beta < MIN_BETA_S:
        alpha, beta = 0.0, float(np.sum(n * t) / np.sum(n * n))
    return float(alpha), float(max(beta, MIN_BETA_S))


def estimate_overlap(points: Sequence[tuple[int, int, float]], alpha_p: float, beta_p: float,
                     alpha_h: float, beta_h: float) -> float:
    """Median over (n_fetch, n_cpu, seconds) points of ``(a + c - t) / min(a, c)``, in [0, 1].
    1.0 when there is no point with both sides active."""
    vals = []
    for f, c, t in points:
        if f > 0 and c > 0:
            a, h = alpha_p + f * beta_p, alpha_h + c * beta_h
            vals.append(float(np.clip((a + h - t) / min(a, h), 0.0, 1.0)))
    return float(np.median(vals)) if vals else 1.0


def fit_impl(points: dict, expert_bytes: int, max_misses: int) -> dict:
    """Turns measured points into the fitted figures of one mechanism.

    points: {"base_s": s, "fetch": [(n, s)], "cpu": [(n, s)], "together": [(f, c, s)]} with raw
    per-layer seconds (the baseline not yet subtracted).
    """
    from ftjax.experts.miss_split import SplitModel, split_table
    base = points["base_s"]
    fp = [(n, max(s - base, 0.0)) for n, s in points["fetch"]]
    cp = [(n, max(s - base, 0.0)) for n, s in points["cpu"]]
    tp = [(f, c, max(s - base, 0.0)) for f, c, s in points["together"]]
    ap, bp = fit_line(fp)
    ah, bh = fit_line(cp)
    rho = estimate_overlap(tp, ap, bp, ah, bh)
    model = SplitModel(beta_p=bp, beta_h=bh, alpha_p=ap, alpha_h=ah, overlap=rho)
    gb = lambda beta: expert_bytes / beta / 1e9  # noqa: E731
    together = []
    for f, c, t in tp:
        a, h = ap + f * bp, ah + c * bh
        together.append({"fetch": f, "cpu": c, "t_s": t, "serial_s": a + h, "parallel_s": max(a, h),
                         "combined_GBps": (f + c) * expert_bytes / t / 1e9 if t > 0 else None})
    return {"ok": True, "base_s": base,
            "fetch": {"alpha_s": ap, "beta_s": bp, "GBps": gb(bp), "points": fp},
            "cpu": {"alpha_s": ah, "beta_s": bh, "GBps": gb(bh), "points": cp},
            "together": {"overlap": rho, "points": together},
            "split_model": model.as_dict(), "split_table": list(split_table(model, max_misses))}


def split_model_from(impl_entry: dict):
    """The :class:`SplitModel` stored in one mechanism's profile entry.

    Raises:
      CalibrationError: the entry records a failed calibration or has no model.
    """
    from ftjax.experts.miss_split import SplitModel
    if not impl_entry.get("ok") or "split_model" not in impl_entry:
        raise CalibrationError(f"calibration of this mechanism failed: {impl_entry.get('error', 'no model')}")
    return SplitModel(**impl_entry["split_model"])


# --------------------------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("cpu", "miss_copy"), donate_argnames=("pools",))
def _probe(banks, pools, x, fetch_ids, cpu_ids, n_fetch, n_cpu, *, cpu, miss_copy="auto"):
    """``reps`` layers of ``fetch_and_cpu``: banks, the host ``ExpertBanks``; pools, an ``ExpertState`` of a
    few slots (no table); fetch_ids [reps, Cf], cpu_ids [reps, Cc] flat ids; the fetches copied as ``miss_copy``
    says (``KernelConfig.miss_copy``). Returns (pools, a checksum)."""
    from ftjax.experts import miss_policy
    slots = jnp.arange(pools.gate_up.shape[0], dtype=jnp.int32)

    def rep(carry, ids):
        st, acc = carry
        fids, cids = ids
        st, y = miss_policy.fetch_and_cpu(cpu, banks, st, x, fids, slots, n_fetch, cids, n_cpu)
        return (st, acc + jnp.sum(y, dtype=jnp.float32)), None

    with registry.using(registry.KernelConfig(miss_copy=miss_copy)):
        (pools, acc), _ = jax.lax.scan(rep, (pools, jnp.float32(0)), (fetch_ids, cpu_ids))
    return pools, acc


@functools.partial(jax.jit, static_argnames=("miss_copy",), donate_argnames=("pools",))
def _fetch_probe(banks, pools, fetch_ids, n_fetch, *, miss_copy="auto"):
    """One layer's fetches as the host-split driver's device program copies them (``fetch_experts``)."""
    from ftjax.experts.fetch import fetch_experts
    with registry.using(registry.KernelConfig(miss_copy=miss_copy)):
        return fetch_experts(banks, pools, fetch_ids, jnp.arange(pools.gate_up.shape[0], dtype=jnp.int32),
                             n_fetch)


#: the host-split driver's front program as far as the host sees it: outputs it reads
_handoff_probe = jax.jit(lambda x, ids: (x * 1, ids + 0))
#: the next front program: waits for the layer's copies and the CPU's outputs
_merge_probe = jax.jit(lambda acc, pool, y: acc + jnp.sum(y, dtype=jnp.float32) + pool[0, 0, 0].astype(jnp.float32))


def impl_key(impl: str, driver: str = "callback") -> str:
    """A mechanism's key in a profile entry's ``impls``: the mechanism, with ``@host`` when it is reached from
    the host-split driver (``MissPolicyConfig.cpu_driver`` "host"), whose per-layer costs differ."""
    return impl if driver == "callback" else f"{impl}@{driver}"


def host_driver_impls(impls: Sequence[str]) -> list[str]:
    """The mechanisms of ``impls`` that the host-split driver can call: those with a host kernel
    (``cpu_experts.CALLBACK_IMPLS``)."""
    from ftjax.experts.cpu_experts import CALLBACK_IMPLS
    return [i for i in impls if i in CALLBACK_IMPLS]


def plan_points(max_misses: int, quick: bool) -> dict:
    """Which (n_fetch, n_cpu) to time for up to ``max_misses`` misses per layer."""
    c = max(1, max_misses)
    alone = sorted({1, c} if quick else {n for n in (1, 2, 4, 8, 16, 32, c) if n <= c})
    if c == 1:
        together = [(1, 1)]
    elif quick:
        together = [(c // 2, c - c // 2)]
    else:
        together = sorted({(c // 2, c - c // 2), (1, c - 1), (c - 1, 1), (c, c)})
    return {"alone": alone, "together": together, "capacity": max(c, max(max(t) for t in together))}


def measure_impl(cpu, banks, tokens: int, max_misses: int, quick: bool, reps: int, repeats: int,
                 seed: int = 0, log: Callable[[str], None] = print, driver: str = "callback",
                 compute_dtype=None, miss_copy: str = "auto") -> dict:
    """Times one mechanism; returns the raw points for :func:`fit_impl`. ``driver`` "callback": ``reps`` layers
    of ``fetch_and_cpu`` in one program (the CPU's share through callbacks); "host": ``reps`` layers of the
    host-split driver's host step (``ftjax.runtime.host_split``): the layer's fetch program dispatched, the
    split's outputs read, the host kernel called from Python, its outputs put on the device and a program
    waiting for both. ``banks``: the host ``ExpertBanks`` (a quantized format's with its scales);
    ``compute_dtype``: the activations' dtype (default the banks'); ``miss_copy``: how the fetches are copied
    (``KernelConfig.miss_copy``: the engine's, so the cost model fits the copies it will run)."""
    from ftjax.experts.state import ExpertState
    host_gu, host_dn = banks.gate_up, banks.down
    plan = plan_points(max_misses, quick)
    cap = plan["capacity"]
    rows, d = host_gu.shape[0], host_gu.shape[1]
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(rows, 2 * cap, replace=rows < 2 * cap) for _ in range(reps)]).astype(np.int32)
    fetch_ids, cpu_ids = jnp.asarray(ids[:, :cap]), jnp.asarray(ids[:, cap:])
    dtype = jnp.dtype(compute_dtype or host_gu.dtype)
    x = (jax.random.normal(jax.random.key(seed), (tokens, d), jnp.float32) * 0.5).astype(dtype)
    pool = lambda a: jnp.zeros((cap,) + a.shape[1:], a.dtype)  # noqa: E731
    state = [ExpertState(pool(host_gu), pool(host_dn), None,
                         scales=tuple(pool(s) for s in banks.scales) if banks.scales else None, fmt=banks.fmt)]

    def layers(nf: int, nc: int):
        if driver == "callback":
            state[0], acc = _probe(banks, state[0], x, fetch_ids, cpu_ids, jnp.int32(nf), jnp.int32(nc), cpu=cpu,
                                   miss_copy=miss_copy)
            return acc
        acc, zeros = jnp.float32(0), jnp.zeros((cpu_ids.shape[1], tokens, d), dtype)
        for r in range(reps):
            xh, idh = _handoff_probe(x, cpu_ids[r])
            state[0] = _fetch_probe(banks, state[0], fetch_ids[r], jnp.int32(nf), miss_copy=miss_copy)
            xn, idn = jax.device_get((xh, idh))
            y = jax.device_put(np.asarray(cpu.kernel.compute(xn, idn, nc))) if nc else zeros
            acc = _merge_probe(acc, state[0].down, y)
        return acc

    def run(nf: int, nc: int) -> float:
        best = float("inf")
        for i in range(repeats + 1):  # call 0 warms up (and compiles, once per mechanism)
            t0 = time.perf_counter()
            layers(nf, nc).block_until_ready()
            if i:
                best = min(best, time.perf_counter() - t0)
        return best / reps

    t0 = time.perf_counter()
    run(0, 0)
    log(f"  {impl_key(cpu.impl, driver)}: probe compiled in {time.perf_counter() - t0:.1f} s")
    base = run(0, 0)
    fetch = [(n, run(n, 0)) for n in plan["alone"]]
    cpu_pts = [(n, run(0, n)) for n in plan["alone"]]
    together = [(f, c, run(f, c)) for f, c in plan["together"]]
    return {"base_s": base, "fetch": fetch, "cpu": cpu_pts, "together": together}


def sweep_threads(banks, tokens: int, max_misses: int, candidates: Sequence[int] | None = None,
                  repeats: int = 3, kind: str = "xla", compute_dtype=None) -> list[tuple[int, float]]:
    """Seconds for the host kernel of kind ``kind`` (``cpu_experts.KERNEL_KIND``; called directly, no jit
    around it) to compute ``max_misses`` experts for ``tokens`` tokens from the host ``ExpertBanks``
    ``banks``, per thread count (``compute_dtype``: the activations', default the banks')."""
    from ftjax.experts.cpu_experts import get_kernel
    cores = os.cpu_count() or 1
    candidates = candidates or [t for t in (1, 2, 4, 8, 16, 32) if t <= cores]
    rows = banks.gate_up.shape[0]
    x = np.ones((tokens, banks.gate_up.shape[1]), np.dtype(compute_dtype or banks.gate_up.dtype))
    ids = (np.arange(max_misses) * 7919 % rows).astype(np.int32)
    out = []
    for th in candidates:
        k = get_kernel(banks.gate_up, banks.down, th, scales=banks.scales, fmt=banks.fmt, kind=kind)
        k.compute(x, ids, max_misses)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            k.compute(x, ids, max_misses)
            best = min(best, time.perf_counter() - t0)
        out.append((th, best))
    return out


def calibrate(host_gu: jax.Array, host_dn: jax.Array, cfg, dtype: str, tokens: int, impls: Sequence[str],
              threads: int | None = None, quick: bool = False, reps: int | None = None,
              repeats: int | None = None, log: Callable[[str], None] = print, driver: str = "callback",
              scales=None, bank_fmt: str = "dense", miss_copy: str = "auto") -> dict:
    """Measures and fits every mechanism in ``impls`` on these host banks; returns a profile entry.

    Args:
      host_gu, host_dn: host banks [rows, D, 2F] / [rows, F, D] of the model's format (the model's
        own banks, or synthetic ones from :func:`synthetic_banks`).
      cfg: model config (E, top_k, D, F); dtype: the banks' dtype name; tokens: tokens per
        decode call (the batch).
      impls: CPU mechanisms to time (``ftjax.experts.cpu_experts.IMPLS``); a mechanism that fails
        is recorded with ``ok: False`` and its error.
      threads: host-kernel threads for the callback mechanisms; None = sweep (or the default in
        quick mode).
      quick: fewer points and repetitions (a few seconds; what ``generate`` runs on first use).
      driver: "callback" or "host" (``MissPolicyConfig.cpu_driver``; :func:`measure_impl`): "host" needs
        mechanisms with a host kernel (``CALLBACK_IMPLS``).
      scales, bank_fmt: a quantized format's scale banks and format (``ExpertBanks.scales`` / ``.fmt``): the
        copies move weights and scales, the CPU kernels dequantize, ``dtype`` is then the compute dtype.
      miss_copy: how the fetches are copied (``KernelConfig.miss_copy``); the entry records the copy that ran
        (``miss_copy``: "kernel" or "xla", :func:`ftjax.experts.fetch.miss_copy_mode`).
    Returns:
      the entry: device, format, date, jax version, tokens, and ``impls: {impl_key(impl, driver): fitted
      figures}``.
    """
    from ftjax.checkpoint import DTYPES
    from ftjax.experts.cpu_experts import CALLBACK_IMPLS, KERNEL_KIND, default_threads, make_cpu_experts
    from ftjax.experts.state import ExpertBanks
    banks = ExpertBanks(host_gu, host_dn, tuple(scales) if scales else None, bank_fmt)
    fmt = expert_format(cfg, dtype, bank_fmt, banks.expert_bytes)
    max_misses = min(cfg.num_experts, tokens * cfg.top_k)
    reps = reps or (4 if quick else 16)
    repeats = repeats or (2 if quick else 3)
    entry: dict[str, Any] = {
        "device": device_name(), "platform": jax.default_backend(), "host_cpus": os.cpu_count(),
        "jax": jax.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "format": fmt, "tokens": tokens, "max_misses": max_misses, "quick": quick, "reps": reps,
        "miss_copy": miss_copy_mode(miss_copy), "impls": {}}
    sweeps: dict[str, list] = {}  # per host kernel kind
    for impl in impls:
        t0 = time.perf_counter()
        try:
            th = threads
            if impl in CALLBACK_IMPLS and th is None:
                kind = KERNEL_KIND[impl]
                if quick:
                    th = default_threads(kind)
                else:
                    if kind not in sweeps:
                        sweeps[kind] = sweep_threads(banks, tokens, max_misses, kind=kind,
                                                     compute_dtype=DTYPES[dtype])
                        name = "host_kernel_thread_sweep" + ("" if kind == "xla" else f"_{kind}")
                        entry[name] = [{"threads": a, "s": s} for a, s in sweeps[kind]]
                    th = min(sweeps[kind], key=lambda p: p[1])[0]
            if driver == "host" and impl not in CALLBACK_IMPLS:
                raise CalibrationError(f"the host driver calls a host kernel; {impl} has none")
            cpu = make_cpu_experts(impl, host_gu, host_dn, th, from_program=driver == "callback", scales=banks.scales,
                                   fmt=bank_fmt)
            pts = measure_impl(cpu, banks, tokens, max_misses, quick, reps, repeats, log=log, driver=driver,
                               compute_dtype=DTYPES[dtype], miss_copy=miss_copy)
            res = fit_impl(pts, fmt["expert_bytes"], max_misses)
            res["mechanism"] = cpu.describe()
        except Exception as e:  # noqa: BLE001 - a failing mechanism is a finding, not a crash
            res = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:2000]}"}
        res["seconds"] = round(time.perf_counter() - t0, 2)
        entry["impls"][impl_key(impl, driver)] = res
        log(describe_impl(impl_key(impl, driver), res))
    return entry


def describe_impl(impl: str, r: dict) -> str:
    """One line per mechanism: fitted copy and CPU costs, overlap, split table."""
    if not r.get("ok"):
        return f"  {impl}: FAILED: {r.get('error', '')[:300]}"
    f, c = r["fetch"], r["cpu"]
    return (f"  {impl}: copy {f['alpha_s'] * 1e3:.3f} ms + {f['beta_s'] * 1e3:.3f} ms/expert ({f['GBps']:.2f} GB/s); "
            f"CPU {c['alpha_s'] * 1e3:.3f} ms + {c['beta_s'] * 1e3:.3f} ms/expert ({c['GBps']:.2f} GB/s); "
            f"overlap {r['together']['overlap']:.2f}; split F(M) {r['split_table'][1:]}")


def synthetic_banks(cfg, dtype: str, rows: int, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    """Random host banks of ``rows`` experts in the model's format ([rows, D, 2F], [rows, F, D]),
    generated on the device and moved to host memory (typed as host memory, see
    ``ftjax.experts.cpu_experts.ensure_host_typed``)."""
    from ftjax.checkpoint import DTYPES
    jdt = jnp.dtype(DTYPES[dtype])
    d, f = cfg.hidden_size, cfg.expert_ffn

    def gen(key, shape, fan_in):
        return (jax.random.normal(key, shape, jnp.float32) * (0.5 / fan_in ** 0.5)).astype(jdt)

    k1, k2 = jax.random.split(jax.random.key(seed))
    gu = jax.jit(functools.partial(gen, shape=(rows, d, 2 * f), fan_in=d))(k1)
    dn = jax.jit(functools.partial(gen, shape=(rows, f, d), fan_in=f))(k2)
    return jax.device_put(gu, jax.memory.Space.Host), jax.device_put(dn, jax.memory.Space.Host)


def profile_for(model, impl: str, tokens: int, path: str | None = None, threads: int | None = None,
                log: Callable[[str], None] = print, driver: str = "callback",
                miss_copy: str = "auto") -> tuple[dict, str, str, bool]:
    """The profile entry for a loaded model and mechanism (reached by ``driver``, its results under
    ``impls[impl_key(impl, driver)]``); quick-calibrates and saves it if missing. ``miss_copy``: the engine's
    ``KernelConfig.miss_copy``; fetches copied by the slot-copy kernel have their own entry (the key ends in
    ``|slot_kernel``), so a profile fitted on XLA's loop is not reused for the kernel's copies, nor the reverse.

    Returns (entry, key, path, calibrated_now). Raises CalibrationError for an unreadable
    profile; the entry may record a failed mechanism (``split_model_from`` raises then).
    """
    path = path or default_profile_path()
    banks = model.banks
    fmt = expert_format(model.cfg, model.dtype, banks.fmt, banks.expert_bytes)
    key = profile_key(device_name(), fmt, tokens) + ("|slot_kernel" if miss_copy_mode(miss_copy) == "kernel" else "")
    entry = get_entry(path, key)
    if entry is not None and impl_key(impl, driver) in entry.get("impls", {}):
        return entry, key, path, False
    check_writable(path)  # before spending time on a calibration that could not be saved
    log(f"calibration: no profile for {key} / {impl_key(impl, driver)} in {path}; quick calibration on this "
        f"model ...")
    new = calibrate(banks.gate_up, banks.down, model.cfg, model.dtype, tokens, [impl], threads,
                    quick=True, log=log, driver=driver, scales=banks.scales, bank_fmt=banks.fmt, miss_copy=miss_copy)
    save_entry(path, key, new)
    return get_entry(path, key), key, path, True


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------
def _flags():
    from absl import flags
    flags.DEFINE_string("checkpoint", None, "HF checkpoint directory (only its config.json is read).")
    flags.DEFINE_string("preset", None, "Model preset instead of a checkpoint (default tiny).")
    flags.DEFINE_enum("dtype", None, ["float32", "bfloat16", "float16"], "Expert dtype; default the model's.")
    flags.DEFINE_list("impls", ["callback", "callback_async", "compute_on"], "CPU mechanisms to calibrate.")
    flags.DEFINE_list("drivers", ["callback"], "How the decode step reaches the CPU (MissPolicyConfig.cpu_driver): "
                      "callback (io_callback inside the step) and/or host (the host-split driver); each is "
                      "stored under its own mechanism key (impl, impl@host).")
    flags.DEFINE_integer("tokens", 1, "Tokens per decode call (the batch).")
    flags.DEFINE_integer("cpu_threads", 0, "Host-kernel threads; 0 = sweep and pick the fastest.")
    flags.DEFINE_integer("bank_rows", 64, "Synthetic experts in the host bank (spread beyond CPU caches).")
    flags.DEFINE_boolean("quick", False, "Fewer points and repetitions.")
    flags.DEFINE_string("profile", None, "Profile JSON to update; default ~/.cache/ftjax/calibration.json.")
    return flags.FLAGS


def main(argv):
    from absl import app, logging
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if logging.get_verbosity() == logging.INFO:  # absl's default: hide JAX's backend probing notes
        logging.set_verbosity(logging.WARNING)
    from ftjax.config import ConfigError, preset
    from ftjax.families import load_hf_config
    from ftjax.experts.cpu_experts import CALLBACK_IMPLS, IMPLS
    flags_ = FLAGS
    try:
        bad = [i for i in flags_.impls if i not in IMPLS]
        if bad:
            raise CalibrationError(f"unknown --impls {bad}; expected some of {IMPLS}")
        if flags_.checkpoint and flags_.preset:
            raise CalibrationError("give --checkpoint or --preset, not both")
        cfg = load_hf_config(flags_.checkpoint) if flags_.checkpoint else preset(flags_.preset or "tiny")
        dtype = flags_.dtype or cfg.dtype
        if flags_.tokens < 1 or flags_.bank_rows < 1:
            raise CalibrationError("--tokens and --bank_rows must be >= 1")
        if not flags_.impls:
            raise CalibrationError(f"--impls is empty; expected some of {IMPLS}")
        from ftjax.config import CPU_DRIVERS
        if not flags_.drivers or any(d not in CPU_DRIVERS for d in flags_.drivers):
            raise CalibrationError(f"--drivers {flags_.drivers}: expected some of {CPU_DRIVERS}")
        if "host" in flags_.drivers and not host_driver_impls(flags_.impls):
            raise CalibrationError(f"--drivers=host calls a host kernel; none of --impls {flags_.impls} has one "
                                   f"(expected some of {CALLBACK_IMPLS})")
        skipped = [i for i in flags_.impls if i not in host_driver_impls(flags_.impls)]
        if "host" in flags_.drivers and skipped:
            print(f"note: {', '.join(skipped)} {'has' if len(skipped) == 1 else 'have'} no host kernel: left out of "
                  f"--drivers=host")
        if flags_.cpu_threads < 0:
            raise CalibrationError(f"--cpu_threads must be >= 0 (0 = sweep), got {flags_.cpu_threads}")
        path = flags_.profile or default_profile_path()
        fmt = expert_format(cfg, dtype)
        key = profile_key(device_name(), fmt, flags_.tokens)
        get_entry(path, key)  # fail early on an unreadable profile or entry
        check_writable(path)
        print(f"calibrating {key}: {fmt['expert_bytes'] / 1e6:.2f} MB per expert, {flags_.tokens} token(s), "
              f"{flags_.bank_rows} host experts")
        gu, dn = synthetic_banks(cfg, dtype, flags_.bank_rows)
        failed = []
        for driver in dict.fromkeys(flags_.drivers):
            impls = host_driver_impls(flags_.impls) if driver == "host" else flags_.impls
            entry = calibrate(gu, dn, cfg, dtype, flags_.tokens, impls, flags_.cpu_threads or None,
                              quick=flags_.quick, driver=driver)
            save_entry(path, key, entry)
            failed += [i for i, r in entry["impls"].items() if not r.get("ok")]
        print(f"profile written: {path} [{key}]")
        if failed:
            raise CalibrationError(f"calibration failed for {failed} (earlier successful results kept)")
    except (CalibrationError, ConfigError, OSError) as e:
        print(f"ftjax.calibrate: error: {e}", file=sys.stderr)
        sys.exit(1)


FLAGS = None
if __name__ == "__main__":
    from ftjax import absl_app
    from ftjax.experts.cpu_experts import use_sync_cpu_dispatch
    use_sync_cpu_dispatch()  # before JAX starts: callback mechanisms on a CPU backend need it
    FLAGS = _flags()
    absl_app.run(main)
