r"""A/B of the slot table's implementations (``ftjax.experts.slot_table.ORDER_IMPLS``) on one device.

An engine picks one with its kernel config (``KernelConfig.slot_order``, ``--slot_order`` of
``ftjax.generate``); here each is passed to ``lookup_layer`` directly (``impl=``).

A cached decode step of qwen3-30b-a3b (48 layers, E = 128, S ~ 1975, batch 1) calls
``lookup_layer`` once per layer inside the layer scan; on the H200 its bookkeeping was 15 kernels
per layer and the LRU ``eviction_order`` (a full argsort of the S slots) alone 0.75 ms per step.
This script jits a ``lax.scan`` of ``--num_layers`` ``lookup_layer`` calls (each layer routes
``--top_k`` random experts, fixed seed) on a full, warmed table built so that about
``--hit_rates`` of the routed experts are resident, for each implementation and policy; checks
that every implementation's outputs (final table and every layer's lookup) equal the ``sort``
ones bit for bit; times the scan (median of ``--repeats`` calls after ``--warmup``, each with
``block_until_ready``); and counts the instructions of the compiled scan body (this backend's
compiler view: fusions, sorts, scatters, ...). A trivial scan (``noop``: the clock advances, same
carry) gives the loop's own cost. Writes ``ab_slot_table.json`` under ``--out_dir``, with per-layer
microseconds (``us_per_layer``: median / layers) for each (case, policy, impl).

GPU (well under a minute):
  PYTHONPATH=. python3 experiments/ab_slot_table.py --out_dir=$OUT
CPU smoke (the [S, S] count of ``rank`` is slow there):
  JAX_PLATFORMS=cpu PYTHONPATH=. python3 experiments/ab_slot_table.py --repeats=3 --warmup=1 --out_dir=/tmp/ab
"""

from __future__ import annotations

import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from experiments import common  # noqa: E402
from ftjax.experts.slot_table import ORDER_IMPLS, POLICIES, SlotTable, lookup_layer  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("out_dir", "experiments/results/ab", "Where the JSON goes.")
flags.DEFINE_list("impls", list(ORDER_IMPLS), f"Implementations to time (of {', '.join(ORDER_IMPLS)}); "
                  "'sort' (the reference) is always run.")
flags.DEFINE_list("policies", list(POLICIES), f"Cache policies (of {', '.join(POLICIES)}; default: all).")
flags.DEFINE_list("hit_rates", ["0.98", "0.4"], "Target hit rates: one warmed table per value.")
flags.DEFINE_integer("num_layers", 48, "L (layers per scan).")
flags.DEFINE_integer("num_experts", 128, "E (experts per layer).")
flags.DEFINE_integer("num_slots", 1975, "S (slots of the table).")
flags.DEFINE_integer("top_k", 8, "Experts routed per layer (batch 1).")
flags.DEFINE_integer("repeats", 50, "Timed calls per (case, policy, impl); the median is reported.")
flags.DEFINE_integer("warmup", 3, "Untimed calls first.")
flags.DEFINE_integer("seed", 0, "Seed of the routing and of the table.")
common.check_names("impls", ORDER_IMPLS, allow_empty=True)
common.check_names("policies", POLICIES)
common.check_numbers("hit_rates", float, low=0, high=1)
for _name in ("num_layers", "num_experts", "num_slots", "top_k", "repeats"):
    flags.register_validator(_name, lambda v: v >= 1, "must be >= 1")
flags.register_validator("warmup", lambda v: v >= 0, "must be >= 0")
flags.register_multi_flags_validator(
    ["num_layers", "num_experts", "num_slots", "top_k"],
    lambda d: d["top_k"] <= d["num_experts"] <= d["num_slots"] <= d["num_layers"] * d["num_experts"],
    "need top_k <= num_experts <= num_slots <= num_layers * num_experts")

_NOT_KERNELS = {"parameter", "get-tuple-element", "constant", "tuple", "bitcast", "after-all"}


def warmed_table(L: int, E: int, S: int, top_k: int, hit_rate: float, seed: int) -> tuple[SlotTable, np.ndarray]:
    """A full table (every slot used, slot_of / id_of_slot mutually inverse) and bool [L, E] routing
    (``top_k`` distinct experts per layer) where each routed expert is resident with probability
    ``hit_rate``; the other slots hold random unrouted ids. ``last_use`` is random below the clock
    (ties happen), the LRFU history consistent with it."""
    rng = np.random.default_rng(seed)
    routed = np.zeros((L, E), bool)
    for layer in range(L):
        routed[layer, rng.choice(E, top_k, replace=False)] = True
    flat_routed = np.nonzero(routed.reshape(-1))[0]
    resident = flat_routed[rng.random(flat_routed.size) < hit_rate][:S]
    others = rng.permutation(np.nonzero(~routed.reshape(-1))[0])[: S - resident.size]
    held = rng.permutation(np.concatenate([resident, others]).astype(np.int32))
    if held.size != S:
        raise ValueError(f"cannot fill S={S} slots from L*E={L * E} ids")
    slot_of = np.full(L * E, -1, np.int32)
    slot_of[held] = np.arange(S, dtype=np.int32)
    clock = 100 * L
    last_use = rng.integers(0, clock, S).astype(np.int32)
    crf_time = np.full(L * E, -1, np.int32)
    crf_time[held] = last_use
    crf_log2 = np.full(L * E, -np.inf, np.float32)
    crf_log2[held] = rng.uniform(0.0, 3.0, S).astype(np.float32)
    table = SlotTable(slot_of=jnp.asarray(slot_of), id_of_slot=jnp.asarray(held), last_use=jnp.asarray(last_use),
                      clock=jnp.int32(clock), crf_log2=jnp.asarray(crf_log2), crf_time=jnp.asarray(crf_time))
    return table, routed


def scan_fn(E: int, policy: str, impl: str | None):
    """jit of (table, routed bool [L, E]) -> (final table, per-layer lookups stacked over L).
    ``impl`` None: the noop baseline (the clock advances, nothing else)."""
    def body(t, xs):
        layer, r = xs
        if impl is None:
            return t.replace(clock=t.clock + 1), r.sum(dtype=jnp.int32)
        out = lookup_layer(t, layer, r, E, policy, impl=impl)
        return out.table, out._replace(table=None)

    def run(table, routed):
        return jax.lax.scan(body, table, (jnp.arange(routed.shape[0], dtype=jnp.int32), routed))
    return jax.jit(run)


def body_ops(hlo_text: str) -> dict:
    """Instructions of the compiled scan's while body, by kind: every instruction but parameters,
    tuples, constants and bitcasts counts (each is about one kernel on a GPU); fusions are named by
    what they contain (sort > scatter > reduce > dynamic-update-slice > loop); calls (the GPU's
    command buffers) are counted by what they call. The
    dynamic-update-slices write each layer's lookup into the scan's stacked outputs (and, for lfru,
    the CRF window): ``total_minus_dynamic_update_slice`` leaves them out."""
    comps: dict[str, list[str]] = {}
    cur = None
    for line in hlo_text.splitlines():
        head = re.match(r"^(?:ENTRY )?%([\w.\-]+) \(.*\{$", line)
        if head:
            cur = head.group(1)
            comps[cur] = []
        elif line.startswith("}"):
            cur = None
        elif cur is not None and " = " in line:
            comps[cur].append(line)

    def opcode(line: str) -> str:
        m = re.search(r" = (?:\([^()]*\)|\S+) ([a-z][\w\-]*)\(", line)
        return m.group(1) if m else "?"

    def kind(line: str) -> str:
        op = opcode(line)
        if op != "fusion":
            return op
        m = re.search(r"calls=%([\w.\-]+)", line)
        inner = {opcode(x) for x in comps.get(m.group(1), [])} if m else set()
        for k in ("sort", "scatter", "reduce", "reduce-window", "dynamic-update-slice", "custom-call"):
            if k in inner:
                return f"fusion:{k}"
        return "fusion:loop"

    def count(comp: str, counts: dict, depth: int = 0) -> dict:
        for line in comps.get(comp, []):
            k = kind(line)
            callee = re.search(r"to_apply=%([\w.\-]+)", line)
            if k == "call" and callee and depth < 4:  # e.g. the GPU's command buffers: count what they run
                count(callee.group(1), counts, depth + 1)
            elif k not in _NOT_KERNELS:
                counts[k] = counts.get(k, 0) + 1
        return counts

    bodies = re.findall(r"while\(.*?body=%([\w.\-]+)", hlo_text)
    if not bodies:
        return {"error": "no while loop in the compiled program"}
    counts = max((count(b, {}) for b in bodies), key=lambda c: sum(c.values()))  # the scan's body
    dus = sum(n for k, n in counts.items() if k.endswith("dynamic-update-slice"))
    return {"total": sum(counts.values()), "total_minus_dynamic_update_slice": sum(counts.values()) - dus,
            "by_kind": dict(sorted(counts.items())), "while_bodies": len(bodies)}


def _time(fn, args, warmup: int, repeats: int) -> list[float]:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return ts


def main(argv):
    del argv
    t_start = time.perf_counter()
    L, E, S = FLAGS.num_layers, FLAGS.num_experts, FLAGS.num_slots
    impls = ["sort"] + [i for i in FLAGS.impls if i != "sort"]
    for i in impls:
        if i not in ORDER_IMPLS:
            raise app.UsageError(f"--impls: unknown {i!r}; expected some of {', '.join(ORDER_IMPLS)}")
    print("backend", jax.default_backend(), jax.devices()[0].device_kind, flush=True)
    cases = [(float(h), *warmed_table(L, E, S, FLAGS.top_k, float(h), FLAGS.seed)) for h in FLAGS.hit_rates]
    compiled, hlo, compile_s = {}, {}, {}
    for policy in FLAGS.policies:
        for impl in impls + [None]:
            if impl is None and policy != FLAGS.policies[0]:
                continue
            t = time.perf_counter()
            lowered = scan_fn(E, policy, impl).lower(cases[0][1], jnp.asarray(cases[0][2]))
            exe = lowered.compile()
            key = (policy, impl or "noop")
            compiled[key], compile_s[key] = exe, time.perf_counter() - t
            hlo[key] = body_ops(exe.as_text())
    rows, mismatches = [], []

    def row(case: str, policy: str, impl: str, ts: list[float], **extra) -> dict:
        sp = common.spread([x * 1e6 for x in ts])
        ops = hlo[(policy if impl != "noop" else FLAGS.policies[0], impl)]
        r = {"case": case, "policy": policy if impl != "noop" else "-", "impl": impl, "us_per_layer": sp["median"] / L,
             "step_us": sp, "body_ops": ops.get("total"),
             "body_ops_minus_dus": ops.get("total_minus_dynamic_update_slice"), **extra}
        print(f"{case} {r['policy']:9s} {impl:7s} {r['us_per_layer']:9.2f} us/layer  body ops {r['body_ops']}"
              + (f"  identical={extra['identical_to_sort']}" if "identical_to_sort" in extra else ""), flush=True)
        rows.append(r)
        return r

    for hit_rate, table, routed in cases:
        case, r = f"hit{hit_rate:g}", jnp.asarray(routed)
        noop = compiled[(FLAGS.policies[0], "noop")]
        row(case, "-", "noop", _time(noop, (table, r), FLAGS.warmup, FLAGS.repeats))
        for policy in FLAGS.policies:
            ref = jax.device_get(compiled[(policy, "sort")](table, r))
            hits = float(ref[1].n_hit.sum() / max(1, routed.sum()))
            ref_leaves = jax.tree.leaves(ref)
            for impl in impls:
                exe = compiled[(policy, impl)]
                leaves = jax.tree.leaves(jax.device_get(exe(table, r)))
                same = len(leaves) == len(ref_leaves) and all(
                    a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(leaves, ref_leaves))
                if not same:
                    mismatches.append((case, policy, impl))
                row(case, policy, impl, _time(exe, (table, r), FLAGS.warmup, FLAGS.repeats), hit_rate=hits,
                    identical_to_sort=same, compile_s=compile_s[(policy, impl)])
    cols = ["case", "policy", "impl", "us_per_layer", "step_us", "body_ops", "body_ops_minus_dus", "identical_to_sort"]
    print(common.table([{**r, "step_us": r["step_us"]["median"]} for r in rows], cols))
    payload = {
        "shape": {"num_layers": L, "num_experts": E, "num_slots": S, "top_k": FLAGS.top_k},
        "results": rows,
        "hlo_body_ops": {f"{p}/{i}": v for (p, i), v in hlo.items()},
        "all_identical_to_sort": not mismatches,
        "mismatches": [list(m) for m in mismatches],
        "wall_s": time.perf_counter() - t_start,
    }
    path = common.write_json(FLAGS.out_dir, "ab_slot_table.json", payload)
    print("wrote", path, f"({payload['wall_s']:.1f} s)")
    if mismatches:
        raise SystemExit(f"outputs differ from 'sort': {mismatches}")


if __name__ == "__main__":
    common.run(main)
