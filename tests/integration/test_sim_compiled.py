"""`fairlane simulate --compiled`: mypyc builds the simulator's modules (a real compiler
run, into a fresh cache) and the compiled run gives the interpreted run's result, for
each policy, with preemption and a quota-blocked tenant in play; and Ctrl-C ends a run,
compiled or not, with the report of what ran."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

# Three tiers, a flood that preemption takes slots from, a tenant capped by
# max_concurrent (quota-blocked: parked by DRR/VTC, skipped by fifo), every arrival
# process and most length distributions: every module the build compiles has work.
WORKLOAD = """
duration_s: 40
seed: 7
pool: {policy: drr, cost_model: tokens, quantum: 544}
tiers:
  - {name: ent, floor_share: 0.5, engine_priority: 0}
  - {name: pro, floor_share: 0.2, aging_ms: 5000, engine_priority: 5}
  - {name: free, aging_ms: 10000, engine_priority: 10}
classes:
  - {name: flood, tier: free, arrival: {process: burst, at_s: 2, count: 900},
     prompt_tokens: {dist: fixed, value: 32},
     output_tokens: {dist: uniform, min: 128, max: 384}, max_tokens: 384}
  - {name: vip, tier: ent, count: 3, weight: 4, arrival: {process: poisson, rate_per_s: 4},
     prompt_tokens: {dist: uniform, min: 16, max: 200},
     output_tokens: {dist: uniform, min: 16, max: 96}, max_tokens: 128}
  - {name: capped, tier: pro, max_concurrent: 2,
     arrival: {process: on_off, rate_per_s: 30, on_s: 3, off_s: 4},
     prompt_tokens: {dist: fixed, value: 64},
     output_tokens: {dist: uniform, min: 64, max: 256}, max_tokens: 256}
  - {name: day, tier: free, count: 20,
     arrival: {process: diurnal, rate_per_s: 0.1, amplitude: 0.5, period_s: 20,
               phase_spread_s: 10},
     prompt_tokens: {dist: lognormal, mean: 64, sigma: 0.5, max: 400},
     output_tokens: {dist: choice, values: [16, 64], weights: [3, 1]}, max_tokens: 64}
"""


def simulate(workload: Path, out: Path, env: dict[str, str], *extra: str) -> dict:
    cmd = [sys.executable, "-m", "fleetsim", str(workload), "--workers", "3",
           "--max-num-seqs", "16", "--out", str(out), "--no-plots", *extra]
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:]
    return json.loads((out / "simulate.json").read_text())


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> dict[str, str]:
    """A fresh, private build cache: this test builds with the compiler."""
    return {**os.environ, "FAIRLANE_CACHE_DIR": str(tmp_path_factory.mktemp("mypyc-cache"))}


@pytest.mark.parametrize("policy", ["drr", "vtc", "fifo"])
def test_compiled_run_gives_the_interpreted_result(tmp_path, cache, policy):
    wl = tmp_path / "wl.yaml"
    wl.write_text(WORKLOAD)
    plain = simulate(wl, tmp_path / "plain", cache, "--policy", policy)
    fast = simulate(wl, tmp_path / "fast", cache, "--policy", policy, "--compiled")
    assert plain["meta"]["compiled"] is False and fast["meta"]["compiled"] is True
    # The run did something worth comparing: work finished, and (fair policies)
    # preemption took slots from the flood.
    assert plain["summary"]["pool"]["finished"] > 500
    if policy != "fifo":
        assert plain["meta"]["preemptions_ordered"] > 0
    assert fast["summary"] == plain["summary"]
    for key in ("arrivals", "events", "preemptions_ordered", "recomputed_tokens",
                "preemption_decisions", "preemption_tenants_weighed"):
        assert fast["meta"][key] == plain["meta"][key], key
    # Built once, into the private cache, and reused by the next policy's run.
    built = list((Path(cache["FAIRLANE_CACHE_DIR"]) / "mypyc").iterdir())
    assert len(built) == 1 and (built[0] / "fleetsim").is_dir()
    assert any((built[0] / "fleetsim").glob("fleet.*.so"))
    # Compiled, the event queue is fleetsim.events' own heap (interpreted, heapq's).
    probe = subprocess.run(
        [sys.executable, "-c",
         "import fleetsim.events as e; print(type(e.event_heap()).__name__, e.__file__)"],
        env={**cache, "PYTHONPATH": str(built[0])}, cwd=tmp_path, stdout=subprocess.PIPE,
        text=True, timeout=60, check=True)
    assert probe.stdout.startswith(f"EventHeap {built[0]}"), probe.stdout


@pytest.mark.parametrize("old, new, message", [
    ("rate_per_s: 4}", "}", "classes[1].arrival.rate_per_s: required"),
    ("process: on_off,", "process: onoff,", "classes[2].arrival.process: unknown process 'onoff'"),
    ("lognormal, mean: 64,", "lognormal, mean: -1,", "classes[3].prompt_tokens.mean: must be > 0"),
])
def test_a_bad_workload_gets_the_same_answer_compiled(tmp_path, cache, old, new, message):
    """The workload's fields are checked by compiled code too (processes.py): a missing,
    unknown or out-of-range one is refused with the interpreted run's message."""
    assert old in WORKLOAD
    wl = tmp_path / "bad.yaml"
    wl.write_text(WORKLOAD.replace(old, new, 1))
    outs = []
    for extra in ((), ("--compiled",)):
        cmd = [sys.executable, "-m", "fleetsim", str(wl), "--workers", "1", "--out",
               str(tmp_path / "out"), "--no-plots", *extra]
        done = subprocess.run(cmd, env=cache, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=600, check=False)
        outs.append((done.returncode, done.stdout))
    (plain_rc, plain_out), (fast_rc, fast_out) = outs
    assert plain_rc == fast_rc == 2, outs
    assert message in plain_out and message in fast_out, outs
    assert not (tmp_path / "out" / "simulate.json").exists()


@pytest.mark.parametrize("extra", [(), ("--compiled",), ("--pools", "2"),
                                   ("--compiled", "--pools", "2")],
                         ids=["interpreted", "compiled", "pools", "compiled-pools"])
def test_ctrl_c_ends_the_run_and_writes_the_report_of_what_ran(tmp_path, cache, extra):
    """SIGINT to the whole process group, as a terminal's Ctrl-C: `fairlane`, the
    `--compiled` parent and the simulating child all get it (with `--pools`, every
    pool's process too). The run ends at the next simulated second (every pool at the
    same one) and its report covers what ran; exit status 130."""
    wl = tmp_path / "long.yaml"
    wl.write_text(WORKLOAD.replace("duration_s: 40", "duration_s: 200000", 1))
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fairlane.cli", "simulate", str(wl), "--workers", "3",
         "--max-num-seqs", "16", "--window-s", "100", "--out", str(out), "--no-plots", *extra],
        env=cache, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        seen = []
        for line in proc.stderr:  # ends at EOF if the run dies first
            seen.append(line)
            # (with pools, their mean: a progress line at or past 60 s)
            reached = re.match(r"\s+simulated ([\d,.]+) s in", line)
            if reached and float(reached[1].replace(",", "")) >= 60:
                break
        assert proc.poll() is None, "".join(seen)
        os.killpg(proc.pid, signal.SIGINT)
        rest = proc.communicate(timeout=120)[1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, "".join(seen) + rest
    assert "interrupted: stopping at the next simulated second" in rest
    doc = json.loads((out / "simulate.json").read_text())
    simulated_s = doc["meta"]["simulated_s"]
    assert 60 <= simulated_s < 200_000 and doc["meta"]["compiled"] == ("--compiled" in extra)
    assert doc["meta"]["stopped_early"].startswith(f"interrupted at {simulated_s:g} of 200000")
    # Rates and windows over what ran, not over the 200,000 s asked for.
    summary = doc["summary"]
    assert summary["duration_s"] == simulated_s and summary["pool"]["finished"] > 500
    assert len(summary["windows"]["start_s"]) == -(-simulated_s // 100)
    if "--pools" in extra:
        assert [r["workers"] for r in summary["pools"]] == [2, 1]
        assert sum(r["finished"] for r in summary["pools"]) == summary["pool"]["finished"]
