"""A fleet split into pools, each simulated in its own process (`--pools K --jobs J`).

A dispatcher schedules one pool on one core; at ~1,000 workers its scheduling core
alone needs most of that core (BENCHMARKS §9, `--time-dispatcher`), so the README says
to split a fleet that size into several pools. `--pools K` simulates that deployment:

- tenant i (the workload's tenant order, class by class) is in pool i mod K, so every
  traffic class is spread evenly over the pools (as a tenants file's `pools:` entries
  would place them);
- the workers are split as evenly (the first `workers mod K` pools get one more);
- each pool is the workload's pool section, its own `PoolCore` over its own workers,
  fed the workload's arrivals for its tenants: the same arrivals a one-pool run of the
  same seed gets, each one going to its tenant's pool.

Pools share nothing (no work moves between them), so they run side by side in `J`
processes (fork: the children inherit the loaded workload and, under `--compiled`,
the compiled modules) and their recorders are merged into one report
(`fleetsim.merge`), with a row per pool. The result does not depend on `J`.

Ctrl-C: the first one ends every pool at the same simulated second (the furthest
pool's, `Shared`) and the report covers [0, that second); a second one stops at once.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
import resource
import signal
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing import connection as mp_connection
from multiprocessing.connection import Connection
from typing import Any, Protocol

from fleetsim.merge import merge_recorders
from fleetsim.recorder import Recorder
from fleetsim.records import Arrival, StopRun
from fleetsim.state import FleetSettings

POLL_S = 0.25  # how often the parent looks at its pools' progress
PARK_POLL_S = 0.005  # how often a parked pool looks for the second to stop at


def split_workers(num_workers: int, num_pools: int) -> list[int]:
    """Workers per pool: as even as can be, the first pools one more."""
    if not 1 <= num_pools <= num_workers:
        raise ValueError(f"--pools must be between 1 and the number of workers "
                         f"({num_workers}), got {num_pools}")
    base, extra = divmod(num_workers, num_pools)
    return [base + (p < extra) for p in range(num_pools)]


def pool_of(tenant: int, num_pools: int) -> int:
    return tenant % num_pools


def pool_arrivals(arrivals: Iterator[Arrival], pool: int, num_pools: int) -> Iterator[Arrival]:
    """The arrivals of `pool`'s tenants, in the same order."""
    if num_pools == 1:
        return arrivals
    return (a for a in arrivals if a.tenant % num_pools == pool)


@dataclass
class Job:
    """One simulation: a workload, its scheduler config and the fleet's settings, what
    the recorders are made with, and how it is split."""

    workload: Any  # fleetsim.workload.Workload
    config: Any  # fairlane.poolconfig.SchedulerConfig
    settings: FleetSettings
    duration_s: float
    window_s: float = 10.0
    detail_tenants: Sequence[str] = ()
    num_pools: int = 1
    time_dispatcher: bool = False
    # Every this many simulated s, each pool notes (s, wall s, cpu s, peak RSS MiB) of
    # its run so far (`PoolResult.checkpoints`; bench/bench_simulate_scale.py's).
    checkpoint_every_s: float = math.inf


@dataclass
class PoolResult:
    """What one pool's run returns (pickled back from its process)."""

    pool: int
    workers: int
    tenants: int
    recorder: Recorder
    end_ms: float
    wall_s: float
    cpu_s: float
    peak_rss_mib: float
    arrivals: int
    events: int
    preemptions_ordered: int
    preemption_decisions: int
    preemption_tenants_weighed: int
    recomputed_tokens: int
    max_seq_len: int
    core: dict[str, Any] = field(default_factory=dict)  # CoreClock.report, if timed
    checkpoints: list[tuple[float, float, float, float]] = field(default_factory=list)


@dataclass
class Outcome:
    """The merged run: one recorder, each pool's result and (several pools) its row of
    the report (`pool_row`)."""

    recorder: Recorder
    pools: list[PoolResult]
    rows: list[dict[str, Any]]
    wall_s: float
    simulated_s: float
    stopped: bool


def run_pool(job: Job, pool: int, progress: Callable[[float], None] | None = None) -> PoolResult:
    """Simulate one pool of `job` here, in this process. `progress` gets the simulated
    second every simulated second and may raise `StopRun`."""
    from fleetsim.cli import tuned_gc
    from fleetsim.core_clock import CoreClock
    from fleetsim.fleet import Fleet

    k = job.num_pools
    workers = split_workers(job.settings.num_workers, k)[pool]
    tenants = job.workload.tenants
    mine = {n for i, n in enumerate(tenants.names) if pool_of(i, k) == pool}
    recorder = Recorder(tenants, job.duration_s, job.window_s,
                        detail_tenants=[t for t in job.detail_tenants if t in mine])
    # Each pool its own draws of the clients' legs (the same seed would repeat them).
    settings = dataclasses.replace(job.settings, num_workers=workers,
                                   client_seed=job.settings.client_seed * k + pool)
    fleet = Fleet(job.config, tenants, recorder, settings)
    clock = CoreClock(fleet.core) if job.time_dispatcher else None
    checkpoints: list[tuple[float, float, float, float]] = []
    next_checkpoint_s = 0.0

    def on_second(t_s: float) -> None:
        nonlocal next_checkpoint_s
        if t_s >= next_checkpoint_s:
            next_checkpoint_s = t_s + job.checkpoint_every_s
            checkpoints.append((t_s, time.perf_counter() - t0, time.process_time() - c0,
                                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
        if progress is not None:
            progress(t_s)

    with tuned_gc():
        t0, c0 = time.perf_counter(), time.process_time()
        fleet.run(pool_arrivals(job.workload.arrivals(), pool, k), job.duration_s, on_second,
                  progress_every_s=1.0)
        wall_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    if fleet.end_ms < job.duration_s * 1000.0:
        recorder.stopped_at(fleet.end_ms / 1000)
    return PoolResult(
        pool=pool, workers=workers, tenants=len(mine), recorder=recorder,
        end_ms=fleet.end_ms, wall_s=wall_s, cpu_s=cpu_s,
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        arrivals=fleet.num_arrivals, events=fleet.num_events,
        preemptions_ordered=fleet.num_preemptions,
        preemption_decisions=fleet.scheduler.preemptor.num_decisions,
        preemption_tenants_weighed=fleet.scheduler.preemptor.num_weighed,
        recomputed_tokens=sum(w.core.num_recomputed_tokens for w in fleet.workers),
        max_seq_len=fleet.max_seq_len,
        core=clock.report(fleet.end_ms / 1000, fleet.num_arrivals) if clock else {},
        checkpoints=checkpoints)


# --- several pools ----------------------------------------------------------------------

# The parent's job and what it shares with its pools' processes, inherited by fork.
_JOB: Job | None = None
_SHARED: Shared | None = None


@dataclass
class Shared:
    """Progress and stopping, shared between the parent and its pools' processes.

    Stopping every pool at the same simulated second: on a stop request (`stopping`)
    each running pool parks at its next simulated second (`parked`), and once all have,
    the parent sets `stop_at` to the furthest one's second; the others run on to it.
    (Without the parking a pool could be past any second the parent picked by the
    time it read it.)"""

    done: Any  # simulated s per pool, as of its last progress call
    parked: Any  # 1 per pool waiting for stop_at
    stopping: Any  # .value 1: a stop was requested
    stop_at: Any  # .value: the simulated second every pool ends at (inf: none yet)


def _pool_progress(pool: int, shared: Shared) -> Callable[[float], None]:
    """A pool process's progress callback (every simulated second)."""
    parent = os.getppid()

    def progress(t_s: float) -> None:
        shared.done[pool] = t_s
        if shared.stopping.value and not shared.parked[pool]:
            shared.parked[pool] = 1
            while shared.stop_at.value == math.inf:
                if os.getppid() != parent:  # the parent is gone: nobody to report to
                    raise SystemExit(1)
                time.sleep(PARK_POLL_S)
        if t_s >= shared.stop_at.value:
            raise StopRun

    return progress


class PoolFailed(RuntimeError):
    """A pool's process raised or died; the message says which pool and why."""


def _child_main(pool: int, conn: Connection) -> None:
    """A pool's process: run it, send back its result or what went wrong."""
    # Ctrl-C reaches the whole process group: the parent decides what it means.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    assert _JOB is not None and _SHARED is not None
    try:
        reply: tuple[str, Any] = ("ok", run_pool(_JOB, pool, _pool_progress(pool, _SHARED)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises
        reply = ("error", "".join(traceback.format_exception(exc)).rstrip())
    conn.send(reply)
    conn.close()


class Stop(Protocol):
    """How the caller ends a run early (`fleetsim.cli`'s Ctrl-C handler): `requested`
    set ends every pool at one simulated second, with a report; a KeyboardInterrupt
    raised meanwhile stops at once, without one."""

    requested: bool


def run_pools(job: Job, jobs: int, stop: Stop,
              on_progress: Callable[[float, float], None] | None = None) -> Outcome | None:
    """Every pool of `job`, in `jobs` processes at a time (1: one after another, in
    this process). `on_progress(simulated s, wall s)` gets the pools' mean simulated
    time now and then. None: stopped by a KeyboardInterrupt. `PoolFailed`: a pool's
    process raised (its traceback) or died (its exit status)."""
    global _JOB, _SHARED
    k = job.num_pools
    jobs = max(1, min(jobs, k))
    t0 = time.perf_counter()
    if jobs == 1:
        shared = Shared([0.0] * k, [0] * k, _Box(0), _Box(math.inf))
    else:
        ctx = multiprocessing.get_context("fork")
        shared = Shared(ctx.Array("d", k, lock=False), ctx.Array("b", k, lock=False),
                        ctx.Value("b", 0, lock=False), ctx.Value("d", math.inf, lock=False))
    running: dict[int, tuple[Any, Connection]] = {}

    def watch() -> None:
        if stop.requested and not shared.stopping.value:
            shared.stopping.value = 1
        if shared.stopping.value and shared.stop_at.value == math.inf and all(
                shared.parked[p] for p in running):
            # In this process (jobs 1) the running pool is the caller: at its second.
            shared.stop_at.value = max(shared.done)
        if on_progress is not None:
            # The pools' mean simulated time: the share of the whole run done, whether
            # they run side by side or one after another.
            on_progress(sum(shared.done) / k, time.perf_counter() - t0)

    results: dict[int, PoolResult] = {}
    if jobs == 1:
        for p in range(k):

            def progress(t_s: float, p: int = p) -> None:
                shared.done[p] = t_s
                watch()
                if t_s >= shared.stop_at.value:
                    raise StopRun

            try:
                results[p] = run_pool(job, p, progress)
            except KeyboardInterrupt:
                return None
            shared.done[p] = results[p].end_ms / 1000  # a stop now ends no earlier
    else:
        _JOB, _SHARED = job, shared
        try:
            todo = list(range(k))
            while todo or running:
                while todo and len(running) < jobs:
                    p = todo.pop(0)
                    recv, send = ctx.Pipe(duplex=False)
                    proc = ctx.Process(target=_child_main, args=(p, send), daemon=True,
                                       name=f"fleetsim-pool-{p}")
                    proc.start()
                    send.close()
                    running[p] = (proc, recv)
                ready = mp_connection.wait([c for _, c in running.values()], POLL_S)
                watch()
                for p, (proc, conn) in list(running.items()):
                    if conn not in ready:
                        continue
                    try:
                        status, value = conn.recv()
                    except EOFError:  # it died before it could answer (killed, OOM)
                        proc.join()
                        raise PoolFailed(f"pool {p}'s process died (exit status "
                                         f"{proc.exitcode})") from None
                    proc.join()
                    del running[p]
                    if status != "ok":
                        raise PoolFailed(f"pool {p} failed:\n{value}")
                    results[p] = value
                    shared.done[p] = value.end_ms / 1000  # a stop now ends no earlier
        except KeyboardInterrupt:
            return None
        finally:
            for proc, conn in running.values():  # on an error or Ctrl-C: none left behind
                proc.kill()
                proc.join()
                conn.close()
            _JOB, _SHARED = None, None
    ordered = [results[p] for p in range(k)]
    wall_s = time.perf_counter() - t0
    end_s = min(r.end_ms for r in ordered) / 1000
    stopped = end_s < job.duration_s
    # Each pool's recorder covers [0, its end) already (`run_pool`); merged, the least.
    recorder = merge_recorders([r.recorder for r in ordered], job.detail_tenants) \
        if k > 1 else ordered[0].recorder
    rows = [pool_row(r) for r in ordered] if k > 1 else []
    return Outcome(recorder, ordered, rows, wall_s, end_s if stopped else job.duration_s,
                   stopped)


class _Box:
    """`.value`, as a shared multiprocessing Value has, for the in-process run."""

    def __init__(self, value: float) -> None:
        self.value = value


def pool_row(r: PoolResult) -> dict[str, Any]:
    """One pool's line of the report (`summary["pools"]`): its size, its own latency
    and throughput (from its recorder, before the merge), its process's cost."""
    s = r.recorder.summary()["pool"]
    row: dict[str, Any] = {
        "pool": r.pool, "workers": r.workers, "tenants": r.tenants, "arrivals": r.arrivals,
        "finished": s["finished"], "rejected": s["rejected"], "preemptions": s["preemptions"],
        "throughput_tok_s": s["throughput_tok_s"],
        "ttft_p50_s": s["ttft_s"]["p50"], "ttft_p99_s": s["ttft_s"]["p99"],
        "wall_s": round(r.wall_s, 2), "cpu_s": round(r.cpu_s, 2),
        "peak_rss_mib": round(r.peak_rss_mib, 1)}
    if r.core:
        row["dispatcher_core_pct_of_a_core"] = r.core["dispatcher_core_pct_of_a_core"]
        row["dispatcher_core_us_per_request"] = r.core["dispatcher_core_us_per_request"]
    return row
