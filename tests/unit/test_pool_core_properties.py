"""Hypothesis: the pool core's recovery decisions under random event sequences.

Events arrive in any order a real fleet can produce them: submits (first deliveries and
redeliveries), pulls, Started/Finished (possibly lost or duplicated), hand-backs,
heartbeats that omit ids, worker restarts under the same id, cancels, clock ticks that
declare workers lost. The shell's JetStream check (`CheckStarted`) is answered with
the truth: whether the worker really started (acked) the request. Invariants:

- a request a worker really started is never requeued (no second generation), even
  when its Started event was lost;
- each request ends at most once (one terminal Ack/Term, at most one error to its
  client) and nothing is decided about it afterwards;
- every request is always in exactly one place: queued, in flight, deferred, or ended;
  per-tenant in-flight counts equal what is really in flight;
- liveness: once faults stop, every request ends.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dispatcher.scheduler.actions import Ack, CheckStarted, Defer, Requeued, SendError, Term
from dispatcher.scheduler.core import Scheduler
from dispatcher.scheduler.pool import PoolCore
from dispatcher.scheduler.types import QueuedRequest
from fairlane.poolconfig import SchedulerConfig

pytestmark = pytest.mark.unit

TIMEOUT_MS = 1_000.0
WORKERS = ("w1", "w2")
TENANTS = ("a", "b")
IDS = tuple(f"r{i}" for i in range(6))

ops = st.one_of(
    st.tuples(st.just("submit"), st.sampled_from(IDS), st.booleans()),
    st.tuples(st.just("pull"), st.sampled_from(WORKERS), st.integers(1, 3)),
    # Worker-side events pick (by index) among the requests workers really hold.
    # started: the worker starts it (acks its message); the bool: its event arrives.
    st.tuples(st.just("started"), st.integers(0, 7), st.booleans()),
    st.tuples(st.just("restart"), st.sampled_from(WORKERS), st.none()),
    st.tuples(st.just("finished"), st.integers(0, 7), st.none()),
    st.tuples(st.just("handed_back"), st.integers(0, 7), st.none()),
    st.tuples(st.just("heartbeat"), st.sampled_from(WORKERS), st.booleans()),
    st.tuples(st.just("cancel"), st.sampled_from(IDS), st.none()),
    st.tuples(st.just("advance"), st.integers(1, 1_500), st.none()),
)


class Model:
    """What the fleet really did, to check the core's decisions against."""

    def __init__(self, policy: str) -> None:
        cfg = SchedulerConfig(policy=policy, allow_unknown_tenants=True)
        self.core = PoolCore(Scheduler(cfg), TIMEOUT_MS)
        self.core.begin_grace(0)
        self.now = 0.0
        self.submitted: set[str] = set()
        self.running: dict[str, str] = {}  # request -> worker that really holds it
        self.started: set[str] = set()  # start acknowledged by the core
        self.really_started: set[str] = set()  # the worker acked its message
        self.in_jetstream: set[str] = set()  # handed back with a delay (Defer)
        self.incarnation = dict.fromkeys(WORKERS, 0)
        self.ended: set[str] = set()
        self.errors: dict[str, int] = {}

    def inc(self, worker: str) -> str:
        return f"{worker}-{self.incarnation[worker]}"

    def apply(self, actions) -> None:
        checks: list[str] = []
        for a in actions:
            rid = a.request.request_id if hasattr(a, "request") else None
            assert rid is None or rid not in self.ended, f"decision about ended {rid}: {a}"
            match a:
                case Ack(reason="started"):
                    self.started.add(rid)
                case Ack() | Term():
                    self.ended.add(rid)
                    self.running.pop(rid, None)
                    self.in_jetstream.discard(rid)  # a term reaches a deferred one too
                case SendError():
                    self.errors[rid] = self.errors.get(rid, 0) + 1
                    assert self.errors[rid] == 1, f"two errors for {rid}"
                case Requeued():
                    assert rid not in self.really_started, f"started {rid} requeued: twice"
                    self.running.pop(rid, None)
                case Defer():
                    self.in_jetstream.add(rid)
                case CheckStarted():
                    self.running.pop(rid, None)
                    checks.append(rid)
        for rid in checks:  # the shell asks JetStream: gone = a worker acked it
            self.apply(self.core.on_start_checked(rid, rid in self.really_started, self.now))

    def step(self, op, x, y) -> None:
        core, now = self.core, self.now
        if op == "submit":
            if x not in self.ended:
                self.resubmit(x, y or x in self.in_jetstream)
        elif op == "pull":
            self.apply(core.on_pull(x, 0, now, incarnation=self.inc(x)))
            for d in core.select(x, y, now, incarnation=self.inc(x)):
                self.running[d.request.request_id] = x
        elif op == "restart":  # the process dies; a new one heartbeats under its id
            for rid in [r for r, w in self.running.items() if w == x]:
                self.running.pop(rid)
            self.incarnation[x] += 1
            self.apply(core.on_heartbeat(x, [], now, interval_ms=TIMEOUT_MS / 4,
                                         incarnation=self.inc(x)))
        elif op in ("started", "finished", "handed_back"):
            if not self.running:
                return
            rid = sorted(self.running)[x % len(self.running)]
            worker = self.running[rid]
            inc = self.inc(worker)
            if op == "started":
                self.really_started.add(rid)
                if y:
                    self.apply(core.on_started(rid, worker, now, incarnation=inc))
            elif op == "finished":
                self.really_started.add(rid)  # it ran, whatever the events said
                self.running.pop(rid)
                self.apply(core.on_finished(rid, worker, None, now, incarnation=inc))
            elif rid not in self.really_started:
                self.running.pop(rid)
                self.apply(core.on_handed_back(rid, worker, now, incarnation=inc))
        elif op == "heartbeat":
            # y: the heartbeat is truthful; else it omits everything (lost state).
            ids = [r for r, w in self.running.items() if w == x] if y else []
            if not y:
                for r in ids:
                    self.running.pop(r)
            self.beat(x, ids)
        elif op == "cancel":
            self.apply(core.on_cancel(x, "test", now))
        elif op == "advance":
            self.now += x
            self.apply(core.tick(self.now))
        self.check()

    def beat(self, worker: str, ids: list[str]) -> None:
        """A heartbeat; a worker told it is unknown (declared lost while it was
        stalled) fences itself as the real one does: drops its work, new incarnation."""
        self.apply(self.core.on_heartbeat(worker, ids, self.now, interval_ms=TIMEOUT_MS / 4,
                                          incarnation=self.inc(worker)))
        if not self.core.knows(self.inc(worker)):
            for rid in [r for r, w in self.running.items() if w == worker]:
                self.running.pop(rid)
            self.incarnation[worker] += 1

    def resubmit(self, rid: str, redelivered: bool) -> None:
        self.submitted.add(rid)
        self.in_jetstream.discard(rid)
        tenant = TENANTS[int(rid[1:]) % 2]
        req = QueuedRequest(rid, tenant, "standard", 5, 10, 10)
        self.apply(self.core.submit(req, self.now, redelivered=redelivered))

    def check(self) -> None:
        s = self.core.scheduler
        for rid in self.submitted:
            places = [rid in self.ended, s.is_queued(rid), rid in s.in_flight_ids(),
                      rid in self.core._deferred or rid in self.in_jetstream]
            assert sum(places) == 1, f"{rid} is in {places} places"
        in_flight = {t: 0 for t in TENANTS}
        for rid in s.in_flight_ids():
            in_flight[s.in_flight_request(rid).tenant] += 1
        for t, load in s.tenant_loads().items():
            assert load.num_in_flight == in_flight[t]

    def settle(self) -> None:
        """Faults stop: workers pull, start and finish everything they get."""
        for _ in range(50):
            if self.ended >= self.submitted:
                return
            self.now += TIMEOUT_MS / 4
            self.apply(self.core.tick(self.now))
            for rid in sorted(self.in_jetstream):  # JetStream redelivers what it got back
                self.resubmit(rid, True)
            for w in WORKERS:
                inc = self.inc(w)
                self.beat(w, [r for r, x in self.running.items() if x == w])
                inc = self.inc(w)
                self.apply(self.core.on_pull(w, 0, self.now, incarnation=inc))
                for d in self.core.select(w, 8, self.now, incarnation=inc):
                    self.running[d.request.request_id] = w
                for rid in [r for r, x in self.running.items() if x == w]:
                    self.really_started.add(rid)
                    self.apply(self.core.on_started(rid, w, self.now, incarnation=inc))
                    self.running.pop(rid)
                    self.apply(self.core.on_finished(rid, w, None, self.now, incarnation=inc))
            self.check()
        raise AssertionError(f"never ended: {sorted(self.submitted - self.ended)}")


@pytest.mark.parametrize("policy", ["fifo", "drr", "vtc"])
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(ops, min_size=20, max_size=80))
def test_recovery_decisions_hold_the_delivery_invariants(policy, steps):
    m = Model(policy)
    for op, x, y in steps:
        m.step(op, x, y)
    m.settle()
