r"""Can a layer scan's expert copies run on a second GPU stream beside the layer's compute (issue 32's offload decode
beyond its serial bound; docs/PROFILE.md "Open")?

A decode step's misses and its other kernels run in series on XLA's one compute stream, so the cached step is at
best the resident step plus its miss bytes over the link (1.04-1.06x of that on an H100, 2026-12-06). Copies that run
while the non-expert kernels run can beat it. ``jax.experimental.compute_on(compute_type="gpu_stream:N")`` marks a
computation for stream N (``_xla_stream_annotation``); in DESIGN.md section 3 (2026-11-30) it failed with "No
ExecutionStreamId found" without XLA's ``xla_gpu_experimental_stream_annotation`` option, which this probe sets in
the programs' compile options.

Each row is one jitted ``lax.scan`` over ``--layers`` layers (the pools and buffers carried, as the decode step's
scan carries them) and times the scan per layer (median and spread of ``--repeats`` calls after two untimed ones):

* ``copy``: ``--copies`` experts a layer read from a pinned host bank (``--expert_mb`` each) into a device staging
  buffer (the next layer's, carried);
* ``compute``: a stand-in for a layer's non-expert work: ``--compute_mb`` of bf16 weights read by a 4-row GEMV chain
  (bandwidth-bound, as decode is);
* ``serial``: both in one body, the compute reading the staging buffer the previous layer filled (a prefetch one
  layer ahead: nothing in the body orders the copy after the compute, only XLA's one stream does);
* ``stream1``: ``serial`` with the copy inside ``compute_on(compute_type="gpu_stream:1")``.

The copy is XLA's (a dynamic index of the host bank moved to the device, ``--copy=xla``) or the slot-copy kernel's
(``ftjax.experts.slot_copy``, ``--copy=kernel``: an FFI call handed the stream it runs on). With ``--graphs=on`` the
programs compile with the cached decode step's command buffers. Overlap shows as ``serial`` near ``copy`` +
``compute`` and ``stream1`` near max(``copy``, ``compute``); each row records its compiled HLO's op counts (async
start / done pairs and the stream ids XLA gave them) and the error of a variant XLA refuses.

  PYTHONPATH=. python3 experiments/probe_copy_stream.py --out_dir=$OUT --tag=h200_$(date -u +%F)        # GPU
  .venv/bin/python experiments/probe_copy_stream.py --expert_mb=1 --compute_mb=4 --layers=4 --repeats=2 \
      --out_dir=/tmp/copy_stream                                                                           # CPU smoke

Writes ``probe_copy_stream[_<tag>].json``: ``b_p`` (a 512 MiB pinned ``device_put``), ``shape``, ``rows``
({variant, copy, graphs, ms_per_layer spread, hlo, stream_ids, same_result_as_serial, error}) and ``overlap`` per
copy path and graphs: (copy + compute - stream1) / min(copy, compute), the share of the shorter part hidden (1.0:
fully overlapped, 0: serial).
"""

from __future__ import annotations

import os
import re
import sys
import time

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
flags.DEFINE_list("copy", ["xla", "kernel"], "Copy paths: xla (a host slice moved to the device), kernel (the "
                  "slot-copy kernel; skipped with the reason where it cannot build).")
flags.DEFINE_list("graphs", ["on", "off"], "Compile with the cached decode step's command buffers (on) and / or "
                  "without (off); GPU only (elsewhere: off).")
flags.DEFINE_integer("repeats", 10, "Timed calls per row (after two untimed).", lower_bound=1)
flags.DEFINE_string("out_dir", "experiments/results/overlap", "Where the JSON goes.")
flags.DEFINE_string("tag", "", "Goes into the JSON's name.")
common.check_names("copy", ("xla", "kernel"))
common.check_names("graphs", ("on", "off"))

VARIANTS = ("copy", "compute", "serial", "stream1")
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
    """``(bank [B, R] host, staging [C, R] device, ids [C]) -> staging``: the layer's copies."""
    import jax

    from ftjax.experts import fetch, slot_copy
    if path == "kernel":
        def copy(bank, staging, ids):
            slots = jax.numpy.arange(ids.shape[0], dtype=jax.numpy.int32)
            return slot_copy.copy_into_slots(bank, staging, ids, slots, jax.numpy.int32(ids.shape[0]))
        return copy

    def copy(bank, staging, ids):
        for i in range(ids.shape[0]):
            staging = jax.lax.dynamic_update_index_in_dim(staging, fetch._bank_row(bank, staging, ids[i]), i, 0)
        return staging
    return copy


def program(variant: str, path: str):
    """The jitted scan of a row: ``(bank, weights, staging, act, ids [L, C]) -> (staging, act)``."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.compute_on import compute_on

    copy = _copy_fn(path)
    if variant == "stream1":
        copy = compute_on(compute_type="gpu_stream:1", out_memory_spaces=jax.memory.Space.Device)(copy)

    def compute(weights, act, staging):
        act = act + staging[0, :WIDTH].astype(act.dtype)[None, :]  # the previous layer's prefetch is read
        for m in range(weights.shape[0]):
            act = jnp.tanh(act @ weights[m]).astype(act.dtype)
        return act

    def call(bank, weights, staging, act, ids):
        def layer(carry, layer_ids):
            staging, act = carry
            new_staging = copy(bank, staging, layer_ids) if variant != "compute" else staging
            act = compute(weights, act, staging) if variant != "copy" else act
            return (new_staging, act), None
        return jax.lax.scan(layer, (staging, act), ids)[0]
    return jax.jit(call, donate_argnums=(2,))


def stream_ids(text: str) -> list[int]:
    """The distinct stream ids XLA wrote into the compiled HLO's backend configs (``"operation_queue_id"`` /
    ``stream``), sorted."""
    found = re.findall(r'"operation_queue_id":"?(\d+)', text) + re.findall(r'_xla_stream_annotation="?(\d+)', text)
    return sorted({int(s) for s in found})


def measure_row(variant: str, path: str, graphs: str, args: tuple, repeats: int) -> tuple[dict, object]:
    """One row: compile (with :data:`STREAM_OPTION` for stream1), time, and the final (staging, act) for the
    identity check; an error XLA raises becomes the row's ``error``."""
    import jax
    import numpy as np
    row = {"variant": variant, "copy": path, "graphs": graphs}
    opts = common.graph_options(graphs)
    if variant == "stream1" and jax.default_backend() == "gpu":
        opts = {**opts, **STREAM_OPTION}
    bank, weights, staging, act, ids = args
    try:
        fn = program(variant, path)
        compiled = fn.lower(bank, weights, staging, act, ids).compile(compiler_options=opts or None)
        text = compiled.as_text()
        row["hlo"] = common.hlo_ops(text)
        row["stream_ids"] = stream_ids(text)
        state = {"staging": staging}

        def one(_):
            state["staging"], a = compiled(bank, weights, state["staging"], act, ids)
            return a
        for _ in range(2):  # untimed
            jax.block_until_ready(one(0))
        secs = []
        for _ in range(repeats):
            t = time.perf_counter()
            jax.block_until_ready(one(0))
            secs.append(time.perf_counter() - t)
        row["ms_per_layer"] = common.spread([s * 1e3 / ids.shape[0] for s in secs])
        result = (np.asarray(state["staging"][:, :16].astype(np.float32)), np.asarray(one(0).astype(np.float32)))
        return row, result
    except Exception as e:  # noqa: BLE001 - a refused variant is a result
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:400]}"
        return row, None


def overlap(rows: list[dict]) -> list[dict]:
    """Per copy path and graphs: the share of the shorter of copy and compute that stream1 (and serial) hid."""
    out = []
    for path in dict.fromkeys(r["copy"] for r in rows):
        for g in dict.fromkeys(r["graphs"] for r in rows):
            ms = {r["variant"]: r["ms_per_layer"]["median"] for r in rows
                  if r["copy"] == path and r["graphs"] == g and "ms_per_layer" in r}
            if "copy" not in ms or "compute" not in ms:
                continue
            shorter = min(ms["copy"], ms["compute"])
            entry = {"copy": path, "graphs": g, "copy_ms": ms["copy"], "compute_ms": ms["compute"],
                     "sum_ms": ms["copy"] + ms["compute"], "max_ms": max(ms["copy"], ms["compute"])}
            for v in ("serial", "stream1"):
                if v in ms:
                    entry[f"{v}_ms"] = ms[v]
                    entry[f"{v}_hidden"] = round((entry["sum_ms"] - ms[v]) / shorter, 3)
            out.append(entry)
    return out


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ftjax.experts import slot_copy
    shape = shapes()
    paths = list(dict.fromkeys(FLAGS.copy))
    skipped = {}
    if "kernel" in paths and slot_copy.unavailable() is not None:
        skipped["kernel"] = slot_copy.unavailable()
        paths.remove("kernel")
    graphs = list(dict.fromkeys(FLAGS.graphs)) if jax.default_backend() == "gpu" else ["off"]
    name = f"probe_copy_stream{'_' + FLAGS.tag if FLAGS.tag else ''}.json"
    out = {"question": "do a layer scan's copies on gpu_stream:1 overlap the layer's compute?",
           "b_p": common.measure_h2d(), "shape": shape, "skipped": skipped, "rows": []}
    bank = common.pinned_array((FLAGS.bank_experts, shape["expert_elems"]), jnp.bfloat16, 1)
    key = jax.random.key(0)
    weights = (jax.random.normal(key, (shape["compute_mats"], WIDTH, WIDTH), jnp.float32) / WIDTH ** 0.5
               ).astype(jnp.bfloat16)
    act = jnp.ones((ROWS, WIDTH), jnp.bfloat16)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, FLAGS.bank_experts, (FLAGS.layers, FLAGS.copies)), jnp.int32)
    results = {}
    for path in paths:
        for g in graphs:
            for variant in VARIANTS:
                staging = jnp.zeros((FLAGS.copies, shape["expert_elems"]), jnp.bfloat16)
                row, res = measure_row(variant, path, g, (bank, weights, staging, act, ids), FLAGS.repeats)
                results[(path, g, variant)] = res
                if variant == "stream1":
                    base = results.get((path, g, "serial"))
                    row["same_result_as_serial"] = (None if res is None or base is None else
                                                    all(np.array_equal(a, b) for a, b in zip(res, base)))
                out["rows"].append(row)
                out["overlap"] = overlap(out["rows"])
                common.write_json(FLAGS.out_dir, name, out)
                print(f"{path} graphs {g} {variant}:", row.get("error") or
                      f"{row['ms_per_layer']['median']:.4f} ms a layer, streams {row['stream_ids']}", flush=True)
    path = common.write_json(FLAGS.out_dir, name, out)
    print(common.table(out["overlap"], ["copy", "graphs", "copy_ms", "compute_ms", "serial_ms", "serial_hidden",
                                        "stream1_ms", "stream1_hidden"]))
    print("wrote", path)


if __name__ == "__main__":
    common.run(main)
