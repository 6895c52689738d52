r"""Can a layer scan's expert copies run on a second GPU stream beside the layer's compute (issue 32's offload decode
beyond its serial bound; docs/PROFILE.md "Open")?

A decode step's misses and its other kernels run in series on XLA's one compute stream, so the cached step is at
best the resident step plus its miss bytes over the link (1.04-1.06x of that on an H100, 2026-12-06). Copies that run
while the non-expert kernels run can beat it. ``jax.experimental.compute_on(compute_type="gpu_stream:N")`` marks a
computation for stream N (``_xla_stream_annotation``); in DESIGN.md section 3 (2026-11-30) it failed with "No
ExecutionStreamId found". XLA has an option for these annotations, ``xla_gpu_experimental_stream_annotation``
(present in jax 0.11.2's XLA); this probe sets it in the compile options of every variant that copies and computes.

Each row is one jitted ``lax.scan`` over ``--layers`` layers (the buffer carried, as the decode step's scan carries
its slot pool) and times the scan per layer (median and spread of ``--repeats`` calls after two untimed ones). Every
layer first reads a row of the buffer that the layer before filled (its last 4096 columns, which a copy writes last),
behind an optimization barrier with the buffer
(so the read is ordered before the layer's copy and XLA need not copy the buffer to keep them apart); then:

* ``empty``: nothing else (the scan's own cost a layer, subtracted from every row in ``overlap``);
* ``copy``: ``--copies`` experts a layer read from a pinned host bank (``--expert_mb`` each) into the next free rows
  of a staging buffer of two layers' copies;
* ``compute``: a stand-in for a layer's non-expert work: ``--compute_mb`` of bf16 weights read by a 4-row GEMV chain
  (bandwidth-bound, as decode is), starting from the row read;
* ``serial``: both (a prefetch one layer ahead: nothing in the body orders the copy after the compute or before it,
  only XLA's one stream does);
* ``stream1``: ``serial`` with the copy inside ``compute_on(compute_type="gpu_stream:1")``;
* ``serial_pool`` / ``stream1_pool``: the same with a buffer of ``--pool_experts`` rows, as a prefetch into the decode
  step's slot pool would be (``buffer_copies``: the compiled program's copies of the whole buffer, which must stay
  0; ``temp_bytes``);
* ``compute_on1`` / ``stream1_compute``: the other way round, the compute inside ``compute_on("gpu_stream:1")``,
  alone (the baseline: the call boundary alone changes how XLA fuses the compute) and beside the copy on XLA's
  stream.

The copy is XLA's (a dynamic index of the host bank moved to the device, ``--copy=xla``) or the slot-copy kernel's
(``ftjax.experts.slot_copy``, ``--copy=kernel``: an FFI call handed the stream it runs on), or that kernel on a stream
the library owns (``--copy=kernel_async``: ``slot_copy.copy_into_slots_start``, returning at once, and ``wait_slots``
at the next layer's start making XLA's stream wait for it; both run outside XLA's CUDA graphs; its ``serial`` rows are
the overlap question, the stream-annotated rows are not run; ``same_result_as_kernel`` compares them with the kernel's
rows, and ``valid`` is false where the compiled program copies the whole buffer, which would race with the copy; its
``copy_nowait`` row is the negative control: ``copy`` without the waits inside the scan (only the one at its end),
whose rows are read while their copies still run, so its ``same_result_as_kernel`` against the kernel's ``copy`` row
must be false, or the check cannot see a missing wait; ``--blocks_per_miss`` sets the kernel's thread blocks per miss:
the async copy overlaps with 2-8, not with the default 64 at several misses). With ``--graphs=on`` the programs
compile with the cached decode step's command buffers. Overlap shows as ``serial`` near ``copy`` + ``compute`` and
``stream1`` near max(``copy``, ``compute``); each row records its compiled HLO's op counts, ``annotated`` (the
annotation survives in the program text even where XLA ignores it: the CPU keeps it), the ``operation_queue_ids`` XLA
assigned in its backend configs (a second id is the evidence of a second stream) and the error of a variant XLA
refuses.

  PYTHONPATH=. python3 experiments/probe_copy_stream.py --out_dir=$OUT --tag=h200_$(date -u +%F)        # GPU
  .venv/bin/python experiments/probe_copy_stream.py --expert_mb=1 --compute_mb=4 --layers=4 --repeats=2 \
      --out_dir=/tmp/copy_stream                                                                           # CPU smoke

Writes ``probe_copy_stream[_<tag>].json``: ``b_p`` (a pinned ``device_put`` of ``--b_p_mib``), ``shape``,
``skipped`` (a copy path or the command buffers this machine cannot run, with the reason; also printed), ``rows``
({variant, copy, graphs, ms_per_layer spread, hlo, annotated, operation_queue_ids, buffer_copies, temp_bytes,
same_result_as_serial and max_abs_diff_vs_serial -- a stream1 variant's (buffer, act) against its serial one's --,
error}) and ``overlap`` per copy path and graphs: with every time net of ``empty``, for each serial and stream1
variant (copy + compute - it) / min(copy, compute), the share of the shorter part hidden (1.0: fully overlapped,
0: serial; ``stream1_compute``'s against ``compute_on1``, the compute it runs). On a CPU there is one
stream and the rows are milliseconds of noise: the CPU run checks the programs, not the overlap.
"""

from __future__ import annotations

import os
import re
import sys

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import common  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("layers", 16, "Layers of the scan.", lower_bound=1)
flags.DEFINE_integer("copies", 1, "Experts copied a layer (the prefetch one layer ahead).", lower_bound=1)
flags.DEFINE_float("expert_mb", 6.29, "MB (1e6 bytes) of one expert, bf16 (6.29: qwen3.5-35b-a3b's).",
                   lower_bound=0.01)
flags.DEFINE_integer("bank_experts", 64, "Experts in the pinned host bank.", lower_bound=1)
flags.DEFINE_float("compute_mb", 300.0, "MB of bf16 weights the stand-in compute reads a layer (300 MB: ~0.1 ms "
                   "at an H100's 3.35 TB/s, about the 16-layer hybrid's non-expert time a layer).", lower_bound=0.01)
flags.DEFINE_integer("blocks_per_miss", 0, "Thread blocks per miss of the slot-copy kernel (0: its default, "
                     "slot_copy.BLOCKS_PER_MISS); fewer leave SMs to the compute beside an async copy.", lower_bound=0)
flags.DEFINE_integer("pool_experts", 256, "Slots of the pool of the *_pool variants.", lower_bound=1)
flags.DEFINE_list("copy", ["xla", "kernel"], "Copy paths: xla (a host slice moved to the device), kernel (the "
                  "slot-copy kernel; skipped with the reason where it cannot build), kernel_async (the same kernel on "
                  "a stream of its own, joined by the next layer: serial and serial_pool rows only).")
flags.DEFINE_list("graphs", ["on", "off"], "Compile with the cached decode step's command buffers (on) and / or "
                  "without (off); GPU only (elsewhere: off).")
flags.DEFINE_integer("b_p_mib", 512, "MiB of the pinned device_put that measures the copy rate B_P.", lower_bound=1)
flags.DEFINE_integer("repeats", 10, "Timed calls per row (after two untimed).", lower_bound=1)
flags.DEFINE_string("out_dir", "experiments/results/overlap", "Where the JSON goes.")
flags.DEFINE_string("tag", "", "Goes into the JSON's name.")
common.check_names("copy", ("xla", "kernel", "kernel_async"))
common.check_names("graphs", ("on", "off"))

VARIANTS = ("empty", "copy", "compute", "serial", "stream1", "serial_pool", "stream1_pool", "compute_on1",
            "stream1_compute")
#: The rows of ``--copy=kernel_async`` (its own stream is the question; the stream-annotated rows are the others'),
#: with the negative control ``copy_nowait`` (no wait inside the scan: the check must see stale rows).
ASYNC_VARIANTS = ("empty", "copy", "compute", "serial", "serial_pool", "copy_nowait")
#: XLA's option that turns ``_xla_stream_annotation`` into a stream of its own (without it: "No ExecutionStreamId").
STREAM_OPTION = {"xla_gpu_experimental_stream_annotation": True}
#: Rows of the stand-in compute's GEMVs (a decode batch padded to 4 rows, as ``KernelConfig.min_dot_rows``).
ROWS, WIDTH = 4, 4096


def shapes() -> dict:
    """The element counts of the run: an expert as one bf16 row, the compute's [n, WIDTH, WIDTH] weights."""
    expert_elems = max(WIDTH, int(FLAGS.expert_mb * 1e6 / 2) // WIDTH * WIDTH)
    mats = max(1, round(FLAGS.compute_mb * 1e6 / (2 * WIDTH * WIDTH)))
    return {"expert_elems": expert_elems, "expert_bytes": expert_elems * 2, "compute_mats": mats,
            "compute_bytes": mats * WIDTH * WIDTH * 2, "copies": FLAGS.copies, "layers": FLAGS.layers,
            "bank_experts": FLAGS.bank_experts}


def _copy_fn(path: str):
    """``(bank [B, R] host, buf [P, R] device, ids [C], slots [C]) -> buf``: the layer's copies, bank row
    ``ids[j]`` into ``buf`` row ``slots[j]``."""
    import jax

    from ftjax.experts import fetch, slot_copy
    blocks = FLAGS.blocks_per_miss or slot_copy.BLOCKS_PER_MISS
    if path == "kernel":
        def copy(bank, buf, ids, slots):
            return slot_copy.copy_into_slots(bank, buf, ids, slots, jax.numpy.int32(ids.shape[0]),
                                             blocks_per_miss=blocks)
        return copy
    if path == "kernel_async":  # on the library's own stream; the next layer's wait_slots joins it
        def copy(bank, buf, ids, slots):
            return slot_copy.copy_into_slots_start(bank, buf, ids, slots, jax.numpy.int32(ids.shape[0]),
                                                   blocks_per_miss=blocks)
        return copy

    def copy(bank, buf, ids, slots):
        for i in range(ids.shape[0]):
            buf = jax.lax.dynamic_update_index_in_dim(buf, fetch._bank_row(bank, buf, ids[i]), slots[i], 0)
        return buf
    return copy


def program(variant: str, path: str):
    """The jitted scan of a row: ``(bank, weights, buf, act, (ids [L, C], slots [L, C], read [L])) -> (buf, act)``
    (``read[l]``: the slot the compute of layer l reads, one the layer before filled)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.compute_on import compute_on

    copy = _copy_fn(path)
    if variant in ("stream1", "stream1_pool"):
        copy = compute_on(compute_type="gpu_stream:1", out_memory_spaces=jax.memory.Space.Device)(copy)

    copies = variant not in ("empty", "compute", "compute_on1")
    computes = variant not in ("empty", "copy", "copy_nowait")

    def compute(weights, act):
        for m in range(weights.shape[0]):
            act = jnp.tanh(act @ weights[m]).astype(act.dtype)
        return act
    if variant in ("compute_on1", "stream1_compute"):  # the other way round: the compute on stream 1
        compute = compute_on(compute_type="gpu_stream:1", out_memory_spaces=jax.memory.Space.Device)(compute)

    joins = path == "kernel_async" and copies  # the copy runs on; the next layer (and the end) waits for it
    waits_each_layer = joins and variant != "copy_nowait"  # the negative control waits only at the end
    if joins:
        from ftjax.experts import slot_copy

    def call(bank, weights, buf, act, xs):
        def layer(carry, x):
            buf, act, last = carry
            ids, slots, read = x
            if waits_each_layer:  # the layer before's copy has landed before its row is read (its indices kept alive)
                buf = slot_copy.wait_slots(buf, *last)
            # the previous layer's prefetch is read before this layer's copy may overwrite the buffer; its last
            # columns, the ones a copy writes last
            row, buf = jax.lax.optimization_barrier((buf[read, -WIDTH:], buf))
            act = act + row.astype(act.dtype)[None, :]
            new_buf = copy(bank, buf, ids, slots) if copies else buf
            if copies and computes:  # the copy is issued before the compute (kernel_async: so it can run beside it)
                new_buf, act = jax.lax.optimization_barrier((new_buf, act))
            act = compute(weights, act) if computes else act
            return (new_buf, act, (ids, slots, jnp.int32(ids.shape[0]))), None
        c = xs[0].shape[1]
        none = (jnp.zeros((c,), jnp.int32), jnp.zeros((c,), jnp.int32), jnp.int32(0))
        buf, act, last = jax.lax.scan(layer, (buf, act, none), xs)[0]
        return (slot_copy.wait_slots(buf, *last) if joins else buf), act
    return jax.jit(call, donate_argnums=(2,))


def queue_ids(text: str) -> list[int]:
    """The distinct ``operation_queue_id`` values of the compiled HLO's backend configs (the streams XLA assigned),
    sorted."""
    return sorted({int(q) for q in re.findall(r'"operation_queue_id":"?(\d+)', text)})


def buffer_copies(text: str, shape: tuple) -> int:
    """Instructions of the compiled HLO that copy a whole bf16 array of ``shape`` on the device (``copy``)."""
    dims = ",".join(str(d) for d in shape)
    return len(re.findall(rf"= bf16\[{dims}\]\{{[^}}]*\}} copy\(", text))


def layer_slots(pool: int, copies: int, layers: int, bank_experts: int) -> tuple:
    """The scan's xs for a buffer of ``pool`` >= 2C rows: (bank ids int32 [L, C] drawn at random, the slots they
    land in int32 [L, C] -- the next C rows, round the buffer's whole blocks of C --, the slot each layer reads int32
    [L]: the first of the layer before's, for layer 0 the first of the ring's last block -- never a row the layer
    writes)."""
    import jax.numpy as jnp
    import numpy as np
    c, n = copies, layers
    ids = np.random.default_rng(0).integers(0, bank_experts, (n, c))
    ring = pool // c * c
    slots = (np.arange(n * c) % ring).reshape(n, c)
    read = np.concatenate([[ring - c], slots[:-1, 0]])
    return jnp.asarray(ids, jnp.int32), jnp.asarray(slots, jnp.int32), jnp.asarray(read, jnp.int32)


def measure_row(variant: str, path: str, graphs: str, args: tuple, repeats: int) -> tuple[dict, object]:
    """One row: compile (with :data:`STREAM_OPTION` on a GPU), time, and the final (buf's first columns, act) for
    the identity check; an error XLA raises becomes the row's ``error``."""
    import jax
    import numpy as np
    row = {"variant": variant, "copy": path, "graphs": graphs}
    opts = common.graph_options(graphs)
    if jax.default_backend() == "gpu":  # every variant alike: the annotation is the one difference
        opts = {**opts, **STREAM_OPTION}
    bank, weights, buf, act, xs = args
    try:
        fn = program(variant, path)
        compiled = fn.lower(bank, weights, buf, act, xs).compile(compiler_options=opts or None)
        text = compiled.as_text()
        row["hlo"] = common.hlo_ops(text)
        row["annotated"] = "_xla_stream_annotation" in text
        row["operation_queue_ids"] = queue_ids(text)
        row["buffer_copies"] = buffer_copies(text, buf.shape)
        mem = compiled.memory_analysis()
        row["temp_bytes"] = None if mem is None else int(mem.temp_size_in_bytes)
        state = {"buf": buf}

        def one(_):
            state["buf"], a = compiled(bank, weights, state["buf"], act, xs)
            return a
        secs = common.timed(one, repeats)
        row["ms_per_layer"] = common.spread([s * 1e3 / xs[2].shape[0] for s in secs])
        result = (np.asarray(state["buf"][:, :16].astype(np.float32)), np.asarray(one(0).astype(np.float32)))
        return row, result
    except Exception as e:  # noqa: BLE001 - a refused variant is a result
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:400]}"
        return row, None


def overlap(rows: list[dict]) -> list[dict]:
    """Per copy path and graphs, every median net of ``empty``'s (the scan's own cost a layer): copy_ms, compute_ms,
    compute_on1_ms, and for each serial and stream1 variant its ms and the share of the shorter of copy and compute
    it hid, (copy + compute - it) / min(copy, compute), where compute is compute_on1's for stream1_compute."""
    out = []
    for path in dict.fromkeys(r["copy"] for r in rows):
        for g in dict.fromkeys(r["graphs"] for r in rows):
            ms = {r["variant"]: r["ms_per_layer"]["median"] for r in rows
                  if r["copy"] == path and r["graphs"] == g and "ms_per_layer" in r}
            if not {"empty", "copy", "compute"} <= set(ms):
                continue
            net = {v: t - ms["empty"] for v, t in ms.items() if v != "empty"}
            entry = {"copy": path, "graphs": g, "empty_ms": ms["empty"], "copy_ms": net["copy"],
                     "compute_ms": net["compute"], "compute_on1_ms": net.get("compute_on1")}
            for v in ("serial", "stream1", "serial_pool", "stream1_pool", "stream1_compute"):
                if v in net:
                    # stream1_compute against the compute it runs (compute_on1's), the others against compute's
                    comp = net.get("compute_on1") if v == "stream1_compute" else net["compute"]
                    entry[f"{v}_ms"] = net[v]
                    entry[f"{v}_hidden"] = (None if comp is None or min(net["copy"], comp) <= 0 else  # no baseline
                                            round((net["copy"] + comp - net[v]) / min(net["copy"], comp), 3))
            out.append(entry)
    return out


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    import numpy as np

    from absl import app

    from ftjax.experts import slot_copy
    if FLAGS.pool_experts < 2 * FLAGS.copies:
        raise app.UsageError(f"--pool_experts={FLAGS.pool_experts} is less than two layers' copies (2 x --copies="
                             f"{FLAGS.copies}): a layer would write the rows it reads")
    shape = shapes()
    paths = list(dict.fromkeys(FLAGS.copy))
    skipped = {}
    for kernel in ("kernel", "kernel_async"):
        if kernel in paths and slot_copy.unavailable() is not None:
            skipped[kernel] = slot_copy.unavailable()
            paths.remove(kernel)
    if not paths:
        raise app.UsageError(f"--copy={','.join(FLAGS.copy)}: nothing to run here ({'; '.join(skipped.values())})")
    graphs = list(dict.fromkeys(FLAGS.graphs)) if jax.default_backend() == "gpu" else ["off"]
    if graphs != list(dict.fromkeys(FLAGS.graphs)):
        skipped["graphs=on"] = "command buffers are XLA:GPU's"
    for what, why in skipped.items():
        print(f"skipped: {what} ({why})", flush=True)
    name = f"probe_copy_stream{'_' + FLAGS.tag if FLAGS.tag else ''}.json"
    out = {"question": "do a layer scan's copies on gpu_stream:1 overlap the layer's compute?",
           "b_p": common.measure_h2d(FLAGS.b_p_mib * 2**20), "shape": shape, "skipped": skipped, "rows": [],
           "overlap": []}
    bank = common.pinned_array((FLAGS.bank_experts, shape["expert_elems"]), jnp.bfloat16, 1)
    key = jax.random.key(0)
    weights = (jax.random.normal(key, (shape["compute_mats"], WIDTH, WIDTH), jnp.float32) / WIDTH ** 0.5
               ).astype(jnp.bfloat16)
    act = jnp.ones((ROWS, WIDTH), jnp.bfloat16)
    results = {}
    for path in paths:
        for g in graphs:
            for variant in ASYNC_VARIANTS if path == "kernel_async" else VARIANTS:
                rows = FLAGS.pool_experts if variant.endswith("_pool") else 2 * FLAGS.copies
                buf = jnp.zeros((rows, shape["expert_elems"]), jnp.bfloat16)
                xs = layer_slots(rows, FLAGS.copies, FLAGS.layers, FLAGS.bank_experts)
                row, res = measure_row(variant, path, g, (bank, weights, buf, act, xs), FLAGS.repeats)
                results[(path, g, variant)] = res
                if path == "kernel_async":  # a copy of the pool while the copy writes it would race: not a result
                    row["valid"] = row.get("buffer_copies") == 0
                same = "copy" if variant == "copy_nowait" else variant  # the control against the waited copies
                if path == "kernel_async" and ("kernel", g, same) in results:  # the same copies, joined later
                    row["same_result_as_kernel"] = common.same_arrays(res, results[("kernel", g, same)])
                if variant.startswith("stream1"):
                    base = results.get((path, g, "serial_pool" if variant == "stream1_pool" else "serial"))
                    row["same_result_as_serial"] = common.same_arrays(res, base)
                    if res is not None and base is not None:
                        row["max_abs_diff_vs_serial"] = [float(np.max(np.abs(a - b))) for a, b in zip(res, base)]
                out["rows"].append(row)
                out["overlap"] = overlap(out["rows"])
                common.write_json(FLAGS.out_dir, name, out)
                print(f"{path} graphs {g} {variant}:", row.get("error") or
                      f"{row['ms_per_layer']['median']:.4f} ms a layer, queues {row['operation_queue_ids']}, "
                      f"buffer copies {row['buffer_copies']}", flush=True)
    path = common.write_json(FLAGS.out_dir, name, out)
    for r in out["rows"]:
        if r["variant"] == "copy_nowait":  # must differ from the waited copies, or the check cannot see a late copy
            seen = r.get("same_result_as_kernel")
            print(f"negative control (graphs {r['graphs']}): same_result_as_kernel={seen}",
                  "(as it must be)" if seen is False else "(WARNING: the result check did not see the missing wait)")
    print(common.table(out["overlap"], ["copy", "graphs", "empty_ms", "copy_ms", "compute_ms", "serial_hidden",
                                        "stream1_hidden", "serial_pool_hidden", "stream1_pool_hidden"]))
    print("wrote", path)


if __name__ == "__main__":
    common.run(main)
