"""bench/render_scheduler.py: the cost-per-decision figures, the §2 table, the flatness
verdict and the Summary row, on a hand-made results file written the way
bench/bench_scheduler.py writes it; and the bench's run itself, small."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest

from bench import render_scheduler as rs
from bench.bench_scheduler import decision_cost, parse_variant, variant_name
from bench.harness import RunMeta, RunRecord, interleaved_order, write_results
from bench.render_common import RenderError, Results

pytestmark = pytest.mark.unit

SIZES = [10, 1000]
# (column, tenants) -> µs per decision of reps 0, 1, 2 (drr-blocked/1000 rep 2 failed)
US = {
    ("fifo", 10): [5.0, 5.2, 4.8], ("drr", 10): [6.0, 6.5, 6.2],
    ("vtc", 10): [6.1, 6.1, 6.4], ("drr-blocked", 10): [7.0, 7.5, 7.2],
    ("fifo", 1000): [5.5, 5.1, 5.3], ("drr", 1000): [9.0, 8.0, 8.5],
    ("vtc", 1000): [7.0, 7.3, 7.1], ("drr-blocked", 1000): [9.5, 9.9],
}
SUBMIT_US = {10: [2.0, 2.2, 2.1], 1000: [3.0, 3.3, 3.1]}  # drr only; others 1.0


def _records(us: dict = US) -> list[dict]:
    """As the JSON holds them: bench.harness.RunRecord as dicts, in run order."""
    variants = [variant_name(c, n) for n in SIZES for c in rs.COLUMNS]
    out = []
    for pos, (rep, v) in enumerate(interleaved_order(variants, 3)):
        column, n = parse_variant(v)
        vals = us[(column, n)]
        if rep >= len(vals):
            out.append(RunRecord(v, rep, pos, {}, "RuntimeError('ran dry')"))
            continue
        sub = SUBMIT_US[n][rep] if column == "drr" else 1.0
        out.append(RunRecord(v, rep, pos, {
            "column": column, "policy": "drr" if column == rs.BLOCKED else column,
            "tenants": n, "requests": 100, "warmup_decisions": 10, "decisions": 100,
            "us_per_submit": sub, "us_per_decision": vals[rep]}))
    return [asdict(r) for r in out]


def _data(us: dict = US) -> dict:
    return {
        "setup": {"sizes": SIZES, "columns": list(rs.COLUMNS), "reps": 3, "decisions": 100,
                  "warmup_decisions": 10},
        "records": _records(us),
        "memory": {"queued": 1000, "tenants": 10, "rows": [
            {"policy": "drr", "core_b_per_request": 335.4, "incl_b_per_request": 615.6}]},
        "noisy_neighbour": {"slots": 64, "service_ms": 50.0, "burst": 10_000, "small": 5,
                            "b_at_ms": 10.0, "rows": [
                                {"policy": "fifo", "b_mean_ms": 7790.0, "b_max_ms": 7790.0,
                                 "a_mean_ms": 3881.2, "makespan_ms": 7850.0}]},
        "weights": {"weights": [1, 2, 4], "decisions": 7000, "rows": [
            {"policy": "drr", "shares": [1 / 7, 2 / 7, 4 / 7], "jain": 1.0}]},
        "load_avg": [[0.5, 0.4, 0.3], [1.25, 1.0, 0.5]], "wall_s": 88.0,
    }


def _results(tmp_path: Path, data: dict | None = None, stem: str = rs.STEM) -> Results:
    """Written the way bench/bench_scheduler.py writes it, read the way the renderer does."""
    data = _data() if data is None else data
    meta = RunMeta("python bench/bench_scheduler.py", "abc1234", "2030-01-02T03:04:05Z", "test")
    write_results(tmp_path / f"{stem}.md", "Scheduler", rs.report(data), data, meta)
    return Results(tmp_path, "res")


# --- figures ---------------------------------------------------------------------------


def test_cells_are_median_and_range_over_repetitions_of_successful_runs():
    data = _data()
    s = rs.cell_summary(data, "drr", 1000)
    assert (s.median, s.lo, s.hi, s.n) == (8.5, 8.0, 9.0, 3)
    blocked = rs.cell_summary(data, rs.BLOCKED, 1000)  # rep 2 failed: two runs
    assert (blocked.median, blocked.n) == (pytest.approx(9.7), 2)
    assert rs.per_rep(data, "drr", 10, "us_per_submit") == [2.0, 2.2, 2.1]
    assert [r["error"] for r in rs.failed_records(data)] == ["RuntimeError('ran dry')"]


def test_flatness_compares_the_medians_at_the_smallest_and_largest_count():
    f = rs.flatness(_data())
    assert (f.small_n, f.large_n, f.small.median, f.large.median) == (10, 1000, 6.2, 8.5)
    assert f.ratio == pytest.approx(8.5 / 6.2)
    assert f.verdict == "met"
    steep = {**US, ("drr", 1000): [12.0, 12.5, 13.0]}  # 12.5 / 6.2 = 2.02 > 2
    assert rs.flatness(_data(steep)).verdict == "missed"
    exact = {**US, ("drr", 1000): [12.4, 12.4, 12.4]}  # exactly 2x: still flat
    assert rs.flatness(_data(exact)).verdict == "met"


def test_flatness_needs_two_counts_and_runs_at_both():
    data = _data()
    data["setup"]["sizes"] = [10]
    with pytest.raises(RenderError, match="nothing to call flat"):
        rs.flatness(data)
    data = _data()
    for r in data["records"]:
        if r["variant"] == "drr/1000":
            r["error"] = "boom"
    with pytest.raises(RenderError, match="no successful drr run at 1,000 tenants"):
        rs.flatness(data)


# --- rendering -------------------------------------------------------------------------


def test_benchmarks_table(tmp_path):
    res = _results(tmp_path, stem="sched")
    out = rs.KINDS["scheduler"](res, ["sched"], "old table\n")
    lines = out.splitlines()
    assert lines[0].startswith("*Generated by `python bench/render_benchmarks.py` from "
                               "[`sched.json`](res/sched.json) (commit abc1234, "
                               "2030-01-02T03:04:05Z)")
    assert ("| 10 | 5.00 (4.80–5.20) | 6.20 (6.00–6.50) | 6.10 (6.10–6.40) | "
            "7.20 (7.00–7.50) | 2.10 (2.00–2.20) |") in lines
    assert ("| 1,000 | 5.30 (5.10–5.50) | 8.50 (8.00–9.00) | 7.10 (7.00–7.30) | "
            "9.70 (9.50–9.90) | 3.10 (3.00–3.30) |") in lines
    assert "a loop of 100 `select(1)` calls on one scheduler, after 10 untimed" in out
    assert "Median (min–max) over 3 repetitions" in out
    assert "1 of 24 runs failed and are left out." in out
    assert ("**Flat (drr at 1,000 tenants ≤ 2× drr at 10, medians): met** — "
            "6.20 (6.00–6.50) → 8.50 (8.00–9.00) µs, ratio 1.37.") in lines
    assert "old table" not in out
    with pytest.raises(RenderError, match="one results file"):
        rs.KINDS["scheduler"](res, [], "")


def test_summary_row(tmp_path):
    row = rs.SUMMARY_ROWS["scheduler"](_results(tmp_path))
    assert row == [
        "scheduler cost per decision, 10 → 1,000 tenants (drr, pure core, every tenant "
        "backlogged, `select(1)`)",
        "**6.20 (6.00–6.50) → 8.50 (8.00–9.00) µs** (ratio 1.37; 3 interleaved reps)",
        "flat: largest ≤ 2× smallest — met",
        "[scheduler](res/scheduler.md) (abc1234, 2030-01-02)"]


def test_summary_row_says_missed(tmp_path):
    data = _data({**US, ("drr", 1000): [20.0, 21.0, 19.0]})
    row = rs.SUMMARY_ROWS["scheduler"](_results(tmp_path, data))
    assert row[1].startswith("**6.20 (6.00–6.50) → 20.00 (19.00–21.00) µs** (ratio 3.23;")
    assert row[2] == "flat: largest ≤ 2× smallest — missed"


def test_report_has_every_section_and_run(tmp_path):
    md = rs.report(_data())
    assert "| drr | 1,000 | 10 | 335 | 616 |" in md
    assert "| fifo | 7,790 | 7,790 | 3,881 | 7,850 |" in md
    assert "| drr | 0.143 | 0.286 | 0.571 | 0.143/0.286/0.571 | 1.0000 |" in md
    assert "A bursts 10,000, B sends 5 at 10 ms (64 slots, 50 ms per request" in md
    runs = [ln for ln in md.splitlines() if ln.startswith("| ") and ln[2].isdigit()
            and "/" in ln.split(" | ")[2]]
    assert len(runs) == 24
    assert runs[0] == "| 1 | 0 | fifo/10 | 5.000 | 1.000 | 100 |  |"
    assert runs[8] == "| 9 | 1 | drr-blocked/1000 | 9.900 | 1.000 | 100 |  |"  # reversed
    assert any("drr-blocked/1000 | n/a | n/a | — | RuntimeError('ran dry') |" in r for r in runs)
    assert "Load average (1 min) before / after: 0.50 / 1.25; wall 88 s." in md


# --- the bench, small ------------------------------------------------------------------


@pytest.mark.parametrize("column", rs.COLUMNS)
def test_decision_cost_times_every_decision_asked(column):
    # Before the rewrite the quota-blocked variant ran dry at 10 tenants after 19
    # decisions and reported their mean as the cell.
    m = decision_cost(column, 10, 300, 30)
    assert (m["decisions"], m["warmup_decisions"], m["tenants"]) == (300, 30, 10)
    assert m["us_per_decision"] > 0 and m["us_per_submit"] > 0
    assert m["policy"] == ("drr" if column == rs.BLOCKED else column)
