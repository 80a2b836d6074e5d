"""`fairlane simulate` end to end on a small workload (virtual time: about a second)."""

from __future__ import annotations

import json

import pytest

from fairlane.cli import main
from fleetsim.cli import cmd_simulate

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

WORKLOAD = """
duration_s: 30
seed: 3
pool: {policy: drr, cost_model: tokens, quantum: 544}
tiers: [{name: paid, engine_priority: 0}, {name: free, engine_priority: 10}]
classes:
  - {name: flood, tier: free, arrival: {process: burst, at_s: 2, count: 1500},
     prompt_tokens: {dist: fixed, value: 32},
     output_tokens: {dist: uniform, min: 128, max: 384}, max_tokens: 384}
  - {name: vip, tier: paid, arrival: {process: poisson, rate_per_s: 5},
     prompt_tokens: {dist: fixed, value: 32},
     output_tokens: {dist: uniform, min: 16, max: 48}, max_tokens: 48}
"""


def run(tmp_path, *extra: str) -> dict:
    wl = tmp_path / "wl.yaml"
    wl.write_text(WORKLOAD)
    out = tmp_path / ("out" + "".join(extra).replace("-", "_"))
    rc = cmd_simulate([str(wl), "--workers", "2", "--max-num-seqs", "32",
                       "--out", str(out), "--no-plots", *extra])
    assert rc == 0
    assert (out / "simulate.md").read_text().startswith("# fairlane simulate")
    return json.loads((out / "simulate.json").read_text())


def test_simulate_writes_a_report_and_preemption_serves_the_paid_tier(tmp_path):
    on = run(tmp_path)
    off = run(tmp_path, "--no-preemption")
    assert on["meta"]["preemption"] == "on" and off["meta"]["preemption"] == "off"
    assert on["meta"]["preemptions_ordered"] > 0 and off["meta"]["preemptions_ordered"] == 0
    # Each order came from a decision, which weighed at least the waiter and its victim.
    decisions = on["meta"]["preemption_decisions"]
    assert 0 < decisions and on["meta"]["preemption_tenants_weighed"] >= 2 * decisions
    assert off["meta"]["preemption_decisions"] == 0

    def ttft_p90(doc: dict) -> float:
        return doc["summary"]["by_tier"]["paid"]["ttft_s"]["p90"]

    assert ttft_p90(on) < ttft_p90(off) / 2


def test_time_dispatcher_reports_the_cores_cpu_and_changes_nothing(tmp_path):
    """--time-dispatcher: the time spent in the dispatcher's core, per entry point, with
    every request's submit counted once; the simulation itself is the same."""
    plain = run(tmp_path)
    timed = run(tmp_path, "--time-dispatcher")
    assert timed["summary"] == plain["summary"]
    meta = timed["meta"]
    assert "dispatcher_core_s" not in plain["meta"]
    assert 0 < meta["dispatcher_core_s"] <= meta["wall_s"]
    assert meta["dispatcher_core_pct_of_a_core"] == pytest.approx(
        100 * meta["dispatcher_core_s"] / meta["simulated_s"], rel=0.01, abs=0.01)
    assert meta["dispatcher_core_us_per_request"] == pytest.approx(
        meta["dispatcher_core_s"] / meta["arrivals"] * 1e6, rel=0.01, abs=0.1)
    assert "submit" in meta["dispatcher_core_by_call"]
    assert f"({meta['arrivals']:,} calls)" in meta["dispatcher_core_by_call"]


def test_the_core_clock_counts_nested_entry_points_once():
    from fleetsim.core_clock import CoreClock

    class Core:
        def submit(self, x):
            return self.select(x) + 1  # an entry point calling another

        def select(self, x):
            return x

    core = Core()
    for name in ("on_pull", "on_started", "on_finished", "on_preempted", "on_heartbeat",
                 "on_handed_back", "on_start_checked", "on_cancel", "tick", "preemptions"):
        setattr(core, name, lambda *a: None)
    clock = CoreClock(core)
    assert core.submit(1) == 2 and core.select(5) == 5
    assert clock.calls["submit"] == 1 and clock.calls["select"] == 1  # not 2
    assert clock.total_s == clock.seconds["submit"] + clock.seconds["select"] > 0


def test_bad_input_is_a_clear_error(tmp_path, capsys):
    assert cmd_simulate([]) == 2
    assert "workload file or --usage" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("duration_s: 10\nclasses: [{name: x, arrival: {process: nope}}]\n")
    assert cmd_simulate([str(bad), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.startswith("fairlane simulate:")
    assert cmd_simulate([str(tmp_path / "missing.yaml")]) == 2


@pytest.mark.parametrize(("flags", "message"), [
    (["--workers", "0"], "--workers: must be >= 1, got 0"),
    (["--max-num-seqs", "0"], "--max-num-seqs: must be >= 1, got 0"),
    (["--prefetch-seqs", "-1"], "--prefetch-seqs: must be >= 0, got -1"),
    (["--max-model-len", "1"], "--max-model-len: must be >= 2, got 1"),
    # Negative or NaN latency would break virtual time's order; NaN silently (every
    # comparison false: nothing after the first event ever ran).
    (["--network-ms", "-5"], "--network-ms: must be a finite number >= 0, got -5.0"),
    (["--network-ms", "nan"], "--network-ms: must be a finite number >= 0, got nan"),
    (["--network-ms", "inf"], "--network-ms: must be a finite number >= 0, got inf"),
    # 0 used to mean "the workload's duration" (`or`): refused, not reinterpreted.
    (["--duration-s", "0"], "--duration-s must be a finite number > 0, got 0"),
    (["--duration-s", "inf"], "--duration-s must be a finite number > 0, got inf"),
    (["--duration-s", "nan"], "--duration-s must be a finite number > 0, got nan"),
    (["--window-s", "inf"], "--window-s must be a finite number > 0, got inf"),
    (["--window-s", "-1"], "--window-s must be a finite number > 0, got -1"),
    # 30 s in 10-us windows: 3,000,000 window rows (an hour would be 19 GB).
    (["--window-s", "0.00001"], "is 3,000,000 windows, more than 100,000: use a window of "
                                "at least 0.000301 s (--window-s)"),
    # Refused before the compiled copy is built (no child process, no compiler).
    (["--compiled", "--max-num-seqs", "0"], "--max-num-seqs: must be >= 1, got 0"),
    # The dispatcher runs the interpreted core: a compiled one's time would understate it.
    (["--compiled", "--time-dispatcher"], "cannot be used with --compiled"),
])
def test_bad_flags_are_refused_before_anything_runs(tmp_path, capsys, flags, message):
    wl = tmp_path / "wl.yaml"
    wl.write_text(WORKLOAD)
    out = tmp_path / "o"
    assert cmd_simulate([str(wl), "--out", str(out), "--no-plots", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fairlane simulate: ") and message in err, err
    assert not out.exists()


def test_an_out_dir_that_cannot_be_written_is_refused_before_the_run(tmp_path, capsys):
    wl = tmp_path / "wl.yaml"
    wl.write_text(WORKLOAD)
    a_file = tmp_path / "taken"
    a_file.write_text("not a directory")
    assert cmd_simulate([str(wl), "--out", str(a_file), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert f"--out {a_file}: cannot write the report there" in err
    assert "simulated" not in err  # refused before the run, not after it
    assert cmd_simulate([str(wl), "--out", str(a_file / "below"), "--no-plots"]) == 2


def test_more_detail_tenants_than_the_report_holds_are_refused(tmp_path, capsys):
    wl = tmp_path / "wl.yaml"
    wl.write_text(WORKLOAD)
    names = ",".join(["flood-0", "vip-0"] * 10 + [f"nobody-{i}" for i in range(70)])
    assert cmd_simulate([str(wl), "--out", str(tmp_path / "o"), "--detail-tenants",
                         names]) == 2
    assert "72 detail tenants named, at most 64" in capsys.readouterr().err


def test_the_fairlane_command_runs_it(tmp_path):
    """`fairlane simulate` runs `python -m fleetsim` (the kernel imports no process
    package, and the simulator runs two of them)."""
    wl = tmp_path / "wl.yaml"
    wl.write_text(WORKLOAD)
    assert main(["simulate", str(wl), "--duration-s", "5", "--out", str(tmp_path / "o"),
                 "--no-plots"]) == 0
    assert (tmp_path / "o" / "simulate.json").is_file()
    assert main(["simulate", "--workers", "0", str(wl)]) == 2
