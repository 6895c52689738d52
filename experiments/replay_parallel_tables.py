r"""Expert slot tables split over N devices, replayed offline on real routing: hit rate and link balance.

  XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m ftjax.generate --dtype=float32 \
      --experts=cached --expert_slots=32 --prefill=on_demand --max_new_tokens=96 --ignore_eos \
      --trace_routing=/tmp/demo96.npz
  python experiments/replay_parallel_tables.py --trace=/tmp/demo96.npz --out=/tmp/tables_demo96.json
  python experiments/replay_parallel_tables.py --ckpt=ftjax/assets/stdlib_moe --decode_batch=1,4 \
      --out=/tmp/tables_heldout.json

Routing. ``--trace``: a ``generate --trace_routing`` file (``ftjax.routing_trace``): one run, the prefill
(step 0) fills the tables but is left out of the figures (``--skip_prefill``), as the engine's decode hit
rate does. ``--ckpt``: ``--streams`` windows of ``--stream_len`` held-out tokens of the trained checkpoint,
teacher-forced (``experiments/policy_study.py``: the routing a batch-1 decode of that text gives); each
group of ``--decode_batch`` streams is one run of decode steps of that many tokens (a step routes the union
of its tokens' experts), from cold tables; every step counts.

Devices and ownership: N devices (``--devices``), S total slots (``--slots``; default E, 2E, 4E), S/N slots
on each device (device d holds slots [d*S/N, (d+1)*S/N)). Expert e of every layer is owned by device
e // (E/N) (ftjax/experts/parallel.py). Every (step, layer) is one lookup of the layer's routed experts,
which must all be resident together (so S >= E). The tables (:data:`VARIANTS`):

* ``per_device`` (what ftjax builds, ``--devices=N``): each device its own LRU table over its own L*E/N
  experts and S/N slots (``ftjax.experts.slot_table``'s lru, ties to the lowest slot). The same as one global
  recency order with device-affine slots in which an expert may only sit on its owner and evicts its
  owner's least recent slot: the restriction of a global recency order to one device is that device's
  order, so that "global table" is this one.
* ``any_device_lru``: one global LRU table over all S slots; an expert may sit in any device's slot (it is
  computed there: the slot, not the expert id, picks the device); misses take the globally least recent
  slots, ties to the lowest slot: exactly one device's global LRU of S slots (the same hits), the copies
  going to whichever device's slot was least recent.
* ``any_device_balanced``: one global table as ``any_device_lru``, but a lookup's misses are dealt over
  the devices: the slots are taken in the order (rank of the slot among its device's evictable slots
  by least recent use, then least recent use, then slot index), protected (hit) slots never; so m misses
  copy ceil(m/N) or floor(m/N) experts per device (fewer where a device has fewer evictable slots), each
  device evicting its own least recent.
* ``tensor_parallel``: every expert split on its FFN width over the N devices (each slot holds a 1/N piece of
  one expert on every device): one global LRU table of S slots (the one-device hits) and every miss copied
  as N pieces of 1/N, one per link: each link copies misses / N experts' bytes, in ``misses`` pieces.

Per lookup each device copies its misses over its own link; the built decode copies a layer's misses
before computing it, so a layer waits for its busiest link. Figures per (variant, N, S): hits, misses,
hit_rate; ``slowest_link_per_step``: the sum over a step's layers of the most misses any one device copies
in that layer (expert copies on the critical path of a step: the link time of a step in units of one
expert copy), averaged over steps; ``layer_balance``: that sum over all steps over misses / N (1.0: every
layer's misses split evenly; the link-bound speedup of N devices over one device with the same misses is
N / layer_balance); ``step_balance``: the same with each device's misses summed over a step's layers first
(the bound if copies of different layers could overlap); ``pieces_per_link_per_step``: copies (H2D
transfers of one expert, or of one 1/N piece of one under ``tensor_parallel``) on the busiest link per step,
summed over layers as ``slowest_link_per_step``.

Output: a table and, with ``--out``, JSON ({meta, sources, num_layers, num_experts, top_k, runs: per source the
number of runs, rows: one per (source, S, N, variant)}).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from experiments import common  # noqa: E402
from ftjax import routing_trace  # noqa: E402

#: The split slot tables replayed (module docstring).
VARIANTS = ("per_device", "any_device_lru", "any_device_balanced", "tensor_parallel")
_INT_MAX = np.iinfo(np.int64).max

FLAGS = flags.FLAGS


class ReplayInputError(ValueError):
    """Bad input to :func:`replay` or :func:`runs_from_trace`: one line naming the field, expected vs got."""


# ---------------------------------------------------------------------------------------- one table


class LruTable:
    """One LRU expert slot table in numpy, the policy of ``ftjax.experts.slot_table.lookup_layer`` with
    ``lru``: hits refresh their slot; misses, in ascending id order, take the non-hit slots in the order
    (least recent use, slot index), free slots (last use -1) first; the clock advances once per lookup.

    Args:
      num_ids: flat ids the table maps (L * experts of its layers).
      slots_per_device: slots on each device; the table has ``devices * slots_per_device`` slots, slot s on
        device ``s // slots_per_device``.
      devices: devices its slots lie on (1 for a per-device table).
      balanced: misses dealt over the devices (``any_device_balanced``): the order is (rank among the
        device's non-hit slots, least recent use, slot index).
    """

    def __init__(self, num_ids: int, slots_per_device: int, devices: int = 1, balanced: bool = False):
        slots = slots_per_device * devices
        self.devices, self.balanced = devices, balanced
        self.slot_of = np.full(num_ids, -1, np.int64)
        self.id_of_slot = np.full(slots, -1, np.int64)
        self.last_use = np.full(slots, -1, np.int64)
        self.device_of_slot = np.arange(slots) // slots_per_device
        self.clock = 0

    def _order(self, protected: np.ndarray) -> np.ndarray:
        """Slots in the order misses take them (protected slots last, never reached)."""
        key = np.where(protected, _INT_MAX, self.last_use)
        order = np.argsort(key, kind="stable")  # (last use, slot index)
        if not self.balanced:
            return order
        dev = self.device_of_slot[order]
        onehot = dev[:, None] == np.arange(self.devices)[None, :]
        rank = (np.cumsum(onehot, axis=0) - 1)[np.arange(order.size), dev]  # rank within the device
        return order[np.lexsort((np.arange(order.size), rank, protected[order]))]

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Looks up ``ids`` (distinct flat ids, ascending: one layer's routed experts) and fills the misses.
        Returns int64 [devices]: misses copied into each device's slots."""
        cur = self.slot_of[ids]
        hit = cur >= 0
        self.last_use[cur[hit]] = self.clock
        missed = ids[~hit]
        copies = np.zeros(self.devices, np.int64)
        if missed.size:
            protected = np.zeros(self.id_of_slot.size, bool)
            protected[cur[hit]] = True
            take = self._order(protected)[:missed.size]
            if protected[take].any():
                raise ReplayInputError(f"{missed.size} misses and {int(hit.sum())} hits exceed the "
                                       f"{self.id_of_slot.size} slots of a table")
            evicted = self.id_of_slot[take]
            self.slot_of[evicted[evicted >= 0]] = -1
            self.slot_of[missed] = take
            self.id_of_slot[take] = missed
            self.last_use[take] = self.clock
            copies = np.bincount(self.device_of_slot[take], minlength=self.devices)
        self.clock += 1
        return copies


# ---------------------------------------------------------------------------------------- replay


@dataclasses.dataclass
class Counts:
    """What one (variant, N, S) replay counted over the counted steps (misses in expert copies)."""

    hits: int = 0
    misses: int = 0
    steps: int = 0
    slowest_link: float = 0.0   # sum over steps and layers of max over devices of a layer's copied experts
    slowest_step: float = 0.0   # sum over steps of max over devices of a step's copied experts
    slowest_pieces: int = 0     # sum over steps and layers of the copies on a layer's busiest link

    def row(self, variant: str, devices: int, slots: int) -> dict:
        """The JSON / table row (module docstring)."""
        requests, even = self.hits + self.misses, self.misses / devices
        return {"variant": variant, "devices": devices, "slots": slots, "hits": self.hits, "misses": self.misses,
                "hit_rate": self.hits / requests if requests else 0.0, "steps": self.steps,
                "misses_per_step": self.misses / self.steps if self.steps else 0.0,
                "slowest_link_per_step": self.slowest_link / self.steps if self.steps else 0.0,
                "layer_balance": self.slowest_link / even if self.misses else 1.0,
                "step_balance": self.slowest_step / even if self.misses else 1.0,
                "pieces_per_link_per_step": self.slowest_pieces / self.steps if self.steps else 0.0}


def _tables(variant: str, num_layers: int, num_experts: int, devices: int, slots: int) -> list[LruTable]:
    if variant == "per_device":
        return [LruTable(num_layers * num_experts // devices, slots // devices) for _ in range(devices)]
    if variant == "tensor_parallel":
        return [LruTable(num_layers * num_experts, slots)]
    return [LruTable(num_layers * num_experts, slots // devices, devices, balanced=variant == "any_device_balanced")]


def replay_run(run: list[list[np.ndarray]], variant: str, num_layers: int, num_experts: int, devices: int,
               slots: int, counts: Counts, skip_first: bool = False) -> None:
    """Replays one run (from cold tables) into ``counts``.

    run: per step, per layer, the distinct routed expert ids of that layer (int, ascending, in [0, E)).
    ``skip_first``: the first step (a prefill) fills the tables but is not counted."""
    el = num_experts // devices
    tables = _tables(variant, num_layers, num_experts, devices, slots)
    for i, step in enumerate(run):
        per_layer = np.zeros((num_layers, devices))  # experts' bytes each device copies, per layer
        pieces = np.zeros(num_layers, np.int64)        # copies on the layer's busiest link
        for layer, ids in enumerate(step):
            if variant == "per_device":
                owner = ids // el
                for d, table in enumerate(tables):
                    per_layer[layer, d] = table.lookup(layer * el + ids[owner == d] - d * el)[0]
                pieces[layer] = per_layer[layer].max()
            elif variant == "tensor_parallel":
                pieces[layer] = tables[0].lookup(layer * num_experts + ids)[0]
                per_layer[layer] = pieces[layer] / devices
            else:
                per_layer[layer] = tables[0].lookup(layer * num_experts + ids)
                pieces[layer] = per_layer[layer].max()
        if skip_first and i == 0:
            continue
        misses = round(per_layer.sum())
        counts.misses += misses
        counts.hits += sum(len(ids) for ids in step) - misses
        counts.steps += 1
        counts.slowest_link += float(per_layer.max(axis=1).sum())
        counts.slowest_step += float(per_layer.sum(axis=0).max())
        counts.slowest_pieces += int(pieces.sum())


def check_split(num_layers: int, num_experts: int, devices: int, slots: int) -> None:
    """Raises ReplayInputError unless N divides E and S, and E <= S <= L*E (a layer's experts fit at once; no
    more slots than experts, as ``ftjax.experts.slot_table.init_slot_table`` requires)."""
    if num_experts % devices or slots % devices:
        raise ReplayInputError(f"devices={devices} must divide num_experts={num_experts} and slots={slots}")
    if not num_experts <= slots <= num_layers * num_experts:
        raise ReplayInputError(f"slots={slots}: expected num_experts={num_experts} <= slots <= num_layers * "
                               f"num_experts={num_layers * num_experts} (a layer's routed experts are resident "
                               "together)")


def replay(runs: list[list[list[np.ndarray]]], num_layers: int, num_experts: int, devices: int, slots: int,
           variant: str, skip_first: bool = False) -> dict:
    """The row (:meth:`Counts.row`) of ``variant`` (of :data:`VARIANTS`) with N = ``devices`` and S = ``slots``
    over ``runs`` (each a list of steps, each a list per layer of routed ids; :func:`runs_from_steps`), each
    run from cold tables; ``skip_first``: leave each run's first step out of the figures.
    Raises:
      ReplayInputError: an unknown variant, or N, S that do not split (:func:`check_split`)."""
    if variant not in VARIANTS:
        raise ReplayInputError(f"unknown variant {variant!r}; expected one of {', '.join(VARIANTS)}")
    check_split(num_layers, num_experts, devices, slots)
    counts = Counts()
    for run in runs:
        replay_run(run, variant, num_layers, num_experts, devices, slots, counts, skip_first)
    return counts.row(variant, devices, slots)


def runs_from_steps(steps: list[np.ndarray]) -> list[list[np.ndarray]]:
    """One run from trace steps (int [L, tokens, top_k] each, -1 = padding): per step, per layer, the
    distinct routed ids, ascending."""
    return [[np.unique(layer[layer >= 0]).astype(np.int64) for layer in ids] for ids in steps]


def runs_from_streams(ids: np.ndarray, decode_batch: int) -> list[list[list[np.ndarray]]]:
    """Runs of ``decode_batch`` streams decoded together: ids int [B, T, L, k] (teacher-forced streams);
    streams i*decode_batch .. (i+1)*decode_batch - 1 make run i (a trailing incomplete group is dropped),
    step t routing the union of their tokens t.
    Raises:
      ReplayInputError: fewer streams than ``decode_batch``."""
    b = ids.shape[0] // decode_batch
    if b < 1:
        raise ReplayInputError(f"decode_batch={decode_batch}: expected at most the {ids.shape[0]} streams")
    grouped = ids[: b * decode_batch].reshape((b, decode_batch) + ids.shape[1:])  # [runs, batch, T, L, k]
    return [runs_from_steps(list(g.transpose(1, 2, 0, 3))) for g in grouped]   # steps: [L, batch, k]


def load_trace(path: str) -> tuple[list[np.ndarray], int, int, int]:
    """A ``generate --trace_routing`` file: (steps, L, E, top_k), checked (``ftjax.routing_trace``).
    Raises:
      ReplayInputError: unreadable or malformed, or written before the shape was recorded."""
    try:
        steps, shape = routing_trace.load(path)
        if shape is None:
            raise ReplayInputError(f"{path}: no {', '.join(routing_trace.SHAPE_KEYS)} fields (an older trace): "
                                   "write it again with ftjax.generate --trace_routing")
        routing_trace.check(path, steps, shape["num_layers"], shape["num_experts"], shape["top_k"])
    except routing_trace.TraceError as e:
        raise ReplayInputError(str(e)) from None
    return steps, shape["num_layers"], shape["num_experts"], shape["top_k"]


# ---------------------------------------------------------------------------------------- the script


def define_flags() -> None:
    """The command-line flags (defined only when run as a script, so that tests import this module)."""
    flags.DEFINE_string("trace", None, "Routing trace .npz from ftjax.generate --trace_routing (one run).")
    flags.DEFINE_string("ckpt", None, "Instead of --trace: teacher-forced held-out streams of this trained checkpoint.")
    flags.DEFINE_integer("streams", 8, "--ckpt: token streams (consecutive held-out windows).")
    flags.DEFINE_integer("stream_len", 512, "--ckpt: tokens per stream (decode steps).")
    flags.DEFINE_list("decode_batch", ["1"], "--ckpt: tokens per decode step (streams decoded together), a list.")
    flags.DEFINE_list("devices", ["1", "2", "4"], "Device counts N (each must divide E and every S).")
    flags.DEFINE_list("slots", None, "Total slot counts S over all devices (default E, 2E, 4E).")
    flags.DEFINE_list("variants", list(VARIANTS), f"Tables to replay, of {', '.join(VARIANTS)}.")
    flags.DEFINE_boolean("skip_prefill", True, "--trace: leave step 0 (the prefill) out; it still fills the tables.")
    flags.DEFINE_string("out", None, "Write the rows as JSON here.")
    common.check_names("variants", VARIANTS)
    common.check_numbers("devices", int, low=1)
    common.check_numbers("slots", int, low=1)
    common.check_numbers("decode_batch", int, low=1)
    for name in ("streams", "stream_len"):
        flags.register_validator(name, lambda v: v >= 1, "must be >= 1")


def _sources() -> tuple[list[tuple[str, list]], int, int, int]:
    """[(source name, runs)], L, E, top_k of the flags' routing."""
    if bool(FLAGS.trace) == bool(FLAGS.ckpt):
        raise app.UsageError("give --trace or --ckpt (one of them)")
    if FLAGS.trace:
        steps, layers, experts, top_k = load_trace(FLAGS.trace)
        return [(os.path.basename(FLAGS.trace), [runs_from_steps(steps)])], layers, experts, top_k
    from experiments import policy_study
    from ftjax.checkpoint import load_checkpoint
    model = load_checkpoint(FLAGS.ckpt, "float32", progress=False)
    if model.tokenizer is None:
        raise app.UsageError(f"--ckpt={FLAGS.ckpt}: no tokenizer.json")
    stream, _ = policy_study.heldout_stream(model.tokenizer, 0)
    n = min(FLAGS.streams, len(stream) // FLAGS.stream_len)
    if n < 1:
        raise app.UsageError(f"the held-out stream has {len(stream)} tokens, fewer than --stream_len")
    ids, _ = policy_study.trace(model, stream[: n * FLAGS.stream_len].reshape(n, FLAGS.stream_len), "float32", 8)
    cfg = model.cfg
    return ([(f"heldout {n}x{FLAGS.stream_len} batch {b}", runs_from_streams(ids, int(b)))
             for b in FLAGS.decode_batch], cfg.num_layers, cfg.num_experts, cfg.top_k)


def main(argv):
    del argv
    if FLAGS.out and not os.path.isdir(os.path.dirname(os.path.abspath(FLAGS.out))):
        raise app.UsageError(f"--out={FLAGS.out}: its folder does not exist")
    try:
        sources, layers, experts, top_k = _sources()
        slots = [int(s) for s in FLAGS.slots] if FLAGS.slots else [experts, 2 * experts, 4 * experts]
        devices = [int(n) for n in FLAGS.devices]
        for n in devices:
            for s in slots:
                check_split(layers, experts, n, s)
        rows = []
        for name, runs in sources:
            for s in slots:
                for n in devices:
                    for v in FLAGS.variants:
                        rows.append({"source": name, **replay(runs, layers, experts, n, s, v,
                                                              FLAGS.skip_prefill and bool(FLAGS.trace))})
                        print(common.table(rows[-1:], list(rows[-1])).splitlines()[-1], flush=True)
    except ReplayInputError as e:
        raise app.UsageError(str(e)) from None
    print(common.table(rows, ["source", "variant", "devices", "slots", "hit_rate", "misses_per_step",
                              "slowest_link_per_step", "layer_balance", "step_balance",
                              "pieces_per_link_per_step"]))
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump({"meta": common.meta(), "sources": [s for s, _ in sources], "num_layers": layers,
                       "num_experts": experts, "top_k": top_k, "runs": {s: len(r) for s, r in sources},
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    define_flags()
    common.run(main)
