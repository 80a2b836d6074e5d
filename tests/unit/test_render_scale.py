"""bench/render_scale.py: the §9 scale table, the target verdict and the Summary row, on
a hand-made results file shaped as bench/bench_simulate_scale.py writes it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import render_scale as rsc
from bench.bench_simulate_scale import report as bench_report
from bench.render_common import RenderError, Results

pytestmark = pytest.mark.unit


def _run(workers: int, tenants: int, simulated_s: float, wall_s: float, hour_wall_s: float,
         extrapolated: bool, stopped: bool = False, variant: str = "interpreted",
         rep: int = 0) -> dict:
    return {"variant": variant, "rep": rep, "workers": workers, "tenants": tenants, "slots": 32, "load_target": 0.8,
            "duration_s": 3600.0, "simulated_s": simulated_s, "stopped_early": stopped,
            "wall_s": wall_s, "cpu_s": wall_s - 0.1, "sim_s_per_wall_s": simulated_s / wall_s,
            "steady_sim_s_per_wall_s": 3600.0 / hour_wall_s, "hour_wall_s": hour_wall_s,
            "hour_extrapolated": extrapolated, "peak_rss_mib": 100.25, "arrivals": 1_234_567,
            "arrivals_per_wall_s": 1_234_567 / wall_s, "busy_fraction": 0.8149,
            "ttft_p50_s": 0.0421, "ttft_p99_s": 0.16349,
            "checkpoints": [[0.0, 0.0, 0.0, 70.0], [simulated_s, wall_s, wall_s, 100.25]]}


def _data(big_hour_wall_s: float = 2400.0) -> dict:
    # 100 x 10,000: the hour ran, in 300 s (12 sim-s per wall-s).
    # 1,000 x 100,000: 600 simulated s in 400 s (1.5 sim-s per wall-s), the hour
    # extrapolated from the steady rate to `big_hour_wall_s` (2,400 s = 40 min = 4x).
    return {"runs": [_run(100, 10_000, 3600.0, 300.0, 300.0, False),
                     _run(1000, 100_000, 600.0, 400.0, big_hour_wall_s, True)],
            "load_avg": [[0.5, 0.5, 0.5], [1.0, 1.0, 1.0]], "args": {"slots": 32}}


def _results(tmp_path: Path, data: dict, stem: str = rsc.STEM) -> Results:
    doc = {"meta": {"command": "python bench/bench_simulate_scale.py", "commit": "abc1234",
                    "date_utc": "2030-01-02T03:04:05Z", "machine": "test"}, "data": data}
    (tmp_path / f"{stem}.json").write_text(json.dumps(doc))
    return Results(tmp_path, "res")


def test_the_bench_markdown_has_the_table_each_runs_memory_and_the_verdict():
    runs = [*_data()["runs"], _run(1000, 100_000, 600.0, 410.0, 2460.0, True, rep=1)]
    parts = bench_report(runs).split("\n\n")
    assert parts[0] == rsc.scale_table(runs)
    assert parts[2].splitlines() == [
        "- 100 x 10,000, interpreted, rep 0: 0: 70, 3,600: 100",
        "- 1,000 x 100,000, interpreted, rep 0: 0: 70, 600: 100",
        "- 1,000 x 100,000, interpreted, rep 1: 0: 70, 600: 100"]
    assert parts[3] == rsc.target_line({"runs": runs})


def test_rows_and_target_verdict():
    data = _data()
    lines = rsc.scale_table(data["runs"]).splitlines()
    assert lines[2] == ("| 100 x 10,000 | interpreted | 1 | 3,600 | 300.0 | 299.9 | 12.00 | 12.00 | "
                        "5.0 min | 100.2 | 1,234,567 | 4,115 | 81% | 0.042 / 0.163 |")
    assert lines[3] == ("| 1,000 x 100,000 | interpreted | 1 | 600 | 400.0 | 399.9 | 1.50 | 1.50 | "
                        "40.0 min (extrapolated) | 100.2 | 1,234,567 | 3,086 | 81% | 0.042 / 0.163 |")
    assert rsc.target_line(data) == ("**Target (1,000 × 100,000 × one simulated hour in < 10 "
                                     "min), interpreted: missed** — 40.0 min (extrapolated), "
                                     "4.0× the target (median of 1).")
    assert rsc.target_verdict([_data(600.0)["runs"][1]]) == "met"  # exactly 10 min
    assert rsc.target_verdict([_data(601.0)["runs"][1]]) == "missed"


def test_a_stopped_run_says_so():
    g = [_run(1000, 100_000, 240.0, 900.0, 13_500.0, True, stopped=True)]
    assert rsc.table_row(g)[3] == "240 (stopped)"
    assert rsc.hour_text(g) == "225.0 min (extrapolated)"


def test_repetitions_make_one_row_median_and_range_and_a_disagreement_is_flagged(tmp_path):
    """Three repetitions of 1,000 x 100,000: one row, the times' median (min–max);
    the verdict and the Summary row on the median, not the fastest repetition."""
    walls = [400.0, 380.0, 450.0]  # hours: 40, 38, 45 min
    runs = [_run(1000, 100_000, 600.0, w, w * 6, True, rep=i) for i, w in enumerate(walls)]
    row = rsc.table_row(runs)
    assert row[:3] == ["1,000 x 100,000", "interpreted", "3"]
    assert row[4] == "400.0 (380.0–450.0)"  # wall s
    assert row[8] == "40.0 (38.0–45.0) min (extrapolated)"
    assert row[10] == "1,234,567"  # the same simulation every repetition
    assert rsc.table_row([*runs[:2], runs[2] | {"arrivals": 7}])[10] == "1,234,567 (differs)"
    assert rsc.scale_table(runs).count("| 1,000 x 100,000 |") == 1
    assert rsc.target_line({"runs": runs}).endswith(
        "40.0 (38.0–45.0) min (extrapolated), 4.0× the target (median of 3).")
    row = rsc.SUMMARY_ROWS["simulate-scale"](_results(tmp_path, {"runs": runs}))
    assert row[1].startswith("**1.50 (1.33–1.58) sim-s per wall-s** interpreted, median of 3 "
                             "(an hour ≈ 40.0 (38.0–45.0) min, extrapolated")
    assert row[2] == "< 10 min — missed (4.0×)"


def test_benchmarks_table(tmp_path):
    res = _results(tmp_path, _data(), "scale")
    out = rsc.KINDS["simulate-scale"](res, ["scale"], "old table\n")
    lines = out.splitlines()
    assert lines[0].startswith("*Generated by `python bench/render_benchmarks.py` from "
                               "[`scale.json`](res/scale.json) (commit abc1234, "
                               "2030-01-02T03:04:05Z)")
    assert "32 slots per worker, arrival rates for 80% of the slots busy" in out
    assert "| 1,000 x 100,000 | interpreted | 1 | 600 | 400.0 |" in out
    assert lines[-1].startswith("**Target (1,000 × 100,000 × one simulated hour in < 10 "
                                "min), interpreted: missed**")
    assert "old table" not in out
    with pytest.raises(RenderError, match="one results file"):
        rsc.KINDS["simulate-scale"](res, ["a", "b"], "")


def test_summary_row_missed(tmp_path):
    row = rsc.SUMMARY_ROWS["simulate-scale"](_results(tmp_path, _data()))
    assert row == [
        "§9 fleet simulator: 1,000 workers × 100,000 tenants × 1 simulated hour",
        "**1.50 sim-s per wall-s** interpreted, median of 1 (an hour ≈ 40.0 min, "
        "extrapolated from 600 simulated s); "
        "100 × 10,000: 12.0 (an hour in 5.0 min)",
        "< 10 min — missed (4.0×)",
        "[simulate_scale](res/simulate_scale.md) (abc1234, 2030-01-02)"]


def test_summary_row_met_and_measured(tmp_path):
    data = {"runs": [_run(1000, 100_000, 3600.0, 480.0, 480.0, False)]}
    row = rsc.SUMMARY_ROWS["simulate-scale"](_results(tmp_path, data))
    assert row[1] == ("**7.50 sim-s per wall-s** interpreted, median of 1 (an hour ≈ 8.0 "
                      "min, measured)")  # no 100 x 10k
    assert row[2] == "< 10 min — met"


def test_two_variants_each_get_a_row_and_a_verdict_the_fastest_leads_the_summary(tmp_path):
    # An older file's runs have no "variant": interpreted.
    old = _run(100, 10_000, 3600.0, 300.0, 300.0, False)
    del old["variant"]
    data = {"runs": [old,
                     _run(100, 10_000, 3600.0, 150.0, 150.0, False, variant="compiled"),
                     _run(1000, 100_000, 600.0, 800.0, 4800.0, True, variant="compiled"),
                     _run(1000, 100_000, 600.0, 1600.0, 9600.0, True)]}
    lines = rsc.scale_table(data["runs"]).splitlines()
    assert [line.split(" | ")[1] for line in lines[2:]] == [
        "interpreted", "compiled", "compiled", "interpreted"]
    assert rsc.scale_table(data["runs"]) == bench_report(data["runs"]).split("\n\n")[0]
    verdicts = rsc.target_line(data).split("\n\n")
    assert [v.split("**")[1] for v in verdicts] == [
        "Target (1,000 × 100,000 × one simulated hour in < 10 min), compiled: missed",
        "Target (1,000 × 100,000 × one simulated hour in < 10 min), interpreted: missed"]
    assert "80.0 min (extrapolated), 8.0× the target (median of 1)" in verdicts[0]
    row = rsc.SUMMARY_ROWS["simulate-scale"](_results(tmp_path, data))
    assert row[1] == ("**0.75 sim-s per wall-s** compiled, median of 1 (an hour ≈ 80.0 min, "
                      "extrapolated from 600 simulated s); interpreted: 0.38 (an hour ≈ 160.0 min); "
                      "100 × 10,000: 24.0 (an hour in 2.5 min)")
    assert row[2] == "< 10 min — missed (8.0×)"


def test_a_pool_split_never_leads_the_summary_but_is_listed(tmp_path):
    """`-poolsK` is another fleet (K dispatchers): the headline stays the one-pool
    fleet the target names, even when the split runs faster; the split is listed."""
    runs = [_run(1000, 100_000, 600.0, 800.0, 4800.0, True, variant="compiled"),
            _run(1000, 100_000, 600.0, 400.0, 2400.0, True, variant="compiled-pools2")]
    for r in runs:
        r["pools"] = 2 if r["variant"].endswith("-pools2") else 1
    data = {"runs": runs}
    row = rsc.SUMMARY_ROWS["simulate-scale"](_results(tmp_path, data))
    assert row[1].startswith("**0.75 sim-s per wall-s** compiled, median of 1")
    assert "; compiled-pools2: 1.50 (an hour ≈ 40.0 min)" in row[1]
    assert row[2] == "< 10 min — missed (8.0×)"
    text = rsc.setup_text(data)
    assert "*-poolsK*: the fleet split into K pools" in text
    assert text.endswith("plus each pool process's peak.")
    assert "`Fleet.run` alone" not in text


def test_a_base_commit_never_leads_the_summary_and_is_named(tmp_path):
    """`base-...` rows are the --base commit's simulator, run beside this checkout's to
    measure a change: the headline is this checkout's, even if the base ran faster."""
    data = {"runs": [_run(1000, 100_000, 600.0, 400.0, 2400.0, True, variant="base-compiled"),
                     _run(1000, 100_000, 600.0, 800.0, 4800.0, True, variant="compiled")],
            "base_commit": "abc1234"}
    row = rsc.SUMMARY_ROWS["simulate-scale"](_results(tmp_path, data))
    assert row[1].startswith("**0.75 sim-s per wall-s** compiled, median of 1")
    assert "; base-compiled: 1.50 (an hour ≈ 40.0 min)" in row[1]
    assert "*base-...*: the same variant from commit abc1234 (`--base`)" in rsc.setup_text(data)
    assert "*base-...*" not in rsc.setup_text({"runs": data["runs"]})
    assert bench_report(data["runs"], "abc1234").startswith(
        "*base-...* variants: the simulator of commit abc1234 (`--base`)")


def test_an_alt_interpreter_is_named_and_never_leads_the_summary(tmp_path):
    runs = [_run(1000, 100_000, 600.0, 400.0, 2400.0, True, variant="alt-compiled"),
            _run(1000, 100_000, 600.0, 800.0, 4800.0, True, variant="compiled")]
    for r, (exe, shared) in zip(runs, [("/usr/bin/python3.11", False),
                                       ("/opt/py/bin/python", True)], strict=True):
        r.update(python="3.11.2", python_executable=exe, libpython_shared=shared)
    data = {"runs": runs}
    row = rsc.SUMMARY_ROWS["simulate-scale"](_results(tmp_path, data))
    assert row[1].startswith("**0.75 sim-s per wall-s** compiled, median of 1")
    assert "; alt-compiled: 1.50 (an hour ≈ 40.0 min)" in row[1]
    assert ("*alt-...*: the same variant run by `/usr/bin/python3.11` (Python 3.11.2, the "
            "interpreter linked into the executable), the others by `/opt/py/bin/python` "
            "(Python 3.11.2, its libpython a shared library)") in rsc.setup_text(data)
    assert "*alt-...*" not in rsc.setup_text({"runs": runs[1:]})


def test_base_variants_parse_as_their_variant_and_need_a_commit(monkeypatch):
    from bench import bench_simulate_scale as bss

    assert bss.parse_variant("base-compiled-pools2") == ("compiled", 2)
    assert bss.parse_variant("base-interpreted") == ("interpreted", 1)
    with pytest.raises(SystemExit, match="unknown 'base-fast'"):
        bss.parse_variant("base-fast")
    assert bss.parse_variant("alt-compiled-pools2") == ("compiled", 2)
    with pytest.raises(SystemExit, match="unknown 'alt-base-compiled'"):
        bss.parse_variant("alt-base-compiled")
    monkeypatch.setattr("sys.argv", ["bench_simulate_scale.py", "--variants", "base-compiled"])
    with pytest.raises(SystemExit, match="name the commit with --base"):
        bss.main()
    monkeypatch.setattr("sys.argv", ["bench_simulate_scale.py", "--variants", "alt-compiled"])
    with pytest.raises(SystemExit, match="name the interpreter with --alt-python"):
        bss.main()


def test_missing_target_scale_is_an_error(tmp_path):
    data = {"runs": [_run(100, 10_000, 3600.0, 300.0, 300.0, False)]}
    with pytest.raises(RenderError, match="no 1,000 x 100,000 run"):
        rsc.SUMMARY_ROWS["simulate-scale"](_results(tmp_path, data))
    with pytest.raises(RenderError, match="no runs"):
        rsc.scale_table(rsc.runs_of({"runs": []}))


def test_the_two_pool_row_lists_each_interpreter_and_is_met_only_if_every_one_is(tmp_path):
    def runs(variant: str, python: str, exe: str, hours_s: list[float]) -> dict:
        out = []
        for rep, h in enumerate(hours_s):
            r = _run(1000, 100_000, 3600.0, h, h, False, variant=variant, rep=rep)
            out.append(r | {"pools": 2, "python": python, "python_executable": exe})
        return {"runs": out}

    pyenv, alt = rsc.POOLS_STEMS
    _results(tmp_path, runs("compiled-pools2", "3.11.7", "/py/a", [570.0, 560.0, 590.0]), pyenv)
    res = _results(tmp_path, runs("alt-compiled-pools2", "3.11.2", "/py/b", [540.0]), alt)
    row = rsc.SUMMARY_ROWS["simulate-scale-pools"](res)
    assert row[0].startswith("§9 fleet simulator: the same hour as 2 pools of 500 workers and "
                             "50,000 tenants")
    assert row[1] == ("Python 3.11.7 (`/py/a`): **9.5 (9.3–9.8) min**, the whole hour, median "
                      "of 3; Python 3.11.2 (`/py/b`): **9.0 min**, the whole hour, median of 1")
    assert row[2] == "< 10 min — met (as one pool: missed, row above)"
    assert row[3] == ("[simulate_scale_pools_hour5](res/simulate_scale_pools_hour5.md) (abc1234, "
                      "2030-01-02), [simulate_scale_pools_hour_alt5](res/"
                      "simulate_scale_pools_hour_alt5.md) (abc1234, 2030-01-02)")
    # One interpreter over the line: missed.
    res = _results(tmp_path, runs("alt-compiled-pools2", "3.11.2", "/py/b", [610.0]), alt)
    assert rsc.SUMMARY_ROWS["simulate-scale-pools"](res)[2].startswith("< 10 min — missed")
