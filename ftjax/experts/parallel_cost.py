"""Link-time model of offloaded experts split over the N GPUs of one host: whole experts per device (expert
parallelism) against every expert split on its FFN width (tensor parallelism). docs/MULTI_GPU.md has the
predictions and the choice.

Each GPU copies its misses over its own host-to-device link; a layer computes once all of its routed experts
are on the devices, so a layer waits for its busiest link, and the layer's output is summed over the devices
(one all-reduce per layer, the same ``psum`` in every split). The strategies (:data:`STRATEGIES`), for a
layer whose m routed experts miss (the missed experts a uniform random m-subset of the E experts):

* ``one``: one GPU copies the m experts: m copies of B bytes (B: one expert, all its weight arrays).
* ``expert``: expert parallelism as ftjax builds it (``ftjax/experts/parallel.py``): expert e is owned by
  device e // (E/N), which copies it whole; the busiest link copies the largest share of the m experts
  that one device owns, in expectation :func:`busiest_owner` (exact, multivariate hypergeometric).
* ``expert_balanced``: whole experts, but an expert may sit on any device and a layer's misses are dealt
  over the devices (one global table; ``any_device_balanced`` of experiments/replay_parallel_tables.py):
  ceil(m / N) experts on the busiest link.
* ``tensor``: every expert's FFN width F split over the N devices (gate/up column blocks, down row blocks;
  the host banks laid out per device, so a piece is contiguous): each link copies all m experts, a piece
  of B / N bytes each. Balanced by construction, N times as many copies, each N times smaller.

A copy costs ``copy_s`` plus its bytes over ``link_Bps`` per weight array of the expert
(``arrays_per_expert`` copies per expert or piece). Decode at batch b: the layer routes r distinct experts
(:func:`distinct_routed`: uniform routing), each missing with probability ``miss_rate`` (m ~ Binomial(r,
miss_rate)); a step is ``other_decode_s`` (the step's non-copy work, replicated on every device) plus, per
layer, the expected busiest-link copy time and the all-reduce of the [b, D] output. A streamed prefill of T
tokens copies all E experts of every layer (one contiguous slice per device and weight array: E / N experts
or E pieces of B / N, the same bytes per link in every split) while the previous layer computes, so a layer
takes max(copy, compute) plus the all-reduce of [T, D]; compute is T * k (token, expert) pairs of 6 * D * F
flops, split N ways under ``tensor`` and not split under ``expert`` (the built version replicates the tokens,
so every device runs every pair, masked).

Units: bytes, seconds, bytes per second, flops per second. Uniform routing is an assumption (trained routing
is a little less even: docs/MULTI_GPU.md compares the model with replayed routing).
"""

from __future__ import annotations

import dataclasses
import functools
import math

from ftjax.config import ModelConfig

#: The splits the model compares (module docstring).
STRATEGIES = ("one", "expert", "expert_balanced", "tensor")


@dataclasses.dataclass(frozen=True)
class LinkModel:
    """The costs the model is made of (defaults: an H200 host with one PCIe link per GPU).

    Attributes:
      link_Bps: host-to-device bytes per second of one GPU's link (52e9: B_P measured on an H200, 50.7 to
        53.1 GB/s; docs/OVERLAP.md).
      copy_s: fixed seconds per copy, whatever its size (5e-6: assumed; the decode fetch fit, 0.22 ms per
        9.44 MB expert, cannot separate it from the bytes at one copy size).
      arrays_per_expert: copies per expert (or per piece): its weight arrays (gate_up and down: 2).
      allreduce_latency_s: fixed seconds of the per-layer all-reduce of the expert outputs (15e-6: assumed,
        NVLink).
      allreduce_Bps: bus bytes per second of that all-reduce (300e9: assumed, NVLink).
      flops_per_s: expert compute rate of a prefill's grouped matmul (400e12: assumed, bf16 on an H200).
      other_decode_s: seconds of a decode step that are not expert copies, replicated on every device (4.7e-3:
        resident qwen3-30b-a3b bf16 decode at batch 1, 211.2 tok/s; docs/FIGURES.md, 2026-12-04).
    """

    link_Bps: float = 52e9
    copy_s: float = 5e-6
    arrays_per_expert: int = 2
    allreduce_latency_s: float = 15e-6
    allreduce_Bps: float = 300e9
    flops_per_s: float = 400e12
    other_decode_s: float = 4.7e-3


def _check(strategy: str, num_experts: int, devices: int) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}")
    if devices < 1 or num_experts % devices:
        raise ValueError(f"devices={devices}: expected >= 1 and a divisor of num_experts={num_experts}")
    if strategy == "one" and devices != 1:
        raise ValueError(f"strategy 'one' is one device, got devices={devices}")


@functools.lru_cache(maxsize=None)
def busiest_owner(misses: int, num_experts: int, devices: int) -> float:
    """Expected largest number of ``misses`` experts (a uniform random subset of the ``num_experts`` of a layer)
    that one of ``devices`` devices owns, each device owning E / N of them (exact: P(max <= t) counts the
    ways to pick at most t from each block).
    Raises:
      ValueError: N not dividing E, or misses outside [0, E]."""
    if devices < 1 or num_experts % devices:
        raise ValueError(f"devices={devices}: expected >= 1 and a divisor of num_experts={num_experts}")
    if not 0 <= misses <= num_experts:
        raise ValueError(f"misses={misses}: expected 0 <= misses <= num_experts={num_experts}")
    block = num_experts // devices
    total = math.comb(num_experts, misses)
    expected = 0.0
    for t in range(misses):  # E[max] = sum over t >= 0 of P(max > t)
        one = [math.comb(block, x) for x in range(min(t, block) + 1)]
        poly = [1]  # ways to pick j experts, at most t from each block so far: coefficients of z^j
        for _ in range(devices):
            nxt = [0] * min(len(poly) + len(one) - 1, misses + 1)
            for i, a in enumerate(poly):
                for j, b in enumerate(one[: len(nxt) - i]):
                    nxt[i + j] += a * b
            poly = nxt
        at_most = poly[misses] if misses < len(poly) else 0
        expected += 1.0 - at_most / total
    return expected


def busiest_link(strategy: str, misses: int, num_experts: int, devices: int) -> tuple[float, float]:
    """(expert bytes, in units of one expert, and copies, each of all of an expert's or a piece's weight
    arrays) on a layer's busiest link when ``misses`` of its experts miss, in expectation over which.
    Raises:
      ValueError: an unknown strategy, N not dividing E, or misses outside [0, E]."""
    _check(strategy, num_experts, devices)
    if strategy == "one":
        return float(misses), float(misses)
    if strategy == "expert":
        share = busiest_owner(misses, num_experts, devices)
        return share, share
    if strategy == "expert_balanced":
        share = float(-(-misses // devices))
        return share, share
    return misses / devices, float(misses)


def distinct_routed(num_experts: int, top_k: int, batch: int) -> int:
    """Distinct experts a layer routes for ``batch`` tokens of uniform routing (each token top_k distinct of E),
    rounded: E * (1 - (1 - k/E)^b)."""
    return round(num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch))


def allreduce_s(nbytes: float, devices: int, link: LinkModel) -> float:
    """Seconds of the per-layer all-reduce of ``nbytes`` over ``devices`` (ring: 2 (N-1)/N of the bytes)."""
    if devices == 1:
        return 0.0
    return link.allreduce_latency_s + 2 * (devices - 1) / devices * nbytes / link.allreduce_Bps


def decode_step_s(strategy: str, cfg: ModelConfig, devices: int, batch: int, miss_rate: float,
                  link: LinkModel = LinkModel(), itemsize: int = 2) -> float:
    """Expected seconds of one decode step of ``batch`` tokens (module docstring): ``other_decode_s`` plus,
    per layer, the busiest link's copies of the layer's misses (m ~ Binomial(r, miss_rate), r =
    :func:`distinct_routed`) and the all-reduce of the [batch, D] output (``itemsize`` bytes per value).
    Raises:
      ValueError: an unknown strategy, N not dividing E or F, a miss rate outside [0, 1], batch < 1."""
    _check(strategy, cfg.num_experts, devices)
    if cfg.expert_ffn % devices:
        raise ValueError(f"devices={devices} must divide expert_ffn={cfg.expert_ffn}")
    if not 0.0 <= miss_rate <= 1.0 or batch < 1:
        raise ValueError(f"miss_rate={miss_rate}, batch={batch}: expected 0 <= miss_rate <= 1 and batch >= 1")
    expert = cfg.expert_bytes(itemsize)
    routed = distinct_routed(cfg.num_experts, cfg.top_k, batch)
    layer = 0.0
    for m in range(routed + 1):
        p = math.comb(routed, m) * miss_rate ** m * (1.0 - miss_rate) ** (routed - m)
        nbytes, copies = busiest_link(strategy, m, cfg.num_experts, devices)
        layer += p * (nbytes * expert / link.link_Bps + copies * link.arrays_per_expert * link.copy_s)
    layer += allreduce_s(batch * cfg.hidden_size * itemsize, devices, link)
    return link.other_decode_s + cfg.num_layers * layer


def prefill_layer_s(strategy: str, cfg: ModelConfig, devices: int, tokens: int, link: LinkModel = LinkModel(),
                    itemsize: int = 2) -> float:
    """Seconds of one layer of a streamed prefill of ``tokens`` tokens: max(copy of the layer's experts, their
    compute) plus the all-reduce of the [tokens, D] output (module docstring).
    Raises:
      ValueError: an unknown strategy, or N not dividing E or F."""
    _check(strategy, cfg.num_experts, devices)
    if cfg.expert_ffn % devices:
        raise ValueError(f"devices={devices} must divide expert_ffn={cfg.expert_ffn}")
    nbytes = cfg.num_experts * cfg.expert_bytes(itemsize) / devices
    copy = nbytes / link.link_Bps + link.arrays_per_expert * link.copy_s
    flops = tokens * cfg.top_k * 6 * cfg.hidden_size * cfg.expert_ffn
    compute = flops / link.flops_per_s / (devices if strategy == "tensor" else 1)
    return max(copy, compute) + allreduce_s(tokens * cfg.hidden_size * itemsize, devices, link)


def predictions(cfg: ModelConfig, devices: tuple[int, ...] = (2, 4), link: LinkModel = LinkModel(),
                itemsize: int = 2, prefill_tokens: int = 8192) -> list[dict]:
    """Rows {scenario, strategy, devices, seconds, speedup} for decode at batch 1 and 4 with every routed
    expert missing (miss_rate 1: the 8 GB budget at qwen3-30b-a3b) and half of them, and a streamed prefill
    of ``prefill_tokens``; speedup over one device at the same miss rate (seconds per step, or per prefill).
    Raises:
      ValueError: a device count not dividing E or F."""
    scenarios = [(f"decode b={b} miss={q:g}", functools.partial(decode_step_s, cfg=cfg, batch=b, miss_rate=q,
                                                                  link=link, itemsize=itemsize))
                 for b in (1, 4) for q in (1.0, 0.5)]
    scenarios.append((f"prefill {prefill_tokens}", lambda strategy, devices: cfg.num_layers * prefill_layer_s(
        strategy, cfg, devices, prefill_tokens, link, itemsize)))
    rows = []
    for name, fn in scenarios:
        base = fn(strategy="one", devices=1)
        rows.append({"scenario": name, "strategy": "one", "devices": 1, "seconds": base, "speedup": 1.0})
        for n in devices:
            for s in STRATEGIES[1:]:
                t = fn(strategy=s, devices=n)
                rows.append({"scenario": name, "strategy": s, "devices": n, "seconds": t, "speedup": base / t})
    return rows


def main() -> None:
    """Prints :func:`predictions` at qwen3-30b-a3b (bf16) with the default :class:`LinkModel`."""
    from ftjax.config import preset
    print(f"{'scenario':>22} {'strategy':>16} {'devices':>7} {'seconds':>9} {'speedup':>7}")
    for r in predictions(preset("qwen3-30b-a3b")):
        print(f"{r['scenario']:>22} {r['strategy']:>16} {r['devices']:>7} {r['seconds']:>9.4f} {r['speedup']:>7.3f}")


if __name__ == "__main__":
    main()
