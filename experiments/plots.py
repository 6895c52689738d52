"""Draws a PNG beside any result JSON of ``experiments/`` (one figure per file).

  python experiments/plots.py experiments/results/bench_decode_*.json    # writes <name>.png beside each
  python experiments/plots.py --all                                      # every JSON in experiments/results

Every script writes its runs as a list of flat dicts (``results`` or ``runs``; the one result
writer of ``experiments/common.py``). This draws, for each metric found in those rows
(:data:`METRICS`: tokens/s, TTFT, TPOT, hit rate, bytes, errors, ...), one horizontal bar chart
with a bar per row, labelled by the row's identifying fields (:data:`LABEL_KEYS`: mode, batch,
variant, tokens, policy, ...). A metric given as a spread (``{"median", "p10", "p90", ...}``) is
drawn at its median with a p10-p90 (else min-max) error bar. The title names the script, the
device and the date from ``meta``.
"""

from __future__ import annotations

import glob
import json
import math
import os
import sys

#: Fields that identify a row (its label), in the order they are printed.
LABEL_KEYS = ("preset", "mode", "variant", "policy", "impl", "load", "fixture", "prompt", "dtype", "expert_dtype",
              "batch", "budget_gb", "tokens", "prompt_len", "slots", "case", "kernels")
#: Metrics drawn when a row has them (name in the JSON, axis label).
METRICS = (
    ("decode_tokens_per_s", "decode tokens/s"), ("tokens_per_s", "tokens/s"), ("tpot_s", "TPOT (s)"),
    ("step_s", "TPOT (s)"),  # the name before tpot_s
    ("ttft_s", "TTFT (s)"), ("s_per_chunk", "s per prefill chunk"), ("ratio_to_bound", "time / bound"),
    ("hit_rate_decode", "decode hit rate"), ("hit_rate", "hit rate"), ("achieved_h2d_GBps", "achieved H2D GB/s"),
    ("speedup_vs_recompute", "speedup vs recompute"), ("hidden_fraction", "hidden fraction of the load"),
    ("max_abs_err", "max |logit error|"), ("plan_bytes", "planned bytes"), ("peak_bytes", "peak device bytes"),
)


def rows_of(result: dict) -> list[dict]:
    """The run rows of a result JSON: ``results`` or ``runs`` (list of dicts), else []. A row whose
    fields hold per-variant dicts of metrics (``{"prefetch": {"ttft_s": ...}, ...}``) becomes one
    row per variant, labelled by it."""
    names = {k for k, _ in METRICS}
    for key in ("results", "runs", "rows", "cases"):
        rows = result.get(key)
        if isinstance(rows, list) and rows and all(isinstance(r, dict) for r in rows):
            out = []
            for r in rows:
                subs = {k: v for k, v in r.items() if isinstance(v, dict) and names & set(v) and "median" not in v}
                plain = {k: v for k, v in r.items() if k not in subs}
                out.extend([dict(plain, variant=k, **v) for k, v in subs.items()] or [r])
            return out
    return []


def value(v) -> tuple[float, tuple[float, float] | None] | None:
    """(centre, (low, high) or None) of a number or a spread dict; None when not a finite number."""
    if isinstance(v, dict) and "median" in v:
        lo, hi = v.get("p10", v.get("min")), v.get("p90", v.get("max"))
        c = value(v["median"])
        return (c[0], (float(lo), float(hi)) if lo is not None and hi is not None else None) if c else None
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return float(v), None
    return None


def label(row: dict) -> str:
    parts = [f"{row[k]}" if k in ("mode", "variant", "policy", "impl", "load", "fixture", "case") else f"{k}={row[k]}"
             for k in LABEL_KEYS if k in row and row[k] is not None and not isinstance(row[k], (dict, list))]
    return " ".join(parts) or "run"


def plot(path: str, out: str | None = None) -> str | None:
    """Draws ``path``'s metrics into ``out`` (default: the JSON's path with .png). Returns the PNG
    path, or None when the file has no run rows with a known metric.

    Raises:
      ValueError: the file is not a JSON object.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        result = json.load(f)
    if not isinstance(result, dict):
        raise ValueError(f"{path}: expected a JSON object")
    rows = rows_of(result)
    panels = []
    for key, name in METRICS:
        pts = [(label(r), value(r.get(key))) for r in rows]
        pts = [(lab, v) for lab, v in pts if v is not None]
        if pts:
            panels.append((name, pts))
    if not panels:
        return None
    n_rows = max(len(p) for _, p in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 0.9 + 0.28 * n_rows * len(panels) + 0.6 * len(panels)),
                             squeeze=False)
    for ax, (name, pts) in zip(axes[:, 0], panels):
        labels = [lab for lab, _ in pts]
        centres = [v[0] for _, v in pts]
        err = [[c - (v[1][0] if v[1] else c) for c, (_, v) in zip(centres, pts)],
               [(v[1][1] if v[1] else c) - c for c, (_, v) in zip(centres, pts)]]
        ax.barh(range(len(pts)), centres, xerr=err, color="tab:blue", alpha=0.8, capsize=2)
        ax.set_yticks(range(len(pts)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel(name)
        ax.grid(axis="x", alpha=0.3)
    meta = result.get("meta", {})
    title = f"{os.path.basename(path)}\n{meta.get('device', '?')}, jax {meta.get('jax', '?')}, {meta.get('date', '?')}"
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    out = out or os.path.splitext(path)[0] + ".png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str]) -> int:
    paths = argv[1:]
    if paths == ["--all"]:
        paths = sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "*.json")))
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    status = 0
    for p in paths:
        try:
            out = plot(p)
        except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
            print(f"plots: error: {p}: {e}", file=sys.stderr)
            status = 1
            continue
        print(f"{p} -> {out}" if out else f"{p}: no run rows with a known metric, no plot")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv))
