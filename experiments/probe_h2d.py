"""Which host-to-device copy paths reach the PCIe link, and which of them overlap device compute.

Issue 12 (items 1 and 4): the streamed prefill and the layerwise KV load need the copy of layer
l+1 to run on the copy engine while layer l computes. This script measures, on one GPU, for a
layer of ``--layer_mb`` MB (qwen3-30b-a3b: 1.21 GB of experts per layer):

* the link: whole-array ``device_put`` of a pinned_host JAX array, of a slice of a stacked one,
  of a numpy view of pinned memory (with and without ``Client.dma_map``), of pageable numpy, and
  several copies in flight at once; torch's pinned copy when torch is installed;
* overlap: ``--layers`` layers, each a copy of the next layer's bytes issued before the current
  layer's compute (a jitted program of ~``--compute_ms``), for each copy path, against copy alone
  and compute alone;
* the in-program switch: whether a ``lax.switch`` over per-layer host arrays inside a layer scan
  compiles and what it moves (the decode fetch if banks were stored per layer).

Writes ``probe_h2d_<device>_<date>.json``. Run on the GPU machine:
  python3 experiments/probe_h2d.py --out_dir=$OUT
"""

from __future__ import annotations

import ctypes
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from experiments import common
from ftjax import memory

FLAGS = flags.FLAGS
flags.DEFINE_string("out_dir", "experiments/results/overlap", "where the JSON goes")
flags.DEFINE_integer("layer_mb", 1208, "bytes per layer copy (MB, 1e6)")
flags.DEFINE_integer("layers", 6, "layers in the overlap runs")
flags.DEFINE_float("compute_ms", 20.0, "target compute time per layer (ms)")
flags.DEFINE_integer("repeats", 3, "repeats of each overlap run (median reported)")
for _name in ("layer_mb", "layers", "repeats"):
    flags.register_validator(_name, lambda v: v >= 1, "must be >= 1")
flags.register_validator("compute_ms", lambda v: v > 0, "must be > 0")


def _time(fn, repeats=5):
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        out.append(time.perf_counter() - t)
    return out


def _numpy_view(x: jax.Array) -> np.ndarray:
    """A numpy uint8 view of a host-resident JAX array's buffer (no copy)."""
    ptr = x.addressable_data(0).unsafe_buffer_pointer()
    n = x.size * x.dtype.itemsize
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(ptr))


def main(argv):
    del argv
    dev_s, host_s = memory.device_sharding(), memory.host_sharding()
    layer_bytes = FLAGS.layer_mb * 10**6 // 4096 * 4096
    n = FLAGS.layers
    elems = layer_bytes // 2
    res: dict = {"layer_bytes": layer_bytes, "layers": n, "link": {}, "overlap": {}, "errors": {}}

    mk_host = jax.jit(lambda i: jnp.full((elems,), i, jnp.bfloat16), out_shardings=host_s)
    per_layer = [mk_host(i + 1.0) for i in range(n + 1)]
    stacked = jax.jit(lambda: jnp.ones(((n + 1) * elems,), jnp.bfloat16), out_shardings=host_s)()
    jax.block_until_ready((per_layer, stacked))

    def gbps(ts):
        return common.spread([layer_bytes / t / 1e9 for t in ts])

    link = res["link"]
    link["pinned_jax_whole"] = gbps(_time(lambda: jax.device_put(per_layer[0], dev_s)))
    try:
        link["pinned_jax_eager_slice"] = gbps(_time(lambda: jax.device_put(stacked[elems:2 * elems], dev_s)))
    except Exception as e:  # noqa: BLE001 - the probe records what fails
        res["errors"]["pinned_jax_eager_slice"] = repr(e)[:400]
    sl = jax.jit(lambda b, i: jax.device_put(jax.lax.dynamic_slice_in_dim(b, i * elems, elems),
                                             jax.memory.Space.Device))
    try:
        link["pinned_jax_jit_slice"] = gbps(_time(lambda: sl(stacked, 1)))
    except Exception as e:  # noqa: BLE001
        res["errors"]["pinned_jax_jit_slice"] = repr(e)[:400]
    view = None
    try:
        view = _numpy_view(stacked)
        link["pinned_numpy_view"] = gbps(_time(lambda: jax.device_put(view[layer_bytes:2 * layer_bytes], dev_s)))
    except Exception as e:  # noqa: BLE001
        res["errors"]["pinned_numpy_view"] = repr(e)[:400]
    page = np.ones(layer_bytes, np.uint8)
    link["pageable_numpy"] = gbps(_time(lambda: jax.device_put(page, dev_s), 3))
    client = jax.devices()[0].client
    try:
        mapped = np.ones(2 * layer_bytes + 4096, np.uint8)
        off = (-mapped.ctypes.data) % 4096
        mapped = mapped[off:off + 2 * layer_bytes]
        client.dma_map(mapped.ctypes.data, mapped.nbytes)
        link["dma_mapped_numpy"] = gbps(_time(lambda: jax.device_put(mapped[:layer_bytes], dev_s)))
    except Exception as e:  # noqa: BLE001
        mapped = None
        res["errors"]["dma_mapped_numpy"] = repr(e)[:400]
    for parts in (2, 4, 8):
        chunks = [mk_host(float(i)) for i in range(parts)]
        chunks = [c[: elems // parts] for c in chunks]
        jax.block_until_ready(chunks)
        link[f"pinned_jax_{parts}_in_flight"] = gbps(_time(lambda: jax.device_put(chunks, dev_s)))
    try:
        import torch
        src = torch.empty(layer_bytes, dtype=torch.uint8).pin_memory()
        dst = torch.empty(layer_bytes, dtype=torch.uint8, device="cuda")
        ts = []
        for _ in range(5):
            torch.cuda.synchronize()
            t = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t)
        link["torch_pinned"] = gbps(ts)
        del src, dst
    except Exception as e:  # noqa: BLE001
        res["errors"]["torch_pinned"] = repr(e)[:400]

    # ---- overlap ----------------------------------------------------------------------------
    d = 4096
    w = jax.device_put(jnp.ones((d, d), jnp.bfloat16) * 1e-3, dev_s)

    @jax.jit
    def compute(x, buf, reps):
        def body(_, x):
            return jnp.tanh(x @ w)
        x = jax.lax.fori_loop(0, reps, body, x)
        return x + buf[:1].astype(x.dtype)  # reads the layer's buffer: depends on its copy

    x0 = jax.device_put(jnp.ones((d, d), jnp.bfloat16), dev_s)
    buf0 = jax.device_put(per_layer[0], dev_s)
    one = _time(lambda: compute(x0, buf0, 10), 3)[-1]
    reps = max(1, int(round(10 * FLAGS.compute_ms / 1e3 / one)))
    compute_only = _time(lambda: [compute(x0, buf0, reps) for _ in range(n)], FLAGS.repeats)

    copy_paths = {"pinned_jax_whole": lambda l: jax.device_put(per_layer[l], dev_s)}
    if "pinned_jax_eager_slice" in link:
        copy_paths["pinned_jax_eager_slice"] = lambda l: jax.device_put(stacked[l * elems:(l + 1) * elems], dev_s)
    if "pinned_jax_jit_slice" in link:
        copy_paths["pinned_jax_jit_slice"] = lambda l: sl(stacked, l)
    if view is not None:
        copy_paths["pinned_numpy_view"] = lambda l: jax.device_put(view[l * layer_bytes:(l + 1) * layer_bytes], dev_s)
    if mapped is not None:
        copy_paths["dma_mapped_numpy"] = lambda l: jax.device_put(mapped[(l % 2) * layer_bytes:(l % 2 + 1)
                                                                         * layer_bytes], dev_s)

    for name, copy in copy_paths.items():
        try:
            copy_only = _time(lambda: [copy(l) for l in range(n)], FLAGS.repeats)

            def pipelined():
                nxt = copy(0)
                x = x0
                for l in range(n):
                    cur, nxt = nxt, (copy(l + 1) if l + 1 < n else None)
                    x = compute(x, cur, reps)
                return x

            piped = _time(pipelined, FLAGS.repeats)
            c, k, p = (float(np.median(v)) for v in (copy_only, compute_only, piped))
            res["overlap"][name] = {"copy_s": c, "compute_s": k, "pipelined_s": p, "serial_s": c + k,
                                    "vs_ideal": p / max(c, k), "hidden_fraction": (c + k - p) / min(c, k)}
        except Exception as e:  # noqa: BLE001
            res["errors"][f"overlap_{name}"] = repr(e)[:400]

    # ---- lax.switch over per-layer host arrays inside a scan (decode fetch, banks per layer) -------
    try:
        small = [mk_host(float(i))[: 8 * 1024 * 1024] for i in range(4)]

        @jax.jit
        def scan_switch(banks):
            def body(acc, l):
                branches = [lambda b=b: jax.device_put(jax.lax.dynamic_slice_in_dim(b, 1024 * 1024, 1024 * 1024),
                                                       jax.memory.Space.Device) for b in banks]
                return acc + jax.lax.switch(l, branches)[:8].astype(jnp.float32), None
            return jax.lax.scan(body, jnp.zeros(8, jnp.float32), jnp.arange(4))[0]

        out = np.asarray(scan_switch(small))
        res["scan_switch"] = {"ok": True, "value": out.tolist(), "expected": [6.0] * 8,
                              "s": common.spread(_time(lambda: scan_switch(small)))}
    except Exception as e:  # noqa: BLE001
        res["errors"]["scan_switch"] = repr(e)[:400]

    print(res)
    common.write_json(FLAGS.out_dir, "probe_h2d", res)


if __name__ == "__main__":
    common.run(main)
