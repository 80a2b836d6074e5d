"""A fleet split into pools (`fairlane simulate --pools`, fleetsim.pools): the split,
one result whatever the number of processes, and a pool's process that fails or dies
is an error, never a wait."""

from __future__ import annotations

import json
import os

import pytest

from fleetsim.cli import cmd_simulate
from fleetsim.fleet import FleetSettings
from fleetsim.pools import Job, PoolFailed, pool_of, run_pools, split_workers
from fleetsim.workload import workload_from_dict
from gpu_worker.sim.step_model import StepModelError

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

WORKLOAD = {
    "duration_s": 20, "seed": 4,
    "pool": {"policy": "drr", "cost_model": "tokens", "quantum": 544},
    "tiers": [{"name": "paid", "engine_priority": 0}, {"name": "free", "engine_priority": 10}],
    "classes": [
        {"name": "flood", "tier": "free", "count": 3,
         "arrival": {"process": "burst", "at_s": 1, "count": 600},
         "prompt_tokens": {"dist": "fixed", "value": 32},
         "output_tokens": {"dist": "uniform", "min": 64, "max": 256}, "max_tokens": 256},
        {"name": "vip", "tier": "paid", "count": 4,
         "arrival": {"process": "poisson", "rate_per_s": 3},
         "prompt_tokens": {"dist": "uniform", "min": 16, "max": 128},
         "output_tokens": {"dist": "uniform", "min": 16, "max": 64}, "max_tokens": 64},
    ]}


class NoStop:
    requested = False


def job(num_pools: int, workers: int = 5, **kw) -> Job:
    wl = workload_from_dict(json.loads(json.dumps(WORKLOAD)))
    return Job(workload=wl, config=wl.scheduler_config,
               settings=FleetSettings(num_workers=workers, max_num_seqs=8, **kw),
               duration_s=wl.duration_s, num_pools=num_pools, detail_tenants=["vip-1"])


def test_workers_and_tenants_are_spread_evenly():
    assert split_workers(10, 3) == [4, 3, 3] and split_workers(4, 4) == [1, 1, 1, 1]
    assert split_workers(1000, 1) == [1000]
    for bad in (0, 6):
        with pytest.raises(ValueError, match="--pools must be between 1 and"):
            split_workers(5, bad)
    assert [pool_of(t, 3) for t in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_one_result_whatever_the_number_of_processes():
    """Pools in 2 processes, or one after another in this one: the same report; each
    request went to its tenant's pool, and every arrival of a one-pool run is in one."""
    together = run_pools(job(1), 1, NoStop())
    apart = run_pools(job(2), 2, NoStop())
    here = run_pools(job(2), 1, NoStop())
    assert together is not None and apart is not None and here is not None
    assert apart.recorder.summary() == here.recorder.summary()
    assert [r.workers for r in apart.pools] == [3, 2]
    assert [r.tenants for r in apart.pools] == [4, 3]
    assert sum(r.arrivals for r in apart.pools) == together.pools[0].arrivals
    s = apart.recorder.summary()
    assert s["pool"]["finished"] == sum(r["finished"] for r in apart.rows) > 0
    assert s["pool"]["preemptions"] == sum(r["preemptions"] for r in apart.rows)
    assert "vip-1" in s["detail_tenants"]  # named: its pool's recorder held it
    # Split pools are a different fleet: the same requests, other latencies.
    assert s["pool"]["ttft_s"] != together.recorder.summary()["pool"]["ttft_s"]


def test_a_pool_that_raises_is_an_error_naming_it():
    """(The command checks its flags first; this is what reaches a pool anyway.) In
    this process the exception itself; from a pool's process, its traceback."""
    bad = job(2, step_model="no-such-step-model")
    with pytest.raises(StepModelError, match="no-such-step-model"):
        run_pools(bad, 1, NoStop())
    with pytest.raises(PoolFailed, match=r"(?s)pool 0 failed:.*StepModelError: cannot read "
                                         r"step model 'no-such-step-model'"):
        run_pools(bad, 2, NoStop())


def test_a_pool_whose_process_dies_is_an_error_not_a_wait(monkeypatch):
    import fleetsim.pools

    def die(*_args, **_kw):
        os._exit(7)  # as the OOM killer would: no reply

    monkeypatch.setattr(fleetsim.pools, "run_pool", die)
    with pytest.raises(PoolFailed, match=r"pool \d's process died \(exit status 7\)"):
        run_pools(job(2), 2, NoStop())


def test_a_stop_ends_every_pool_at_the_same_second():
    class StopSoon:
        requested = False

    stop = StopSoon()

    def on_progress(t_s: float, _wall_s: float) -> None:
        if t_s >= 3:
            stop.requested = True

    for jobs in (1, 2):
        stop.requested = False
        long = job(2)
        long.duration_s = 100_000.0  # ends when stopped (the test's timeout otherwise)
        out = run_pools(long, jobs, stop, on_progress)
        assert out is not None and out.stopped
        ends = {r.end_ms for r in out.pools}
        assert len(ends) == 1 and 3 < out.simulated_s == ends.pop() / 1000 < 100_000
        assert out.simulated_s == int(out.simulated_s)  # a whole simulated second
        assert out.recorder.duration_s == out.simulated_s


def test_the_command_reports_each_pool(tmp_path, capsys):
    wl = tmp_path / "wl.yaml"
    wl.write_text(json.dumps(WORKLOAD))
    out = tmp_path / "o"
    assert cmd_simulate([str(wl), "--workers", "4", "--pools", "2", "--out", str(out),
                         "--no-plots"]) == 0
    assert "4 workers in 2 pools (2 processes)" in capsys.readouterr().err
    doc = json.loads((out / "simulate.json").read_text())
    assert doc["meta"]["pools"] == 2 and len(doc["summary"]["pools"]) == 2
    assert "## Per pool" in (out / "simulate.md").read_text()


@pytest.mark.parametrize(("flags", "message"), [
    (["--pools", "0"], "--pools and --jobs must be >= 1"),
    (["--pools", "2", "--jobs", "0"], "--pools and --jobs must be >= 1"),
    (["--pools", "5"], "--pools 5: more pools than --workers (4)"),
    (["--pools", "2", "--time-dispatcher"], "needs --jobs 1"),
])
def test_bad_pool_flags_are_refused_before_anything_runs(tmp_path, capsys, flags, message):
    wl = tmp_path / "wl.yaml"
    wl.write_text(json.dumps(WORKLOAD))
    out = tmp_path / "o"
    assert cmd_simulate([str(wl), "--workers", "4", "--out", str(out), "--no-plots",
                         *flags]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_time_dispatcher_times_each_pools_core(tmp_path):
    wl = tmp_path / "wl.yaml"
    wl.write_text(json.dumps(WORKLOAD))
    out = tmp_path / "o"
    assert cmd_simulate([str(wl), "--workers", "4", "--pools", "2", "--jobs", "1",
                         "--time-dispatcher", "--out", str(out), "--no-plots"]) == 0
    rows = json.loads((out / "simulate.json").read_text())["summary"]["pools"]
    assert all(r["dispatcher_core_pct_of_a_core"] > 0 for r in rows)
