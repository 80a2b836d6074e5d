"""bench/render_noisy.py: the fairness arithmetic, the per-record figures, BENCHMARKS.md's
tables and Summary rows, on a hand-made results file."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import render_noisy as rn
from bench.render_common import RenderError, Results

pytestmark = pytest.mark.unit

WEIGHTS = {"w1": 1, "w2": 2, "w4": 4}


def _weighted(w1: int, w2: int, w4: int, window_s: float = 10.0) -> dict:
    return {"window_s": window_s, "tokens": {"w1": w1, "w2": w2, "w4": w4}, "weights": WEIGHTS,
            "preemptions": 3, "errors": []}


def _asym(l1: int, l2: int, l3: int, h: int, ttft: list[float], censored: int = 0) -> dict:
    # Demand over the 10 s window: 100 tok/s per light tenant, 2,000 for the heavy one.
    return {"window_s": 10.0, "heavy": "h",
            "tokens": {"h": h, "l1": l1, "l2": l2, "l3": l3},
            "demand_tokens": {"h": 20_000.0, "l1": 1000.0, "l2": 1000.0, "l3": 1000.0},
            "offered_tokens": {"h": 20_100, "l1": 990, "l2": 1010, "l3": 1000},
            "light_ttft_ms": ttft, "light_censored": censored, "preemptions": 7, "errors": []}


def _rec(policy: str, rep: int, pos: int, w: dict, a: dict, error: str | None = None) -> dict:
    metrics = {} if error else {"profiles": {"long": {"weighted": w, "asymmetric": a}}}
    return {"variant": policy, "rep": rep, "position": pos, "metrics": metrics, "error": error,
            "elapsed_s": 80.0}


FAST = [float(v) for v in range(1, 201)]  # 200 samples: p50 100.5, p99 198.01
SLOW = [float(v) for v in range(1, 251)]  # 250 samples: p50 125.5, p99 247.51


def _data() -> dict:
    # drr 1:2:4 max relative errors 2.0% / 1.0% / 4.0%; fifo serves 1:1:1 (w1 133.3% off).
    # Tokens/s: drr 700 each rep; fifo 700, 700, 800 -> drr ÷ fifo 1.0, 1.0, 0.875.
    # Asymmetric: 8,000 tokens delivered (800 tok/s): lights owed their 100 tok/s, h 500.
    fifo_a = _asym(350, 350, 350, 6950, [float(v) for v in range(1000, 11000, 1000)], censored=2)
    recs = [
        _rec("fifo", 0, 0, _weighted(2333, 2333, 2334), fifo_a),
        _rec("drr", 0, 1, _weighted(1020, 2000, 3980), _asym(1000, 1000, 1000, 5000, FAST)),
        _rec("vtc", 0, 2, _weighted(1000, 2000, 4000), _asym(1000, 1000, 1000, 5000, FAST)),
        _rec("vtc", 1, 3, {}, {}, error="RuntimeError('fleet not ready')"),
        _rec("drr", 1, 4, _weighted(1010, 2010, 3980), _asym(950, 1000, 1050, 5000, SLOW)),
        _rec("fifo", 1, 5, _weighted(2333, 2333, 2334), fifo_a),
        _rec("fifo", 2, 6, _weighted(2666, 2667, 2667), fifo_a),
        _rec("drr", 2, 7, _weighted(1040, 1960, 4000), _asym(1000, 1000, 1000, 5000, SLOW)),
        _rec("vtc", 2, 8, _weighted(1000, 2000, 4000), _asym(1000, 1000, 1000, 5000, FAST)),
    ]
    setup = {"policies": ["fifo", "drr", "vtc"], "reps": 3, "workers": 2, "max_num_seqs": 32,
             "slots": 64, "prefetch_seqs": 4, "step_model": "default", "time_scale": 1.0,
             "prompt_tokens": 32, "quantum": 544.0, "preemption": "the pool defaults",
             "profiles": {"long": {"out_min": 128, "out_max": 384}}, "weights": WEIGHTS,
             "outstanding": 100, "warmup_s": {"weighted": 8.0, "asymmetric": 8.0},
             "window_s": {"weighted": 20.0, "asymmetric": 35.0},
             "asymmetric": {"light_share_frac": 0.5, "heavy_factor": 10.0,
                            "offered_over_capacity": 1.625}}
    cal = {"long": {"policy": "fifo", "warmup_s": 8.0, "window_s": 15.0, "tok_per_s": 4800.0,
                    "req_per_s": 18.75, "token_s": 64 / 4800, "errors": [],
                    "offered_req_per_s": {"h": 23.44, "l1": 2.34, "l2": 2.34, "l3": 2.34}}}
    return {"setup": setup, "calibration": cal, "records": recs, "notes": [], "wall_s": 1200.0}


def _results(tmp_path: Path, data: dict | None = None, stem: str = rn.STEM) -> Results:
    doc = {"meta": {"command": "python bench/noisy_neighbor.py", "commit": "abc1234",
                    "date_utc": "2030-01-02T03:04:05Z", "machine": "test"},
           "data": data or _data()}
    (tmp_path / f"{stem}.json").write_text(json.dumps(doc))
    return Results(tmp_path, "res")


def _row(text: str, first: str) -> list[str]:
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        if cells[0] == first:
            return cells
    raise AssertionError(f"no row {first!r} in\n{text}")


# --- arithmetic ------------------------------------------------------------------------------


def test_jain_is_one_when_equal_and_one_over_n_when_one_gets_all():
    assert rn.jain([2.0, 2.0, 2.0]) == pytest.approx(1.0)
    assert rn.jain([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert math.isnan(rn.jain([]))


def test_max_min_fair_gives_small_demands_in_full_and_splits_the_rest():
    owed = rn.max_min_fair({"h": 2000, "l1": 100, "l2": 100, "l3": 100}, 800)
    assert owed == pytest.approx({"h": 500, "l1": 100, "l2": 100, "l3": 100})
    # Two tenants above the level share what is left equally; weights scale levels.
    assert rn.max_min_fair({"a": 10, "b": 500, "c": 500}, 310) == pytest.approx(
        {"a": 10, "b": 150, "c": 150})
    assert rn.max_min_fair({"a": 500, "b": 500}, 300, {"a": 1, "b": 2}) == pytest.approx(
        {"a": 100, "b": 200})
    # More capacity than demand: everyone gets their demand.
    assert rn.max_min_fair({"a": 10, "b": 20}, 100) == {"a": 10, "b": 20}


def test_fluid_tokens_counts_the_part_streamed_inside_the_window():
    # 100 tokens at 10 ms each: 1 s of streaming.
    assert rn.fluid_tokens(5.0, 100, 0.01, 0.0, 10.0) == pytest.approx(100)
    assert rn.fluid_tokens(9.5, 100, 0.01, 0.0, 10.0) == pytest.approx(50)  # half after w1
    assert rn.fluid_tokens(-0.25, 100, 0.01, 0.0, 10.0) == pytest.approx(75)  # began before w0
    assert rn.fluid_tokens(10.0, 100, 0.01, 0.0, 10.0) == 0.0


def test_weighted_and_asymmetric_figures_of_one_record():
    w = rn.weighted_figures(_weighted(1020, 2000, 3980))
    assert w["max_rel_err"] == pytest.approx(0.02)
    assert w["tok_per_s"] == pytest.approx(700)
    a = rn.asym_figures(_asym(950, 1000, 1050, 5000, SLOW))
    assert a["owed"] == pytest.approx({"h": 500, "l1": 100, "l2": 100, "l3": 100})
    assert a["x"] == pytest.approx({"h": 1.0, "l1": 0.95, "l2": 1.0, "l3": 1.05})
    assert a["jain"] == pytest.approx(16 / (4 * 4.005))
    assert a["max_rel_err"] == pytest.approx(0.05)
    f = rn.asym_figures(_asym(350, 350, 350, 6950, []))
    assert f["x"]["h"] == pytest.approx(1.39) and f["x"]["l1"] == pytest.approx(0.35)
    assert f["jain"] == pytest.approx(2.44 ** 2 / (4 * (3 * 0.35 ** 2 + 1.39 ** 2)))  # 0.647
    with pytest.raises(RenderError, match="no tokens"):
        rn.weighted_figures(_weighted(0, 0, 0))


# --- tables ----------------------------------------------------------------------------------


def test_weighted_table_medians_ranges_and_the_paired_fifo_ratio(tmp_path):
    out = rn.KINDS["noisy-weighted"](_results(tmp_path, stem="nb"), ["nb"], "old\n")
    assert out.startswith("*Generated by `python bench/render_benchmarks.py` from "
                          "[`nb.json`](res/nb.json) (commit abc1234, 2030-01-02T03:04:05Z)")
    assert "old" not in out.split("\n")
    assert "4,800 tokens/s = 18.8 requests/s" in out
    assert _row(out, "drr") == ["drr", "128–384 tokens (mean 256)", "0.146 (0.144–0.149)",
                                "0.286 (0.280–0.287)", "0.569 (0.569–0.571)",
                                "**2.0% (1.0–4.0)**", "700 (700–700)",
                                "1.000 (0.875–1.000)", "3"]
    fifo = _row(out, "fifo")
    assert fifo[5] == "133.3% (133.3–133.3)" and fifo[7] == "1.000 (1.000–1.000)"
    vtc = _row(out, "vtc")  # rep 1 failed: reps 0 and 2 (÷ fifo 1.0 and 0.875)
    assert vtc[5:] == ["0.0% (0.0–0.0)", "700 (700–700)", "0.938 (0.875–1.000)", "2"]
    with pytest.raises(RenderError, match="one results file"):
        rn.KINDS["noisy-weighted"](_results(tmp_path), [], "")


def test_asymmetric_table_jain_and_light_ttft_tails(tmp_path):
    out = rn.KINDS["noisy-asymmetric"](_results(tmp_path), [rn.STEM], "")
    drr = _row(out, "drr")
    assert drr[2:4] == ["500 (500–500) (500)", "100 (100–100) (100)"]
    assert drr[4:8] == ["1.00 (1.00–1.00)", "1.00 (0.95–1.00)", "**1.000 (0.999–1.000)**",
                        "0.0% (0.0–5.0)"]
    # Every rep has >= 200 light samples: a p99 per rep, median (min–max).
    assert drr[8:10] == ["126 (100–126)", "248 (198–248)"]
    fifo = _row(out, "fifo")
    assert fifo[4:7] == ["1.39 (1.39–1.39)", "0.35 (0.35–0.35)", "0.647 (0.647–0.647)"]
    # 10 samples, 2 cut off: the max, flagged as a lower bound.
    assert fifo[8:10] == ["≥ 5,500 (5,500–5,500)", "≥ max=10,000 (10,000–10,000)"]


def test_report_lists_every_run_including_the_failed_one():
    md = rn.report(_data())
    assert "| 4 | vtc | 1 | — | failed: RuntimeError('fleet not ready') |" in md
    assert "| 2 | drr | 0 | long | 0.146 / 0.286 / 0.569 | 700 |" in md
    assert "l1 0.35 / l2 0.35 / l3 0.35 / h 1.39 | 0.647 | 10 (2 cut off) | 0 | 3; 7 |" in md
    assert "Wall time 20.0 min." in md


# --- Summary rows ----------------------------------------------------------------------------


def test_summary_rows(tmp_path):
    res = _results(tmp_path)
    src = "[noisy_neighbor](res/noisy_neighbor.md) (abc1234, 2030-01-02)"
    shares = rn.SUMMARY_ROWS["noisy-shares"](res)
    assert shares[1:] == ["**2.0% (1.0–4.0)** (3 interleaved reps); fifo 133.3% (133.3–133.3); "
                          "vtc 0.0% (0.0–0.0)", "≤ 3% — met", src]
    jain = rn.SUMMARY_ROWS["noisy-jain"](res)
    assert jain[1:] == ["**1.000 (0.999–1.000)** (3 interleaved reps); fifo 0.647 (0.647–0.647); "
                        "vtc 1.000 (1.000–1.000)", "≥ 0.99 — met", src]
    thr = rn.SUMMARY_ROWS["noisy-throughput"](res)
    assert thr[1:] == ["1:2:4 **1.000 (0.875–1.000)**, asymmetric 1.000 (1.000–1.000) (3 "
                       "interleaved reps); vtc 1:2:4 0.938 (0.875–1.000)", "≥ 0.97 — met; met",
                       src]


def test_missed_targets_are_printed_as_missed(tmp_path):
    data = _data()
    fifo_metrics = json.dumps(data["records"][0]["metrics"])
    for r in data["records"]:
        if r["variant"] == "drr":  # drr behaving like fifo
            r["metrics"] = json.loads(fifo_metrics)
        if r["variant"] == "fifo":  # and fifo twice as fast
            r["metrics"]["profiles"]["long"]["weighted"]["window_s"] = 5.0
            r["metrics"]["profiles"]["long"]["asymmetric"]["window_s"] = 5.0
    res = _results(tmp_path, data)
    assert rn.SUMMARY_ROWS["noisy-shares"](res)[2] == "≤ 3% — **missed**"
    assert rn.SUMMARY_ROWS["noisy-jain"](res)[2] == "≥ 0.99 — **missed**"
    assert rn.SUMMARY_ROWS["noisy-throughput"](res)[2] == "≥ 0.97 — **missed**; **missed**"


def test_no_successful_run_or_no_drr_is_an_error(tmp_path):
    data = _data()
    data["records"] = [r for r in data["records"] if r["variant"] != "drr"]
    with pytest.raises(RenderError, match="no successful run of \\['drr'\\]"):
        rn.SUMMARY_ROWS["noisy-jain"](_results(tmp_path, data))
    data["records"] = [{**r, "error": "boom"} for r in data["records"]]
    with pytest.raises(RenderError, match="no successful run"):
        rn.weighted_table(data)
