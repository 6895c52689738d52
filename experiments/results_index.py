r"""Index of the committed GPU results: one markdown table row per result JSON.

Reads every ``*.json`` under ``experiments/results/`` (subfolders included, ``archive/`` left out) and
prints a markdown table: file, the script that wrote it, date (UTC), commit, device, jax version and
one headline figure where the JSON has an obvious one (decode tokens/s, prefill TTFT against its copy
bound, KV-reuse TTFT against recompute, the serving bench's ratios, a profile's step time against its
floor, a check's pass count).
Fields a file lacks show as "-". The output depends only on the files: rows are sorted by path.

Commit: ``meta.git_commit`` (``+dirty``: a working tree on top of that commit). For the runs listed in
:data:`COMMIT_AS_RUN` the copy on the GPU machine carried stale git metadata; the table shows the commit
recorded for the run when its file was added, marked ``*``.

Usage (from the repository root)::

  python experiments/results_index.py                      # the table for experiments/results/
  python experiments/results_index.py --write_readme       # ... written into its README's "Full index"
  python experiments/results_index.py --results_dir=experiments/results/archive

The "Full index" section of ``experiments/results/README.md`` is this script's output
(tests/test_results_layout.py checks that it is current).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_DIR = os.path.join(ROOT, "results")
README = os.path.join(DEFAULT_DIR, "README.md")
INDEX_HEADING = "## Full index"
ARCHIVE = "archive"

#: Result files whose ``meta.git_commit`` is not the code the run used (the GPU machine's copy of the
#: repository had stale git metadata), mapped to the commit recorded for the run when the file was added
#: (experiments/results/README.md, the commit messages that added them).
COMMIT_AS_RUN = {
    "probe_copy_stream_h100_2026-12-07_copies-1_blocks-16.json": "034a310",
    "probe_copy_stream_h100_2026-12-07_copies-1_blocks-4.json": "034a310",
    "probe_copy_stream_h100_2026-12-07_copies-4_blocks-2.json": "034a310",
    "probe_copy_stream_h100_2026-12-07_copies-4_blocks-4.json": "034a310",
    "probe_copy_stream_h100_2026-12-07_copies-4_blocks-4_graphs.json": "034a310",
    "probe_copy_stream_h100_2026-12-07_copies-4_blocks-8.json": "034a310",
    "probe_copy_stream_h100_2026-12-07_copies-8_blocks-2.json": "034a310",
    "bench_gated_delta_qwen3.5-35b-a3b_scan-kernel_h200_2026-12-04.json": "57a2d1a",
    "bench_gated_delta_qwen3.5-35b-a3b_solve-kernel_h200_2026-12-04.json": "7474a03",
    "bench_decode_speed_qwen3-30b-a3b_16l_h200_2026-12-03.json": "f19eceb",
    "bench_decode_speed_qwen3-30b-a3b_48l_h200_2026-12-03.json": "f19eceb",
    "bench_decode_speed_qwen3-30b-a3b_48l-graphs-off_h200_2026-12-03.json": "f19eceb",
    "bench_decode_speed_qwen3-30b-a3b_48l-graphs-on_h200_2026-12-03.json": "f19eceb",
    "bench_serve_qwen3-30b-a3b_resident_run-ahead_h200_2026-12-03.json": "9c907c9",
    "ab_slot_table_qwen3-30b-a3b_h200_2026-12-01.json": "a65cb21",
    "bench_decode_qwen3-30b-a3b_8gb_int4-rank_h200_2026-12-01.json": "a65cb21",
    "bench_decode_qwen3-30b-a3b_8gb_lookahead-c602b22_h200_2026-12-02.json": "c602b22",
    "bench_kv_reuse_qwen3-30b-a3b_9gb_groups-2-3-4_h200_2026-12-01.json": "325f3d4",
    "bench_kv_reuse_qwen3-30b-a3b_9gb_groups-4-8-16_h200_2026-12-01.json": "325f3d4",
    "bench_kv_reuse_qwen3-30b-a3b_9gb_in-program_h200_2026-12-01.json": "86d8682",
    "bench_prefill_qwen3-30b-a3b_24gb_d2d-rerun_h200_2026-11-30.json": "76bc8af",
    "bench_prefill_qwen3-30b-a3b_9gb_int4-fp8_h200_2026-12-02.json": "d5f3250",
    "check_identity_gpu_route-decode_h200_2026-12-02.json": "df6870a",
    "check_identity_gpu_kernels-cb80241_h200_2026-12-02.json": "cb80241",
    "check_identity_gpu_c602b22_h200_2026-12-02.json": "c602b22",
    "check_kernels_gpu_e2e-prefill-gather_h200_2026-12-01.json": "a65cb21",
    "check_kernels_gpu_rope-merge-slot_h200_2026-12-02.json": "cb80241",
    "check_kernels_gpu_route-decode-nan-fix_h200_2026-12-02.json": "0e93b8f",
    "check_kernels_gpu_c602b22_h200_2026-12-02.json": "c602b22",
    "check_oracle_gpu_h200_2026-12-01.json": "86d8682",
    "check_reuse_gpu_qwen3.5-35b-a3b_8-layers-cut_h200_2026-12-01.json": "9c79115",
    "profile_step_qwen3-30b-a3b_ab-merge-cached_h200_2026-12-02.json": "d6cca5e",
    "profile_step_qwen3-30b-a3b_ab-rope-cache_h200_2026-12-02.json": "7fd593d",
    "profile_step_qwen3-30b-a3b_ab-route-decode_h200_2026-12-02.json": "df6870a",
    "profile_step_qwen3-30b-a3b_ab-defaults-d06b014_h200_2026-12-02.json": "d06b014",
    "profile_step_qwen3-30b-a3b_ab-kernels-cb80241_h200_2026-12-02.json": "cb80241",
    "profile_step_qwen3-30b-a3b_b1-autotune0-cublas_h200_2026-12-02.json": "d5f3250",
    "profile_step_qwen3-30b-a3b_b1-autotune0-dsf_h200_2026-12-02.json": "d5f3250",
    "profile_step_qwen3-30b-a3b_b1-autotune0_h200_2026-12-02.json": "d5f3250",
    "profile_step_qwen3-30b-a3b_b1-cublas_h200_2026-12-02.json": "69824bd",
    "profile_step_qwen3-30b-a3b_cached-b4-h2d-class_h200_2026-12-02.json": "0e93b8f",
    "profile_step_qwen3-30b-a3b_check13-c602b22_h200_2026-12-02.json": "c602b22",
    "profile_step_qwen3-30b-a3b_h200_2026-12-01.json": "86d8682",
    "profile_step_qwen3-30b-a3b_host-dispatch-graphs-on_h200_2026-12-02.json": "6038118",
    "profile_step_qwen3-30b-a3b_host-dispatch_h200_2026-12-02.json": "6038118",
    # archived runs (experiments/results/archive/README.md)
    "bench_decode_qwen3-30b-a3b_8gb_lookahead-session12_h200_2026-12-02.json": "cb80241",
    "bench_prefill_qwen3-30b-a3b_24gb_d2d_h200_2026-11-30.json": "52f1003",
    "check_identity_gpu_rope-cache_h200_2026-12-02.json": "7fd593d",
    "check_identity_gpu_session11-defaults_h200_2026-12-02.json": "d06b014",
    "check_kernels_gpu_e2e-prefill-session12_h200_2026-12-02.json": "7fd593d",
    "check_kernels_gpu_rope-cache_h200_2026-12-02.json": "7fd593d",
    "check_kernels_gpu_route-slot_h200_2026-12-02.json": "df6870a",
    "profile_step_qwen3-30b-a3b_b1-cublas-dense_h200_2026-12-02.json": "69824bd",
    "profile_step_qwen3-30b-a3b_b1-padded-fence-in-and-out_h200_2026-11-30.json": "4c85292",
    "profile_step_qwen3-30b-a3b_b1-padded_h200_2026-11-30.json": "4c85292",
    "profile_step_qwen3-30b-a3b_b1-unpadded_h200_2026-11-30.json": "4c85292",
    "profile_step_qwen3-30b-a3b_cublas-dense_h200_2026-12-02.json": "69824bd",
    "profile_step_qwen3-30b-a3b_h200_2026-11-30.json": "ef7a0d8",
}

COLUMNS = ("file", "what", "date", "commit", "device", "jax", "headline")


class ResultError(Exception):
    """A result file the index cannot read (one line, with the file's path)."""


def _scripts() -> list[str]:
    """The experiment scripts' names, longest first (a file is named after the script that wrote it)."""
    names = [f[:-3] for f in os.listdir(ROOT) if f.endswith(".py") and not f.startswith("_")]
    return sorted(names, key=lambda n: (-len(n), n))


def _median(x):
    if isinstance(x, dict):
        return x.get("median")
    return x


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _secs(s) -> str:
    """Seconds as ms below 1 s, else s."""
    if s is None:
        return "-"
    if s < 0.01:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.3f} s"


def _dtype(row: dict) -> str:
    d = row.get("expert_dtype")
    return "" if d in (None, "dense", "bfloat16") else f" {d}"


def _bench_decode(d: dict) -> str:
    rows = [r for r in d.get("results") or [] if isinstance(r.get("decode_tokens_per_s"), (int, float))]
    if not rows:
        return "-"
    r = max(rows, key=lambda r: (r["decode_tokens_per_s"], str(r.get("mode"))))
    at = f" at {r['budget_gb']:g} GB" if isinstance(r.get("budget_gb"), (int, float)) else ""  # a sweep's row
    return (f"{r.get('mode')} b{r.get('batch')}{_dtype(r)}, {r.get('slots')} slots{at}: "
            f"{r['decode_tokens_per_s']:.2f} tok/s")


def _bench_decode_speed(d: dict) -> str:
    """The fastest resident batch-1 row; in a file of cached rows only, the first one (with its prefetch and split
    probe, where set); then where a cached row was compared with resident, whether its tokens were the same."""
    rows = [r for r in d.get("rows") or [] if r.get("mode") == "resident" and r.get("batch") == 1]
    if not rows:
        cached = [r for r in d.get("rows") or [] if r.get("mode") == "cached"]
        if not cached:
            return "-"
        r = cached[0]
        extra = "".join([f", prefetch {r['prefetch_guesses']}" if r.get("prefetch_guesses") else "",
                         ", split probe" if d.get("split_probe") else ""])
        return (f"{r['layers']} layers cached b{r['batch']}, decode_block {r['decode_block']}{extra}: "
                f"{r['tokens_per_s']['median']:.2f} tok/s, hit rate {r['hit_rate']:.3f}")
    r = max(rows, key=lambda r: r["tokens_per_s"]["median"])
    gain = f", {r['speedup_vs_block1']:.2f}x block 1" if r.get("speedup_vs_block1") else ""
    out = (f"{r['layers']} layers resident b1, decode_block {r['decode_block']}: "
           f"{r['tokens_per_s']['median']:.1f} tok/s{gain}")
    for c in (c for c in d.get("rows") or [] if "first_token_unlike_resident" in c):
        first = c["first_token_unlike_resident"]
        extra = f", prefetch {c['prefetch_guesses']}" if c.get("prefetch_guesses") else ""
        out += (f"; cached b{c['batch']}{extra} {c['tokens_per_s']['median']:.2f} tok/s, tokens "
                + ("= resident" if first is None else f"unlike resident from index {first}"))
    return out


def _bench_decode_loop(d: dict) -> str:
    rows = d.get("rows") or []
    fixed = [r for r in rows if r.get("form") == "fixed" and "over_dynamic" in r]
    several = len({r.get("kernels") for r in rows}) > 1
    out = [f"b{r['batch']} fixed" + (f" {r['kernels']}" if several else "")
           + f" {r['tokens_per_s']['median']:.1f} tok/s = {r['over_dynamic']:.3f}x dynamic"
           + (f" (EOS after {max(r['generated'])} tokens)" if r.get("eos_ids") else "") for r in fixed]
    base = {(r["batch"], r["form"]): r for r in rows if "over_first_kernels" not in r}  # the first kernel config's
    out += [f"b{r['batch']} {r['form']} {r['kernels']} {r['tokens_per_s']['median']:.1f} tok/s = "
            f"{r['over_first_kernels']:.3f}x {base[(r['batch'], r['form'])]['kernels']}"
            for r in rows if "over_first_kernels" in r and (r["batch"], r["form"]) in base]
    return "; ".join(out) or "-"


def _bench_miss_copy(d: dict) -> str:
    best = [b for b in d.get("best") or [] if isinstance(b.get("ratio_to_contig"), (int, float))]
    if not best:
        return "-"
    b = max(best, key=lambda b: (b["layers"], b["graphs"] == "on"))  # the decode-like sequence, as decode runs
    group1 = [r for r in d.get("rows") or [] if r.get("variant") == "group1" and r.get("ids") == "random"
              and r.get("layers") == b["layers"] and r.get("graphs") == b["graphs"] and "ratio_to_contig" in r]
    was = f" (one copy per iteration {group1[0]['ratio_to_contig']:.3f}x)" if group1 else ""
    caveat = f"{d['caveat']}; " if d.get("caveat") else ""  # a run whose rows are not what their names say
    return (f"{caveat}misses of {b['layers']} layers, graphs {b['graphs']}: {b['variant']} {b['GBps']:.1f} GB/s = "
            f"{b['ratio_to_contig']:.3f}x the pinned copy{was}")


def _bench_gated_delta(d: dict) -> str:
    rule = {(r.get("variant"), r.get("chunk_states"), r.get("highest")): r for r in d.get("rule") or [] if "s" in r}
    xla = rule.get(("xla", False, False))
    model = [r for r in (d.get("model") or {}).get("rows") or [] if "ttft_s" in r]
    if xla is None and model:  # a model-stage run: its kernel configs' TTFT
        best = min(model, key=lambda r: r["ttft_s"]["median"])
        return (f"{d['model']['layers']}-layer prefill TTFT {model[0]['kernels']} {_secs(model[0]['ttft_s']['median'])}"
                f", best {best['kernels']} {_secs(best['ttft_s']['median'])}")
    if xla is None:
        return "-"
    out = []
    for (name, states, highest), r in rule.items():
        if name != "xla" and not states and not highest:
            out.append((r["s"]["median"], name))
    best = min(out) if out else None
    s = f"rule at {d.get('shape', {}).get('tokens')} tokens: XLA {_secs(xla['s']['median'])}"
    if best:
        s += f", {best[1]} {_secs(best[0])} ({xla['s']['median'] / best[0]:.2f}x)"
    if len(model) > 1:
        s += (f"; {d['model']['layers']}-layer prefill TTFT {_secs(model[0]['ttft_s']['median'])} -> "
              f"{_secs(model[-1]['ttft_s']['median'])}")
    return s + (" (partial)" if d.get("partial") else "")


def _bench_prefill(d: dict) -> str:
    for r in d.get("results") or []:
        t = r.get("ttft_s")
        if t is None:
            continue
        med, lo = _median(t), t.get("min") if isinstance(t, dict) else None
        s = f"{r.get('variant')}{_dtype(r)} {r.get('tokens')} tok: {_secs(med)}"
        if lo is not None and med and lo < 0.9 * med:
            s += f" (min {_secs(lo)})"
        if r.get("ratio_to_bound") is not None:
            s += f" = {r['ratio_to_bound']:.2f}x bound"
        return s
    return "-"


def _bench_kv_reuse(d: dict) -> str:
    res = d.get("results") or []
    if not res:
        return "-"
    r = res[0]
    rec = _median((r.get("recompute") or {}).get("ttft_s"))
    loads = {k: v for k, v in r.items()
             if isinstance(v, dict) and "ttft_s" in v and k not in ("recompute", "store_request")}
    if not loads:
        return f"{r.get('mode')}: recompute {_secs(rec)}" if rec else "-"
    name, best = min(loads.items(), key=lambda kv: (_median(kv[1]["ttft_s"]), kv[0]))
    t = _median(best["ttft_s"])
    s = f"{r.get('mode')}, {name}: {_secs(t)}"
    if rec and t:
        s += f" vs recompute {_secs(rec)} ({rec / t:.1f}x)"
    return s


def _bench_miss_policy(d: dict) -> str:
    rows = [r for r in d.get("runs") or [] if isinstance(r.get("decode_tokens_per_s"), (int, float))]
    if not rows:
        return "-"
    r = max(rows, key=lambda r: (r["decode_tokens_per_s"], str(r.get("policy"))))
    impl = f"/{r['impl']}" if r.get("impl") else ""
    # a split that ran no miss on the CPU made fetch's choices: its lead over fetch is the runs' spread
    same = " (no miss on the CPU)" if r.get("policy") == "adaptive" and r.get("cpu_decode") == 0 else ""
    return f"{r.get('policy')}{impl} {r.get('budget_gb'):g} GB: {r['decode_tokens_per_s']:.2f} tok/s{same}"


def _bench_cpu_experts(d: dict) -> str:
    """All-thread DRAM read; per format the CPU mechanism with the highest fitted weight GB/s (1 token) at most the
    DRAM's (a fit above it comes from a large fixed cost over k = 1..8, not a read rate), its fraction of DRAM and
    fixed cost; the split's per-token gain at the slowest modelled link."""
    out = [f"DRAM {_num((d.get('dram_all_threads_GBps') or {}).get('alone'), '.1f')} GB/s"]
    for fmt in ("bfloat16", "int8", "int4"):
        fits = [(r["fits"]["1"], r["mechanism"]) for r in d.get("ffn") or []
                if r.get("format") == fmt and ((r.get("fits") or {}).get("1") or {}).get("GBps")
                and (r["fits"]["1"].get("fraction_of_dram") or 0) <= 1]
        if fits:
            fit, mech = max(fits, key=lambda f: f[0]["GBps"])
            out.append(f"{fmt} {mech} {fit['GBps']:.1f} GB/s ({_num(fit.get('fraction_of_dram'), '.2f')} of DRAM, "
                       f"{fit['alpha_s'] * 1e3:.2f} ms fixed)")
    links = (((d.get("links") or {}).get("formats") or {}).get("bfloat16") or {}).get("links") or []
    if links:
        last = links[-1]
        out.append(f"bf16 split gain at {last['link']}: {last['per_token_zero_hits']['gain']:.2f}x")
    return "; ".join(out)


def _kernel_set(k: str) -> str:
    """A ``--kernels`` value, short: ``auto`` / ``xla`` as they are, a list by its last name."""
    names = k.split(",")
    return k if len(names) == 1 else f"...,{names[-1]}"


def _profile_step(d: dict) -> str:
    runs = d.get("runs") or []
    by_kernels = d.get("targets_by_kernels") or {}
    if len(by_kernels) > 1:  # an A/B of kernel sets in one process: each set's ratios, in run order
        parts = []
        for k, t in by_kernels.items():
            p = f"{_kernel_set(k)}: resident b1 {_num(t.get('resident_b1_over_floor'), '.2f')}x floor"
            if t.get("cached_b1_over_resident_plus_misses") is not None:
                p += f", cached b1 {t['cached_b1_over_resident_plus_misses']:.3f}x"
            parts.append(p)
        return "; ".join(parts)
    parts = []
    res = [r for r in runs if r.get("run") == "resident_decode" and r.get("batch") == 1]
    if res:
        r = res[0]
        parts.append(f"resident b1 {_secs(_median(r.get('step_s')))} = {_num(r.get('ratio_to_floor'), '.2f')}x floor")
    t = d.get("targets") or {}
    for b in (1, 4):
        v = t.get(f"cached_b{b}_over_resident_plus_misses")
        if v is not None:
            parts.append(f"cached b{b} {v:.3f}x resident + misses")
    if not parts and runs:
        r = runs[0]
        parts.append(f"{r.get('run')} b{r.get('batch')} {_secs(_median(r.get('step_s')))}"
                     f" = {_num(r.get('ratio_to_floor'), '.2f')}x floor")
    return "; ".join(parts) or "-"


def _profile_overlap(d: dict) -> str:
    runs = d.get("runs") or {}
    parts = []
    for name in sorted(runs):
        r = runs[name]
        parts.append(f"{name}: copy {_secs(r.get('copy_s'))}, span {_secs(r.get('span_s'))},"
                     f" {_num(r.get('copy_overlapped_fraction'), '.0%')} of copy under compute")
    return "; ".join(parts) or "-"


def _check_identity(d: dict) -> str:
    s = d.get("summary") or {}
    n, failed = s.get("cases"), s.get("failed")
    if n is None or failed is None:
        return "-"
    return f"{n - len(failed)}/{n} cached = resident bit for bit"


def _check_oracle(d: dict) -> str:
    s = d.get("summary") or {}
    n, failed = s.get("float32_cases"), s.get("float32_failed")
    if n is None or failed is None:
        return "-"
    worst = _num(s.get("float32_max_err_over_tol"), ".2f")
    out = f"float32 {n - len(failed)}/{n} within tolerance (max err / tol {worst})"
    if s.get("bfloat16_ids_agree"):
        out += f"; bf16 ids agree {s['bfloat16_ids_agree']}"
    return out


def _check_reuse(d: dict) -> str:
    s = d.get("summary") or {}
    cases = s.get("cases") or {}
    if not cases:
        return "-"
    exact = sum(1 for v in cases.values() if isinstance(v, dict) and str(v.get("reuse", "")).startswith("exact"))
    out = f"reuse exact in {exact}/{len(cases)} cases"
    return out + (" (partial)" if d.get("partial") else "")


def _check_kernels(d: dict) -> str:
    checks = d.get("checks") or []
    flash = [c for c in checks
             if c.get("section") == "e2e_prefill" and c.get("name") == "resident prefill flash pallas"]
    sections = sorted({str(c.get("section")) for c in checks if c.get("section") not in (None, "hbm")})
    s = "sections " + ", ".join(sections) if sections else "-"
    if flash:
        c = flash[0]
        s += f"; {c.get('layers')}-layer {c.get('prompt_len')}-token prefill (flash) {_secs(c.get('ttft_s'))}"
    return s


def _plan_vs_peak(d: dict) -> str:
    below, res = d.get("plan_below_peak"), d.get("results")
    if below is None or res is None:
        return "-"
    ran = [r for r in res if r.get("verdict")] if any("verdict" in r for r in res) else res
    return f"plan below peak in {len(below)} of {len(ran)} cases that ran"


def _policy_study(d: dict) -> str:
    hr = d.get("hit_rate") or {}
    out = []
    for pol in ("lru", "lfru", "belady"):
        at = [r for r in hr.get(pol) or [] if r.get("slots_over_E") == 2.0]
        if at:
            out.append(f"{pol.upper() if pol != 'belady' else 'Belady'} {at[0]['hit_rate']:.3f}")
    return ("hit rate at S = 2E: " + ", ".join(out)) if out else "-"


def _probe_h2d(d: dict) -> str:
    v = _median((d.get("link") or {}).get("pinned_jax_whole"))
    return "-" if v is None else f"whole pinned array H2D {v:.1f} GB/s"


def _ab_slot_table(d: dict) -> str:
    rows = [r for r in d.get("results") or []
            if r.get("policy") == "lru" and str(r.get("case", "")).startswith("hit0.98")]
    by = {r.get("impl"): r.get("us_per_layer") for r in rows}
    if "rank" not in by:
        return "-"
    return f"LRU at 98% hits: rank {by['rank']:.1f} vs sort {_num(by.get('sort'), '.1f')} us per layer"


def _serve_soak(d: dict) -> str:
    steady = d.get("steady_growth_per_request") or {}
    last = (d.get("samples") or [{}])[-1]
    return (f"{d['requests']} requests, {d['requests_per_s']:.1f}/s; {last.get('tracked', '-')} tracked at the end; "
            f"after the first interval RSS {_num(steady.get('rss_mb'), '+.3f')} MB and "
            f"{_num(steady.get('live__Job'), '+.2f')} server request records per request")


def _bench_serve(d: dict) -> str:
    parts = d.get("parts") or {}
    out = []
    for mode, r in ((parts.get("concurrency") or {}).get("modes") or {}).items():
        at4 = [x for x in r.get("levels") or [] if x.get("concurrency") == 4 and x.get("speedup_vs_c1")]
        if at4:
            out.append(f"{mode} concurrency 4: {at4[0]['speedup_vs_c1']:.2f}x concurrency 1's tok/s")
    for mode, r in ((parts.get("multiround") or {}).get("modes") or {}).items():
        if r.get("speedup_after_first_round"):
            out.append(f"{mode} multi-round TTFT {r['speedup_after_first_round']:.1f}x with KV reuse")
    for mode, r in ((parts.get("server_overhead") or {}).get("modes") or {}).items():
        if r.get("tpot_ratio"):
            out.append(f"{mode} batch-1 TPOT over HTTP {r['tpot_ratio']:.3f}x direct")
    return "; ".join(out) + (" (partial)" if out and d.get("partial") else "") or "-"


def _bench_grouped_matmul(d: dict) -> str:
    out = []
    for name, r in (d.get("presets") or {}).items():
        whole = ((r.get("pieces") or {}).get("whole") or {}).get("ms")
        if whole is None:
            continue
        s = f"{name} layer {whole:.2f} ms"
        # the fastest config whose output matched the reference tiles' (bf16: the same bits, or near them)
        tiles = [t for t in r.get("tiles") or []
                 if t.get("tflops") and not t.get("groups") and (t.get("err") or 0) < 1e-2]
        if tiles:
            best = max(tiles, key=lambda t: t["tflops"])
            kernel = "" if best.get("kernel", "mgpu") == "mgpu" else f"{best['kernel']} "
            s += f", best tiles {best['matmul']} {kernel}{best['config']} {best['tflops']:.0f} TFLOP/s"
        out.append(s)
    return "; ".join(out) + (" (partial)" if out and d.get("partial") else "") or "-"


def _probe_hybrid_batch_decode(d: dict) -> str:
    rows = d.get("rows") or []
    return ", ".join(f"B={r['batch']} compile {r['compile_s']:.0f} s" for r in rows) or "-"


def _lower_programs(d: dict) -> str:
    rows = [r for r in d.get("rows") or [] if r.get("program") == "forward_step"]
    first = rows[:len({r["grouped_matmul"] for r in rows})]  # the first program: the prefill
    return ", ".join(f"prefill {r['grouped_matmul']} {r['chars'] / 1e3:.0f} k chars, "
                     f"{r['trace_s'] + r['lower_s']:.1f} s" for r in first) or "-"


def _probe_copy_stream(d: dict) -> str:
    """Per copy path and graphs, the share of the shorter part a stream1 variant (for kernel_async: the serial ones,
    its copy on the library's stream) hid (1: overlapped, 0: serial)."""
    out = []
    for o in d.get("overlap") or []:
        names = ("serial", "serial_pool") if o["copy"] == "kernel_async" else ("stream1", "stream1_compute")
        hid = [f"{v} {o[v + '_hidden']:+.2f}" for v in names if o.get(v + "_hidden") is not None]
        if hid:
            out.append(f"{o['copy']} graphs {o['graphs']}: " + ", ".join(hid))
    return ("hidden share " + "; ".join(out)) if out else "-"


def _hlo_tiling(d: dict) -> str:
    pairs = d.get("differences") or []
    differing = sum(bool(p.get("ops") or p.get("only_first") or p.get("only_second")) for p in pairs)
    counts = "/".join(str(p["count"]) for p in d.get("programs") or [])
    return f"{len(d.get('programs') or [])} programs ({counts} fusions and GEMMs listed), {differing} of " \
        f"{len(pairs)} pairs build an op otherwise"


def _probe_host_ffi(d: dict) -> str:
    fits = "; ".join(f"{f['route']} {f['fixed_us'] / 1e3:.2f} ms fixed" for f in d.get("fits") or [])
    failed = [r["variant"] for r in d.get("rows") or [] if not r.get("ok")]
    return (fits or "-") + (f"; failed: {', '.join(failed)}" if failed else "")


HEADLINES = {
    "bench_decode": _bench_decode,
    "bench_decode_speed": _bench_decode_speed,
    "bench_gated_delta": _bench_gated_delta,
    "bench_prefill": _bench_prefill,
    "bench_kv_reuse": _bench_kv_reuse,
    "bench_serve": _bench_serve,
    "bench_miss_policy": _bench_miss_policy,
    "bench_cpu_experts": _bench_cpu_experts,
    "bench_miss_copy": _bench_miss_copy,
    "bench_decode_loop": _bench_decode_loop,
    "profile_step": _profile_step,
    "profile_overlap": _profile_overlap,
    "check_identity_gpu": _check_identity,
    "check_oracle_gpu": _check_oracle,
    "check_reuse_gpu": _check_reuse,
    "check_kernels_gpu": _check_kernels,
    "plan_vs_peak": _plan_vs_peak,
    "policy_study": _policy_study,
    "probe_h2d": _probe_h2d,
    "probe_copy_stream": _probe_copy_stream,
    "bench_grouped_matmul": _bench_grouped_matmul,
    "probe_hybrid_batch_decode": _probe_hybrid_batch_decode,
    "lower_programs": _lower_programs,
    "ab_slot_table": _ab_slot_table,
    "serve_soak": _serve_soak,
    "hlo_tiling": _hlo_tiling,
    "probe_host_ffi": _probe_host_ffi,
}


def _what(rel: str, scripts: list[str]) -> str:
    base = os.path.basename(rel)
    for s in scripts:
        if base == s + ".json" or base.startswith(s + "_"):
            return s
    return "-"


def _commit(base: str, meta: dict) -> str:
    if base in COMMIT_AS_RUN:
        return COMMIT_AS_RUN[base] + "*"
    c = meta.get("git_commit")
    if not c:
        return "-"
    sha, _, rest = str(c).partition("+")
    return sha[:7] + ("+" + rest if rest else "")


def row(path: str, rel: str, scripts: list[str]) -> dict:
    """One table row for the result JSON at ``path`` (``rel``: its path relative to the results folder)."""
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ResultError(f"{path}: not a readable JSON file ({type(e).__name__}: {e})") from None
    if not isinstance(d, dict):
        raise ResultError(f"{path}: the top level is a {type(d).__name__}, expected an object")
    meta = d.get("meta") if isinstance(d.get("meta"), dict) else d  # older bench_miss_policy files: top level
    what = _what(rel, scripts)
    try:
        headline = HEADLINES[what](d) if what in HEADLINES else "-"
    except (TypeError, ValueError, KeyError, AttributeError, ZeroDivisionError) as e:
        raise ResultError(f"{path}: unexpected layout for a {what} result ({type(e).__name__}: {e})") from None
    date = str(meta.get("date") or "-")
    return {
        "file": rel,
        "what": what,
        "date": date[:10] + (" " + date[11:16] if len(date) >= 16 else ""),
        "commit": _commit(os.path.basename(rel), meta),
        "device": str(meta.get("device") or "-"),
        "jax": str(meta.get("jax") or meta.get("jax_version") or "-"),
        "headline": headline,
    }


def result_files(results_dir: str) -> list[str]:
    """Every ``*.json`` under ``results_dir``, relative paths, sorted; ``archive/`` left out."""
    out = []
    for dirpath, dirnames, filenames in os.walk(results_dir):
        dirnames[:] = sorted(n for n in dirnames if n != ARCHIVE)
        for n in filenames:
            if n.endswith(".json"):
                out.append(os.path.relpath(os.path.join(dirpath, n), results_dir).replace(os.sep, "/"))
    return sorted(out)


def table(results_dir: str) -> str:
    scripts = _scripts()
    rows = [row(os.path.join(results_dir, rel), rel, scripts) for rel in result_files(results_dir)]
    if not rows:
        raise ResultError(f"{results_dir}: no result JSON files")
    esc = lambda s: str(s).replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = [f"`{r['file']}`"] + [esc(r[c]) for c in COLUMNS[1:]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _index_span(readme: str) -> tuple[int, int]:
    """Line numbers [start, end) of the table under ``readme``'s "Full index" heading.
    Raises:
      ResultError: no such heading, or no table under it."""
    lines = readme.split("\n")
    if INDEX_HEADING not in lines:
        raise ResultError(f"{README}: no '{INDEX_HEADING}' heading")
    start = lines.index(INDEX_HEADING) + 1
    while start < len(lines) and not lines[start].startswith("|") and not lines[start].startswith("#"):
        start += 1
    if start == len(lines) or not lines[start].startswith("|"):
        raise ResultError(f"{README}: no table under '{INDEX_HEADING}'")
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return start, end


def readme_index(readme: str) -> str:
    """The table of the "Full index" section of ``readme`` (the text of experiments/results/README.md)."""
    start, end = _index_span(readme)
    return "\n".join(readme.split("\n")[start:end])


def with_index(readme: str, index: str) -> str:
    """``readme`` with the table of its "Full index" section replaced by ``index`` (a :func:`table`)."""
    start, end = _index_span(readme)
    lines = readme.split("\n")
    return "\n".join(lines[:start] + index.split("\n") + lines[end:])


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        print(f"results_index: {message}", file=sys.stderr)
        sys.exit(2)


def main(argv=None) -> int:
    p = _Parser(description=__doc__.split("\n")[0])
    p.add_argument("--results_dir", default=DEFAULT_DIR,
                   help="folder of result JSONs (default: experiments/results; its archive/ is left out)")
    p.add_argument("--write_readme", action="store_true",
                   help="write the table into the 'Full index' section of experiments/results/README.md "
                        "instead of printing it (the default --results_dir only)")
    args = p.parse_args(argv)
    if not os.path.isdir(args.results_dir):
        print(f"results_index: {args.results_dir}: no such folder", file=sys.stderr)
        return 2
    if args.write_readme and os.path.abspath(args.results_dir) != DEFAULT_DIR:
        print("results_index: --write_readme indexes experiments/results only, not --results_dir", file=sys.stderr)
        return 2
    try:
        index = table(args.results_dir)
        if args.write_readme:
            with open(README, encoding="utf-8") as f:
                text = with_index(f.read(), index)
            with open(README, "w", encoding="utf-8") as f:
                f.write(text)
            print(f"wrote the index of {index.count(chr(10)) - 1} files into {README}")
        else:
            print(index)
    except ResultError as e:
        print(f"results_index: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
