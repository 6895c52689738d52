"""Device-memory plan: how many expert slots fit a VRAM budget, and the experts mode of a run (DESIGN.md 1.1,
1.3). The one planner: :func:`plan_memory` is the arithmetic, :func:`plan_run` the decision a run makes.

budget = non-expert weights + KV cache + workspace + layer buffers + S * expert_bytes, with S
clamped to [E, L*E]. The layer buffers depend on the prefill driver (``EngineConfig.prefill_driver``):
the layer scan streams through 2E slots borrowed from the pool and copies one layer's E experts for the
grouped (prefill) expert matmul (the "layer gather", ``ftjax.experts.compute.experts_from_pool``; 1.2 GB
for qwen3-30b-a3b in bf16); the layer-pipelined driver (``ftjax.runtime.drivers``) gathers nothing
and borrows no slot, but holds two full-layer buffers of its own (2.4 GB), so it streams with S >= E.
Where the driver is the planner's to choose (``prefill_driver`` "auto", ``prefill`` "auto") and the
pipelined driver's buffers would leave fewer than E slots, :func:`plan_run` plans the scan driver
instead (its workspace measured again, on the scan's programs) and the run's config names it: a budget
that holds the scan's plan is not refused for buffers the run can do without (DESIGN.md 1.3: the scan
streams through 2E slots borrowed from the pool; with fewer, prefill loads the routed experts on demand).

The workspace (activations and every other temporary of the compiled steps) is either
*measured*: the largest ``temp_size_in_bytes`` of the XLA programs the run will execute, plus a
margin for the allocator (:func:`plan_run` compiles them first; the gather is part of
that temp, so it is not added again), or, without a measurement, a *stated* WORKSPACE_BYTES
(1 GB). The stated margin is too small for long prefills: on the H200 an 8192-token chunk of
qwen3-30b-a3b peaked 6.9 GB above such a plan at 8 GB (experiments/results/checks/plan_vs_peak_*.json).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from ftjax import model as model_lib
from ftjax.config import EngineConfig, MissPolicyConfig, ModelConfig
from ftjax.kernels import grouped_matmul, registry
from ftjax.runtime.engine import Engine

GB = 1e9
WORKSPACE_BYTES = int(1.0 * GB)
#: The plan's ``driver_note`` where ``prefill_driver`` "auto" became the scan for a float32 model on a GPU
#: (``EngineConfig.for_compute_dtype``).
F32_SCAN_NOTE = "float32 on a GPU: the scan, whose logits are the resident model's bit for bit (docs/OVERLAP.md)"
#: Added to a measured workspace: the device allocator's rounding and fragmentation.
WORKSPACE_MARGIN_FRACTION, WORKSPACE_MARGIN_BYTES = 0.10, int(0.25 * GB)


class BudgetTooSmall(ValueError):
    """:func:`plan_memory`: the budget leaves fewer than E expert slots (the message gives the minimum budget).

    Attributes: slots: the slots it leaves (>= 0); minimum_bytes: the smallest budget that leaves E."""

    def __init__(self, message: str, slots: int, minimum_bytes: int):
        super().__init__(message)
        self.slots, self.minimum_bytes = slots, minimum_bytes


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per part of the device budget and the resulting slot count.

    All sizes in bytes. ``slots`` is S; ``fits_resident``: the whole pool fits (S = L*E);
    ``prefill_double_buffer``: prefill can stream whole layers (some expert has no slot, and the pipelined
    driver's buffers are planned or S >= 2E for the scan's);
    ``workspace_temp_bytes``: the compiled programs' largest temporaries the workspace was
    measured from (None: the workspace is the stated one); ``pipelined``: the layer buffers are the
    pipelined driver's two full-layer buffers (else the scan's layer gather); ``driver_note``: why the
    planner chose the scan driver where the pipelined one would have run (None: it did not choose);
    ``devices``: N, the devices the experts are split over (``EngineConfig.devices``), as ``expert_split`` says
    (``EngineConfig.expert_split``): every size is then one device's (its budget, its replicated weights and KV
    cache). "expert": its ``slots`` of its ``pool_slots`` = L*E/N experts, ``num_experts`` = E/N, and the run's
    slot count is ``slots * devices`` (:attr:`total_slots`). "tensor": its ``slots`` pieces of 1/N of an expert
    each (``expert_bytes`` is a piece's), of all L*E experts, ``num_experts`` = E; the run's slot count is
    ``slots`` (one table).
    """

    budget_bytes: int
    non_expert_bytes: int
    kv_cache_bytes: int
    workspace_bytes: int
    layer_gather_bytes: int
    expert_bytes: int
    slots: int
    pool_slots: int
    num_experts: int
    workspace_temp_bytes: int | None = None
    pipelined: bool = False
    driver_note: str | None = None
    devices: int = 1
    expert_split: str = "expert"

    @property
    def total_slots(self) -> int:
        """Slots over all devices: the run's ``EngineConfig.num_slots`` (the tensor split's slots are pieces of
        the same experts on every device: one table of ``slots``)."""
        return self.slots * self.devices if self.expert_split == "expert" else self.slots

    @property
    def driver(self) -> str:
        """The prefill driver the plan is for: "pipelined" or "scan"."""
        return "pipelined" if self.pipelined else "scan"

    @property
    def planned_bytes(self) -> int:
        """Everything the plan puts on the device: the number that must not be below the peak."""
        return (self.non_expert_bytes + self.kv_cache_bytes + self.workspace_bytes + self.layer_gather_bytes
                + self.all_slots_bytes)

    @property
    def all_slots_bytes(self) -> int:
        """Bytes of the whole slot pool (S x expert_bytes)."""
        return self.slots * self.expert_bytes

    @property
    def fits_resident(self) -> bool:
        return self.slots >= self.pool_slots

    @property
    def prefill_double_buffer(self) -> bool:
        """Whether prefill can stream whole layers: some expert has no slot (with every expert in one there is
        nothing to stream), and the pipelined driver's buffers are planned or the scan's 2E borrowed slots fit."""
        return not self.fits_resident and (self.pipelined or self.slots >= 2 * self.num_experts)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(all_slots_bytes=self.all_slots_bytes, fits_resident=self.fits_resident, driver=self.driver,
                 total_slots=self.total_slots,
                 prefill_double_buffer=self.prefill_double_buffer, planned_bytes=self.planned_bytes)
        return d

    def describe(self) -> str:
        gb = lambda n: f"{n / GB:8.3f} GB"  # noqa: E731
        measured = self.workspace_temp_bytes is not None
        if self.pipelined:
            gather = [(f"stream buffers (2 x {self.num_experts} experts)", self.layer_gather_bytes)]
        else:  # a measured workspace includes the gather; the kernels may read the pool in place instead
            label = "layer gather for prefill " + (f"({self.num_experts} experts)" if self.layer_gather_bytes
                                                   else "(none: the experts are read in the pool)")
            gather = [] if measured else [(label, self.layer_gather_bytes)]
        rows = [("budget", self.budget_bytes), ("non-expert weights", self.non_expert_bytes),
                ("KV cache", self.kv_cache_bytes),
                ("workspace (" + ("measured" if measured else "stated") + ")", self.workspace_bytes),
                *gather,
                (f"expert slots ({self.slots} x {self.expert_bytes / 1e6:.2f} MB)", self.all_slots_bytes)]
        if self.devices == 1:
            head = "memory plan:"
        elif self.expert_split == "tensor":
            head = (f"memory plan, per device ({self.devices} devices, each holding 1/{self.devices} of every expert's "
                    f"FFN width, one slot table; weights and KV cache replicated):")
        else:
            head = (f"memory plan, per device ({self.devices} devices, each owning {self.num_experts} experts of every "
                    f"layer; weights and KV cache replicated):")
        lines = [head] + [f"  {name:<40} {gb(n)}" for name, n in rows]
        lines.append(f"  slots {self.slots} of {self.pool_slots} experts in the pool "
                     f"({100 * self.slots / self.pool_slots:.1f}%)")
        e2 = 2 * self.num_experts
        if self.fits_resident:  # every expert has a slot: nothing to stream
            buffer = "not needed (every expert has a slot)"
        elif self.pipelined:
            buffer = "yes (two full-layer buffers of its own)"
        elif self.prefill_double_buffer:
            buffer = f"yes ({e2} slots borrowed from the pool)"
        else:
            buffer = f"no (it needs {e2} slots: prefill loads the routed experts on demand)"
        note = f" ({self.driver_note})" if self.driver_note else ""
        lines.append(f"  prefill driver {self.driver}{note}; prefill double buffer: {buffer}")
        return "\n".join(lines)


def non_expert_params(cfg: ModelConfig) -> int:
    """Number of parameters outside the routed experts (embeddings, mixers, norms, routers, shared experts,
    head): every leaf of ``ftjax.model.param_shapes``."""
    shapes = model_lib.param_shapes(cfg)
    leaves = [s for k, s in shapes.items() if k != "layers"] + list(shapes["layers"].values())
    return sum(math.prod(s) for s in leaves)


def split_factors(devices: int, expert_split: str) -> tuple[int, int]:
    """(share, piece) of one device under a split of the experts over ``devices`` (``EngineConfig.expert_split``):
    it owns E / share experts of every layer, and one of its slots holds 1 / piece of an expert. "expert":
    (N, 1); "tensor": (1, N)."""
    return (devices, 1) if expert_split == "expert" else (1, devices)


def plan_memory(cfg: ModelConfig, itemsize: int, budget_bytes: int | None = None, slots: int | None = None,
                batch: int = 1, max_seq_len: int = 512, workspace_bytes: int | None = None,
                expert_bytes: int | None = None, pipelined: bool = False, devices: int = 1,
                expert_split: str = "expert", kernels: registry.KernelConfig | None = None) -> MemoryPlan:
    """Plans the device memory for a budget or an explicit slot count (exactly one of them).

    Args:
      cfg: model config; itemsize: bytes per weight/KV element (2 for bf16).
      budget_bytes: device bytes available to ftjax. slots: explicit S instead.
      workspace_bytes: the measured temporaries of the compiled steps (the layer gather
        included; the allocator margin is added here); None: the stated WORKSPACE_BYTES plus
        the layer gather, unless the run's kernels on this backend read dense experts in the pool
        (``grouped_matmul.reads_pool_in_place``: a GPU, 256 experts a layer or more).
      expert_bytes: bytes of one expert as stored (``ExpertBanks.expert_bytes``: quantized
        weights + scales); default: dense at ``itemsize``. Slots are sized by it; the stated
        layer gather is E experts as stored plus, when quantized, their dequantized copy.
      pipelined: plan for the layer-pipelined prefill driver: two full-layer buffers (2E experts as
        stored) outside the pool, counted whether the workspace is measured or stated (they are
        the programs' arguments, not temporaries), instead of the layer gather.
      devices: N > 1 plans one device of a split of the experts (``expert_split``): the budget and slots are
        one device's, the non-expert weights and KV cache replicated on it. "expert" (``ftjax.experts.parallel``):
        its experts E/N per layer (pool L*E/N). "tensor" (``ftjax.experts.tensor_parallel``): a slot holds a
        1/N piece of an expert (``expert_bytes`` / N), of all E per layer (pool L*E).
      kernels: the run's kernel config (``EngineConfig.kernels``), which decides whether a stated plan holds the
        layer gather; None: the active one (``ftjax.kernels.registry.active``).
    Raises:
      BudgetTooSmall: the budget leaves fewer than E slots (the message gives the minimum budget; a
        ValueError).
      ValueError: neither or both given; slots outside [E, L*E].
    """
    if (budget_bytes is None) == (slots is None):
        raise ValueError("give exactly one of a VRAM budget or a slot count")
    share, piece = split_factors(devices, expert_split)
    e, pool = cfg.num_experts // share, cfg.num_layers * cfg.num_experts // share
    dense_eb = cfg.expert_bytes(itemsize) // piece
    eb = (int(expert_bytes) if expert_bytes is not None else cfg.expert_bytes(itemsize)) // piece
    non_expert = non_expert_params(cfg) * itemsize
    kv = cfg.kv_cache_bytes(batch, max_seq_len, itemsize)
    if workspace_bytes is None:
        workspace = WORKSPACE_BYTES
        # one layer's experts, copied for the grouped matmul (prefill chunks > 64 pairs), and dequantized; none
        # where the kernels read dense experts in the pool (on a GPU from 256 experts a layer)
        with registry.using(kernels or registry.active()):
            in_place = eb == dense_eb and grouped_matmul.reads_pool_in_place(cfg.hidden_size,
                                                                             cfg.expert_ffn // piece, e, itemsize)
        gather = 0 if in_place else e * eb + (e * dense_eb if eb != dense_eb else 0)
    else:
        workspace = int(workspace_bytes * (1 + WORKSPACE_MARGIN_FRACTION)) + WORKSPACE_MARGIN_BYTES
        gather = 0  # part of the measured temporaries
    if pipelined:
        gather = 2 * e * eb
    fixed = non_expert + kv + workspace + gather
    if slots is None:
        slots = min(pool, (budget_bytes - fixed) // eb) if budget_bytes > fixed else 0
        if slots < e:
            need = fixed + e * eb
            hint = (f" (the workspace of the compiled steps is {workspace / GB:.2f} GB; a smaller --prefill_chunk "
                    f"shrinks it)" if workspace_bytes is not None else "")
            if pipelined:
                hint += (f"; {gather / GB:.2f} GB of it are the pipelined prefill driver's two full-layer buffers "
                         f"(prefill_driver 'scan' plans without them; 'auto' does so itself with prefill 'auto')")
            raise BudgetTooSmall(f"VRAM budget {budget_bytes / GB:.3f} GB leaves {max(slots, 0)} expert slots; "
                                 f"at least E={e} are needed (one layer may route to every expert): the minimum "
                                 f"budget is {math.ceil(need / 1e7) / 100:.2f} GB{hint}", max(slots, 0), need)
    elif not e <= slots <= pool:
        per = "" if devices == 1 else " per device"
        raise ValueError(f"expert slots {slots}{per} out of range: need E={e} <= slots <= L*E={pool}")
    budget = budget_bytes if budget_bytes is not None else fixed + slots * eb
    return MemoryPlan(int(budget), int(non_expert), int(kv), int(workspace), int(gather), int(eb), int(slots), pool, e,
                      None if workspace_bytes is None else int(workspace_bytes), pipelined, devices=devices,
                      expert_split=expert_split)


def plan_run(model, config: EngineConfig, prompts: Sequence[Sequence[int]], budget_bytes: int | None = None,
             slots: int | None = None, mode: str = "auto") -> tuple[EngineConfig, MemoryPlan | None]:
    """The experts mode and slot count of a run of ``prompts`` with ``config`` (its mode and slots are
    replaced): (EngineConfig for the run, MemoryPlan or None for a resident run with no budget).

    * ``budget_bytes``: the slots that fit it, with the workspace *measured*: a probe engine at
      min(2E, L*E) slots (so that the streamed prefill programs are compiled where streaming can happen)
      compiles every prefill call and the decode step, and the largest temporary buffer of those
      programs is the plan's workspace. Where streamed calls would run on the layer-pipelined driver
      (``config.pipelines_streams()``) its two full-layer buffers are planned; if they leave fewer than E
      slots and the driver is the planner's to choose (``prefill_driver`` "auto" and ``prefill`` "auto"),
      the plan is the scan driver's instead (the workspace measured again on a probe of the scan's
      programs, which include its layer gather), the returned config says ``prefill_driver="scan"`` and
      the plan's ``driver_note`` says why (as it does where a float32 model on a GPU took the scan, below).
    * ``slots``: that many slots (the workspace stated); a resident mode ignores them.
    * neither: resident for ``mode`` "auto" or "resident"; for an offloading mode a cache of min(2E, L*E)
      slots, smaller than the pool, so that the mechanism shows (the demo's default).
    Over ``config.devices`` N > 1 the plan is one device's (``plan_memory(devices=N, expert_split=...)``:
    ``budget_bytes`` is each device's budget; ``slots`` the total: split S / N under the expert split, S pieces
    on every device under the tensor split), and a resident run gets that plan too (not None).
    ``mode``: "auto" (resident when the whole pool fits, else cached) or an experts mode to keep.
    A float32 model on a GPU is planned on the scan driver under ``prefill_driver`` "auto"
    (``EngineConfig.for_compute_dtype``: the engine runs it there): the returned config says so, and the plan's
    ``driver_note`` (:data:`F32_SCAN_NOTE`).

    Raises:
      BudgetTooSmall: the budget leaves fewer than E slots (the message gives the minimum budget): on the
        scan driver, or on the pipelined driver when it was asked for (``prefill_driver="pipelined"``, or
        ``prefill="stream"``, which the scan could only serve with 2E slots). A ValueError.
      ValueError: both budget and slots; the budget leaves fewer than the 2E slots that ``prefill="stream"``
        needs on the scan driver, or, with ``mode="resident"``, fewer than the whole pool (the message gives
        the budget it needs).
    """
    cfg = model.cfg
    if budget_bytes is not None and slots is not None:
        raise ValueError("give a VRAM budget or a slot count, not both")
    dtype = np.dtype(model.params["embed"].dtype)
    resolved = config.for_compute_dtype(dtype.name)  # float32 on a GPU: the scan
    note = None if resolved == config else F32_SCAN_NOTE
    config = resolved
    itemsize = dtype.itemsize
    demo_slots = min(2 * cfg.num_experts, cfg.num_layers * cfg.num_experts)
    pipelined = config.pipelines_streams() and config.prefill != "on_demand"
    n = config.devices  # over N devices every size is one device's (MemoryPlan.devices)
    split = config.expert_split
    share = split_factors(n, split)[0]  # slots S / N each under the expert split; S pieces under tensor
    if budget_bytes is None:
        if mode == "resident" or (slots is None and mode == "auto"):
            per_device = None if n == 1 else plan_memory(
                cfg, itemsize, slots=cfg.num_layers * cfg.num_experts // share, batch=config.batch,
                max_seq_len=config.max_seq_len, expert_bytes=model.expert_bytes, devices=n, expert_split=split,
                kernels=config.kernels)
            return _resident(config), per_device
        plan = plan_memory(cfg, itemsize, slots=(slots or demo_slots) // share, batch=config.batch,
                           max_seq_len=config.max_seq_len, expert_bytes=model.expert_bytes, pipelined=pipelined,
                           devices=n, expert_split=split, kernels=config.kernels)
    else:
        def plan_for(run: EngineConfig, pipelined: bool) -> MemoryPlan:
            return plan_memory(cfg, itemsize, budget_bytes=budget_bytes, batch=run.batch,
                               max_seq_len=run.max_seq_len, workspace_bytes=_workspace(model, run, prompts),
                               expert_bytes=model.expert_bytes, pipelined=pipelined, devices=n,
                               expert_split=split)
        try:
            plan = plan_for(config, pipelined)
        except BudgetTooSmall as err:
            if not (pipelined and config.prefill_driver == "auto" and config.prefill == "auto"):
                raise
            config = dataclasses.replace(config, prefill_driver="scan")
            plan = plan_for(config, False)  # raises if even the scan's plan does not fit
            buffers = 2 * cfg.num_experts * model.expert_bytes
            plan = dataclasses.replace(plan, driver_note=(
                f"pipelined buffers do not fit: their {buffers / GB:.3f} GB would leave {err.slots} slots, "
                f"E={cfg.num_experts} needed"))
    if note and plan.driver_note is None:
        plan = dataclasses.replace(plan, driver_note=note)
    if mode == "auto":
        mode = "resident" if plan.fits_resident else "cached"
    if mode == "resident" and not plan.fits_resident:
        need = plan.planned_bytes - plan.layer_gather_bytes + (plan.pool_slots - plan.slots) * plan.expert_bytes
        raise ValueError(f"experts mode 'resident' keeps all {plan.pool_slots} experts "
                         f"({plan.pool_slots * plan.expert_bytes / 1e9:.3f} GB) on the device, but a budget of "
                         f"{plan.budget_bytes / 1e9:.3f} GB leaves room for {plan.slots}; give at least "
                         f"{need / 1e9:.3f} GB, or experts mode 'cached' or 'auto'")
    if mode == "resident":
        return _resident(config), plan
    # validated against the model here: e.g. prefill=stream with fewer than 2E slots is refused
    return dataclasses.replace(config, experts=mode, num_slots=plan.total_slots).for_model(cfg), plan


def _workspace(model, config: EngineConfig, prompts: Sequence[Sequence[int]]) -> int:
    """The measured workspace of a run of ``prompts`` with ``config``: the largest temporaries of the programs a
    probe engine at min(2E, L*E) slots compiles (every prefill call, with streaming where it can happen, and the
    decode step). Misses are fetched in the probe: its programs are what the run compiles, without the CPU
    mechanism's calibration (a measured workspace of a cpu / adaptive step would only add the CPU outputs)."""
    cfg = model.cfg
    probe = Engine(model, dataclasses.replace(config, experts="cached", miss=MissPolicyConfig(),
                                              num_slots=min(2 * cfg.num_experts, cfg.num_layers * cfg.num_experts)))
    probe.prepare_prefill(prompts, probe.new_cache(len(prompts)))
    workspace = probe.programs.workspace_bytes()
    del probe
    return workspace


def _resident(config: EngineConfig) -> EngineConfig:
    """``config`` with every expert on the device: nothing to stream."""
    return dataclasses.replace(config, experts="resident", num_slots=None,
                               prefill="auto" if config.prefill == "stream" else config.prefill)
