"""bench/capacity_plan.py's answer rule and warm-up filter, its workload, and
bench/render_capacity.py on a small hand-made results file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import capacity_plan as cp
from bench import render_capacity as rc
from bench.render_common import RenderError, Results
from fleetsim.workload import load_workload

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


# --- the answer rule ---------------------------------------------------------------------------


def test_every_seed_is_stricter_than_the_median():
    tails = {10: [3.0, 4.0, 5.0], 12: [1.5, 2.5, 1.8], 16: [1.0, 1.2, 1.1]}
    assert cp.smallest_meeting(tails, 2.0, every_seed=True) == 16  # 12 misses in one seed
    assert cp.smallest_meeting(tails, 2.0, every_seed=False) == 12  # median 1.8


def test_the_target_itself_meets_it():
    assert cp.smallest_meeting({8: [2.0, 2.0], 12: [1.0, 1.0]}, 2.0) == 8


def test_none_when_no_count_meets_it():
    tails = {8: [9.0, 8.0], 16: [3.0, 2.5], 32: [2.1, 1.0]}
    assert cp.smallest_meeting(tails, 2.0, every_seed=True) is None
    assert cp.smallest_meeting(tails, 2.0, every_seed=False) is not None  # median 1.55
    assert cp.smallest_meeting({32: [2.1, 2.2]}, 2.0, every_seed=False) is None
    assert cp.smallest_meeting({}, 2.0) is None


def test_a_count_that_meets_below_one_that_misses_is_not_the_answer():
    tails = {8: [1.0], 12: [3.0], 16: [1.0], 20: [0.5]}
    assert cp.smallest_meeting(tails, 2.0) == 16


def test_a_seed_without_a_value_does_not_meet():
    assert not cp.meets([1.0, None], 2.0, every_seed=True)
    assert not cp.meets([1.0, None, 1.0], 2.0, every_seed=False)
    assert not cp.meets([], 2.0, every_seed=True)


def test_the_tail_is_the_max_where_there_was_no_p99():
    assert cp.tail_s({"ttft_p99_s": 1.5, "ttft_max_s": 9.0}) == 1.5
    assert cp.tail_s({"ttft_p99_s": None, "ttft_max_s": 9.0}) == 9.0
    assert cp.tail_s({"ttft_p99_s": None, "ttft_max_s": None}) is None


# --- the warm-up filter --------------------------------------------------------------------------


class _Sink:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __getattr__(self, name: str):
        return lambda *args: self.calls.append((name, *args))


def test_requests_arriving_in_the_warm_up_are_left_out():
    inner = _Sink()
    s = cp.AfterWarmup(inner, warmup_s=10.0)
    s.on_first_token(0, 12.0, 3.0)  # arrived at 9 s: out
    s.on_first_token(1, 12.0, 2.0)  # arrived at 10 s: in
    s.on_finished(0, 20.0, 11.0, 3.0, 100, 0)  # arrived at 9 s: out
    s.on_finished(1, 20.0, 10.0, 2.0, 100, 0)  # arrived at 10 s: in
    s.on_rejected(2, 9.9, "queue_full")
    s.on_rejected(3, 10.0, "queue_full")
    s.on_preempted(4, 5.0)
    s.on_preempted(5, 11.0)
    s.on_recomputed(4, 9.0, 10)
    s.on_recomputed(5, 12.0, 10)
    s.on_tokens(6, 0.0, 1.0, 5)  # windows pass whole: run_one skips the early ones
    s.sample(1.0, [0], 0, 0)
    assert [c[:2] for c in inner.calls] == [
        ("on_first_token", 1), ("on_finished", 1), ("on_rejected", 3), ("on_preempted", 5),
        ("on_recomputed", 5), ("on_tokens", 6), ("sample", 1.0)]


# --- the workload --------------------------------------------------------------------------------


def test_capacity_mix_loads_with_two_tiers():
    wl = load_workload(ROOT / "bench" / "workloads" / "capacity_mix.yaml")
    assert wl.tenants.tiers == ["enterprise", "free"]
    per_tier = [wl.tenants.tier_of.count(i) for i in range(2)]
    assert 10 <= per_tier[0] < 100 and per_tier[1] >= 2000
    cfg = wl.scheduler_config
    assert cfg.cost_model == "tokens" and cfg.preemption.enabled
    assert cfg.tiers[0].floor_share > cfg.tiers[1].floor_share
    # Paid is a minority of the traffic: the answer is not simply "the whole fleet".
    paid_per_s = sum(c.process.expected(c.num_tenants, wl.duration_s) for c in wl.classes
                     if wl.tenants.tier_of[c.first_tenant] == 0) / wl.duration_s
    assert 20 < paid_per_s < 0.6 * wl.expected_requests() / wl.duration_s


def test_one_small_run_reports_every_figure(tmp_path):
    mix = tmp_path / "mix.yaml"
    mix.write_text(
        "duration_s: 20\nseed: 1\npool: {policy: drr, cost_model: tokens, quantum: 512}\n"
        "tiers: [{name: paid, floor_share: 0.5}, {name: free}]\nclasses:\n"
        "  - {name: p, count: 2, tier: paid, arrival: {process: poisson, rate_per_s: 4},\n"
        "     prompt_tokens: {dist: fixed, value: 64}, output_tokens: {dist: fixed, value: 32}}\n"
        "  - {name: f, count: 20, tier: free, arrival: {process: poisson, rate_per_s: 0.5},\n"
        "     prompt_tokens: {dist: fixed, value: 64}, output_tokens: {dist: fixed, value: 32}}\n")
    point = cp.Point(2, "on", 1, str(mix), 20.0, 5.0, 8, "default")
    run = cp.run_one(point)
    whole = cp.run_one(cp.Point(2, "off", 1, str(mix), 20.0, 0.0, 8, "default"))
    paid = run["tiers"]["paid"]
    assert 0 < paid["ttft_n"] < whole["tiers"]["paid"]["ttft_n"] < run["arrivals"]
    assert paid["ttft_p99_s"] is None and paid["ttft_max_s"] > 0  # < 200 samples
    assert run["throughput_tok_s"] > 0 and 0 < run["busy_fraction"] <= 1
    assert run["rejected"] == 0 and run["preemptions_per_s"] >= 0


def test_quick_and_full_defaults():
    q = cp.parse_args(["--quick"])
    assert q.seeds == 2 and q.duration_s == 60.0 and q.worker_counts == [10, 16, 32]
    full = cp.parse_args(["--workers", "24,8,16,8"])
    assert full.worker_counts == [8, 16, 24] and full.seeds == 5 and full.duration_s is None


# --- the renderer --------------------------------------------------------------------------------


def _run(workers: int, pre: str, seed: int, paid_p99: float | None, free_p99: float,
         paid_max: float = 5.0) -> dict:
    def tier(p50: float, p99: float | None, mx: float) -> dict:
        return {"ttft_n": 500 if p99 is not None else 50, "ttft_p50_s": p50,
                "ttft_p99_s": p99, "ttft_max_s": mx}
    return {"workers": workers, "preemption": pre, "seed": seed, "wall_s": 1.0,
            "tiers": {"gold": tier(0.1, paid_p99, paid_max), "free": tier(1.0, free_p99, 90.0)},
            "throughput_tok_s": 1000.0 * workers, "preemptions_per_s": 2.0 if pre == "on" else 0.0,
            "rejected": 0, "busy_fraction": 0.5}


def _doc(runs: list[dict]) -> dict:
    return {"meta": {"command": "python bench/capacity_plan.py", "commit": "abc1234",
                     "date_utc": "2030-01-02T03:04:05Z", "machine": "test"},
            "data": {"workload": "mix.yaml", "paid_tier": "gold", "free_tier": "free",
                     "target_s": 2.0, "workers": [8, 16], "seeds": 2, "slots": 32,
                     "duration_s": 240.0, "warmup_s": 30.0, "runs": runs}}


def _results(tmp_path: Path, runs: list[dict]) -> Results:
    (tmp_path / f"{rc.STEM}.json").write_text(json.dumps(_doc(runs)))
    return Results(tmp_path, "res")


def test_the_table_from_a_synthetic_sweep(tmp_path):
    runs = [_run(8, "on", 1, 1.5, 50.0), _run(8, "on", 2, 2.5, 60.0),   # median only
            _run(16, "on", 1, 0.5, 5.0), _run(16, "on", 2, 0.7, 7.0),   # meets
            _run(8, "off", 1, 3.0, 40.0), _run(8, "off", 2, 4.0, 45.0),
            _run(16, "off", 1, None, 6.0, paid_max=1.9), _run(16, "off", 2, 0.9, 6.0)]
    out = rc.capacity_table(_results(tmp_path, runs), [rc.STEM], "")
    assert "[`capacity_plan.json`](res/capacity_plan.json) (commit abc1234, 2030-01-02T03:04:05Z)" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "workers" not in line]
    assert [r.split(" | ")[:2] for r in rows] == [["| 8", "on"], ["| 16", "on"], ["| 8", "off"],
                                                 ["| 16", "off"]]
    assert rows[0] == ("| 8 | on | 0.10 (0.10–0.10) | 2.00 (1.50–2.50) | 55.0 (50.0–60.0) "
                       "| 8,000 (8,000–8,000) | 2.0 (2.0–2.0) | median only |")
    assert "| 0.60 (0.50–0.70) | 6.00 (5.00–7.00) |" in rows[1] and rows[1].endswith("| yes |")
    assert rows[2].endswith("| no |")
    # One run had < 200 paid samples: its max (1.9 s) stands in, and the cell says so.
    assert "| max=1.40 (0.90–1.90) | 6.00 (6.00–6.00) |" in rows[3]
    assert rows[3].endswith("| yes |")
    assert ("preemption on: **16** workers (by the median over seeds: 8); "
            "preemption off: **16** workers (by the median over seeds: 16).") in out


def test_the_summary_row_says_when_no_count_meets_the_target(tmp_path):
    runs = [_run(8, "on", 1, 5.0, 50.0), _run(16, "on", 1, 0.5, 5.0),
            _run(8, "off", 1, 5.0, 50.0), _run(16, "off", 1, 2.5, 5.0)]
    claim, measured, target, file = rc.summary_capacity(_results(tmp_path, runs))
    assert "gold TTFT p99 ≤ 2 s" in claim and "`mix.yaml`" in claim
    assert measured == ("preemption on: **16** workers (gold p99 0.50 s, free p99 5.00 s "
                        "there); preemption off: **none up to 16** workers")
    assert target == "p99 ≤ 2 s in every seed — **not met in the sweep**"
    assert file == "[capacity_plan](res/capacity_plan.md) (abc1234, 2030-01-02)"


def test_the_renderer_refuses_an_empty_results_file(tmp_path):
    with pytest.raises(RenderError, match="no runs"):
        rc.capacity_table(_results(tmp_path, []), [rc.STEM], "")
    with pytest.raises(RenderError, match="one results file"):
        rc.capacity_table(_results(tmp_path, []), [], "")


@pytest.mark.parametrize(("argv", "message"), [
    (["--workers", "8,abc"], "--workers: comma-separated whole numbers, got '8,abc'"),
    (["--workers", "0,8"], "--workers needs counts >= 1"),
    (["--slots", "0"], "--slots must be >= 1, got 0"),
    (["--duration-s", "0"], "--duration-s must be a finite number > 0, got 0"),
    (["--duration-s", "nan"], "--duration-s must be a finite number > 0, got nan"),
    (["--target-s", "-1"], "--target-s must be a finite number > 0, got -1"),
])
def test_bad_flags_are_refused_by_the_parser(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cp.parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["--workload", "/nonexistent/mix.yaml"], "cannot read"),
    (["--step-model", "no-such-model"], "cannot read step model 'no-such-model'"),
    (["--paid-tier", "gold"], "--paid-tier / --free-tier must be among"),
])
def test_bad_inputs_stop_the_sweep_before_any_run(argv, message, tmp_path):
    """Said once, up front, not as a traceback in each of the sweep's child processes."""
    with pytest.raises(SystemExit) as exc:
        cp.main(["--workers", "2", "--seeds", "1", "--out-dir", str(tmp_path / "o"), *argv])
    assert message in str(exc.value.code)
    assert not (tmp_path / "o" / "capacity_plan.json").exists()
