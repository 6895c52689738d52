"""Draws a PNG beside any result JSON of ``experiments/`` (one figure per file).

  python experiments/plots.py experiments/results/prefill/bench_prefill_*.json  # writes <name>.png beside each
  python experiments/plots.py --all         # every JSON under experiments/results (its archive/ left out)

Every script writes its runs as a list of flat dicts (``results`` or ``runs``; the one result
writer of ``experiments/common.py``). This draws, for each metric found in those rows
(:data:`METRICS`: tokens/s, TTFT, TPOT, hit rate, bytes, errors, ...), one horizontal bar chart
with a bar per row, labelled by the row's identifying fields (:data:`LABEL_KEYS`: mode, batch,
variant, tokens, policy, ...). A metric given as a spread (``{"median", "p10", "p90", ...}``) is
drawn at its median with a p10-p90 (else min-max) error bar. The title names the script, the
device and the date from ``meta``.

Figures for a paper (any of the flags below switches to this mode; docs/FIGURES.md has one command
per figure of the two papers):

  python experiments/plots.py --kind=line --x=tokens --y=ttft_s --series=variant \
      --where=expert_dtype=dense --formats=png,pdf,svg --out=/tmp/ttft_by_length FILE.json [FILE.json ...]

  --kind=line|bars         a line chart (one line per series) or a grouped bar chart (one bar per
                           series in each x group); default line
  --x=FIELD, --y=FIELD     the fields plotted (required); y is a metric: a number, or a spread
                           {median, p10, p90, min, max} drawn at its median with a p10-p90
                           (else min-max) error bar
  --series=FIELD[,FIELD]   one line / bar per distinct value (of the tuple) of these fields
  --where=FIELD=VALUE      keep rows whose FIELD prints as VALUE (or equals it as a number; a
                           comma list: any of them); repeatable, all must hold
  --formats=png,pdf,svg    the files written, OUT.<format> each; default png
  --out=PATH_STEM          default: the first JSON's path less .json, plus _<y>_by_<x>
  --title=TEXT             default: none (a paper's caption says it)

A FIELD is a key of the rows or a dotted path into them (``engine.num_slots``). Rows are those of
:func:`figure_rows`: every file's run rows concatenated, each also carrying its file's ``meta``,
``flags`` and name (``file``), so ``--x=flags.vram_budget_gb`` or ``--series=meta.device`` work
across files. The metrics JSON of ``python -m ftjax.generate --metrics_json=FILE`` gives one row per
request of its ``requests`` list (field ``request``: its index), else one row: the run itself. Axis
labels carry the unit of a known field (:data:`FIELD_LABELS`), else the field name. Bad input (a
field no row has, a filter that keeps nothing, an unknown flag) stops with one line ``error: ...``
and exit status 1, as ``experiments/common.run`` does for the benchmark scripts.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, field

#: Fields that identify a row (its label), in the order they are printed.
LABEL_KEYS = ("preset", "mode", "variant", "policy", "impl", "load", "fixture", "prompt", "dtype", "expert_dtype",
              "format", "mechanism", "batch", "budget_gb", "tokens", "prompt_len", "slots", "case", "kernels",
              "chunk_states", "highest", "ids", "graphs", "layers", "form")
#: Metrics drawn when a row has them (name in the JSON, axis label).
METRICS = (
    ("decode_tokens_per_s", "decode tokens/s"), ("tokens_per_s", "tokens/s"), ("tpot_s", "TPOT (s)"),
    ("step_s", "TPOT (s)"),  # the name before tpot_s
    ("ttft_s", "TTFT (s)"), ("s_per_chunk", "s per prefill chunk"), ("ratio_to_bound", "time / bound"),
    ("hit_rate_decode", "decode hit rate"), ("hit_rate", "hit rate"), ("achieved_h2d_GBps", "achieved H2D GB/s"),
    ("speedup_vs_recompute", "speedup vs recompute"), ("hidden_fraction", "hidden fraction of the load"),
    ("max_abs_err", "max |logit error|"), ("plan_bytes", "planned bytes"), ("peak_bytes", "peak device bytes"),
    ("s", "time per call (s)"),  # bench_gated_delta's rows
    ("GBps", "GB/s"), ("ratio_to_contig", "rate / one contiguous copy's"),  # bench_miss_copy, bench_cpu_experts
    ("fixed_ms", "fixed cost per layer (ms)"),  # bench_cpu_experts
)


def _fit_rows(rows: list[dict]) -> list[dict]:
    """bench_cpu_experts' ``ffn`` rows, one per (format, mechanism) with a linear fit per token count in
    ``fits`` (``{"1": {"GBps", "alpha_s", ...}}``), as one row per token count: tokens, GBps, fixed_ms."""
    return [{"format": r.get("format"), "mechanism": r.get("mechanism"), "tokens": int(t), "GBps": f.get("GBps"),
             "fixed_ms": None if f.get("alpha_s") is None else 1e3 * f["alpha_s"]}
            for r in rows for t, f in (r.get("fits") or {}).items() if isinstance(f, dict)]


def rows_of(result: dict) -> list[dict]:
    """The run rows of a result JSON: ``results``, ``runs``, ``rows``, ``cases``, (bench_gated_delta)
    ``rule``, ``conv``, ``decode`` or ``model.rows``, or (bench_cpu_experts) ``ffn``, one row per token count
    of each fit (the first that is a list of dicts), else []. A row whose fields hold per-variant dicts of
    metrics (``{"prefetch": {"ttft_s": ...}, ...}``) becomes one row per variant, labelled by it."""
    names = {k for k, _ in METRICS}
    if isinstance(result.get("ffn"), list) and "rows" not in result:
        return _fit_rows([r for r in result["ffn"] if isinstance(r, dict)])
    for key in ("results", "runs", "rows", "cases", "rule", "conv", "decode"):
        rows = result.get(key)
        if isinstance(rows, list) and rows and all(isinstance(r, dict) for r in rows):
            out = []
            for r in rows:
                subs = {k: v for k, v in r.items() if isinstance(v, dict) and names & set(v) and "median" not in v}
                plain = {k: v for k, v in r.items() if k not in subs}
                out.extend([dict(plain, variant=k, **v) for k, v in subs.items()] or [r])
            return out
    model = result.get("model")  # bench_gated_delta run with its model stage alone
    if isinstance(model, dict) and isinstance(model.get("rows"), list):
        return [r for r in model["rows"] if isinstance(r, dict)]
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


def category_shares(rows: list[dict]) -> list[tuple[str, list[tuple[str, float]], float]]:
    """Per traced run (``profile_step``'s rows with ``profile.categories``; the rows that :func:`rows_of` splits
    out of one run share its profile and give one bar): (label, [(category, share of the step's span)] in the
    JSON's order, the span in ms). Categories, span and gaps are per step in the JSON; each category's device
    time and the gaps between kernels (``gap``) over the span sum to about 1 whatever the step's length."""
    out, seen = [], set()
    for r in rows:
        prof = r.get("profile") if isinstance(r.get("profile"), dict) else {}
        cats, span = prof.get("categories"), prof.get("span_s")
        if not isinstance(cats, dict) or not span or id(prof) in seen:
            continue
        seen.add(id(prof))
        parts = [(c, v["s"] / span) for c, v in cats.items() if isinstance(v, dict) and v.get("s")]
        parts.append(("gap", (prof.get("gap_s") or 0.0) / span))
        lab = label({k: v for k, v in r.items() if k != "variant"})
        out.append((lab, parts, 1e3 * span))
    return out


def plot(path: str, out: str | None = None) -> str | None:
    """Draws ``path``'s metrics into ``out`` (default: the JSON's path with .png), and for a step profile each
    traced run's device time by category (:func:`category_shares`) as one stacked bar. Returns the PNG
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
    shares = category_shares(rows)
    n_rows = max(len(p) for _, p in panels)
    n_axes = len(panels) + bool(shares)
    fig, axes = plt.subplots(n_axes, 1, figsize=(9, 0.9 + 0.28 * n_rows * n_axes + 0.6 * n_axes), squeeze=False)
    if shares:
        _draw_shares(axes[-1, 0], shares)
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


def _draw_shares(ax, shares) -> None:
    """One stacked horizontal bar per traced run: its categories' shares of the span, in a fixed colour each."""
    import matplotlib.pyplot as plt
    names = list(dict.fromkeys(c for _, parts, _ in shares for c, _ in parts))
    colours = {c: plt.get_cmap("tab20")(i % 20) for i, c in enumerate(names)}
    colours["gap"] = "lightgrey"
    for i, (_, parts, _) in enumerate(shares):
        left = 0.0
        for c, v in parts:
            ax.barh(i, v, left=left, color=colours[c])
            left += v
    ax.set_yticks(range(len(shares)), [f"{lab} ({ms:.2f} ms)" for lab, _, ms in shares], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("share of the step's span (device time by category; gap: between kernels)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[c]) for c in names]
    ax.legend(handles, names, fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))


# ---- figures for a paper ----------------------------------------------------------------------
#: Axis labels of known fields, with their units (a dotted field is looked up by its last part).
FIELD_LABELS = {
    "decode_tokens_per_s": "decode throughput (tokens/s)",
    "decode_tokens_per_s_median_tpot": "decode throughput, median step (tokens/s)",
    "tokens_per_s": "throughput (tokens/s)", "prefill_tokens_per_s": "prefill throughput (tokens/s)",
    "throughput_tokens_per_s": "throughput (tokens/s)",
    "ttft_s": "TTFT (s)", "tpot_s": "TPOT (s)", "step_s": "step time (s)", "decode_s": "decode time (s)",
    "s_per_chunk": "time per prefill chunk (s)", "compile_s": "compile time (s)", "bound_s": "bound (s)",
    "decode_s_per_token": "decode time per token (s)", "replay_s": "replay time (s)",
    "ttft_ms": "TTFT (ms)", "tpot_ms": "TPOT (ms)", "step_ms": "step time (ms)",
    "vram_budget_gb": "GPU memory budget (GB)", "budget_gb": "GPU memory budget (GB)",
    "kv_host_gb": "host KV store (GB)",
    "achieved_h2d_GBps": "achieved host-to-device bandwidth (GB/s)", "h2d_GBps": "host-to-device bandwidth (GB/s)",
    "hit_rate": "hit rate (fraction of lookups)", "hit_rate_decode": "decode hit rate (fraction of lookups)",
    "hit_rate_prefill": "prefill hit rate (fraction of lookups)",
    "slots": "expert slots", "num_slots": "expert slots", "slots_over_E": "expert slots / experts per layer",
    "layers": "layers", "num_layers": "layers", "batch": "batch (sequences)", "concurrency": "concurrent requests",
    "decode_block": "decode block (steps per program)", "decode_blocks": "decode block (steps per program)",
    "tokens": "prompt length (tokens)", "prompt_len": "prompt length (tokens)",
    "prompt_tokens": "prompt length (tokens)", "reused_tokens": "reused context (tokens)",
    "prefix_tokens": "reused context (tokens)", "context_tokens": "context (tokens)",
    "request": "request (index)", "round": "round", "max_new_tokens": "new tokens per request",
    "max_tokens": "new tokens per request", "steps": "decode steps",
    "h2d_bytes": "host-to-device bytes", "h2d_bytes_per_step": "host-to-device bytes per step",
    "expert_bytes": "bytes per expert", "misses_per_step": "misses per step",
    "ratio_to_bound": "time / bound", "speedup_vs_recompute": "speedup vs recompute",
    "overlap_speedup": "speedup of overlap", "speedup_vs_first_format": "speedup vs the first format",
    "hidden_fraction": "hidden fraction of the load", "fetch_fraction_decode": "fetched fraction of decode misses",
    "max_abs_err": "max |logit error|", "expert_dtype": "expert format", "policy": "cache policy",
}


def axis_label(name: str) -> str:
    """The axis label of field ``name`` with its unit: :data:`FIELD_LABELS` of the name (or of its
    last dotted part), else a unit read off a suffix (``_s``: s, ``_ms``: ms, ``_gb``: GB,
    ``_GBps``: GB/s, ``_bytes``: bytes, ``_per_s``: per s), else the field name itself."""
    last = name.rsplit(".", 1)[-1]
    if last in FIELD_LABELS:
        return FIELD_LABELS[last]
    for suffix, unit in (("_GBps", "GB/s"), ("_tokens_per_s", "tokens/s"), ("_per_s", "per s"), ("_ms", "ms"),
                         ("_s", "s"), ("_gb", "GB"), ("_bytes", "bytes")):
        if last.endswith(suffix) and len(last) > len(suffix):
            return f"{last[:-len(suffix)].replace('_', ' ')} ({unit})"
    return name


_MISSING = object()


def field_value(row: dict, name: str):
    """``row[name]``, or for a dotted ``name`` the path into nested dicts (a key holding a dot is
    tried whole first); a sentinel (not None: None is a value) when absent."""
    if name in row:
        return row[name]
    head, sep, rest = name.partition(".")
    if sep and isinstance(row.get(head), dict):
        return field_value(row[head], rest)
    return _MISSING


def _grouped_rows(result: dict) -> list[dict]:
    """Rows of tables keyed by name: a top-level dict whose values are all lists of dicts (e.g.
    policy_study's ``hit_rate``: {policy: [{slots, hit_rate, ...}]}); each row gets ``table`` (the
    top-level key) and ``group`` (its key)."""
    out = []
    for table_name, tab in result.items():
        if isinstance(tab, dict) and tab and all(isinstance(v, list) and v and all(isinstance(r, dict) for r in v)
                                                 for v in tab.values()):
            out += [dict(r, table=table_name, group=g) for g, rs in tab.items() for r in rs]
    return out


def file_rows(path: str) -> list[dict]:
    """The rows a figure draws from one JSON: its run rows (:func:`rows_of`), else the per-request
    list ``requests`` of ``ftjax.generate --metrics_json`` (field ``request``: the index), else the rows
    of keyed tables (:func:`_grouped_rows`), else the object itself as one row (one run's figures).
    Every row also gets the file's ``meta``, ``flags`` and ``file`` (its base name) where it has none.

    Raises:
      OSError: the file cannot be read.
      ValueError: it is not JSON, or not a JSON object.
    """
    with open(path) as f:
        result = json.load(f)
    if not isinstance(result, dict):
        raise ValueError(f"{path}: expected a JSON object")
    rows = rows_of(result)
    reqs = result.get("requests")
    if not rows and isinstance(reqs, list) and reqs and all(isinstance(r, dict) for r in reqs):
        rows = [dict(r, request=i) for i, r in enumerate(reqs)]
    rows = rows or _grouped_rows(result) or [result]
    meta = result.get("meta") or {k: result[k] for k in ("device", "jax", "date") if k in result}
    extra = {"meta": meta, "flags": result.get("flags") or result.get("args") or {}, "file": os.path.basename(path)}
    return [{**{k: v for k, v in extra.items() if k not in r}, **r} for r in rows]


def figure_rows(paths: list[str]) -> list[dict]:
    """The rows of every file of ``paths`` concatenated, in order (:func:`file_rows`).

    Raises:
      app.UsageError: a file cannot be read or is not a JSON object (the message names it).
    """
    from absl import app
    rows = []
    for p in paths:
        try:
            rows += file_rows(p)
        except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
            raise app.UsageError(f"{p}: {e}" if p not in str(e) else str(e)) from None
    return rows


def _fields(rows: list[dict]) -> list[str]:
    """The top-level fields of ``rows`` (sorted), for error messages."""
    return sorted({k for r in rows for k in r})


def _require(rows: list[dict], name: str, what: str) -> None:
    from absl import app
    if not any(field_value(r, name) is not _MISSING for r in rows):
        raise app.UsageError(f"--{what}={name}: no row has field {name!r}; fields: {', '.join(_fields(rows))} "
                             "(nested ones as a dotted path, e.g. meta.device)")


def parse_where(spec: str) -> tuple[str, str]:
    """(field, value) of a ``--where=FIELD=VALUE`` filter.

    Raises:
      app.UsageError: no ``=`` or an empty field name."""
    from absl import app
    name, sep, want = spec.partition("=")
    if not sep or not name:
        raise app.UsageError(f"--where={spec}: expected FIELD=VALUE")
    return name, want


def _matches(v, want: str) -> bool:
    """Whether a row's value ``v`` passes a filter value: its text, or as a number; a comma list
    passes any of its values."""
    if v is _MISSING:
        return False
    if "," in want:
        return any(_matches(v, w) for w in want.split(","))
    if str(v) == want or (isinstance(v, bool) and str(v).lower() == want.lower()):
        return True
    try:
        return not isinstance(v, bool) and isinstance(v, (int, float)) and float(v) == float(want)
    except ValueError:
        return False


def _scalar(v):
    """A row's x or series value as something sortable and printable (lists as tuples)."""
    return tuple(v) if isinstance(v, list) else v


@dataclass
class Series:
    """One line (or one bar of each group) of a figure: ``x`` values, ``y`` centres, and the error
    bar's absolute ends ``lo`` / ``hi`` (equal to ``y`` where the metric is a plain number)."""
    label: str
    x: list = field(default_factory=list)
    y: list[float] = field(default_factory=list)
    lo: list[float] = field(default_factory=list)
    hi: list[float] = field(default_factory=list)


@dataclass
class FigureData:
    """What a figure draws: its kind, fields, axis labels, the x categories (bars: in order) and
    its series."""
    kind: str
    x_field: str
    y_field: str
    series_fields: tuple[str, ...]
    x_label: str
    y_label: str
    categories: list
    series: list[Series]


def _order(values) -> list:
    """Distinct values, numbers ascending, then the rest in first-seen order."""
    seen = list(dict.fromkeys(values))
    nums = sorted(v for v in seen if isinstance(v, (int, float)) and not isinstance(v, bool))
    return nums + [v for v in seen if v not in nums]


def figure_data(rows: list[dict], x: str, y: str, series=(), where=(), kind: str = "line") -> FigureData:
    """The points of a figure of ``y`` against ``x`` from ``rows``: rows kept by every ``where``
    filter ((field, value) pairs) and holding a number or spread at ``y`` and a value at ``x``,
    one :class:`Series` per distinct value of the ``series`` fields (one series named by ``y``
    when none), its points in the order of x (numbers ascending).

    Raises:
      app.UsageError: an unknown kind; ``x``, ``y``, a series or a filter field that no row has
        (the message lists the fields there are); filters that keep no row; no kept row with a
        number at ``y``.
    """
    from absl import app
    if kind not in ("line", "bars"):
        raise app.UsageError(f"--kind={kind}: expected line or bars")
    if not rows:
        raise app.UsageError("no rows to plot")
    series = tuple(series)
    for name, what in [(x, "x"), (y, "y"), *((s, "series") for s in series), *((w, "where") for w, _ in where)]:
        _require(rows, name, what)
    kept = [r for r in rows if all(_matches(field_value(r, n), v) for n, v in where)]
    if not kept:
        raise app.UsageError("--where " + ", ".join(f"{n}={v}" for n, v in where) + " keeps no row; values there: "
                             + "; ".join(f"{n}: " + ", ".join(sorted({str(field_value(r, n)) for r in rows
                                                                      if field_value(r, n) is not _MISSING}))
                                         for n, _ in where))
    pts = []
    for r in kept:
        xv, yv = field_value(r, x), value(field_value(r, y))
        if xv is _MISSING or yv is None or isinstance(xv, dict):
            continue
        key = tuple(_scalar(field_value(r, s)) if field_value(r, s) is not _MISSING else None for s in series)
        pts.append((key, _scalar(xv), yv, r))
    if not pts:
        raise app.UsageError(f"--y={y}: no kept row has a number or a spread at {y!r} together with a value at {x!r}")
    _check_one_point_each(pts, x, series)
    categories = _order(p[1] for p in pts)
    out = []
    for key in dict.fromkeys(p[0] for p in pts):
        name = ", ".join(str(v) if len(series) == 1 else f"{n}={v}" for n, v in zip(series, key)) or axis_label(y)
        s = Series(name)
        for _, xv, (c, band), _ in sorted((p for p in pts if p[0] == key), key=lambda p: categories.index(p[1])):
            s.x.append(xv)
            s.y.append(c)
            s.lo.append(band[0] if band else c)
            s.hi.append(band[1] if band else c)
        out.append(s)
    return FigureData(kind, x, y, series, axis_label(x), axis_label(y), categories, out)


def _tick(v) -> str:
    """A category's tick label: a whole float without its ``.0``."""
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


def _check_one_point_each(pts: list, x: str, series: tuple) -> None:
    """Refuses two kept rows at the same (series, x): one would hide the other.

    Raises:
      app.UsageError: naming the x and series values and the fields on which those rows differ."""
    from absl import app
    seen: dict = {}
    for key, xv, _, row in pts:
        other = seen.setdefault((key, xv), row)
        if other is not row:
            differ = sorted(k for k in set(row) | set(other) if not isinstance(row.get(k), (dict, list))
                            and row.get(k) != other.get(k))
            raise app.UsageError(f"several rows at {x}={xv}" + (f", {', '.join(map(str, key))}" if series else "")
                                 + "; tell them apart with --series or --where (they differ in: "
                                 + (", ".join(differ) or "nested fields only") + ")")


def _numeric(values) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def draw(data: FigureData, out_stem: str, formats=("png",), title: str | None = None) -> list[str]:
    """Draws ``data`` (matplotlib, Agg) into ``out_stem.<format>`` for each of ``formats`` (png at
    200 dpi; pdf and svg as vectors); returns the paths written.

    Raises:
      app.UsageError: a format matplotlib cannot write.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from absl import app

    bad = [f for f in formats if f not in ("png", "pdf", "svg")]
    if bad or not formats:
        raise app.UsageError(f"--formats={','.join(formats)}: each must be one of png, pdf, svg")
    with plt.rc_context({"font.size": 9, "axes.spines.top": False, "axes.spines.right": False}):
        fig, ax = plt.subplots(figsize=(5.0, 3.3))
        numeric_x = data.kind == "line" and _numeric(data.categories) and len(data.categories) > 1
        n = len(data.series)
        width = 0.8 / n
        for i, s in enumerate(data.series):
            err = [[c - lo for c, lo in zip(s.y, s.lo)], [hi - c for c, hi in zip(s.y, s.hi)]]
            has_err = any(e > 0 for e in err[0] + err[1])
            if data.kind == "line":
                xs = s.x if numeric_x else [data.categories.index(v) for v in s.x]
                ax.errorbar(xs, s.y, yerr=err if has_err else None, marker="o", ms=4, lw=1.5, capsize=3,
                            label=s.label)
            else:
                xs = [data.categories.index(v) - 0.4 + width * (i + 0.5) for v in s.x]
                ax.bar(xs, s.y, width=width * 0.95, yerr=err if has_err else None, capsize=3, label=s.label)
        if not numeric_x:
            ticks = [_tick(c) for c in data.categories]
            long = max(len(t) for t in ticks) > 8
            ax.set_xticks(range(len(ticks)), ticks, rotation=30 if long else 0, ha="right" if long else "center")
        ax.set_xlabel(data.x_label)
        ax.set_ylabel(data.y_label)
        if data.kind == "bars" or min(min(s.lo) for s in data.series) >= 0:
            ax.set_ylim(bottom=0)
        ax.grid(axis="y", alpha=0.3)
        if title:
            ax.set_title(title)
        fig.tight_layout()
        if n > 1 or data.series_fields:  # beside the axes (after the layout: the saved figure grows to hold it)
            ax.legend(title=", ".join(data.series_fields) if len(data.series_fields) == 1 else None,
                      frameon=False, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        paths = []
        os.makedirs(os.path.dirname(os.path.abspath(out_stem)), exist_ok=True)
        for fmt in formats:
            paths.append(f"{out_stem}.{fmt}")
            fig.savefig(paths[-1], dpi=200 if fmt == "png" else None, bbox_inches="tight")
        plt.close(fig)
    return paths


def figure(paths: list[str], x: str, y: str, kind: str = "line", series=(), where=(), formats=("png",),
           out: str | None = None, title: str | None = None) -> tuple[FigureData, list[str]]:
    """A paper figure of ``y`` against ``x`` from the JSONs ``paths`` (:func:`figure_rows`,
    :func:`figure_data`, :func:`draw`); ``out``: the path stem (default: the first JSON's path
    less .json, plus ``_<y>_by_<x>``). Returns (the data drawn, the files written).

    Raises:
      app.UsageError: bad input (see :func:`figure_rows`, :func:`figure_data`, :func:`draw`).
    """
    data = figure_data(figure_rows(paths), x, y, series, where, kind)
    if out is None:
        out = os.path.splitext(paths[0])[0] + f"_{y}_by_{x}".replace(".", "-")
    return data, draw(data, out, tuple(formats), title)


FIGURE_FLAGS = ("kind", "x", "y", "series", "where", "formats", "out", "title")


def parse_figure_args(args: list[str]) -> tuple[list[str], dict]:
    """(input paths, figure options) of the command line ``args`` (no program name): ``--NAME=VALUE``
    for each name of :data:`FIGURE_FLAGS` (``--where`` repeatable), the rest paths.

    Raises:
      app.UsageError: an unknown flag, a flag without ``=VALUE``, a flag given twice, no --x or
        --y, or no input file."""
    from absl import app
    opts: dict = {"where": []}
    paths = []
    for a in args:
        if not a.startswith("--"):
            paths.append(a)
            continue
        name, sep, val = a[2:].partition("=")
        if name not in FIGURE_FLAGS:
            raise app.UsageError(f"unknown flag --{name}; figure flags: " + ", ".join(f"--{f}" for f in FIGURE_FLAGS))
        if not sep:
            raise app.UsageError(f"--{name}: expected --{name}=VALUE")
        if name == "where":
            opts["where"].append(parse_where(val))
        elif name in opts:
            raise app.UsageError(f"--{name} given twice")
        else:
            opts[name] = val
    for need in ("x", "y"):
        if not opts.get(need):
            raise app.UsageError(f"--{need}=FIELD is required for a figure")
    if not paths:
        raise app.UsageError("no input JSON given")
    for name in ("series", "formats"):
        if name in opts:
            opts[name] = tuple(v for v in opts[name].split(",") if v)
    return paths, opts


def figure_main(args: list[str]) -> int:
    """The figure mode's command line: draws the figure, prints the files written; bad input prints
    ``error: <message>`` and returns 1 (``experiments/common.run``'s convention)."""
    from absl import app
    try:
        paths, opts = parse_figure_args(args)
        _, written = figure(paths, **opts)
    except app.UsageError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    print("\n".join(written))
    return 0


def result_files() -> list[str]:
    """Every committed result JSON (experiments/results/, a folder per figure, ``archive/`` left out):
    :func:`results_index.result_files`, as sorted paths."""
    import results_index  # beside this file, on sys.path when plots.py runs or tests import it
    root = results_index.DEFAULT_DIR
    return [os.path.join(root, rel) for rel in results_index.result_files(root)]


def main(argv: list[str]) -> int:
    """``plots.py FILE...`` / ``plots.py --all``: a debug PNG beside each file (:func:`plot`); any
    figure flag (:data:`FIGURE_FLAGS`) draws one paper figure instead (:func:`figure_main`); ``-h`` / ``--help``
    prints the docstring. Returns the exit status: 0, 1 on a bad file or bad input, 2 with no arguments."""
    paths = argv[1:]
    if paths in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if any(a.split("=", 1)[0][2:] in FIGURE_FLAGS for a in paths if a.startswith("--")):
        return figure_main(paths)
    every = paths == ["--all"]  # every committed file: one without run rows is skipped, not an error
    if every:
        paths = result_files()
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
        if out:
            print(f"{p} -> {out}")
        elif every:
            print(f"{p}: no run rows with a known metric, no plot")
        else:
            print(f"plots: error: {p}: no run rows with a known metric, so no bar chart (a --metrics_json of "
                  f"ftjax.generate is drawn in figure mode: --kind=bars --x=flags.vram_budget_gb "
                  f"--y=decode_tokens_per_s)", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv))
