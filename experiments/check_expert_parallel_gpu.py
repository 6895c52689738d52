r"""Does splitting the experts over the GPUs of one host pay? Streamed prefill and offloaded decode at 1 and N GPUs.

  PYTHONPATH=. python3 experiments/check_expert_parallel_gpu.py --out_dir=$OUT          # nvidia-h200-x2
  XLA_FLAGS=--xla_force_host_platform_device_count=2 PYTHONPATH=. JAX_PLATFORMS=cpu .venv/bin/python \
      experiments/check_expert_parallel_gpu.py --preset=tiny --dtype=float32 --vram_budget_gb=1.012 \
      --prefill_tokens=64 --decode_tokens=4 --out_dir=/tmp/ep                             # CPU smoke (~1 min)

Targets (issue 35; docs/MULTI_GPU.md): at the qwen3-30b-a3b shape (random weights, bf16, batch 1), each GPU
with the same ``--vram_budget_gb`` (8 GB), the streamed 8192-token prefill on 2 GPUs >= 1.8x faster than on
1 GPU, and offloaded decode >= 1.7x one GPU's tokens/s.

For each device count of ``--devices`` (default 1,2; the experts split over N GPUs, ``EngineConfig.devices``) and,
over N > 1, each split of ``--expert_splits`` (``EngineConfig.expert_split``: "expert", whole experts owned by
each GPU; "tensor", every expert's FFN width split over the GPUs, one slot table), experts "cached":

* ``prefill``: an engine with 2E slots over all devices (2E/N each: the smallest cache that streams on the
  layer scan, whatever the budget; a streamed call copies all E experts of every layer either way),
  ``--repeats`` prefills of ``--prefill_tokens`` random tokens, each from an empty expert cache, in one call
  that streams whole layers (each GPU its E/N experts of a layer through its own link): TTFT each;
* ``decode``: an engine with the slots one device's budget buys (``plan_memory(devices=N)``: its replicated
  weights and KV cache, the stated 1 GB workspace, its S/N slots; N * S/N in all), prefill on demand;
  ``--decode_tokens`` greedy tokens after a 16-token prompt from an empty expert cache, then again warm (the
  cache as the first left it): tokens/s, hit rate, H2D bytes, and the imbalance of the routed experts over
  the devices (``routed_imbalance``: per (step, layer), the most distinct routed experts one device owns
  over the mean; 1.0 = balanced; the link-bound speedup of N devices is about N / imbalance; the tensor split
  copies a 1/N piece of every miss on every link: 1.0).

One GPU runs its streamed prefill on the layer-pipelined driver (the default ``auto``) and, for the
comparison on the same driver as N > 1, once more on the scan (``prefill_1gpu_scan``). ``summary`` gives the
speedups of the largest N over 1, per split, and whether the targets were met. Greedy ids of N > 1 vs 1 are compared
(``ids_equal``): in bf16 the sum over devices rounds differently and may change a token late in a run.

Output: ``check_expert_parallel_gpu.json`` (meta, flags, one row per device count and split, summary), rewritten
after each row. GPU runtime (estimate, not measured): ~4-8 min: the 30 GB bank built once, per row one prefill
program (8192 rows; for 1 GPU also the scan's) and one decode program compiled, the runs seconds each. Each
2-GPU engine copies the host banks once more, split over the devices in pinned host memory (58 GB at this shape;
the expert split also a transient numpy copy while splitting, the tensor split a copy of each device's pieces),
freed before the next row: ~180 GB of host memory at the peak.
"""

from __future__ import annotations

import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from experiments import common  # noqa: E402
from ftjax import Engine  # noqa: E402
from ftjax.config import EXPERT_SPLITS, EngineConfig  # noqa: E402
from ftjax.runtime.planner import GB, plan_memory  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("preset", "qwen3-30b-a3b", "Model shape (random weights).")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Compute and expert dtype.")
flags.DEFINE_list("devices", ["1", "2"], "Device counts to compare (each must divide E and F; 1 first).")
flags.DEFINE_list("expert_splits", ["expert", "tensor"], "Splits of the experts over N > 1 devices to compare.")
flags.DEFINE_float("vram_budget_gb", 8.0, "Each GPU's budget in GB (1e9 bytes), the workspace stated (1 GB).")
flags.DEFINE_integer("prefill_tokens", 8192, "Tokens of the streamed prefill (one call).")
flags.DEFINE_integer("decode_tokens", 64, "Greedy tokens of each decode run.")
flags.DEFINE_integer("repeats", 3, "Prefills per device count.")
flags.DEFINE_integer("seed", 0, "Weights and prompt seed.")
flags.DEFINE_string("out_dir", "experiments/results", "Where the JSON goes.")
common.define_kernel_flags()
common.check_preset()
common.check_names("expert_splits", EXPERT_SPLITS)
common.validate("devices", lambda v: None if v and all(x.isdigit() and int(x) >= 1 for x in v) and v[0] == "1"
                else "a comma list of device counts >= 1, starting with 1")
for _name in ("prefill_tokens", "decode_tokens", "repeats"):
    flags.register_validator(_name, lambda v: v >= 1, "must be >= 1")


def _plan(model, devices: int, max_seq_len: int, split: str):
    itemsize = np.dtype(model.params["embed"].dtype).itemsize
    return plan_memory(model.cfg, itemsize, budget_bytes=int(FLAGS.vram_budget_gb * GB), max_seq_len=max_seq_len,
                       expert_bytes=model.expert_bytes, devices=devices, expert_split=split,
                       kernels=common.kernel_config())


def routed_imbalance(routing: list[np.ndarray], num_experts: int, devices: int) -> float:
    """Mean over (step, layer) of the most distinct routed experts one device owns over their mean (1.0: even).
    routing: per step int32 [L, N, k] routed ids (-1: padding)."""
    el, ratios = num_experts // devices, []
    for step in routing:
        for layer in step:
            ids = np.unique(layer[layer >= 0])
            if ids.size:
                per = np.bincount(ids // el, minlength=devices)
                ratios.append(per.max() / (ids.size / devices))
    return float(np.mean(ratios)) if ratios else 1.0


def _engine(model, devices: int, slots: int, max_seq_len: int, prefill: str, driver: str = "auto",
            split: str = "expert") -> Engine:
    return Engine(model, EngineConfig("cached", num_slots=slots, max_seq_len=max_seq_len, prefill=prefill,
                                      prefill_chunk=FLAGS.prefill_tokens, prefill_driver=driver, devices=devices,
                                      expert_split=split, kernels=common.kernel_config()))


def _prefill(engine: Engine, prompt: list[int]) -> dict:
    engine.generate([prompt], max_new_tokens=1)  # compiles outside the timing
    ttft = []
    for _ in range(FLAGS.repeats):
        engine.reset_expert_cache()
        ttft.append(engine.generate([prompt], max_new_tokens=1).ttft_s)
    return {"ttft_s": common.spread(ttft), "prefill_tokens_per_s": len(prompt) / float(np.median(ttft)),
            "driver_calls": dict(engine.prefill_driver_calls), "engine": engine.describe()}


def _decode(engine: Engine, prompt: list[int], devices: int, split: str) -> dict:
    out = {}
    engine.reset_expert_cache()
    for name in ("cold", "warm"):
        res = engine.generate([prompt], max_new_tokens=FLAGS.decode_tokens, trace_routing=True)
        cache = res.expert_cache
        out[name] = {"tokens_per_s": res.decode_tokens_per_s, "ttft_s": res.ttft_s, "hit_rate": cache["hit_rate"],
                     "bytes_h2d": cache["bytes_h2d"], "ids": res.generated_ids[0],
                     "routed_imbalance": routed_imbalance(res.routing[1:], engine.cfg.num_experts, devices)
                     if split == "expert" else 1.0}
    return out


def _row(model, n: int, split: str, long_prompt: list[int], short_prompt: list[int], max_seq_len: int) -> dict:
    """One device count and split: its plan, streamed prefill and decode (module docstring).
    Raises:
      app.UsageError: a budget that leaves fewer than E slots on a device."""
    cfg = model.cfg
    try:
        plan = _plan(model, n, max_seq_len, split)
    except ValueError as err:  # BudgetTooSmall: the message gives the minimum budget
        raise app.UsageError(f"--vram_budget_gb={FLAGS.vram_budget_gb} at devices={n}, expert_split={split}: "
                             f"{err}") from None
    print(plan.describe(), flush=True)
    stream_slots = 2 * cfg.num_experts
    row = {"devices": n, "expert_split": split, "memory_plan": plan.as_dict(), "decode_slots": plan.total_slots,
           "prefill_slots": stream_slots}
    t0 = time.perf_counter()
    engine = _engine(model, n, stream_slots, max_seq_len, "stream", split=split)
    row["prefill"] = _prefill(engine, long_prompt)
    compile_s = engine.compile_s
    del engine
    if n == 1:  # the streamed prefill on the scan, the driver N > 1 runs on
        engine = _engine(model, 1, stream_slots, max_seq_len, "stream", driver="scan")
        row["prefill_1gpu_scan"] = _prefill(engine, long_prompt)
        compile_s += engine.compile_s
        del engine
    engine = _engine(model, n, plan.total_slots, max_seq_len, "on_demand", split=split)
    row["decode"] = _decode(engine, short_prompt, n, split)
    row["compile_s"] = compile_s + engine.compile_s
    del engine
    row["wall_s"] = time.perf_counter() - t0
    print(f"devices {n} ({split}): prefill {row['prefill']['prefill_tokens_per_s']:.0f} tok/s, decode cold "
          f"{row['decode']['cold']['tokens_per_s']:.2f} tok/s (hit rate {row['decode']['cold']['hit_rate']:.3f}, "
          f"imbalance {row['decode']['cold']['routed_imbalance']:.2f}), warm "
          f"{row['decode']['warm']['tokens_per_s']:.2f} tok/s", flush=True)
    return row


def main(argv):
    del argv
    counts = [int(x) for x in FLAGS.devices]
    if max(counts) > jax.device_count():
        raise app.UsageError(f"--devices={','.join(FLAGS.devices)}: only {jax.device_count()} device(s) present")
    cfg, model, build_s, bp = common.build_random_model(FLAGS.preset, FLAGS.dtype)
    rng = np.random.default_rng(FLAGS.seed)
    long_prompt = rng.integers(0, cfg.vocab_size, FLAGS.prefill_tokens).tolist()
    short_prompt = rng.integers(0, cfg.vocab_size, 16).tolist()
    max_seq_len = FLAGS.prefill_tokens + 128
    rows = []
    payload = {"model": {"preset": FLAGS.preset, "dtype": FLAGS.dtype, "build_s": build_s,
                         "expert_bytes": model.expert_bytes}, "B_P": bp, "rows": rows}
    for n in counts:
        for split in ["expert"] if n == 1 else FLAGS.expert_splits:
            rows.append(_row(model, n, split, long_prompt, short_prompt, max_seq_len))
            common.write_json(FLAGS.out_dir, "check_expert_parallel_gpu.json", payload)
    one, top_n = rows[0], counts[-1]

    def speedups(row: dict) -> dict:
        prefill_x = row["prefill"]["prefill_tokens_per_s"] / one["prefill"]["prefill_tokens_per_s"]
        decode_x = row["decode"]["warm"]["tokens_per_s"] / max(one["decode"]["warm"]["tokens_per_s"], 1e-9)
        return {"prefill_speedup": prefill_x, "prefill_speedup_vs_1gpu_scan": row["prefill"]["prefill_tokens_per_s"]
                / one["prefill_1gpu_scan"]["prefill_tokens_per_s"], "decode_speedup_warm": decode_x,
                "prefill_target_1p8x_met": prefill_x >= 1.8, "decode_target_1p7x_met": decode_x >= 1.7}

    payload["summary"] = {
        "devices": top_n, "by_split": {r["expert_split"]: speedups(r) for r in rows if r["devices"] == top_n},
        "ids_equal": [r["decode"]["cold"]["ids"] == one["decode"]["cold"]["ids"] for r in rows]}
    common.write_json(FLAGS.out_dir, "check_expert_parallel_gpu.json", payload)
    print(payload["summary"])


if __name__ == "__main__":
    common.run(main)
