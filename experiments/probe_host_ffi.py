r"""Can a GPU program reach a compiled CPU kernel without a Python callback (issue 33, the CPU as a second link)?

The CPU expert kernel (``ftjax/experts/native/expert_ffn.c``) reads 0.71-0.85 of the host's DRAM bandwidth with
0.04-0.07 ms fixed cost a layer (H100 host, 2026-12-07), but the engine reaches it through two ``io_callback``s per
layer, which raise the fixed cost to 0.63 ms (docs/MISS_POLICY.md): a Python round trip each. XLA compiles a
``compute_on(compute_type="device_host")`` region of a GPU program for the host; if an XLA FFI custom call registered
for the CPU may run inside such a region, the kernel could be called from the step with no Python at all.

This probe builds a one-line CPU FFI handler (``experiments/native/probe_host_ffi.cc``: y = 2 x, compiled with the
system C++ compiler against ``jax.ffi.include_dir()``), registers it for the CPU, and times four jitted programs on
the default device, each taking x float32 [``--rows``, ``--hidden``] on the device and returning 2 x there:

* ``device``: 2 x on the device (the baseline every other row is net of);
* ``io_callback``: x to the host and back through ``jax.experimental.io_callback`` (numpy doubles it);
* ``host_jnp``: x put in host memory, doubled inside ``compute_on("device_host")``, put back on the device;
* ``host_ffi``: the same with the FFI handler inside the host region;
* ``host_ffi_bank``: a second handler inside the host region that also reads one row of a pinned host bank of
  ``--bank_mb`` (y = 2 x + bank[row], the bank an operand of the region as the expert banks would be): about
  ``host_ffi``'s time if the bank reaches the handler in place, a copy of the bank's bytes more if XLA copies it.

Each row: ``ok``, ``error`` (the first 800 characters of a refusal), ``correct`` (the result is 2 x), and the call's
microseconds (median, p10, p90 of ``--repeats`` calls after two untimed ones) with ``net_us`` (median minus
``device``'s). On the CPU backend every region is the CPU and the rows check the programs only.

  PYTHONPATH=. python3 experiments/probe_host_ffi.py --out_dir=$OUT --tag=h100_$(date -u +%F)       # GPU
  .venv/bin/python experiments/probe_host_ffi.py --repeats=5 --out_dir=/tmp/host_ffi                 # CPU smoke

Writes ``probe_host_ffi[_<tag>].json`` (meta, flags, ``compiler``, ``skipped`` with the reason where the handler
could not be built, ``rows``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import common  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("rows", 1, "Rows of x (a decode step's tokens).", lower_bound=1)
flags.DEFINE_integer("hidden", 2048, "Columns of x (the model's hidden size).", lower_bound=1)
flags.DEFINE_integer("repeats", 200, "Timed calls per program.", lower_bound=1)
flags.DEFINE_integer("bank_mb", 512, "The pinned host bank of host_ffi_bank, MB (rows of --hidden float32).",
                     lower_bound=1)
flags.DEFINE_string("out_dir", "experiments/results/miss_policy", "Where the JSON goes.")
flags.DEFINE_string("tag", "", "Suffix of the JSON's name.")

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native", "probe_host_ffi.cc")
TARGET, TARGET_BANK = "ftjax_probe_double", "ftjax_probe_double_add_row"
VARIANTS = ("device", "io_callback", "host_jnp", "host_ffi", "host_ffi_bank")
ROW = 5  # the bank row host_ffi_bank reads


def build(folder: str) -> tuple[str | None, str]:
    """Compiles :data:`SOURCE` into ``folder``; returns (the library's path, or None, and the compiler or why not)."""
    import jax
    cxx = next((c for c in (os.environ.get("CXX"), "c++", "g++", "clang++") if c and shutil.which(c)), None)
    if cxx is None:
        return None, "no C++ compiler (CXX, c++, g++, clang++)"
    lib = os.path.join(folder, "libprobe_host_ffi.so")
    cmd = [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-w", f"-I{jax.ffi.include_dir()}", SOURCE, "-o", lib]
    r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=300)
    if r.returncode != 0:
        return None, f"{' '.join(cmd)} failed: {r.stderr[-800:]}"
    return lib, cxx


def programs(registered: bool, bank) -> dict:
    """The jitted program of each variant (:data:`VARIANTS`; the ``host_ffi`` ones only where the handlers are
    registered), each a function of x; ``bank``: the pinned host bank host_ffi_bank reads."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import io_callback
    from jax.experimental.compute_on import compute_on
    host, device = jax.memory.Space.Host, jax.memory.Space.Device

    def on_host(fn):
        return lambda x: jax.device_put(compute_on(fn, compute_type="device_host", out_memory_spaces=host)(
            jax.device_put(x, host)), device)

    def ffi_double(x):
        return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    def ffi_double_add_row(x, b):
        return jax.ffi.ffi_call(TARGET_BANK, jax.ShapeDtypeStruct(x.shape, x.dtype))(x, b, jnp.int32(ROW))

    def bank_on_host(x, b):
        y = compute_on(ffi_double_add_row, compute_type="device_host", out_memory_spaces=host)(
            jax.device_put(x, host), b)
        return jax.device_put(y, device)

    out = {"device": lambda x: x * 2,
           "io_callback": lambda x: io_callback(lambda a: np.asarray(a) * np.float32(2),
                                                jax.ShapeDtypeStruct(x.shape, jnp.float32), x),
           "host_jnp": on_host(lambda x: x * 2)}
    out = {k: jax.jit(v) for k, v in out.items()}
    if registered:
        out["host_ffi"] = jax.jit(on_host(ffi_double))
        with_bank = jax.jit(bank_on_host)
        out["host_ffi_bank"] = lambda x: with_bank(x, bank)
    return out


def check(fn, x, want) -> dict:
    """A variant compiled and run once: {ok, correct} or {ok: False, error}."""
    import numpy as np
    try:
        got = np.asarray(fn(x))
        fn(x).block_until_ready()
    except Exception as e:  # a refusal is the probe's answer, not its failure
        return {"ok": False, "error": f"{type(e).__name__}: {str(e)[:800]}"}
    return {"ok": True, "correct": bool(np.array_equal(got, want))}


def time_all(fns: dict, x) -> dict:
    """Microseconds a call of each program, timed in rounds (one call of each per round, so that drift of the
    machine reaches every variant alike): variant -> spread."""
    times = {k: [] for k in fns}
    for _ in range(FLAGS.repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn(x).block_until_ready()
            times[k].append(1e6 * (time.perf_counter() - t0))
    return {k: common.spread(v) for k, v in times.items()}


def main(argv):
    del argv
    import ctypes

    import jax
    import jax.numpy as jnp
    import numpy as np
    out = {"question": "does a CPU FFI custom call run inside compute_on('device_host') of a GPU program, and at "
                       "what fixed cost against an io_callback?", "skipped": {}, "rows": []}
    with tempfile.TemporaryDirectory(prefix="probe_host_ffi-") as folder:
        lib, compiler = build(folder)
        out["compiler"] = compiler if lib else None
        if lib is None:
            out["skipped"]["host_ffi"] = compiler
            print(f"skipped: host_ffi ({compiler})", flush=True)
        else:
            handle = ctypes.cdll.LoadLibrary(lib)
            jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handle.FtjaxProbeDouble), platform="cpu")
            jax.ffi.register_ffi_target(TARGET_BANK, jax.ffi.pycapsule(handle.FtjaxProbeDoubleAddRow), platform="cpu")
        x = jnp.arange(FLAGS.rows * FLAGS.hidden, dtype=jnp.float32).reshape(FLAGS.rows, FLAGS.hidden) / 7
        want = np.asarray(x) * np.float32(2)
        rows = max(ROW + 1, FLAGS.bank_mb * 2**20 // (4 * FLAGS.hidden))
        bank = common.pinned_array((rows, FLAGS.hidden), jnp.float32, 3) if lib is not None else None
        out["bank"] = None if bank is None else {"rows": rows, "bytes": rows * FLAGS.hidden * 4,
                                                 "memory_kind": bank.sharding.memory_kind}
        wants = {"host_ffi_bank": None if bank is None else want + np.asarray(bank[ROW])[None, :]}
        fns = programs(lib is not None, bank)
        out["rows"] = [{"variant": name, **check(fn, x, want if wants.get(name) is None else wants[name])}
                       for name, fn in fns.items()]
        spreads = time_all({r["variant"]: fns[r["variant"]] for r in out["rows"] if r["ok"]}, x)
    base = spreads.get("device", {}).get("median")
    for r in out["rows"]:
        if r["ok"]:
            r["us"] = spreads[r["variant"]]
            r["net_us"] = None if base is None else r["us"]["median"] - base
            net = "" if r["net_us"] is None else f" (net {r['net_us']:.1f})"
            shown = f"{r['us']['median']:.1f} us{net}, correct {r['correct']}"
        else:
            shown = r["error"]
        print(f"{r['variant']:12s} {shown}", flush=True)
    name = f"probe_host_ffi{'_' + FLAGS.tag if FLAGS.tag else ''}.json"
    print("wrote", common.write_json(FLAGS.out_dir, name, out))


if __name__ == "__main__":
    common.run(main)
