"""Chaos scenarios: every single fault of issue 9, run on a real fleet (see
`tests.chaos.scenario_base` for what is counted and how). Part one here (workers,
broker, clients); part two in `tests.chaos.scenarios_dispatch`."""

from __future__ import annotations

import asyncio
import signal
import statistics
import time
from pathlib import Path
from typing import Any

from producer.client import FairlaneClient
from tests.chaos.analysis import analyse
from tests.chaos.harness import (
    LOST_CODES,
    PREFIX,
    ChaosRun,
    now,
)
from tests.chaos.scenario_base import (
    HEARTBEAT_S,
    WORKER_TIMEOUT_S,
    Check,
    Params,
    Scenario,
    _check,
)
from tests.chaos.scenarios_cluster import NatsFollowerKill, NatsLeaderKill, NatsLeaseLeaderKill
from tests.chaos.scenarios_dispatch import (
    DispatcherCrashLoop,
    DuplicateWithoutMsgId,
    LeaderGraceful,
    LeaderKill,
    TwoDispatchers,
    UnknownTierAndPool,
)
from tests.chaos.scenarios_partition import NatsPartitionFollower, NatsPartitionLeader


class WorkerRestart(Scenario):
    name = "worker_restart"
    fault = "kill -9 worker-0 under load; restart it under the same --worker-id 0.2 s later"
    victim = "worker-0"

    async def drive(self, run, p):
        load = self.load(run, p)
        await self.mid_run(run, p)
        hb = run.obs.heartbeats["worker-0"][1]
        self.unstarted = set(hb.in_flight_ids) - set(hb.started_ids)
        run.fault_t = now()
        run.signal("worker-0", signal.SIGKILL)
        await asyncio.sleep(0.2)
        run.respawn("worker-0")
        await load

    def checks(self, run, res, out):
        rec = res["recovery_s"]
        bound = 2 * HEARTBEAT_S
        told = rec.get("victims_told_max")
        _check(out, "victims' clients told (worker_lost or resumed) within 2 heartbeats",
               told is not None and told <= bound, told, f"<= {bound} s")
        bad = [r for r in self.unstarted if run.requests.get(r) and
               run.requests[r].outcome != "ok"]
        _check(out, "prefetched-unstarted on the victim completed elsewhere", not bad,
               f"{len(self.unstarted) - len(bad)}/{len(self.unstarted)}", "all")
        rejoined = any(s[1] == "worker-0" and s[0] > run.fault_t
                       for st in run.obs.started.values() for s in st)
        _check(out, "restarted worker-0 serves again", rejoined, rejoined, "True")


class NatsRestart(Scenario):
    name = "nats_restart"
    fault = "kill -9 nats-server; restart it on the same port and store 1 s later"

    async def drive(self, run, p):
        load = self.load(run, p)
        await self.mid_run(run, p, worker=None)
        run.fault_t = now()
        run.kill_nats()
        await asyncio.sleep(1.0)
        run.start_nats()
        run.restore_t = now()
        await load


class NatsDown5s(Scenario):
    name = "nats_down_5s"
    fault = ("SIGSTOP nats-server for 5 s, then SIGCONT (the broker unreachable, TCP "
             "connections kept: the closest to a network outage)")

    async def drive(self, run, p):
        load = self.load(run, p)
        await self.mid_run(run, p, worker=None)
        run.fault_t = now()
        run.pause_nats(True)
        await asyncio.sleep(5.0)
        run.pause_nats(False)
        run.restore_t = now()
        await load


class WorkerStall(Scenario):
    name = "worker_stall"
    fault = "SIGSTOP worker-0 for 10 s, then SIGCONT"
    victim = "worker-0"

    async def drive(self, run, p):
        load = self.load(run, p)
        await self.mid_run(run, p)
        run.fault_t = now()
        run.signal("worker-0", signal.SIGSTOP)
        await asyncio.sleep(10.0)
        run.signal("worker-0", signal.SIGCONT)
        run.restore_t = now()
        await load

    def checks(self, run, res, out):
        rec = res["recovery_s"]
        bound = WORKER_TIMEOUT_S + 2 * HEARTBEAT_S
        told = rec.get("victims_told_max")
        _check(out, "victims' clients told within worker timeout + 2 heartbeats",
               told is not None and told <= bound, told, f"<= {bound} s")
        # The stalled incarnation (declared lost meanwhile) must publish nothing more;
        # its successor (same id, after fencing) may legitimately run the same requests.
        obs = run.obs
        old = {s[2] for st in obs.started.values() for s in st
               if s[1] == "worker-0" and s[0] < run.fault_t}
        late = [rid for rid, evs in [*obs.started.items(), *obs.finished.items()]
                for e in evs if e[1] == "worker-0" and e[2] in old and e[0] > run.restore_t]
        _check(out, "stalled incarnation published no event after waking", not late,
               len(late), "0")
        fenced = [d for d in run.worker_log if d.get("event") == "worker_fenced"
                  and d.get("worker_id") == "worker-0"]
        res["extra"]["worker_0_fenced"] = len(fenced)


# --- 5-8: clients ---------------------------------------------------------------------------


class ClientClose(Scenario):
    name = "client_close"
    fault = "FairlaneClient.close() with 50 long streams open"

    async def drive(self, run, p):
        num_long = max(10, round(50 * p.scale))
        closer = await FairlaneClient.connect(run.nats.url, prefix=PREFIX)
        load = run._spawn_task(run.open_loop(p.num_requests // 2, p.rate_per_s / 2))
        self.long = []
        for _ in range(num_long):
            req = run.new_req("closer", "closer", 400)  # ~14 s each
            self.long.append(req.rid)
            run.start_req(req, closer)
        await run.wait(lambda: sum(1 for r in self.long if run.obs.started.get(r)) >= 8,
                       120, "long streams running")
        await asyncio.sleep(1.5)  # mid-stream, not just started
        run.fault_t = now()
        on_workers = set().union(*(run.obs.running_on(f"worker-{i}")
                                   for i in range(run.spec.num_workers)))
        self.running = on_workers & set(self.long)
        await closer.close()
        self.close_s = now() - run.fault_t
        await load

    def checks(self, run, res, out):
        obs, t0 = run.obs, run.fault_t
        latencies, continued = [], []
        for rid in self.running:
            fins = [f[0] for f in obs.finished.get(rid, ()) if f[0] >= t0]
            if fins:
                latencies.append(min(fins) - t0)
            if not fins or min(fins) - t0 > 1.0:
                continued.append(rid)
        started_after = [r for r in self.long for s in obs.started.get(r, ()) if s[0] > t0 + 0.2]
        finished_ok_after = [r for r in self.long for f in obs.finished.get(r, ())
                             if f[0] > t0 and f[3] is None]
        cancel_lines = [d for d in run.worker_log if d.get("event") == "cancel"
                        and d.get("request_id") in set(self.long)]
        res["extra"].update({
            "long_streams": len(self.long), "running_at_close": len(self.running),
            "close_call_s": round(self.close_s, 3),
            "abort_latency_max_s": round(max(latencies), 3) if latencies else None,
            "abort_latency_median_s": round(statistics.median(latencies), 3) if latencies else None,
            "worker_cancel_lines": len(cancel_lines),
            "started_after_close": len(set(started_after)),
            "finished_normally_after_close": len(set(finished_ok_after)),
            "billed_completion_tokens_closed": sum(
                max((u.completion_tokens for _, u in obs.usage.get(r, ())), default=0)
                for r in self.long),
        })
        _check(out, "running streams aborted within 1 s of close", not continued,
               len(continued), "0")
        _check(out, "no closed-client request started after close", not started_after,
               len(set(started_after)), "0")
        _check(out, "no closed-client request ran to its end", not finished_ok_after,
               len(set(finished_ok_after)), "0")


class RetryAfterWorkerLost(Scenario):
    name = "retry_after_worker_lost"
    fault = ("kill -9 worker-0 (restarted under its id 0.2 s later); the library's own "
             "migration is off (max_resumes=0), so clients see worker_lost and re-submit "
             "the same request id through the library")
    victim = "worker-0"
    client_kwargs = {"max_resumes": 0}  # noqa: RUF012

    async def drive(self, run, p):
        self.long = []
        for i in range(8):  # long enough to be mid-stream at the kill
            req = run.new_req("retry", f"r{i % 2}", 150, retry_lost=2)
            self.long.append(req.rid)
            run.start_req(req)
        load = self.load(run, p, retry_lost=2)

        def busiest() -> str:
            return max(("worker-0", "worker-1"),
                       key=lambda w: len(run.obs.running_on(w) & set(self.long)))

        await run.wait(lambda: len(run.obs.running_on(busiest()) & set(self.long)) >= 2,
                       60, "long requests running")
        await asyncio.sleep(1.0)  # mid-stream
        self.victim = busiest()
        run.fault_t = now()
        run.signal(self.victim, signal.SIGKILL)
        await asyncio.sleep(0.2)
        run.respawn(self.victim)
        await load

    def checks(self, run, res, out):
        retried = [r for r in run.requests.values() if len(r.attempts) > 1]
        ok = [r for r in retried if r.outcome == "ok"]
        waits = [r.attempts[-1].end_t - r.attempts[-1].submit_t for r in ok]
        res["extra"].update({
            "retried": len(retried), "retried_completed": len(ok),
            "retry_to_answer_max_s": round(max(waits), 3) if waits else None,
        })
        _check(out, "some request was retried after worker_lost", retried, len(retried), ">= 1")
        _check(out, "every retried request completed", len(ok) == len(retried),
               f"{len(ok)}/{len(retried)}", "all")
        stored = [r for r in ok if [u.completion_tokens for u in run.stored_usage.get(r.rid, [])]
                  == [r.attempts[-1].tokens]]
        _check(out, "every retried completion billed once, in full, in FL_USAGE",
               len(stored) == len(ok), f"{len(stored)}/{len(ok)}", "all")


SCENARIOS: dict[str, type[Scenario]] = {c.name: c for c in (
    WorkerRestart, NatsRestart, NatsDown5s, WorkerStall, ClientClose, RetryAfterWorkerLost,
    DuplicateWithoutMsgId, UnknownTierAndPool, TwoDispatchers, DispatcherCrashLoop,
    LeaderKill, LeaderGraceful, NatsLeaderKill, NatsLeaseLeaderKill, NatsFollowerKill,
    NatsPartitionLeader, NatsPartitionFollower)}
# Need `ip netns` (root): run by tests/chaos/test_partition.py, which skips without it.
PARTITION = (NatsPartitionLeader.name, NatsPartitionFollower.name)


async def run_scenario(name: str, params: Params, workdir: Path) -> dict[str, Any]:
    """Run one scenario on a fresh fleet; the result dict (see the module docstring)."""
    sc = SCENARIOS[name]()
    t0 = time.monotonic()
    with sc.environment():
        return await _run(sc, params, workdir, t0)


async def _run(sc: Scenario, params: Params, workdir: Path, t0: float) -> dict[str, Any]:
    name = sc.name
    async with ChaosRun(Path(workdir), sc.fleet(params), sc.client_kwargs) as run:
        await sc.drive(run, params)
        await run.finish()
        res = analyse(run, sc.victim)
        res["extra"] = {}
        checks: list[Check] = []
        _check(checks, "0 lost", res["lost"] == 0, res["lost"], "0")
        _check(checks, "0 generated twice", res["generated_twice"] == 0,
               res["generated_twice"], "0")
        _check(checks, "0 failed but billed", res["failed_but_billed"] == 0,
               res["failed_but_billed"], "0")
        _check(checks, "0 wrongly failed", res["wrongly_failed"] == 0, res["wrongly_failed"], "0")
        _check(checks, "0 incomplete ok answers", res["incomplete_ok"] == 0,
               res["incomplete_ok"], "0")
        _check(checks, "every completion billed once, in full (FL_USAGE)",
               res["completed_billing_mismatch"] == 0, res["completed_billing_mismatch"], "0")
        sc.checks(run, res, checks)
        res["supervisor_restarts"] = [(round(t - (run.fault_t or t), 2), n, rc)
                                      for t, n, rc in run.supervisor_restarts]
        res["notes"] = run.notes
    res.update(scenario=name, fault=sc.fault, known_gap=sc.known_gap,
               wall_s=round(time.monotonic() - t0, 1),
               checks=[c.__dict__ for c in checks], ok=all(c.ok for c in checks),
               params=params.__dict__)
    return res


__all__ = ["LOST_CODES", "PARTITION", "SCENARIOS", "Params", "run_scenario"]
