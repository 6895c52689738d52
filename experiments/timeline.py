"""Reductions of a ``jax.profiler`` timeline (perfetto / chrome trace JSON). No flags here, so tests
and notebooks import it freely.

* :func:`summarize_trace`: copy vs compute on the GPU: how much of the host-to-device copy time
  runs while kernels run (issue 12, item 5; the script is ``experiments/profile_overlap.py``).
* :func:`step_breakdown`: where a step's GPU time goes, by op category (attention, a hybrid's
  linear attention, router, slot table, experts, norms, ...) and idle gaps (issue 13; ``experiments/profile_step.py``).
  Events are classified by kernel name and by the ``op_name`` metadata (the ``jax.named_scope``
  path) of their HLO instruction (:func:`hlo_op_names`), on GPU kernels or, on the CPU backend,
  on the host events that execute each HLO instruction.
* :func:`trace_events`: runs a function under the profiler and reads the trace back.
* :func:`targets`: issue 13's decode targets as same-run ratios of ``profile_step``'s finished rows.
"""

from __future__ import annotations

import re

import numpy as np


COPY_WORDS = ("memcpyh2d", "memcpyhtod", "copy-start")  # host-to-device copies (D2D / D2H are compute-side)


def _merge(intervals, gap=0.0):
    """Union of [start, end) intervals (sorted, touching or closer than ``gap`` merged)."""
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def _overlap(a, b) -> float:
    """Total length of the intersection of two merged interval lists."""
    i = j = 0
    tot = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        tot += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tot


def summarize_trace(events: list[dict], gap_us: float = 500.0) -> dict:
    """Copy vs compute on the GPU timeline of one perfetto/chrome trace.

    events: the trace's ``traceEvents``. GPU events are the complete ("X") events of processes whose
    name mentions a GPU; among them, copies are the host-to-device memcpy events (named ``MemcpyH2D``
    on the H200), every other one is compute (kernels, device-to-device copies). Times in microseconds in, seconds out.
    Returns {copy_s, compute_s, span_s, copy_overlapped_fraction, bursts: [{start_s, end_s, copy_s,
    overlapped_fraction}], top_gpu_events}; bursts are copy intervals merged across gaps < gap_us.
    """
    pname = {}
    for ev in events:
        if ev.get("ph") == "M" and ev.get("name") == "process_name":
            pname[ev.get("pid")] = str(ev.get("args", {}).get("name", ""))
    gpu_pids = {p for p, n in pname.items() if "gpu" in n.lower()}
    copies, compute, names = [], [], {}
    for ev in events:
        if ev.get("ph") != "X" or ev.get("pid") not in gpu_pids or "dur" not in ev:
            continue
        s, d = float(ev["ts"]), float(ev["dur"])
        is_copy = any(w in str(ev.get("name", "")).lower() for w in COPY_WORDS)  # thread names mix both
        (copies if is_copy else compute).append((s, s + d))
        key = ("copy: " if is_copy else "compute: ") + str(ev.get("name", ""))[:60]
        names[key] = names.get(key, 0.0) + d
    cu, ku = _merge(copies), _merge(compute)
    copy_t = sum(e - s for s, e in cu)
    bursts = []
    t0 = min([s for s, _ in cu + ku], default=0.0)
    for s, e in _merge(copies, gap_us):
        inside = [[max(s, a), min(e, b)] for a, b in cu if b > s and a < e]
        busy = sum(b - a for a, b in inside)
        bursts.append({"start_s": (s - t0) / 1e6, "end_s": (e - t0) / 1e6, "copy_s": busy / 1e6,
                       "overlapped_fraction": _overlap(inside, ku) / busy if busy else 0.0})
    span = (max([e for _, e in cu + ku], default=0.0) - t0) / 1e6
    top = dict(sorted(names.items(), key=lambda kv: -kv[1])[:25])
    return {"gpu_processes": [pname[p] for p in gpu_pids], "copy_s": copy_t / 1e6,
            "compute_s": sum(e - s for s, e in ku) / 1e6, "span_s": span,
            "copy_overlapped_fraction": _overlap(cu, ku) / copy_t if copy_t else 0.0,
            "bursts": bursts, "top_gpu_events_s": {k: v / 1e6 for k, v in top.items()}}


# --------------------------------------------------------------------------------------------
# Trace capture
# --------------------------------------------------------------------------------------------
def trace_events(fn, log_dir: str, python_tracer: bool = True):
    """Runs ``fn()`` under ``jax.profiler.trace`` (perfetto output in ``log_dir``) and returns
    (fn's value, the trace's ``traceEvents``). ``fn`` must wait for its device work itself
    (``jax.block_until_ready``). ``python_tracer=False`` leaves Python function events out (a
    smaller trace; ``jax.profiler.TraceAnnotation`` events stay).

    Raises:
      RuntimeError: no perfetto trace was written under ``log_dir``.
    """
    import glob
    import gzip
    import json
    import os

    import jax
    opts = jax.profiler.ProfileOptions()
    if not python_tracer:
        opts.python_tracer_level = 0
    with jax.profiler.trace(log_dir, create_perfetto_trace=True, profiler_options=opts):
        value = fn()
    files = sorted(glob.glob(os.path.join(log_dir, "**", "*perfetto_trace.json.gz"), recursive=True),
                   key=os.path.getmtime)
    if not files:
        raise RuntimeError(f"no perfetto trace under {log_dir}")
    with gzip.open(files[-1], "rt") as f:
        return value, json.load(f)["traceEvents"]


# --------------------------------------------------------------------------------------------
# Where a step's GPU time goes (experiments/profile_step.py, issue 13)
# --------------------------------------------------------------------------------------------
#: Categories of GPU time, in table order. attention: the attention block (QKV / output
#: projections, RoPE, KV cache writes, the attention itself, Pallas decode_attention /
#: flash_prefill); linear_attention: a hybrid's Gated DeltaNet token mixer (its projections, conv,
#: gated delta rule and gated norm; the Pallas causal_conv / gated_delta kernels); router: router
#: matmul, softmax, top-k; slot_table: slot-table lookup and the routed-expert mask; experts:
#: expert gather and matmuls (Pallas moe_decode, grouped matmul); norm: RMSNorms; head: what runs
#: outside the layer loop (embedding rows, last-token select, LM head); h2d_copy: host-to-device
#: copies and the device side of expert / layer / KV loads; loop: the layer loop's own work
#: (per-layer slicing of the stacked weights and cache, loop condition, device-to-host copies of
#: the loop predicate); other: everything else (residual adds, stats, memsets, ops the profile
#: could not name). Idle GPU time inside a step is ``gap`` (reported beside these).
CATEGORIES = ("attention", "linear_attention", "router", "slot_table", "experts", "norm", "head", "h2d_copy", "loop",
              "other")

#: jax.named_scope names set in ftjax (grep named_scope ftjax/) -> category; the innermost wins.
SCOPE_CATEGORY = {"attention": "attention", "gated_deltanet": "linear_attention", "router": "router",
                  "slot_lookup": "slot_table", "experts": "experts", "shared_expert": "experts",
                  "cpu_experts": "experts", "norm": "norm", "expert_fetch": "h2d_copy", "stream_prefetch": "h2d_copy",
                  "expert_prefetch": "h2d_copy", "prefetch_wait": "h2d_copy", "guess_experts": "router",
                  "prefetch_lookup": "slot_table", "prefetch_stats": "slot_table",
                  "kv_prefix_load": "h2d_copy", "kv_prefix_state_load": "h2d_copy",
                  "moe": "other", "kv_store": "other"}  # the rest of the MoE block: residual add, reshapes

_H2D_WORDS = ("memcpyh2d", "memcpyhtod", "memcpy htod")
_D2H_WORDS = ("memcpyd2h", "memcpydtoh", "memcpy dtoh")
#: Derived rows of a GPU process in the trace (not kernels: they repeat the kernels' time).
_DERIVED_LINES = ("xla modules", "xla ops", "steps", "tensorflow ops", "framework", "source", "launch stats",
                  "scope range", "xla tracemes")
_CONTAINER = re.compile(r"^(while|conditional|call)(\.\d+)?$")  # host events that hold other ops' events
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([A-Za-z_][\w.\-]*)\s*=\s*(.+)$")
_HEADER = re.compile(r"^\s*(?:ENTRY\s+)?%?([A-Za-z_][\w.\-]*)\s*\(.*\{\s*$")


def _norm_name(name: str) -> str:
    """An HLO instruction name as XLA spells a GPU kernel after it ("fusion.19" -> "fusion_19")."""
    return re.sub(r"\W", "_", name.lstrip("%"))


def hlo_op_names(hlo_text: str) -> dict[str, str]:
    """Instruction name -> ``op_name`` metadata (the jax name stack: ``jit(f)/while/body/moe/experts/
    dot_general``) of a compiled program's HLO text (``compiled.as_text()``).

    An instruction without metadata (XLA drops it in some rewrites: the CPU backend's dots) takes
    its called computation's root op_name (fusions), else that of its first user that has one,
    else of its first operand that has one; a matmul (dot, convolution) borrowing a name inside a
    ``norm`` scope takes the scope around it (a norm has no matmul: it is the projection after
    one). Every name is also keyed as a GPU kernel would be named after it (``.`` and ``-`` ->
    ``_``), and an async ``fusion-start`` also by its called computation's name without
    ``_computation``, as XLA names that kernel. Returns {} for text with no metadata.
    """
    instrs = []  # (computation, is root, name, opcode, op_name or None, called computation, refs)
    users: dict[str, list[str]] = {}
    comp = None
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if m is None:
            h = _HEADER.match(line)
            if h:
                comp = h.group(1)
            continue
        root, name, rest = m.groups()
        meta = re.search(r'op_name="([^"]*)"', rest)
        opcode = re.search(r"(?:^|[\s)])([a-z][a-z0-9\-]*)\(", rest)
        called = re.search(r"\b(?:calls|to_apply|body)=%?([\w.\-]+)", rest)
        refs = re.findall(r"%([\w.\-]+)", rest)
        instrs.append((comp, bool(root), name, opcode.group(1) if opcode else "", meta.group(1) if meta else None,
                       called.group(1) if called else None, refs))
        for r in refs:
            users.setdefault(r, []).append(name)
    own = {name: op for _, _, name, _, op, _, _ in instrs if op is not None}
    names: dict[str, str] = {}
    comp_root: dict[str, str] = {}
    for comp, root, name, opcode, op, called, refs in instrs:  # callees are printed before their callers
        if op is None and called is not None:
            op = comp_root.get(called)
        if op is None:
            op = next((own[u] for u in users.get(name, ()) if u in own), None)
        if op is None:
            op = next((names[r] for r in refs if r in names), None)
        if op is None:
            continue
        if name not in own and opcode in ("dot", "convolution") and "norm" in op.split("/")[:-1]:
            op = "/".join(op.split("/")[: op.split("/").index("norm")] + ["dot_general"])
        names[name] = op
        if root and comp is not None:
            comp_root[comp] = op
        if opcode == "fusion-start" and called is not None:
            # an async fusion's kernel is named after its computation, not the instruction: a host-memory read of
            # the miss loop, fusion-start(..., calls=%wrapped_dynamic-slice_computation.1), runs as the kernel
            # wrapped_dynamic_slice_1 (H200 traces, 2026-12-02)
            names.setdefault(_norm_name(called.replace("_computation", "")), op)
    for name, op in list(names.items()):
        names.setdefault(_norm_name(name), op)
    return names


def classify_op(name: str, op_name: str = "") -> str:
    """The :data:`CATEGORIES` entry of one device event.

    name: the kernel or op event's name (a GPU kernel, ``MemcpyH2D``, a CPU thunk such as
    ``dot.39``); op_name: its HLO instruction's ``op_name`` metadata ("" when unknown; see
    :func:`hlo_op_names`). Copies are classified by name; then the innermost ftjax named scope in
    op_name decides (:data:`SCOPE_CATEGORY`); an op in the layer loop outside every named scope is
    ``loop``, one outside the loop ``head``; with no op_name, the Pallas kernels' names
    (moe_decode, decode_attention, flash_prefill, gated_delta, causal_conv) still name their category; else ``other``.
    """
    low = name.lower()
    if any(w in low for w in _H2D_WORDS):
        return "h2d_copy"
    if any(w in low for w in _D2H_WORDS):
        return "loop"
    if "memset" in low or "memcpy" in low:
        return "other"
    parts = [p for p in op_name.split("/") if p]
    for p in reversed(parts[:-1]):  # the last part is the primitive
        if p in SCOPE_CATEGORY:
            return SCOPE_CATEGORY[p]
    if parts:
        return "loop" if "while" in parts else "head"
    if "moe_decode" in low or "grouped" in low:
        return "experts"
    if "gated_delta" in low or "causal_conv" in low:
        return "linear_attention"
    if "attention" in low or "flash" in low:
        return "attention"
    return "other"


def device_events(events: list[dict]) -> tuple[list[dict], str]:
    """The device work of a trace: (events, source).

    On a GPU trace (a process whose name mentions a GPU; source "gpu"): its complete ("X") events
    (kernels, memcpys, memsets), less derived rows such as "XLA Ops" that repeat them. Without
    one (the CPU backend; source "host"): the host events that execute one HLO instruction
    (``args.hlo_op``), less control-flow containers (while / conditional / call) whose time is
    their body ops'. Each returned event: {ts, end (microseconds), tid, name, hlo_op, hlo_module}.
    """
    pname, tname = {}, {}
    for ev in events:
        if ev.get("ph") == "M" and ev.get("name") == "process_name":
            pname[ev.get("pid")] = str(ev.get("args", {}).get("name", ""))
        if ev.get("ph") == "M" and ev.get("name") == "thread_name":
            tname[(ev.get("pid"), ev.get("tid"))] = str(ev.get("args", {}).get("name", "")).lower()
    gpu = {p for p, n in pname.items() if "gpu" in n.lower()}
    out = []
    for ev in events:
        if ev.get("ph") != "X" or "dur" not in ev:
            continue
        args = ev.get("args") or {}
        name, hlo = str(ev.get("name", "")), str(args.get("hlo_op", ""))
        if gpu:
            if ev.get("pid") not in gpu or any(w in tname.get((ev.get("pid"), ev.get("tid")), "")
                                               for w in _DERIVED_LINES):
                continue
        elif not hlo or name.startswith("end: ") or _CONTAINER.match(hlo):
            continue
        s = float(ev["ts"])
        out.append({"ts": s, "end": s + float(ev["dur"]), "tid": (ev.get("pid"), ev.get("tid")), "name": name,
                    "hlo_op": hlo, "hlo_module": str(args.get("hlo_module", ""))})
    return out, "gpu" if gpu else "host"


def step_windows(events: list[dict], prefix: str) -> list[tuple[float, float]]:
    """[start, end) in microseconds of the host annotations named ``prefix#<i>``
    (``jax.profiler.TraceAnnotation(f"{prefix}#{i}")``), in order of i."""
    found = []
    for ev in events:
        name = str(ev.get("name", ""))
        if ev.get("ph") == "X" and "dur" in ev and name.startswith(prefix + "#") and name[len(prefix) + 1:].isdigit():
            found.append((int(name[len(prefix) + 1:]), float(ev["ts"]), float(ev["ts"]) + float(ev["dur"])))
    return [(s, e) for _, s, e in sorted(found)]


def _attribute(items: list[tuple[float, float, object, str]]) -> dict[str, float]:
    """Busy time per category of (start, end, tid, category) intervals: every moment with work is
    split equally among the threads (GPU streams, CPU threads) busy then, each thread's share to
    its innermost (latest started) event. The values sum to the union of the intervals."""
    items = sorted(items, key=lambda x: (x[0], x[1]))
    bounds = sorted({t for s, e, _, _ in items for t in (s, e)})
    out: dict[str, float] = {}
    active, j = [], 0
    for a, b in zip(bounds, bounds[1:]):
        while j < len(items) and items[j][0] <= a:
            active.append(items[j])
            j += 1
        active = [x for x in active if x[1] > a]
        if not active:
            continue
        inner: dict = {}
        for x in active:
            cur = inner.get(x[2])
            if cur is None or (x[0], -x[1]) > (cur[0], -cur[1]):
                inner[x[2]] = x
        share = (b - a) / len(inner)
        for x in inner.values():
            out[x[3]] = out.get(x[3], 0.0) + share
    return out


def step_breakdown(events: list[dict], op_names: dict[str, str] | None = None, prefix: str = "profile_step",
                   module: str | None = None, top: int = 5) -> dict:
    """Where the GPU time of each traced step goes, by :data:`CATEGORIES`.

    events: a trace's ``traceEvents``; op_names: :func:`hlo_op_names` of the traced program (an
    event's instruction is its ``hlo_op``, else its name); prefix: the steps are the host
    annotations ``prefix#<i>`` (:func:`step_windows`; without any, the whole trace is one step),
    a device event belonging to the step it starts in; module: if given, events of other programs
    (an ``args.hlo_module`` without this text) are left out.

    Per step, in seconds: ``span_s`` (first device event's start to last one's end), ``busy_s``
    (union of device events), ``gap_s`` = span - busy (idle GPU time inside the step; with it,
    the categories sum to the span), ``idle_intervals`` (how many idle stretches) and ``idle_max_s``,
    ``window_s`` (the host annotation: dispatch + device + sync). Returns the mean over steps of
    these, ``categories`` {name: {s (busy time, overlaps split; sums to busy_s), fraction (of
    span_s), kernel_s (summed event durations), count (events per step)}}, ``top_ops`` (per
    category the ``top`` event names by kernel_s), ``unnamed_kernel_s`` / ``unnamed_count`` (events
    per step whose instruction had no op_name: classified by name alone), ``steps`` (their count),
    ``per_step`` (span, busy, gap of each) and ``source`` ("gpu" or "host", :func:`device_events`).

    Raises:
      ValueError: no device event inside any step.
    """
    op_names = op_names or {}
    dev, source = device_events(events)
    if module:
        dev = [e for e in dev if not e["hlo_module"] or module in e["hlo_module"]]
    windows = step_windows(events, prefix) or ([(min(e["ts"] for e in dev), max(e["end"] for e in dev) + 1.0)]
                                                if dev else [])
    per_step, cats, names = [], {c: {"s": 0.0, "kernel_s": 0.0, "count": 0} for c in CATEGORIES}, {}
    unnamed = [0.0, 0]  # summed durations and count of the events with no HLO op_name found
    for w0, w1 in windows:
        evs = [e for e in dev if w0 <= e["ts"] < w1]
        if not evs:
            continue
        items = []
        for e in evs:
            op = next((op_names[k] for k in (e["hlo_op"], _norm_name(e["hlo_op"]), e["name"], _norm_name(e["name"]))
                       if k and k in op_names), "")
            cat = classify_op(e["name"], op)
            items.append((e["ts"], e["end"], e["tid"], cat))
            if not op:
                unnamed[0] += (e["end"] - e["ts"]) / 1e6
                unnamed[1] += 1
            cats[cat]["kernel_s"] += (e["end"] - e["ts"]) / 1e6
            cats[cat]["count"] += 1
            key = (cat, e["name"][:80])
            names[key] = names.get(key, 0.0) + (e["end"] - e["ts"]) / 1e6
        busy = _merge([(s, e) for s, e, _, _ in items])
        idle = [b[0] - a[1] for a, b in zip(busy, busy[1:])]
        span = busy[-1][1] - busy[0][0]
        busy_t = sum(e - s for s, e in busy)
        for cat, t in _attribute(items).items():
            cats[cat]["s"] += t / 1e6
        per_step.append({"span_s": span / 1e6, "busy_s": busy_t / 1e6, "gap_s": (span - busy_t) / 1e6,
                         "idle_intervals": len(idle), "idle_max_s": max(idle, default=0.0) / 1e6,
                         "window_s": (w1 - w0) / 1e6, "events": len(evs)})
    if not per_step:
        raise ValueError(f"no device event inside the {len(windows)} step window(s) ({len(dev)} device events)")
    n = len(per_step)
    mean = {k: sum(p[k] for p in per_step) / n for k in per_step[0]}
    for c in cats.values():
        c["s"] /= n
        c["kernel_s"] /= n
        c["count"] /= n
        c["fraction"] = c["s"] / mean["span_s"] if mean["span_s"] else 0.0
    top_ops = {c: dict(sorted(((nm, t / n) for (cc, nm), t in names.items() if cc == c), key=lambda kv: -kv[1])[:top])
               for c in CATEGORIES}
    gap_fraction = mean["gap_s"] / mean["span_s"] if mean["span_s"] else 0.0
    return {"source": source, "steps": n, **mean, "gap_fraction": gap_fraction, "unnamed_kernel_s": unnamed[0] / n,
            "unnamed_count": unnamed[1] / n, "categories": cats,
            "top_ops": {c: v for c, v in top_ops.items() if v}, "per_step": per_step}


def targets(rows: list[dict], bp_gbps: float) -> dict:
    """Issue 13's decode targets from the finished rows of one run (same process, same machine):
    per batch B, ``resident_bB_over_floor`` (the resident step / its floor; target <= 2.5 at B = 1), where the
    row has ``pipelined_step_s`` ``resident_bB_pipelined_over_floor`` (the mean of steps run back to back / the
    floor), and,
    where the cached run of that batch finished too, ``cached_bB_over_resident_plus_misses``: the
    cached step / (the resident step + the cached step's H2D bytes / B_P in GB/s) (target <= 1.15 at
    24 GB): where the cached row has ``timed_steps`` (each timed step's seconds and H2D bytes), the
    median over those steps of each step against its own misses (plus ``..._p10_p90``, and
    ``cached_bB_misses_in_step_over_B_P``: the median over the steps that copied of their miss bytes /
    (step - resident step) / B_P; target >= 0.9), else its median step against the traced steps' mean
    misses. The resident step is its median, in seconds in the inputs; the dict holds plain ratios."""
    done = {(r["run"], r["batch"]): r for r in rows if "profile" in r and r.get("variant") == "decode"}
    out = {}
    for (run, batch), r in sorted(done.items()):
        if run != "resident_decode":
            continue
        out[f"resident_b{batch}_over_floor"] = r["ratio_to_floor"]
        if r.get("pipelined_step_s"):  # the steps run back to back, as a generation decodes
            out[f"resident_b{batch}_pipelined_over_floor"] = r["pipelined_step_s"] / r["floor"]["s"]
        cached = done.get(("cached_decode", batch))
        if cached is None:
            continue
        res = r["step_s"]["median"]
        timed = cached.get("timed_steps") or {}
        if timed.get("s"):  # each timed step against its own misses: the routing, and so the misses, vary by step
            if len(timed["s"]) != len(timed.get("h2d_bytes", ())):
                raise ValueError(f"cached_decode b{batch}: {len(timed['s'])} timed steps but "
                                 f"{len(timed.get('h2d_bytes', ()))} H2D byte counts")
            ratios = [t / (res + b / (bp_gbps * 1e9)) for t, b in zip(timed["s"], timed["h2d_bytes"])]
            out[f"cached_b{batch}_over_resident_plus_misses"] = float(np.median(ratios))
            out[f"cached_b{batch}_over_resident_plus_misses_p10_p90"] = [float(np.percentile(ratios, 10)),
                                                                         float(np.percentile(ratios, 90))]
            # issue 13's "misses copied inside the step at >= 90% of B_P": a step's miss bytes over the time it
            # took beyond the resident step (everything the cached mode adds is charged to its copies)
            rates = [b / (t - res) / (bp_gbps * 1e9) for t, b in zip(timed["s"], timed["h2d_bytes"]) if b and t > res]
            if rates:
                out[f"cached_b{batch}_misses_in_step_over_B_P"] = float(np.median(rates))
        else:  # rows written before the timed steps' misses were recorded: the traced steps' misses
            bound = res + cached["bytes"]["h2d_link"] / (bp_gbps * 1e9)
            out[f"cached_b{batch}_over_resident_plus_misses"] = cached["step_s"]["median"] / bound
    return out
