"""Shared pieces of the GPU scripts: run metadata, H2D bandwidth, medians, JSON output.

Every script writes one JSON file through :func:`write_json`, the one result writer: ``meta``
(git commit, device, jax version, date, host), the script's ``flags``, the measured host-to-device
bandwidth ``B_P`` of that run, its figures, and per run the engine config
(``Engine.describe()``). One naming throughout: ``ttft_s``, ``tpot_s`` (a :func:`spread` of
per-step seconds), ``tokens_per_s``, ``bytes_h2d``, ``hit_rate``. ``experiments/plots.py`` draws a
PNG from any of these files. Absolute times on shared machines are noisy, so scripts report
medians, spreads and ratios measured in the same run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from ftjax import memory
from ftjax.provenance import run_meta

#: The transformers-made test fixtures (tests/fixtures/, each with expected.npz), read by the GPU checks.
FIXTURES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures")


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


def build_random_model(preset_name: str, dtype: str):
    """Random weights at a preset's shape; returns (cfg, model, build seconds, B_P dict)."""
    from ftjax.checkpoint import random_model
    from ftjax.config import preset
    cfg = preset(preset_name)
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


def hlo_ops(text: str) -> dict:
    """Counts of the HLO ops that tell whether host copies are asynchronous."""
    ops: dict[str, int] = {}
    for op in re.findall(r"(?<=\s)([a-z][a-z0-9\-]*)\(", text):
        if any(w in op for w in ("copy", "slice", "start", "done", "custom-call", "while")):
            ops[op] = ops.get(op, 0) + 1
    ops["host_memory_space_S(5)"] = text.count("S(5)")
    return ops


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
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths))  # noqa: E731
    return "\n".join([line(cols)] + [line(r) for r in cells])
