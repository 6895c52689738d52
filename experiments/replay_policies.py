r"""Replay a routing trace against expert-cache policies and slot counts, offline (CPU is fine).

  .venv/bin/python -m ftjax.generate --preset=tiny --max_new_tokens=64 --trace_routing=/tmp/routing.npz
  .venv/bin/python experiments/replay_policies.py --trace=/tmp/routing.npz --num_experts=16 --slots=16,24,32,48

The trace (``generate --trace_routing``) holds ``step{i}``: int32 [L, tokens, top_k] routed ids
(-1 = padding). Each step's layers are looked up in order through the same
``ftjax.experts.slot_table.lookup_layer`` that the decode scan uses (every registered policy,
``ftjax.experts.policies``, by default), so the hit rates are exactly
what the runtime sees when every call goes through the cache (``generate --prefill=on_demand``).
A streamed prefill (``--prefill=auto`` with S >= 2E and a long enough prompt) instead copies whole
layers through 2E borrowed slots and frees them, which this replay does not model: the runtime's
decode hit rate is then a little lower (0.423 vs 0.442 replayed for the command above at S = 32).
Prints a table and writes JSON (--out) with hit rate per policy and S.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments import common  # noqa: E402
from ftjax.experts.slot_table import LFRU_HALF_LIFE_TOKENS, POLICIES, init_slot_table, lookup_layer  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("trace", None, "Routing trace .npz from generate --trace_routing.", required=True)
flags.DEFINE_integer("num_experts", None, "E of the model.", required=True)
flags.DEFINE_list("slots", None, "Slot counts S to replay (each E <= S <= L*E).", required=True)
flags.DEFINE_list("policies", list(POLICIES), f"Policies to compare (of {', '.join(POLICIES)}; default: all).")
flags.DEFINE_float("lfru_half_life_tokens", LFRU_HALF_LIFE_TOKENS, "lfru: decode steps after which a use counts half.")
flags.DEFINE_boolean("skip_prefill", True, "Leave step 0 (the prefill) out of the hit rate; it still fills the cache.")
flags.DEFINE_string("out", None, "Write the results as JSON here.")
common.check_names("policies", POLICIES)
common.check_numbers("slots", int, low=1)
flags.register_validator("num_experts", lambda v: v >= 1, "must be >= 1")
flags.register_validator("lfru_half_life_tokens", lambda v: v > 0, "must be > 0")


def routed_masks(trace: dict, num_experts: int) -> list[np.ndarray]:
    """bool [L, E] per step: experts routed by any valid token, in step order."""
    steps = sorted(trace, key=lambda k: int(k[4:]))
    masks = []
    for k in steps:
        ids = trace[k]  # [L, N, top_k]
        m = np.zeros((ids.shape[0], num_experts), bool)
        for layer in range(ids.shape[0]):
            valid = ids[layer][ids[layer] >= 0]
            m[layer, valid] = True
        masks.append(m)
    return masks


def replay(masks: list[np.ndarray], num_experts: int, slots: int, policy: str, skip_first: bool,
           half_life_tokens: float = LFRU_HALF_LIFE_TOKENS) -> dict:
    """Hit rate of ``policy`` (a name of ``slot_table.POLICIES``) with ``slots`` slots over the routed
    masks (bool [L, E] per step; one scan per step); ``half_life_tokens``: for the policies that take it
    (lfru). Returns {policy, slots, hits, misses, hit_rate}. Raises ValueError for an unknown policy."""
    num_layers = masks[0].shape[0]

    @jax.jit
    def step(table, routed):
        def body(t, xs):
            layer, r = xs
            out = lookup_layer(t, layer, r, num_experts, policy, half_life_tokens)
            return out.table, (out.n_hit, out.n_miss)
        return jax.lax.scan(body, table, (jnp.arange(num_layers, dtype=jnp.int32), routed))

    table = init_slot_table(num_layers, num_experts, slots)
    hits = misses = 0
    for i, m in enumerate(masks):
        table, (h, mi) = step(table, jnp.asarray(m))
        if i or not skip_first:
            hits, misses = hits + int(h.sum()), misses + int(mi.sum())
    return {"policy": policy, "slots": slots, "hits": hits, "misses": misses,
            "hit_rate": hits / (hits + misses) if hits + misses else 0.0}


def main(argv):
    del argv
    try:
        with np.load(FLAGS.trace) as z:
            trace = {k: z[k] for k in z.files if k.startswith("step")}
    except (OSError, ValueError) as e:
        raise app.UsageError(f"--trace={FLAGS.trace}: cannot read it ({e})") from None
    if not trace:
        raise app.UsageError(f"{FLAGS.trace}: no step<i> arrays (expected a generate --trace_routing file)")
    e = FLAGS.num_experts
    top = max(int(v.max()) for v in trace.values())
    if top >= e:
        raise app.UsageError(f"--num_experts={e}: the trace routes expert id {top}")
    layers = next(iter(trace.values())).shape[0]
    bad = [s for s in FLAGS.slots if not e <= int(s) <= layers * e]
    if bad:
        raise app.UsageError(f"--slots {','.join(bad)}: each must be in [E, L*E] = [{e}, {layers * e}]")
    masks = routed_masks(trace, FLAGS.num_experts)
    rows = [replay(masks, FLAGS.num_experts, int(s), p, FLAGS.skip_prefill, FLAGS.lfru_half_life_tokens)
            for s in FLAGS.slots for p in FLAGS.policies]
    print(common.table(rows, ["policy", "slots", "hits", "misses", "hit_rate"]))
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump({"trace": os.path.basename(FLAGS.trace), "steps": len(masks), "results": rows}, f, indent=1)


if __name__ == "__main__":
    common.run(main)
