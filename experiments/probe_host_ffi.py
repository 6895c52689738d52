r"""Can a GPU program reach a compiled CPU kernel without a Python callback (issue 33, the CPU as a second link)?

The CPU expert kernel (``ftjax/experts/native/expert_ffn.c``) reads 0.71-0.85 of the host's DRAM bandwidth with
0.04-0.07 ms fixed cost a layer (H100 host, 2026-12-07), but the engine reaches it through two ``io_callback``s per
layer, which raise the fixed cost to 0.63 ms (docs/MISS_POLICY.md): a Python round trip each. XLA compiles a
``compute_on(compute_type="device_host")`` region of a GPU program for the host; if an XLA FFI custom call registered
for the CPU may run inside such a region, the kernel could be called from the step with no Python at all.

This probe builds three small CPU FFI handlers (``experiments/native/probe_host_ffi.cc``, compiled with the system
C++ compiler against ``jax.ffi.include_dir()``), registers them for the CPU, and times five jitted programs on the
default device, each taking x float32 [``--rows``, ``--hidden``] on the device and returning 2 x there (2 x + a bank
row for the last), timed in rounds over them:

* ``device``: 2 x on the device (the baseline every other row is net of);
* ``io_callback``: x to the host and back through ``jax.experimental.io_callback`` (numpy doubles it);
* ``host_jnp``: x put in host memory, doubled inside ``compute_on("device_host")``, put back on the device;
* ``host_ffi``: the same with the FFI handler inside the host region;
* ``host_ffi_bank``: a second handler inside the host region that also reads one row of a pinned host bank of
  ``--bank_mb`` MiB (y = 2 x + bank[row], the bank an operand of the region as the expert banks would be, the row an
  int32 computed on the device as an expert id is): about ``host_ffi``'s time if the bank reaches the handler in
  place, a copy of the bank's bytes more if XLA copies it.

Then the expert rows, the question's own case: the C expert kernel (``ftjax.experts.cpu_native.NativeKernel`` on
seeded bf16 banks of ``--experts`` experts, [R, ``--hidden``, 2 ``--ffn``] and [R, ``--ffn``, ``--hidden``], in
pinned host memory, read in place) computing k experts (``--ks``) for x, reached the engine's way
(``native_callbacks_k<k>``: ``make_cpu_experts("native_async")``'s ``launch`` and ``collect``, two ``io_callback``s
under their conds) and from a host region (``host_expert_ffn_k<k>``: the third handler calling the kernel through
its address, with its bank descriptors and work buffer as attributes). Each is timed in a block of its own (after a
pause: each host thread that calls the kernel has its own OpenMP team, which must not spin beside another's), each
call on the next k experts round the bank (cold, as a layer's misses are); ``correct``: the kernel's own result
from its driver thread, ``kernel_rel_err``: that result against a float64 SwiGLU. ``fits``: per route, the fixed
microseconds a call and the weight GB/s of the line through the smallest and largest k (issue 33 asks <= 0.2 ms
fixed a layer).

Each row: ``ok``, ``error`` (the first 800 characters of a refusal), ``correct`` (the result is numpy's, or for an
expert row the kernel's), ``hlo``
(counts in the compiled program's text of the FFI targets' names, host-compute annotations and asynchronous host
calls: whether the region was split off the device program at all), and the call's microseconds (median, p10, p90 of
``--repeats`` calls after two untimed ones) with ``net_us`` (median minus
``device``'s). What needs no handler runs and is timed first (``device``, ``io_callback``, ``host_jnp``, then the
``native_callbacks`` rows), the handlers' rows after it (``host_ffi``, ``host_ffi_bank``, timed in rounds of their
own, then the ``host_expert_ffn`` rows). The JSON is rewritten before and after each variant's first run and its
timing, its row saying ``no answer: ...`` until they return, so a handler that ends the process (as each did on an
H100, 2026-12-07: XLA:GPU aborted compiling the host region, "No FFI handler registered for ftjax_probe_double on a
platform Host") leaves its name and every row before it; ``--skip`` leaves variants out for the next run. On a GPU
the handlers are also registered through the GPU plugin for platform "Host" (``host_registration`` says how that
went; :func:`register`). On the CPU backend every region is the CPU and the rows check the programs only.

  PYTHONPATH=. python3 experiments/probe_host_ffi.py --out_dir=$OUT --tag=h100_$(date -u +%F)       # GPU
  .venv/bin/python experiments/probe_host_ffi.py --repeats=5 --bank_mb=8 --experts=8 --hidden=256 --ffn=128 \
      --out_dir=/tmp/host_ffi                                                                       # CPU smoke

Writes ``probe_host_ffi[_<tag>].json`` (meta, flags, ``compiler``, ``host_registration``, ``skipped``: ``host_ffi``
with the reason where the handlers could not be built or registered, every handler variant then left out; ``experts``
with the reason where the kernel could not be built or view the banks, the expert rows then left out; ``left_out``: the
variants ``--skip`` left out; ``bank``; ``experts``; ``rows``; ``fits``).
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
flags.DEFINE_integer("bank_mb", 512, "The pinned host bank of host_ffi_bank, MiB (rows of --hidden float32).",
                     lower_bound=1)
flags.DEFINE_integer("experts", 64, "Experts in the bf16 banks of the expert rows (pinned host memory).",
                     lower_bound=1)
flags.DEFINE_integer("ffn", 768, "The experts' FFN width F (banks [R, D, 2F] and [R, F, D]; qwen3-30b-a3b's 768).",
                     lower_bound=1)
flags.DEFINE_list("ks", ["1", "8"], "Experts per call of the expert rows (k; two or more give the fit).")
flags.DEFINE_integer("threads", 0, "The C kernel's threads (0: every core).", lower_bound=0)
flags.DEFINE_float("pause_s", 0.5, "Seconds of pause before each expert row's timed block (longer than an idle "
                   "OpenMP team spins before it sleeps).", lower_bound=0)
flags.DEFINE_list("skip", [], "Variants to leave out, as names or shell patterns (host_ffi, 'host_expert_ffn_k*'): "
                  "one that ended the process in an earlier run (its row says so), so that the others still run.")
flags.DEFINE_string("out_dir", "experiments/results/miss_policy", "Where the JSON goes.")
flags.DEFINE_string("tag", "", "Suffix of the JSON's name.")

common.validate("ks", lambda v: next((f"--ks: {k!r} is not a positive integer" for k in v
                                      if not k.strip().isdigit() or int(k) < 1), None if v else "--ks is empty"))
flags.register_multi_flags_validator(["ks", "experts"], lambda f: all(not k.strip().isdigit() or int(k) <= f["experts"]
                                                                  for k in f["ks"]),
                                     "--ks: each k at most --experts (the ids of a call are distinct experts)")

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native", "probe_host_ffi.cc")
TARGET, TARGET_BANK, TARGET_FFN = "ftjax_probe_double", "ftjax_probe_double_add_row", "ftjax_probe_expert_ffn"
ROW = 5  # the bank row host_ffi_bank reads


#: Targets registered in this process (a second registration of a name from another library is refused).
_REGISTERED: dict[str, object] = {}


def build(folder: str) -> tuple[str | None, str]:
    """Compiles :data:`SOURCE` into ``folder``; returns (the library's path, or None, and the compiler or why not)."""
    import jax
    cxx = next((c for c in (os.environ.get("CXX"), "c++", "g++", "clang++") if c and shutil.which(c)), None)
    if cxx is None:
        return None, "no C++ compiler (CXX, c++, g++, clang++)"
    lib = os.path.join(folder, "libprobe_host_ffi.so")
    cmd = [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", f"-I{jax.ffi.include_dir()}", SOURCE, "-o", lib]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{' '.join(cmd)}: {type(e).__name__}: {e}"
    if r.returncode != 0:
        errors = "\n".join(line for line in r.stderr.splitlines() if "error" in line)
        return None, f"{' '.join(cmd)} failed: {(errors or r.stderr)[-800:]}"
    return lib, cxx


def register(lib: str) -> str | None:
    """Registers the three handlers of ``lib`` for the CPU, once per process; returns why not, or None.

    On a GPU each is also registered through the GPU plugin for platform "Host" (:data:`HOST_REGISTRATION` says how
    that went): XLA:GPU compiles a host region with the plugin's own copy of XLA, whose FFI registry the CPU client's
    registration does not reach (an H100 run of 2026-12-07 aborted in compile: "No FFI handler registered for
    ftjax_probe_double on a platform Host")."""
    import ctypes

    import jax
    if _REGISTERED:
        return None
    try:
        handle = ctypes.cdll.LoadLibrary(lib)
        symbols = {TARGET: handle.FtjaxProbeDouble, TARGET_BANK: handle.FtjaxProbeDoubleAddRow,
                   TARGET_FFN: handle.FtjaxProbeExpertFfn}
        for name, symbol in symbols.items():
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(symbol), platform="cpu")
    except Exception as e:  # a library that does not load, or a refused registration: the rows say so
        return f"{type(e).__name__}: {str(e)[:800]}"
    _REGISTERED.update({TARGET: handle, TARGET_BANK: handle, TARGET_FFN: handle})
    if jax.default_backend() == "gpu":
        from jax._src.lib import xla_client
        plugin = getattr(xla_client, "_custom_callback_handler", {}).get("CUDA")
        if plugin is None:
            HOST_REGISTRATION["error"] = "no CUDA custom-call handler in xla_client"
        else:
            try:
                for name, symbol in symbols.items():
                    plugin(name, jax.ffi.pycapsule(symbol), "Host", 1, xla_client.CustomCallTargetTraits.DEFAULT)
                HOST_REGISTRATION["plugin"] = "Host"
            except Exception as e:
                HOST_REGISTRATION["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    return None


#: How the handlers were registered for the GPU plugin's host platform (:func:`register`; empty off a GPU).
HOST_REGISTRATION: dict[str, str] = {}


def on_host(fn, *args, in_place: tuple[int, ...] = ()):
    """``fn(*args)`` inside a ``compute_on("device_host")`` region, its result put on the device; each of ``args`` is
    put in host memory first, but those at the positions ``in_place`` (already host arrays: the pinned bank), which
    are handed over as they are."""
    import jax
    from jax.experimental.compute_on import compute_on
    host = jax.memory.Space.Host
    placed = (a if n in in_place else jax.device_put(a, host) for n, a in enumerate(args))
    y = compute_on(fn, compute_type="device_host", out_memory_spaces=host)(*placed)
    return jax.device_put(y, jax.memory.Space.Device)


def programs(registered: bool) -> dict:
    """The jitted program of each of the five first variants (the ``host_ffi`` ones last and only where the handlers
    are registered), each taking (x float32 [rows, hidden] on the device, the bank float32 [R, hidden] in pinned host
    memory, the bank row int32 [] on the device) and returning its result on the device."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import io_callback

    def ffi_double(x):
        return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    def ffi_double_add_row(x, bank, row):
        return jax.ffi.ffi_call(TARGET_BANK, jax.ShapeDtypeStruct(x.shape, x.dtype))(x, bank, row)

    out = {"device": lambda x, bank, row: x * 2,
           "io_callback": lambda x, bank, row: io_callback(lambda a: np.asarray(a) * np.float32(2),
                                                           jax.ShapeDtypeStruct(x.shape, jnp.float32), x),
           "host_jnp": lambda x, bank, row: on_host(lambda a: a * 2, x)}
    if registered:
        out["host_ffi"] = lambda x, bank, row: on_host(ffi_double, x)
        out["host_ffi_bank"] = lambda x, bank, row: on_host(ffi_double_add_row, x, bank, row, in_place=(1,))
    return {k: jax.jit(v) for k, v in out.items()}


def expert_programs(cpu, ks: list[int], registered: bool) -> dict:
    """The expert rows' programs, per k in ``ks``, each of (x float32 [rows, hidden] on the device, ids int32 [k] on
    the device) -> [k, rows, hidden] float32 on the device: the C kernel's FFN of experts ``ids`` on x, reached the
    engine's way (``native_callbacks_k<k>``: ``cpu`` is ``make_cpu_experts("native_async", ...)``, and the program
    its ``launch`` then ``collect``: two ``io_callback``s, each under its ``lax.cond``) and, where the handlers are
    registered, from a host region (``host_expert_ffn_k<k>``: the FFI handler calling the kernel through its address,
    with its bank descriptors, a work buffer and its size as attributes). A host-region program owns its work
    buffer (sized at trace time for its x; held by the traced function), so one call of it may run at a time, as
    :func:`main` runs them."""
    import ctypes

    import jax
    import jax.numpy as jnp
    import numpy as np

    from ftjax.experts import cpu_native
    kernel = cpu.kernel
    fns = {}
    fn_addr = ctypes.cast(kernel._lib.ftjax_expert_ffn, ctypes.c_void_p).value
    gu, dn = ctypes.addressof(kernel._gu.mat), ctypes.addressof(kernel._dn.mat)

    def callbacks(x, i):
        handle = cpu.launch(x, i, jnp.int32(i.shape[0]), None)
        return cpu.collect(handle, x, i.shape[0])

    for k in ks:
        fns[f"native_callbacks_k{k}"] = jax.jit(callbacks)  # one jit each: the rows are timed apart
        if not registered:
            continue
        rb1, rb2 = kernel._gu.rows_per_block(kernel.threads, k), kernel._dn.rows_per_block(kernel.threads, k)
        buffers = []  # the work buffers of this program's traces (each x shape gets its own, sized for it)

        def ffn(x, i, k=k, rb1=rb1, rb2=rb2, buffers=buffers):
            size = int(kernel._lib.ftjax_expert_ffn_work(ctypes.byref(kernel._gu.mat), ctypes.byref(kernel._dn.mat),
                                                         k, x.shape[0], rb1, rb2, kernel.threads))
            work = cpu_native._Work().get(size)
            buffers.append(work)
            return jax.ffi.ffi_call(TARGET_FFN, jax.ShapeDtypeStruct((k,) + x.shape, jnp.float32))(
                x, i, fn=np.uint64(fn_addr), gu=np.uint64(gu), dn=np.uint64(dn), work=np.uint64(work.ctypes.data),
                work_floats=np.int64(size), hidden=np.int32(kernel.hidden), experts=np.int32(kernel.experts),
                rb1=np.int32(rb1), rb2=np.int32(rb2), threads=np.int32(kernel.threads))

        fns[f"host_expert_ffn_k{k}"] = jax.jit(lambda x, i, ffn=ffn: on_host(ffn, x, i))
    return fns


def expert_ids(k: int, calls: int, experts: int) -> list:
    """``calls`` id arrays int32 [k] on the device, each the next k experts round the bank (so that repeated calls
    read other experts, as a layer's misses do, not the same ones warm in the host's cache)."""
    import jax.numpy as jnp
    import numpy as np
    return [jnp.asarray((c * k + np.arange(k)) % experts, jnp.int32) for c in range(calls)]


def swiglu_reference(gu, dn, x, ids):
    """float64 numpy SwiGLU FFNs [k, N, D] of experts ``ids`` on x [N, D] (banks bf16 [R, D, 2F] / [R, F, D])."""
    import numpy as np
    out = []
    for e in np.asarray(ids):
        h = np.asarray(x, np.float64) @ np.asarray(gu[e], np.float64)
        f = h.shape[1] // 2
        a = h[:, :f] * (0.5 + 0.5 * np.tanh(h[:, :f] / 2)) * h[:, f:]  # silu by tanh: no overflow in exp
        out.append(a @ np.asarray(dn[e], np.float64))
    return np.stack(out)


def time_block(fn, args_of_call: list) -> dict:
    """Microseconds a call of one program, its calls back to back (each on the next of ``args_of_call``, round),
    after two untimed ones and a pause: a route's OpenMP threads (each calling host thread has its own team) run
    alone, not beside another route's spinning ones."""
    time.sleep(FLAGS.pause_s)
    seconds = common.timed(lambda c: fn(*args_of_call[c % len(args_of_call)]), FLAGS.repeats)
    return common.spread([1e6 * t for t in seconds])


def fits(rows: list[dict], expert_bytes: int) -> list[dict]:
    """Per route of the expert rows, the line through its two ends of k: fixed microseconds a call (the intercept)
    and weight GB/s (expert bytes per microsecond of slope / 1e3)."""
    out = []
    for route in ("native_callbacks", "host_expert_ffn"):
        pts = sorted((int(r["variant"].rsplit("_k", 1)[1]), r["us"]["median"]) for r in rows
                     if r["variant"].startswith(route + "_k") and r.get("us"))
        if len(pts) >= 2 and pts[-1][0] > pts[0][0]:
            (k0, t0), (k1, t1) = pts[0], pts[-1]
            per = (t1 - t0) / (k1 - k0)
            out.append({"route": route, "ks": [k0, k1], "fixed_us": t0 - per * k0,
                        "gbps": expert_bytes / per / 1e3 if per > 0 else None})
    return out


def evidence(fn, args) -> dict:
    """What the compiled program says of where each part ran: counts of the FFI targets' names, of host-compute
    annotations and of asynchronous host calls in its optimized HLO text (a region XLA did not split off would leave
    the custom call in the device program with no host annotation)."""
    try:
        text = fn.lower(*args).compile().as_text()
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e)[:400]}"}
    marks = (TARGET_BANK, TARGET_FFN, "_xla_compute_type", "host-execute", "HostExecute", "call-start",
             "custom-call-start")
    # the bank's target contains the plain one's name: count the plain name apart
    counts = {m: text.count(m) for m in marks}
    counts[TARGET] = text.count(f'"{TARGET}"')
    return counts


def check(fn, args, want) -> dict:
    """A variant compiled and run once: {ok, correct} or {ok: False, error}."""
    import numpy as np
    try:
        got = np.asarray(fn(*args))
        fn(*args).block_until_ready()
    except Exception as e:  # a refusal is the probe's answer, not its failure
        return {"ok": False, "error": f"{type(e).__name__}: {str(e)[:800]}"}
    return {"ok": True, "correct": bool(np.array_equal(got, want))}


def time_all(fns: dict, args: dict) -> dict:
    """Microseconds a call of each program, timed in rounds (one call of each per round, so that drift of the
    machine reaches every variant alike), each on its own arguments (``args``: variant -> tuple): variant -> spread,
    or {error} for a variant that failed while timed (it leaves the rounds)."""
    times, errors = {k: [] for k in fns}, {}
    for _ in range(FLAGS.repeats):
        for k, fn in fns.items():
            if k in errors:
                continue
            try:
                t0 = time.perf_counter()
                fn(*args[k]).block_until_ready()
                times[k].append(1e6 * (time.perf_counter() - t0))
            except Exception as e:
                errors[k] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
    return {k: errors.get(k) or common.spread(v) for k, v in times.items()}


def expert_kernel():
    """``make_cpu_experts("native_async", ...)`` (the C kernel, ``cpu_native.NativeKernel``, read in place) on bf16
    banks [experts, hidden, 2 ffn] / [experts, ffn, hidden] of seeded normal values (x 0.05) in pinned host memory;
    returns (it, (the banks as numpy arrays, for the reference)).

    Raises:
      cpu_native.NativeBuildError, cpu_experts.HostViewError, ValueError: no C compiler, no zero-copy view of the
        banks, a kernel that refuses them (:func:`main` records the reason and skips the expert rows)."""
    import jax
    import ml_dtypes
    import numpy as np

    from ftjax import memory
    from ftjax.experts import cpu_experts
    rng = np.random.default_rng(0)
    shapes = ((FLAGS.experts, FLAGS.hidden, 2 * FLAGS.ffn), (FLAGS.experts, FLAGS.ffn, FLAGS.hidden))
    banks = [(rng.standard_normal(shape, np.float32) * 0.05).astype(ml_dtypes.bfloat16) for shape in shapes]
    gu, dn = (jax.device_put(b, memory.host_sharding()) for b in banks)
    cpu = cpu_experts.make_cpu_experts("native_async", gu, dn, threads=FLAGS.threads or None, from_program=False)
    cpu.kernel.expert_bytes = (gu.nbytes + dn.nbytes) // FLAGS.experts
    return cpu, banks


PENDING = "no answer: the process ended in this variant's first compile or call"
TIMING = "no answer: the process ended while this variant was timed"


def first_run(out: dict, save, variant: str, fn, args, want, **extra) -> dict:
    """Appends ``variant``'s row, saved as :data:`PENDING` before its first compile and call and then with
    :func:`check`'s answer and :func:`evidence` (and ``extra``): a handler that kills the process leaves its name."""
    row = {"variant": variant, "ok": False, "error": PENDING, **extra}
    out["rows"].append(row)
    save()
    row.pop("error")
    row.update(check(fn, args, want), hlo=evidence(fn, args))
    save()
    return row


def main(argv):
    del argv
    import fnmatch

    import jax.numpy as jnp
    import numpy as np

    from ftjax.experts import cpu_experts, cpu_native
    out = {"question": "does a CPU FFI custom call run inside compute_on('device_host') of a GPU program, does a "
                       "pinned bank reach it in place, and what fixed cost has the C expert kernel called that way "
                       "against native_async's two io_callbacks?", "skipped": {}, "left_out": [], "rows": []}
    name = f"probe_host_ffi{'_' + FLAGS.tag if FLAGS.tag else ''}.json"

    def save():  # after every step: a crash in XLA's host path must not lose the rows before it
        return common.write_json(FLAGS.out_dir, name, out)

    def wanted(fns: dict) -> dict:
        left = {v: f for v, f in fns.items() if not any(fnmatch.fnmatchcase(v, p) for p in FLAGS.skip)}
        out["left_out"] += [v for v in fns if v not in left]
        return left

    def timing(rows: list[dict]):  # rows saved as TIMING while timed: a crash there leaves their names too
        for r in rows:
            r["error"] = TIMING
        save()
        return rows

    with tempfile.TemporaryDirectory(prefix="probe_host_ffi-") as folder:
        lib, compiler = (None, "registered earlier in this process") if _REGISTERED else build(folder)
        why = None if _REGISTERED else (compiler if lib is None else register(lib))
        out["compiler"] = None if why else compiler
        out["host_registration"] = dict(HOST_REGISTRATION)
        if why:
            out["skipped"]["host_ffi"] = why  # every handler variant
            print(f"skipped: host_ffi, host_ffi_bank, host_expert_ffn ({why})", flush=True)
    x = jnp.arange(FLAGS.rows * FLAGS.hidden, dtype=jnp.float32).reshape(FLAGS.rows, FLAGS.hidden) / 7
    rows = max(ROW + 1, FLAGS.bank_mb * 2**20 // (4 * FLAGS.hidden))
    bank = common.pinned_array((rows, FLAGS.hidden), jnp.float32, 3)
    args = (x, bank, jnp.int32(ROW))
    out["bank"] = {"rows": rows, "bytes": rows * FLAGS.hidden * 4, "memory_kind": bank.sharding.memory_kind}
    want = np.asarray(x) * np.float32(2)
    wants = {"host_ffi_bank": want + np.asarray(bank[ROW])[None, :]}
    ks = sorted({int(k) for k in FLAGS.ks})
    try:
        cpu, banks = expert_kernel()
    except (cpu_native.NativeBuildError, cpu_experts.HostViewError, ValueError) as e:  # the rest stands
        cpu, banks = None, None
        out["skipped"]["experts"] = f"{type(e).__name__}: {str(e)[:800]}"
        print(f"skipped: the expert rows ({str(e)[:200]})", flush=True)
    out["experts"] = None if cpu is None else {
        "experts": FLAGS.experts, "hidden": FLAGS.hidden, "ffn": FLAGS.ffn, "ks": ks, "threads": cpu.kernel.threads,
        "expert_bytes": cpu.kernel.expert_bytes, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}
    fns = wanted(programs(not why))
    efns = wanted(expert_programs(cpu, ks, not why)) if cpu else {}
    # what runs without the handlers first, each part timed and saved before any handler's first call: a handler
    # that kills the process in a host region (on a GPU) then leaves every figure but its own
    spreads, checks = {}, {}  # checks: k -> (its calls' ids, the kernel's own result, its error against float64)

    def kernel_check(k: int):  # once per k: both routes of k call the kernel on the same ids
        if k not in checks:
            calls = expert_ids(k, max(1, min(FLAGS.repeats, -(-FLAGS.experts // k))), FLAGS.experts)
            # the kernel's own result, from its driver thread (as the callbacks route runs it), checked against
            # float64
            want_e = cpu.kernel.result(cpu.kernel.submit(np.asarray(x), np.asarray(calls[0]), k))
            ref = swiglu_reference(banks[0], banks[1], np.asarray(x), np.asarray(calls[0]))
            checks[k] = calls, want_e, float(np.max(np.abs(want_e - ref)) / max(np.max(np.abs(ref)), 1e-30))
        return checks[k]

    for handlers in (False, True):
        part = {v: f for v, f in fns.items() if v.startswith("host_ffi") == handlers}
        done = [first_run(out, save, v, f, args, wants.get(v, want)) for v, f in part.items()]
        timed = timing([r for r in done if r["ok"]])
        spreads.update(time_all({r["variant"]: fns[r["variant"]] for r in timed}, {r["variant"]: args for r in done}))
        for r in timed:
            r.pop("error")
            r["us"] = spreads[r["variant"]]
        save()
        for variant, fn in efns.items():
            if variant.startswith("host_expert_ffn") != handlers:
                continue
            calls, want_e, rel_err = kernel_check(int(variant.rsplit("_k", 1)[1]))
            row = first_run(out, save, variant, fn, (x, calls[0]), want_e, kernel_rel_err=rel_err)
            if row["ok"]:
                timing([row])
                try:
                    row["us"] = time_block(fn, [(x, c) for c in calls])
                    row.pop("error")
                except Exception as e:
                    row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:400]}")
            save()
    base = spreads.get("device", {}).get("median")
    for r in out["rows"]:
        timed = r.get("us") or {}
        if r["ok"] and "error" in timed:
            r.update(ok=False, error=timed["error"])
        if r["ok"]:
            r["us"] = timed
            r["net_us"] = None if base is None else r["us"]["median"] - base
            net = "" if r["net_us"] is None else f" (net {r['net_us']:.1f})"
            shown = f"{r['us']['median']:.1f} us{net}, correct {r['correct']}"
        else:
            shown = r["error"]
        print(f"{r['variant']:20s} {shown}", flush=True)
    out["fits"] = fits(out["rows"], cpu.kernel.expert_bytes) if cpu else []
    for f in out["fits"]:
        gbps = "-" if f["gbps"] is None else f"{f['gbps']:.1f}"
        print(f"fit {f['route']:18s} fixed {f['fixed_us']:.1f} us, {gbps} GB/s (k {f['ks']})", flush=True)
    if cpu is not None:
        cpu.kernel.close()
    print("wrote", save())


if __name__ == "__main__":
    common.run(main)
