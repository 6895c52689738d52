"""Reduction of a ``jax.profiler`` timeline (perfetto / chrome trace JSON) to copy vs compute on the
GPU: how much of the host-to-device copy time runs while kernels run (issue 12, item 5). No flags
here, so tests and notebooks import it freely (``experiments/profile_overlap.py`` is the script).
"""

from __future__ import annotations


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
