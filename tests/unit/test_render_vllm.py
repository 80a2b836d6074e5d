"""bench/render_vllm.py and bench/bench_vllm_report.py on small hand-made results of
bench/bench_vllm.py: paired ratios, pooled tails, the table and the Summary rows."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import render_vllm as rv
from bench.bench_vllm_report import (
    overheads_ms,
    report,
    tail_overhead,
    throughput_ratios,
    ttft_p50_ratios,
)
from bench.common import quantile
from bench.harness import RunMeta, RunRecord, write_results
from bench.render_common import RenderError, Results

pytestmark = pytest.mark.unit

SETUP = {"requests": 3, "prompt_tokens": 128, "max_tokens": 128, "light_requests": 3,
         "light_prompt_tokens": 128, "light_max_tokens": 8, "max_num_seqs": 32,
         "max_model_len": 1024, "prefetch_seqs": 4, "direct_bound": 36, "reps": 3,
         "variants": ["direct", "fleet", "sim-direct", "sim-fleet"],
         "warmup": "one untimed run of every variant on the measured workload"}


def _metrics(tok_s: float, loaded_ttft: list[float], light_ttft: list[float]) -> dict:
    loaded = {"wall_s": 10.0, "output_tokens": int(tok_s * 10), "tok_s": tok_s,
              "ttft_ms": loaded_ttft, "e2e_ms": [x + 1000 for x in loaded_ttft],
              "cpu_main_s": 1.0, "cpu_engine_s": 18.0, "cpu_nats_s": 0.1,
              "mean_running": 30.0, "mean_in_engine": 34.0, "max_in_engine": 36}
    light = {"wall_s": 1.0, "output_tokens": 24, "tok_s": 24.0, "ttft_ms": light_ttft,
             "e2e_ms": [x + 40 for x in light_ttft]}
    return {"loaded": loaded, "light": light}


# (variant, rep) -> (tok/s, loaded TTFT samples, light TTFT samples)
RUNS = {
    ("direct", 0): (2000.0, [100, 200, 300], [10, 12, 14]),
    ("fleet", 0): (1900.0, [110, 220, 330], [13, 15, 17]),
    ("sim-direct", 0): (1900.0, [120, 240, 360], [11, 12, 13]),
    ("sim-fleet", 0): (1900.0, [120, 240, 360], [14, 15, 16]),
    ("direct", 1): (2000.0, [100, 200, 300], [10, 11, 12]),
    ("fleet", 1): (1800.0, [100, 200, 300], [15, 16, 17]),
    ("sim-direct", 1): (2100.0, [100, 200, 300], [10, 11, 12]),
    ("sim-fleet", 1): (1800.0, [100, 200, 300], [15, 16, 17]),
    ("direct", 2): (1000.0, [100, 200, 300], [10, 11, 12]),  # its fleet run failed
}


def _records(runs: dict = RUNS, failed: tuple = (("fleet", 2),)) -> list[RunRecord]:
    out = []
    for pos, ((variant, rep), (tps, loaded, light)) in enumerate(runs.items()):
        out.append(RunRecord(variant, rep, pos, _metrics(tps, loaded, light)))
    for variant, rep in failed:
        out.append(RunRecord(variant, rep, len(out), {}, "RuntimeError('boom')"))
    return out


def _results(tmp_path: Path, records: list[RunRecord]) -> Results:
    """Written the way bench/bench_vllm.py writes them, read the way the renderer does."""
    meta = RunMeta("python bench/bench_vllm.py --reps 3", "abc1234", "2030-01-02T03:04:05Z",
                   "test")
    body = report(records, [], SETUP)
    write_results(tmp_path / "vllm.md", "vLLM", body,
                  {"setup": SETUP, "warmup": [], "records": records}, meta)
    return Results(tmp_path, "res")


# --- pure figures -----------------------------------------------------------------------


def test_ratios_are_paired_per_repetition_and_skip_a_failed_side():
    recs = _records()
    # rep 2's direct ran alone (its fleet failed): no pair, not a ratio of 1000 tok/s.
    assert throughput_ratios(recs) == pytest.approx([0.95, 0.90])
    assert throughput_ratios(recs, "sim-direct", "direct") == pytest.approx([0.95, 1.05])
    assert ttft_p50_ratios(recs, "sim-direct", "direct") == pytest.approx([1.2, 1.0])


def test_light_overhead_is_fleet_minus_direct_p50_of_each_repetition():
    assert overheads_ms(_records()) == pytest.approx([3.0, 5.0])


def test_tail_overhead_is_a_max_below_200_pooled_samples():
    label, value, n_fleet, n_direct = tail_overhead(_records())
    # pooled light TTFT: fleet max 17, direct max 14 (reps 0-2; rep 2 has no fleet)
    assert (label, value, n_fleet, n_direct) == ("max", pytest.approx(3.0), 6, 9)


def test_tail_overhead_is_a_p99_from_200_pooled_samples():
    direct = [float(i) for i in range(100)]
    fleet = [x + 2.0 for x in direct]
    fleet[-1] = 500.0  # one outlier: a p99 interpolates, a max would be +401 ms
    runs = {(v, rep): (1000.0, [1, 2, 3], samples)
            for rep in (0, 1) for v, samples in (("direct", direct), ("fleet", fleet))}
    label, value, n_fleet, n_direct = tail_overhead(_records(runs, ()))
    expected = quantile(fleet + fleet, 0.99) - quantile(direct + direct, 0.99)
    assert (label, n_fleet, n_direct) == ("p99", 200, 200)
    assert value == pytest.approx(expected)
    assert value < 401
    # One side short of 200: both sides' max, not a p99 against a max.
    runs[("direct", 1)] = (1000.0, [1, 2, 3], direct[:50])
    label, value, n_fleet, n_direct = tail_overhead(_records(runs, ()))
    assert (label, value, n_fleet, n_direct) == ("max", pytest.approx(401.0), 200, 150)


# --- rendering ----------------------------------------------------------------------------


def test_table_rows_give_median_and_range_over_repetitions(tmp_path):
    out = rv.KINDS["vllm"](_results(tmp_path, _records()), ["vllm"], "")
    assert out.startswith("*Generated by `python bench/render_benchmarks.py` from "
                          "[`vllm.json`](res/vllm.json) (commit abc1234, 2030-01-02T03:04:05Z)")
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line
            for line in out.splitlines() if line.startswith("| ") and "---" not in line}
    # direct tok/s over reps 0-2: 2000, 2000, 1000; loaded TTFT p50 200 in each
    assert rows[("direct", "loaded")] == (
        "| direct | loaded | 2,000 (1,000–2,000) | 200 (200–200) | max=300 | "
        "1,200 (1,200–1,200) | 9 |")
    assert rows[("fleet", "light")] == (
        "| fleet | light | — | 15.5 (15.0–16.0) | max=17.0 | 55.5 (55.0–56.0) | 6 |")
    assert "**fleet ÷ direct output tok/s: 0.925 (0.900–0.950)**" in out
    assert ("over 2 of 3 interleaved repetitions (a side failed in the others); per "
            "repetition: 0.950, 0.900") in out
    assert "p50 +4.00 ms (+3.00 to +5.00) per repetition; max +3.0 ms (pooled, 6 / 9" in out
    assert "- simulator ÷ vLLM (sim-direct ÷ direct): output tok/s 1.000 (0.950–1.050)" in out


def test_summary_rows(tmp_path):
    res = _results(tmp_path, _records())
    claim, measured, target, source = rv.SUMMARY_ROWS["vllm-throughput"](res)
    assert "bounded to 36 requests" in claim
    assert measured == ("**0.925 (0.900–0.950)** over 2 of 3 interleaved repetitions (a side "
                        "failed in the others)")
    assert target == "≥ 0.95 — missed"
    assert source == "[vllm](res/vllm.md) (abc1234, 2030-01-02)"
    ttft = rv.SUMMARY_ROWS["vllm-ttft"](res)
    assert ttft[1] == "p50 +4.00 ms (+3.00 to +5.00) per rep; max +3.0 ms (pooled, 6 / 9 samples)"
    sim = rv.SUMMARY_ROWS["vllm-sim"](res)
    assert sim[1] == ("direct: tok/s 1.000 (0.950–1.050), TTFT p50 1.100 (1.000–1.200); "
                      "fleet: tok/s 1.000 (1.000–1.000), TTFT p50 1.045 (1.000–1.091)")


def test_throughput_target_met_at_or_above_095(tmp_path):
    runs = {k: v for k, v in RUNS.items() if k[0] in ("direct", "fleet") and k[1] < 2}
    runs[("fleet", 1)] = (1960.0, [1, 2, 3], [1, 2, 3])  # 0.98 -> median 0.965
    row = rv.SUMMARY_ROWS["vllm-throughput"](_results(tmp_path, _records(runs, ())))
    assert row[1] == "**0.965 (0.950–0.980)** over 2 interleaved repetitions"
    assert row[2] == "≥ 0.95 — met"


def test_missing_variants_and_empty_files_are_render_errors(tmp_path):
    only_direct = {k: v for k, v in RUNS.items() if k[0] == "direct"}
    res = _results(tmp_path, _records(only_direct, ()))
    with pytest.raises(RenderError, match="fleet"):
        rv.SUMMARY_ROWS["vllm-throughput"](res)
    with pytest.raises(RenderError, match="sim-direct"):
        rv.SUMMARY_ROWS["vllm-sim"](res)
    res = _results(tmp_path / "none", [RunRecord("direct", 0, 0, {}, "boom")])
    with pytest.raises(RenderError, match="no successful run"):
        rv.KINDS["vllm"](res, ["vllm"], "")
    with pytest.raises(RenderError, match="one results file"):
        rv.KINDS["vllm"](res, [], "")


def test_the_bench_markdown_prints_the_rendered_figures(tmp_path):
    recs = _records()
    md = report(recs, [], SETUP)
    rendered = rv.KINDS["vllm"](_results(tmp_path, recs), ["vllm"], "")
    table = rendered.split("\n\n")[2]
    assert table.startswith("| variant | load |") and table in md
    assert "| 2 | 9 | fleet | failed: RuntimeError('boom') |" in md
