"""Chaos scenarios, part two: duplicates, stranded subjects, dispatchers (standby,
crash loop, leader kill and graceful stop). Definitions: `tests.chaos.scenario_base`."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import statistics
import time

from fairlane.protocol import InferenceRequest, SamplingParams
from tests.chaos.analysis import _ms, quantile
from tests.chaos.harness import (
    POOL,
    PREFIX,
    Attempt,
    FleetSpec,
    now,
)
from tests.chaos.scenario_base import (
    WORKER_TIMEOUT_S,
    Scenario,
    _check,
)


def _raw_request(rid: str, tenant: str, max_tokens: int, reply_to: str,
                 tier: str = "standard", pool: str = POOL) -> InferenceRequest:
    return InferenceRequest(request_id=rid, tenant=tenant, pool=pool, tier=tier,
                            reply_to=reply_to, prompt="chaos", created_ms=int(time.time() * 1000),
                            sampling=SamplingParams(max_tokens=max_tokens),
                            expected_output_tokens=max_tokens)


class DuplicateWithoutMsgId(Scenario):
    name = "duplicate_without_msg_id"
    fault = ("after a request finished, publish its exact InferenceRequest body twice with "
             "js.publish and no Nats-Msg-Id")

    async def drive(self, run, p):
        num_dup = 5
        load = self.load(run, p)
        self.dups: dict[str, tuple[InferenceRequest, float]] = {}
        for _ in range(num_dup):
            req = run.new_req("dup", "dup", 30)
            body = _raw_request(req.rid, "dup", 30, "")
            stream = await run.client.submit_request(body)  # sets reply_to; same body
            req.attempts.append(Attempt(submit_t=now()))
            await run._consume(stream, req.attempts[-1])
            req.done = True
            subject = run.subjects.request(POOL, "standard", "dup")
            if run.fault_t is None:
                run.fault_t = now()
            t = now()
            await run.raw_publish(subject, body)
            await run.raw_publish(subject, body)
            self.dups[req.rid] = (body, t)
        # Informational: the same, while the request is still running.
        req = run.new_req("duprun", "duprun", 150)
        body = _raw_request(req.rid, "duprun", 150, "")
        stream = await run.client.submit_request(body)
        req.attempts.append(Attempt(submit_t=now()))
        consume = run._spawn_task(run._consume(stream, req.attempts[-1]))
        await run.wait(lambda: run.obs.started.get(req.rid), 60, "duprun started")
        self.running_dup = (req.rid, now())
        await run.raw_publish(run.subjects.request(POOL, "standard", "duprun"), body)
        await consume
        req.done = True
        await load
        await asyncio.sleep(5.0)  # answers to the raw publishes
        self.gone = await run.request_gone(run.subjects.request(POOL, "standard", "dup"))

    def checks(self, run, res, out):
        obs = run.obs
        answers, slow, regenerated = 0, [], []
        for rid, (_, t) in self.dups.items():
            errs = [c for c in obs.chunks.get(rid, ()) if c[0] > t and c[3] == "duplicate"]
            answers += len(errs)
            if len(errs) < 2 or max(c[0] for c in errs) - t > 5.0:
                slow.append(rid)
            if len(obs.started.get(rid, ())) > 1 or len(obs.usage.get(rid, ())) > 1:
                regenerated.append(rid)
        rid, t = self.running_dup
        live_answer = [c for c in obs.chunks.get(rid, ()) if c[0] > t and c[3] is not None]
        res["extra"].update({
            "duplicates_published": 2 * len(self.dups), "duplicate_answers": answers,
            "duplicate_while_running_answered": [c[3] for c in live_answer],
            "duplicate_while_running_started_twice": len(obs.started.get(rid, ())) > 1,
        })
        _check(out, "each duplicate answered `duplicate` within 5 s", not slow,
               f"{answers}/{2 * len(self.dups)}", "all")
        _check(out, "no duplicate generated again", not regenerated, len(regenerated), "0")
        _check(out, "duplicates removed from FL_REQUESTS", self.gone, self.gone, "True")


class UnknownTierAndPool(Scenario):
    name = "unknown_tier_and_pool"
    fault = ("raw js.publish to fl.req.<pool>.<tier that does not exist>.<tenant> and to a "
             "pool no dispatcher serves")

    async def drive(self, run, p):
        load = self.load(run, p)
        await self.mid_run(run, p, worker=None)
        run.fault_t = now()
        self.probes = {}
        for rid, pool, tier in (("probe-tier", POOL, "nosuchtier"),
                                ("probe-pool", "nosuchpool", "standard")):
            body = _raw_request(rid, "t0", 16, f"{PREFIX}.inbox.probe.{rid}", tier=tier, pool=pool)
            subject = run.subjects.request(pool, tier, "t0")
            await run.raw_publish(subject, body, headers={"Nats-Msg-Id": rid})
            self.probes[rid] = subject
        await load
        with contextlib.suppress(TimeoutError):
            await run.wait(lambda: all(self._answer(run, r) for r in self.probes),
                           max(0.0, run.fault_t + 16 - now()), "probe answers")
        self.gone = {rid: await run.request_gone(s) for rid, s in self.probes.items()}

    def _answer(self, run, rid):
        errs = [c for c in run.obs.chunks.get(rid, ()) if c[3] is not None]
        return errs[0] if errs else None

    def checks(self, run, res, out):
        # The dispatcher sweeps requests nobody serves every janitor_every_s (2 s); an
        # unserved pool's after stranded_after_s (10 s) without a leader: both defaults.
        for rid in self.probes:
            a = self._answer(run, rid)
            what, bound = (("unknown tier", 5.0) if rid == "probe-tier"
                           else ("unserved pool", 15.0))
            took = None if a is None else round(a[0] - run.fault_t, 3)
            res["extra"][f"{what}: answer, s"] = (a[3], took) if a else None
            _check(out, f"{what}: error chunk on the reply subject",
                   took is not None and took <= bound, (a[3], took) if a else None,
                   f"an error within {bound:.0f} s")
            _check(out, f"{what}: message gone from FL_REQUESTS", self.gone[rid],
                   self.gone[rid], "True")


# --- 9-11: dispatchers ------------------------------------------------------------------------

TENANTS_CAPPED = """\
tiers:
  - name: standard
pools:
  default:
    policy: drr
    cost_model: requests
    allow_unknown_tenants: true
tenants:
  capped:
    tier: standard
    max_concurrent: 2
"""


class TwoDispatchers(Scenario):
    name = "two_dispatchers"
    fault = ("two dispatchers for the pool (leader + standby by the KV lease); tenant "
             "`capped` (max_concurrent: 2) floods 30 requests at once beside the load")

    def fleet(self, p):
        return FleetSpec(num_dispatchers=2, tenants_yaml=TENANTS_CAPPED)

    async def drive(self, run, p):
        load = self.load(run, p)
        await self.mid_run(run, p, worker=None, fraction=0.2)
        run.fault_t = now()
        self.capped = []
        for i in range(max(10, round(30 * p.scale))):
            req = run.new_req("capped", "capped", (30, 60, 90)[i % 3])
            self.capped.append(req.rid)
            run.start_req(req)
        await load

    def checks(self, run, res, out):
        obs = run.obs
        steps = []
        for rid in self.capped:
            starts = obs.started.get(rid, ())
            if not starts:
                continue
            steps.append((min(s[0] for s in starts), 1))
            fins = [f[0] for f in obs.finished.get(rid, ())]
            if fins:
                steps.append((max(fins), -1))
        level = peak = 0
        for _, d in sorted(steps, key=lambda x: (x[0], x[1])):
            level += d
            peak = max(peak, level)
        epochs = sorted({e for _, e, n in obs.batches if n})
        ttft = {g: [a.first_t - a.submit_t for r in run.requests.values() if r.group == g
                    for a in r.attempts[:1] if a.first_t] for g in ("capped", "load")}
        res["extra"].update({
            "capped_max_running": peak, "dispatching_epochs": epochs,
            "ttft_p99_ms_capped": _ms(quantile(ttft["capped"], 0.99)),
            "ttft_p99_ms_others": _ms(quantile(ttft["load"], 0.99)),
            "ttft_p50_ms_others": _ms(quantile(ttft["load"], 0.5)),
        })
        _check(out, "capped tenant never more than 2 running", peak <= 2, peak, "<= 2")
        _check(out, "one dispatcher dispatched (one epoch)", len(epochs) == 1, epochs, "1 epoch")


class DispatcherCrashLoop(Scenario):
    name = "dispatcher_crash_loop"
    fault = ("kill -9 the dispatcher 3 times in a row, each ~1 s after its replacement "
             "(same flags, as `fairlane up` starts it) started; ack_wait 10 s")

    async def drive(self, run, p):
        load = self.load(run, p)
        await self.mid_run(run, p, worker=None)
        self.kills = []
        for i in range(3):
            started = run.log_count("dispatcher-a", "dispatcher_started")
            self.kills.append(now())
            if run.fault_t is None:
                run.fault_t = self.kills[0]
            run.signal("dispatcher-a", signal.SIGKILL)
            run.respawn("dispatcher-a")
            await run.wait(lambda n=started: run.log_count("dispatcher-a", "dispatcher_started") > n,
                           60, "replacement dispatcher")
            if i < 2:
                await asyncio.sleep(1.0)
        run.restore_t = now()
        await load

    def checks(self, run, res, out):
        s = run.spec
        span = self.kills[-1] - self.kills[0]
        # One failover: the loop itself, the lease TTL, one ack_wait and the grace (one
        # worker timeout), plus 3 s of slack; a request that waited longer was parked twice.
        bound = span + s.lease_ttl_s + s.ack_wait_s + WORKER_TIMEOUT_S + 3.0
        waits = {}
        for r in run.requests.values():
            if not r.attempts:
                continue
            starts = [x[0] for x in run.obs.started.get(r.rid, ())]
            t = min(starts) if starts else r.end_t
            if t is not None and t > self.kills[0]:
                waits[r.rid] = t - max(r.created_t, self.kills[0])
        over = [rid for rid, w in waits.items() if w > bound]
        res["extra"].update({
            "kill_times_s": [round(k - self.kills[0], 2) for k in self.kills],
            "wait_bound_s": round(bound, 2),
            "wait_after_first_kill_max_s": round(max(waits.values()), 2) if waits else None,
            "wait_after_first_kill_p50_s": round(statistics.median(waits.values()), 2)
            if waits else None,
            "waited_past_one_failover": len(over),
        })
        _check(out, "no request parked for a second ack_wait", not over, len(over),
               f"0 waiting > {bound:.1f} s")


class LeaderKill(Scenario):
    name = "leader_kill"
    fault = "kill -9 the leading dispatcher under load; a standby holds the other lease slot"

    def fleet(self, p):
        return FleetSpec(num_dispatchers=2)

    async def drive(self, run, p):
        load = self.load(run, p)
        await self.mid_run(run, p, worker=None)
        leader = await run.leader_name_async()
        self.old_epochs = {e for _, e, n in run.obs.batches if n}
        run.fault_t = now()
        run.signal(leader, signal.SIGKILL)
        await load

    def first_new_dispatch(self, run):
        ts = [t for t, e, n in run.obs.batches if n and e not in self.old_epochs
              and t > run.fault_t]
        return min(ts) - run.fault_t if ts else None

    def checks(self, run, res, out):
        d = self.first_new_dispatch(run)
        res["extra"]["standby_first_dispatch_s"] = None if d is None else round(d, 3)
        _check(out, "standby dispatches within 5 s of the kill", d is not None and d < 5.0,
               None if d is None else round(d, 3), "< 5 s")


class LeaderGraceful(LeaderKill):
    name = "leader_graceful"
    fault = ("SIGTERM the leading dispatcher right after a burst of 40 requests (it holds "
             "queued ones); the standby takes them over")

    async def drive(self, run, p):
        load = self.load(run, p)
        await self.mid_run(run, p, worker=None)
        leader = await run.leader_name_async()
        burst = [run.new_req("burst", f"b{i % 4}", 60) for i in range(40)]
        for req in burst:
            run.start_req(req)
        await asyncio.sleep(1.0)  # published and fetched: the leader holds them
        self.old_epochs = {e for _, e, n in run.obs.batches if n}
        run.fault_t = now()
        self.held = [r.rid for r in run.requests.values()
                     if r.created_t < run.fault_t and not run.obs.dispatched.get(r.rid)]
        run.signal(leader, signal.SIGTERM)
        await load

    def checks(self, run, res, out):
        d = self.first_new_dispatch(run)
        waits = []
        for rid in self.held:
            ts = [t for t, _, _ in run.obs.dispatched.get(rid, ()) if t > run.fault_t]
            waits.append(min(ts) - run.fault_t if ts else float("inf"))
        res["extra"].update({
            "standby_first_dispatch_s": None if d is None else round(d, 3),
            "held_at_stop": len(self.held),
            "held_dispatched_max_s": round(max(waits), 3) if waits else None,
        })
        _check(out, "standby dispatches within 2 s of SIGTERM", d is not None and d < 2.0,
               None if d is None else round(d, 3), "< 2 s")
        _check(out, "held requests handed over (not after ack_wait)",
               all(w < run.spec.ack_wait_s for w in waits),
               round(max(waits), 3) if waits else None, f"< ack_wait {run.spec.ack_wait_s} s")
