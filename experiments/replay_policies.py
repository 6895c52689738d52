r"""Replay a routing trace against expert-cache policies and slot counts, offline (CPU is fine).

  .venv/bin/python -m ftjax.generate --preset=tiny --max_new_tokens=64 --trace_routing=/tmp/routing.npz
  .venv/bin/python experiments/replay_policies.py --trace=/tmp/routing.npz --slots=16,24,32,48

The trace (``generate --trace_routing``; ``ftjax.routing_trace``) holds ``step{i}``: int32 [L, tokens, top_k]
routed ids (-1 = padding), and the model's ``num_layers``, ``num_experts`` and ``top_k``: E comes from the
trace (``--num_experts``, if given, must agree; a trace written before the shape was recorded needs it).
Each step's layers are looked up in order through the same
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
from ftjax import routing_trace  # noqa: E402
from ftjax.experts.slot_table import LFRU_HALF_LIFE_TOKENS, POLICIES, init_slot_table, lookup_layer  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("trace", None, "Routing trace .npz from generate --trace_routing.", required=True)
flags.DEFINE_integer("num_experts", None, "E of the model: default the trace's (needed for a trace that does not "
                     "record it); given, it must agree with the trace's.")
flags.DEFINE_list("slots", None, "Slot counts S to replay (each E <= S <= L*E).", required=True)
flags.DEFINE_list("policies", list(POLICIES), f"Policies to compare (of {', '.join(POLICIES)}; default: all).")
flags.DEFINE_float("lfru_half_life_tokens", LFRU_HALF_LIFE_TOKENS, "lfru: decode steps after which a use counts half.")
flags.DEFINE_boolean("skip_prefill", True, "Leave step 0 (the prefill) out of the hit rate; it still fills the cache.")
flags.DEFINE_string("out", None, "Write the results as JSON here.")
common.check_names("policies", POLICIES)
common.check_numbers("slots", int, low=1)
flags.register_validator("num_experts", lambda v: v is None or v >= 1, "must be >= 1")
flags.register_validator("lfru_half_life_tokens", lambda v: v > 0, "must be > 0")


def routed_masks(steps: list[np.ndarray], num_experts: int) -> list[np.ndarray]:
    """bool [L, E] per step: experts routed by any valid token, in step order (``steps``: int [L, N, top_k]
    routed ids per step, -1 = padding)."""
    masks = []
    for ids in steps:
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


def load_trace(path: str, num_experts: int | None) -> tuple[list[np.ndarray], int, int]:
    """The trace's steps (int [L, N, top_k] each, in step order), L and E, checked: E and L from the trace's
    recorded shape, or, for a trace without it, E = ``num_experts`` and L = the first step's.
    Raises:
      app.UsageError: an unreadable or malformed trace, ``num_experts`` given and not the trace's, a trace
        without its shape and no ``num_experts``, steps whose layer count or top_k is not the recorded one,
        routed ids outside [0, E) (one line: the file, the field, expected vs got)."""
    try:
        steps, shape = routing_trace.load(path)
        if shape is None:
            if num_experts is None:
                raise app.UsageError(f"{path}: no {', '.join(routing_trace.SHAPE_KEYS)} fields (a trace written "
                                     "before they were recorded): give --num_experts")
            layers, top_k = steps[0].shape[0] if steps[0].ndim else 0, None
        else:
            if num_experts is not None and num_experts != shape["num_experts"]:
                raise app.UsageError(f"{path}: num_experts: expected {num_experts} (--num_experts), got "
                                     f"{shape['num_experts']} (the trace's)")
            num_experts, layers, top_k = shape["num_experts"], shape["num_layers"], shape["top_k"]
        routing_trace.check(path, steps, layers, num_experts, top_k)
    except routing_trace.TraceError as e:
        raise app.UsageError(str(e)) from None
    return steps, layers, num_experts


def main(argv):
    del argv
    steps, layers, e = load_trace(FLAGS.trace, FLAGS.num_experts)
    bad = [s for s in FLAGS.slots if not e <= int(s) <= layers * e]
    if bad:
        raise app.UsageError(f"--slots {','.join(bad)}: each must be in [E, L*E] = [{e}, {layers * e}]")
    if FLAGS.out and not os.path.isdir(os.path.dirname(os.path.abspath(FLAGS.out))):
        raise app.UsageError(f"--out={FLAGS.out}: its folder does not exist")
    masks = routed_masks(steps, e)
    rows = [replay(masks, e, int(s), p, FLAGS.skip_prefill, FLAGS.lfru_half_life_tokens)
            for s in FLAGS.slots for p in FLAGS.policies]
    print(common.table(rows, ["policy", "slots", "hits", "misses", "hit_rate"]))
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump({"trace": os.path.basename(FLAGS.trace), "steps": len(masks), "num_layers": layers,
                       "num_experts": e, "results": rows}, f, indent=1)


if __name__ == "__main__":
    common.run(main)
