"""experiments/plots.py's figure mode: paper figures (line and grouped bar charts) from result JSONs
and ``ftjax.generate --metrics_json`` files, with the values drawn returned for checking."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest
from absl import app

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
import plots  # noqa: E402


def _spread(median, p10, p90, lo, hi):
    return {"median": median, "p10": p10, "p90": p90, "min": lo, "max": hi, "n": 5}


def _write(path: pathlib.Path, payload: dict) -> str:
    path.write_text(json.dumps(payload))
    return str(path)


@pytest.fixture
def prefill_json(tmp_path):
    """A bench_prefill-like file: TTFT spreads per variant and prompt length, rows out of order."""
    rows = [{"variant": "stream", "tokens": 4096, "ttft_s": _spread(0.6, 0.55, 0.7, 0.5, 0.8), "expert_dtype": "dense"},
            {"variant": "stream", "tokens": 1024, "ttft_s": _spread(0.2, 0.15, 0.3, 0.1, 0.4), "expert_dtype": "dense"},
            {"variant": "resident", "tokens": 1024, "ttft_s": {"median": 0.05, "min": 0.04, "max": 0.07},
             "expert_dtype": "dense"},
            {"variant": "resident", "tokens": 4096, "ttft_s": 0.11, "expert_dtype": "dense"},
            {"variant": "stream", "tokens": 1024, "ttft_s": 9.0, "expert_dtype": "int4"}]
    return _write(tmp_path / "bench_prefill_tiny.json", {"meta": {"device": "cpu", "date": "2026-12-03"},
                                                         "flags": {"vram_budget_gb": 9.0}, "results": rows})


def test_line_chart_with_spreads_writes_every_format(prefill_json, tmp_path):
    data, files = plots.figure([prefill_json], x="tokens", y="ttft_s", kind="line", series=("variant",),
                               where=[("expert_dtype", "dense")], formats=("png", "pdf", "svg"),
                               out=str(tmp_path / "fig" / "ttft"), title="TTFT")
    assert files == [str(tmp_path / "fig" / f"ttft.{f}") for f in ("png", "pdf", "svg")]
    for f in files:
        assert pathlib.Path(f).stat().st_size > 1000, f
    assert pathlib.Path(files[0]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert pathlib.Path(files[1]).read_bytes()[:5] == b"%PDF-"
    assert "<svg" in pathlib.Path(files[2]).read_text()
    assert (data.x_label, data.y_label) == ("prompt length (tokens)", "TTFT (s)")
    by = {s.label: s for s in data.series}
    assert list(by) == ["stream", "resident"]  # first-seen order; the int4 row is filtered out
    stream, resident = by["stream"], by["resident"]
    assert stream.x == [1024, 4096] and stream.y == [0.2, 0.6]  # sorted by x, drawn at the median
    assert stream.lo == [0.15, 0.55] and stream.hi == [0.3, 0.7]  # p10-p90 error bars
    assert resident.x == [1024, 4096] and resident.y == [0.05, 0.11]
    assert resident.lo == [0.04, 0.11] and resident.hi == [0.07, 0.11]  # min-max without p10/p90; none for a number


def test_grouped_bars_across_files_keep_each_files_meta(tmp_path):
    def bench(budget, device, rows):
        return _write(tmp_path / f"bench_decode_{budget}gb.json",
                      {"meta": {"device": device}, "flags": {"vram_budget_gb": budget}, "results": rows})
    a = bench(8, "H200", [{"mode": "cached", "policy": "lru", "batch": 1, "decode_tokens_per_s": 10.0},
                          {"mode": "cached", "policy": "lookahead", "batch": 1, "decode_tokens_per_s": 30.0},
                          {"mode": "cached", "policy": "lru", "batch": 4, "decode_tokens_per_s": 99.0}])
    b = bench(24, "H100", [{"mode": "cached", "policy": "lru", "batch": 1, "decode_tokens_per_s": 62.0}])
    data, files = plots.figure([a, b], x="flags.vram_budget_gb", y="decode_tokens_per_s", kind="bars",
                               series=("policy",), where=[("batch", "1")], out=str(tmp_path / "bars"))
    assert [pathlib.Path(f).name for f in files] == ["bars.png"] and pathlib.Path(files[0]).stat().st_size > 1000
    assert data.categories == [8, 24] and data.x_label == "GPU memory budget (GB)"
    assert data.y_label == "decode throughput (tokens/s)"
    assert [(s.label, s.x, s.y) for s in data.series] == [("lru", [8, 24], [10.0, 62.0]),
                                                          ("lookahead", [8], [30.0])]
    # each row keeps its own file's meta: a series per device
    data, _ = plots.figure([a, b], x="policy", y="decode_tokens_per_s", kind="bars", series=("meta.device",),
                           where=[("batch", "1")], out=str(tmp_path / "dev"))
    assert [(s.label, s.x, s.y) for s in data.series] == [("H200", ["lru", "lookahead"], [10.0, 30.0]),
                                                          ("H100", ["lru"], [62.0])]
    # a comma list filters on any of its values
    data, _ = plots.figure([a, b], x="flags.vram_budget_gb", y="decode_tokens_per_s", series=("batch",),
                           where=[("flags.vram_budget_gb", "8,24"), ("policy", "lru")], out=str(tmp_path / "any"))
    assert [(s.label, s.x, s.y) for s in data.series] == [("1", [8, 24], [10.0, 62.0]), ("4", [8], [99.0])]


def test_one_budget_sweep_file_draws_the_curve(tmp_path):
    """bench_decode --vram_budgets_gb: one file, each row with its own budget_gb; a line per mode and format, the
    resident row a point at the budget it needs, batch 4 filtered out."""
    rows = [{"mode": m, "policy": p, "batch": b, "expert_dtype": f, "budget_gb": g, "slots": s,
             "decode_tokens_per_s": v}
            for m, p, b, f, g, s, v in (("cached", "lru", 1, "bfloat16", 12.0, 704, 20.0),
                                        ("cached", "lru", 1, "bfloat16", 8.0, 280, 11.0),
                                        ("cached-lookahead", "lookahead", 1, "bfloat16", 8.0, 280, 30.0),
                                        ("cached", "lru", 4, "bfloat16", 8.0, 280, 40.0),
                                        ("cached", "lru", 1, "int4", 8.0, 869, 70.0),
                                        ("resident", "lru", 1, "bfloat16", 63.336, 6144, 93.0))]
    path = _write(tmp_path / "bench_decode_qwen3-30b-a3b.json", {"meta": {"device": "H200"}, "budgets_gb": [8.0, 12.0],
                                                                "flags": {"vram_budgets_gb": ["8", "12"]},
                                                                "results": rows})
    data, files = plots.figure([path], x="budget_gb", y="decode_tokens_per_s", kind="line",
                               series=("mode", "expert_dtype"), where=[("batch", "1")], out=str(tmp_path / "curve"))
    assert pathlib.Path(files[0]).stat().st_size > 1000 and data.x_label == "GPU memory budget (GB)"
    assert data.categories == [8.0, 12.0, 63.336]
    assert [(s.label, s.x, s.y) for s in data.series] == [
        ("mode=cached, expert_dtype=bfloat16", [8.0, 12.0], [11.0, 20.0]),
        ("mode=cached-lookahead, expert_dtype=bfloat16", [8.0], [30.0]),
        ("mode=cached, expert_dtype=int4", [8.0], [70.0]),
        ("mode=resident, expert_dtype=bfloat16", [63.336], [93.0])]


def test_generate_metrics_json_per_request_and_one_run(tmp_path, capsys):
    """The layouts ``ftjax.generate --metrics_json`` writes: a ``requests`` list (--prompts_file /
    --kv_offload), else one run's top-level figures."""
    reqs = _write(tmp_path / "m.json", {"model": "tiny", "ttft_s": 0.5, "flags": {"vram_budget_gb": 1.0},
                                        "requests": [{"prompt_tokens": 64, "reused_tokens": 0, "ttft_s": 0.5},
                                                     {"prompt_tokens": 72, "reused_tokens": 64, "ttft_s": 0.1}]})
    data, _ = plots.figure([reqs], x="request", y="ttft_s", out=str(tmp_path / "r"))
    assert [(s.x, s.y) for s in data.series] == [([0, 1], [0.5, 0.1])]
    runs = [_write(tmp_path / f"run_{p}.json", {"decode_tokens_per_s": v, "flags": {"cache_policy": p},
                                                 "expert_cache": {"hit_rate": h}})
            for p, v, h in (("lru", 11.0, 0.2), ("lookahead", 30.5, 0.7))]
    data, _ = plots.figure(runs, x="flags.cache_policy", y="expert_cache.hit_rate", kind="bars",
                           out=str(tmp_path / "g"))
    assert data.categories == ["lru", "lookahead"] and data.series[0].y == [0.2, 0.7]
    assert data.y_label == "hit rate (fraction of lookups)"
    # without figure flags (bar charts of run rows) the same file is refused, pointing at figure mode
    assert plots.main(["plots", reqs]) == 1
    assert "figure mode: --kind=" in capsys.readouterr().err


def test_bad_field_names_it_and_lists_the_fields(prefill_json, tmp_path, capsys):
    with pytest.raises(app.UsageError, match=r"--x=length: no row has field 'length'; fields: .*tokens.*variant"):
        plots.figure([prefill_json], x="length", y="ttft_s", out=str(tmp_path / "x"))
    with pytest.raises(app.UsageError, match=r"--series=policy: no row has field 'policy'"):
        plots.figure([prefill_json], x="tokens", y="ttft_s", series=("policy",), out=str(tmp_path / "x"))
    with pytest.raises(app.UsageError, match=r"keeps no row; values there: expert_dtype: dense, int4"):
        plots.figure([prefill_json], x="tokens", y="ttft_s", where=[("expert_dtype", "fp8")], out=str(tmp_path / "x"))
    # two rows at one point: the message says which fields tell them apart
    with pytest.raises(app.UsageError, match=r"several rows at tokens=1024, stream; .*differ in: expert_dtype, ttft_s"):
        plots.figure([prefill_json], x="tokens", y="ttft_s", series=("variant",), out=str(tmp_path / "x"))
    # the command line: one line, status 1, nothing written
    assert plots.main(["plots", "--kind=line", "--x=tokens", "--y=ttft", f"--out={tmp_path / 'y'}", prefill_json]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --y=ttft: no row has field 'ttft'; fields: ") and err.count("\n") == 1
    assert not list(tmp_path.glob("y.*"))
    assert plots.main(["plots", "--kind=pie", "--x=tokens", "--y=ttft_s", prefill_json]) == 1
    assert "error: --kind=pie: expected line or bars" in capsys.readouterr().err
    assert plots.main(["plots", "--x=tokens", "--y=ttft_s", "--colour=red", prefill_json]) == 1
    assert "error: unknown flag --colour" in capsys.readouterr().err


def test_command_line_writes_the_named_files(prefill_json, tmp_path, capsys):
    out = tmp_path / "cli"
    assert plots.main(["plots", "--kind=bars", "--x=tokens", "--y=ttft_s", "--series=variant,expert_dtype",
                       "--formats=png,svg", f"--out={out}", prefill_json]) == 0
    assert capsys.readouterr().out.split() == [f"{out}.png", f"{out}.svg"]
    assert out.with_suffix(".png").stat().st_size > 1000 and out.with_suffix(".svg").stat().st_size > 1000


@pytest.mark.parametrize("name,label", [("ttft_s", "TTFT (s)"),
                                        ("meta.B_P.h2d_GBps", "host-to-device bandwidth (GB/s)"),
                                        ("prefix_load_ms", "prefix load (ms)"), ("kv_host_gb", "host KV store (GB)"),
                                        ("wibble", "wibble")])
def test_axis_labels_carry_units(name, label):
    assert plots.axis_label(name) == label


def test_step_profile_draws_one_stacked_bar_per_traced_run(tmp_path):
    """A profile_step run split into variant rows gives one bar of category shares (device time and gaps over
    the step's span, per step as the JSON holds them), and the PNG gets that panel."""
    cats = {"experts": {"s": 0.002}, "linear_attention": {"s": 0.001}, "slot_table": {"s": 0.0}}
    run = {"mode": "resident", "batch": 1, "tokens": 1, "tpot_s": 0.004,
           "profile": {"span_s": 0.004, "gap_s": 0.001, "steps": 2, "categories": cats}}
    rows = [dict(run, variant="timed_steps"), dict(run, variant="floor"), {"mode": "cached", "tpot_s": 0.01}]
    [(lab, parts, ms)] = plots.category_shares(rows)  # the two variants share one profile; cached has none
    assert lab == "resident batch=1 tokens=1" and ms == pytest.approx(4.0)
    assert parts == [("experts", pytest.approx(0.5)), ("linear_attention", pytest.approx(0.25)),
                     ("gap", pytest.approx(0.25))]
    png = plots.plot(_write(tmp_path / "profile_step_x.json", {"runs": [run]}))
    assert png and pathlib.Path(png).stat().st_size > 0
