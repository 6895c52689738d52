"""Tensor parallelism of the routed experts over the devices of one host: every expert's FFN width F split over
the N devices, one slot table replicated on all of them (``EngineConfig.expert_split="tensor"``;
docs/MULTI_GPU.md has why: balanced links and the one-device hit rate).

Layout (``N`` devices in ``ftjax.experts.parallel.expert_mesh``; F divisible by N; ``Fl = F / N``): device d
holds, of every expert, the gate and up columns [d*Fl, (d+1)*Fl) and the down rows [d*Fl, (d+1)*Fl): its
*piece*, gate_up [D, 2*Fl] (its gate columns, then its up columns, as a whole expert's) and down [Fl, D]. An
array of pieces is [N*R, ...] split on axis 0 (``P("expert")``): device d's block is the pieces of all R rows,
so inside ``shard_map`` each device sees the one-device layout of narrower experts: host banks [L*E, D, 2*Fl]
and [L*E, Fl, D] (its share, each piece contiguous: one copy per weight array and miss, over its own link),
pools [S, D, 2*Fl] and [S, Fl, D].

The slot table is one table of (L, E, S), replicated (``P()``): every device runs the same lookup on the same
routing and takes the same decisions with no communication; hits and misses are one device's, and every miss
is copied by all N devices, a piece each. Each device computes every routed (token, expert) pair on its Fl
columns (SwiGLU is elementwise over F), a partial [T, D] output, and the partials are summed with ``psum``: the
sum of the same terms as one device's in another order, so logits agree to float32 rounding.

Inside ``shard_map`` each device runs the one-device expert function (``ftjax.experts.offload``) on its
pieces: resident, cached, on_demand and streamed prefill calls are exactly one device's, over narrower
experts. Dense banks only: a quantized format's scale blocks would have to split with F.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ftjax.config import check_ffn_split
from ftjax.experts import offload
from ftjax.experts.parallel import EXPERT_AXIS, expert_mesh, host_memory_kind, sharded_zeros
from ftjax.experts.slot_table import init_slot_table
from ftjax.experts.state import ExpertBanks, ExpertState
from ftjax.seams import LayerRouting


def check_split(num_ffn: int, fmt: str, devices: int) -> None:
    """Raises ValueError unless ``devices`` divides the expert FFN width F (``config.check_ffn_split``) and the
    banks are dense (a format the engine config cannot see)."""
    check_ffn_split(devices, num_ffn)
    if fmt != "dense":
        raise ValueError(f"expert_split='tensor' splits dense expert banks only, got format {fmt!r} (a quantized "
                         f"format's scales would split with F); use expert_split='expert' or dense experts")


def pieces(host: np.ndarray, which: str, devices: int, d: int) -> np.ndarray:
    """Device d's pieces of a bank or pool array: ``host`` gate_up [R, D, 2F] -> [R, D, 2*Fl] (gate columns
    d*Fl.., then up columns d*Fl..), or down [R, F, D] -> [R, Fl, D]; a new contiguous array."""
    if which == "gate_up":
        r, dm, f2 = host.shape
        fl = f2 // 2 // devices
        return np.ascontiguousarray(host.reshape(r, dm, 2, devices, fl)[:, :, :, d, :]).reshape(r, dm, 2 * fl)
    fl = host.shape[1] // devices
    return np.ascontiguousarray(host[:, d * fl:(d + 1) * fl, :])


def _split_pieces(arrays: tuple, devices: int, sharding: NamedSharding) -> tuple:
    """(gate_up, down) [R, ...] each -> [N*R, ...] arrays of pieces split on axis 0 (``sharding``): device d's
    block made from the host array by :func:`pieces` (each device's share copied once, never the whole)."""
    out = []
    for a, which in zip(arrays, ("gate_up", "down")):
        host = np.asarray(a)
        rows = host.shape[0]
        shape = pieces(host[:1], which, devices, 0).shape
        out.append(jax.make_array_from_callback(
            (devices * rows,) + shape[1:], sharding,
            lambda idx, h=host, w=which: pieces(h, w, devices, (idx[0].start or 0) // rows)))
    return tuple(out)


def shard_host_banks(banks: ExpertBanks, devices: int) -> ExpertBanks:
    """The host banks as the offloading modes read them: arrays of pieces [N*L*E, ...] in host memory
    (``pinned_host`` where the device has it, else ``unpinned_host``), device d's share its pieces.
    Raises:
      ValueError: a quantized format, or N not dividing F (:func:`check_split`)."""
    check_split(banks.down.shape[1], banks.fmt, devices)
    mesh = expert_mesh(devices)
    gu, dn = _split_pieces((banks.gate_up, banks.down), devices,
                           NamedSharding(mesh, P(EXPERT_AXIS), memory_kind=host_memory_kind(mesh)))
    return ExpertBanks(gu, dn, None, banks.fmt)


def replicated_table(num_layers: int, num_experts: int, num_slots: int, devices: int):
    """An empty slot table of (L, E, S) (``init_slot_table``), replicated on every device of the mesh."""
    table = init_slot_table(num_layers, num_experts, num_slots)
    return jax.device_put(table, NamedSharding(expert_mesh(devices), P()))


def init_state(mode: str, num_layers: int, num_experts: int, num_slots: int, banks: ExpertBanks,
               devices: int) -> ExpertState:
    """The expert state of an experts mode split on F over ``devices`` devices (module docstring).

    resident: the banks' pieces [N*L*E, ...] in device memory, device d its own (no table). cached / on_demand:
    pools of pieces [N*S, ...] (device d: its S pieces) and one replicated table of (L, E, S).
    Raises:
      ValueError: a quantized format, N not dividing F (:func:`check_split`), slots outside [E, L*E]."""
    check_split(banks.down.shape[1], banks.fmt, devices)
    mesh = expert_mesh(devices)
    split = NamedSharding(mesh, P(EXPERT_AXIS))
    if mode == "resident":
        gu, dn = _split_pieces((banks.gate_up, banks.down), devices, split)
        return ExpertState(gu, dn, None, fmt=banks.fmt)
    table = replicated_table(num_layers, num_experts, num_slots, devices)

    def pool(a: jax.Array, rows_axis: int) -> jax.Array:
        shape = list(a.shape)
        shape[0] = devices * num_slots
        shape[rows_axis] //= devices
        return sharded_zeros(tuple(shape), a.dtype, split)

    return ExpertState(pool(banks.gate_up, 2), pool(banks.down, 1), table, None, None, banks.fmt)


def _state_spec(state: ExpertState) -> ExpertState:
    """The split of an expert state's leaves: pools on axis 0, the table replicated."""
    return state.replace(gate_up=P(EXPERT_AXIS), down=P(EXPERT_AXIS), table=None if state.table is None else P())


def step_expert_fn(num_layers: int, num_experts: int, mode: str, banks: ExpertBanks | None, state: ExpertState,
                   devices: int, stream: bool = False, overlap: bool = True, policy: str = "lru",
                   cheap_conds: bool = False):
    """(state, expert function) of one jitted step with the experts split on F over ``devices`` devices, inside
    the jit: ``ftjax.experts.offload.step_expert_fn`` (the fetch miss policy) run on every device's pieces under
    ``shard_map``, the table replicated and the expert outputs summed over the devices (module docstring).

    banks: the host banks of :func:`shard_host_banks` (None for resident). A streamed call's prologue runs on
    every device first. Stats are the replicated table's (one device's hits and misses; each miss is copied by
    every device, a piece each).
    Raises:
      ValueError: host banks missing for an offloading mode."""
    mesh = expert_mesh(devices)
    if mode != "resident" and banks is None:
        raise ValueError(f"experts mode {mode!r} needs the host expert banks")
    spec = _state_spec(state)
    # The table and the stats are computed from replicated inputs only (the routing, the table), the same
    # way on every device, so they are replicated (P()); check_vma cannot see that through the Pallas kernels
    # of a GPU step (the slot lookup), so it is off and the out_specs state it.
    shard = lambda f, i, o: jax.shard_map(f, mesh=mesh, in_specs=i, out_specs=o, check_vma=False)  # noqa: E731
    if stream:
        state = shard(lambda s, b: offload.stream_prologue(b, s, num_experts, overlap), (spec, P(EXPERT_AXIS)),
                      spec)(state, banks)

    def expert_fn(state: ExpertState, layer: jax.Array, r: LayerRouting):
        def body(state, banks, layer, x, ids, weights, valid):
            if stream:
                fn = offload.make_stream_expert_fn(num_experts, num_layers, banks, overlap)
            else:
                fn = offload.make_expert_fn(mode, num_experts, banks, policy, None, cheap_conds)
            y, state, stats = fn(state, layer, LayerRouting(x, ids, weights, valid))
            return jax.lax.psum(y, EXPERT_AXIS), state, stats

        fn = shard(body, (spec, P(EXPERT_AXIS), P(), P(), P(), P(), P()), (P(), spec, P()))
        return fn(state, banks, layer, r.x, r.ids, r.weights, r.valid)

    return state, expert_fn
