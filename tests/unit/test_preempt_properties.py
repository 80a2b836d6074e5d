"""Hypothesis properties of fleet-level preemption (DESIGN.md 5b) over random fleets:
orders follow the rules, the per-request bound and the rate cap hold, the freed slot
goes to the waiting request, every continuation completes, each request is charged
exactly its work; tenants behind a flood get slots without any turnover, and the
policies' fairness bounds hold with preemption as eager as it can be. Scenarios are
in test_preempt.py."""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st

from dispatcher.scheduler.base import water_fill
from dispatcher.scheduler.core import Scheduler
from dispatcher.scheduler.types import ActualUsage, QueuedRequest
from fairlane.poolconfig import PreemptionConfig, SchedulerConfig, TenantConfig, TierConfig

pytestmark = pytest.mark.unit

_ids = itertools.count()


def cfg(policy: str, *, tenants: dict[str, TenantConfig], tiers: list[TierConfig] | None = None,
        cost_model: str = "requests", quantum: float = 1.0, **pre) -> SchedulerConfig:
    return SchedulerConfig(
        policy=policy, cost_model=cost_model, quantum=quantum, throttle_window_ms=0,
        tiers=tiers or [TierConfig("standard")], tenants=tenants,
        preemption=PreemptionConfig(**pre))


def eager(s: Scheduler, recheck_ms: float = 0.0) -> Scheduler:
    """Decide every time asked (the shell's rechecks are throttled by default)."""
    s.preemptor.recheck_ms = recheck_ms
    return s


def worker_of(rid: str) -> str:
    return "w0"


TENANTS = ("t0", "t1", "t2")
TIERS = ("gold", "free")
PROMPT = 10
PREFILL_MS = 40  # every run (re-)prefills before its first token: preempting wastes it

submit_op = st.tuples(st.just("submit"), st.integers(0, 2), st.integers(1, 2000),
                     st.integers(1, 4))
fleet_op = st.one_of(
    submit_op, submit_op,
    st.tuples(st.just("advance"), st.integers(1, 300)),
    st.tuples(st.just("decide"), st.booleans()),
    st.tuples(st.just("decide"), st.booleans()),
    st.tuples(st.just("report"), st.integers(0, 20)),
)


class Fleet:
    """A fleet of `num_slots` slots on two workers, run by the test. A request needs
    `work` tokens, one per ms once its run has prefilled (`PREFILL_MS`), and keeps its
    tokens across preemptions: a preemption costs a re-prefill."""

    def __init__(self, s: Scheduler, num_slots: int) -> None:
        self.s, self.num_slots, self.now = s, num_slots, 0.0
        self.work: dict[str, int] = {}
        self.done_tokens: dict[str, int] = {}  # tokens generated in earlier runs
        self.running: dict[str, float] = {}  # request id -> started at
        self.worker: dict[str, str] = {}
        self.orders: list = []  # outstanding, not yet carried out by the worker
        self.order_times: list[float] = []
        self.preemptions: Counter[str] = Counter()
        self.finished: dict[str, QueuedRequest] = {}
        self.accepted: dict[str, QueuedRequest] = {}

    def tokens(self, rid: str) -> int:
        return self.done_tokens.get(rid, 0) + max(int(self.now - self.running[rid]) - PREFILL_MS, 0)

    def fill(self) -> None:
        free = self.num_slots - len(self.running)
        if free <= 0:
            return
        held = [r for r in self.s.preemptor.held.values()
                if self.s.is_queued(r.request_id) and self.s.within_quota(r.tenant, r.kv_tokens)]
        # Pulls alternate between the two workers: continuations go home when they can.
        self.num_pulls = getattr(self, "num_pulls", 0) + 1
        wid = f"w{self.num_pulls % 2}"
        out = self.s.select(free, self.now, worker_id=wid)
        if held:  # the freed slot goes to the request it was taken for
            assert out and out[0].request is held[0], (held, out)
        for d in out:
            rid = d.request.request_id
            assert rid not in self.running and rid not in self.finished
            self.running[rid] = self.now
            self.worker[rid] = wid
            assert self.s.on_started(rid, self.now)

    def advance(self, dt: float) -> None:
        # Finish what completes within dt, in time order, refilling slots as they free.
        end = self.now + dt
        while True:
            due = sorted((self.running[r] + PREFILL_MS + self.work[r]
                          - self.done_tokens.get(r, 0), r) for r in self.running)
            if not due or due[0][0] > end:
                break
            self.now = max(self.now, due[0][0])
            rid = due[0][1]
            del self.running[rid]
            usage = ActualUsage(PROMPT, self.work[rid])
            self.finished[rid] = self.s.on_finished(rid, usage, self.now)
            self.fill()
        self.now = end
        self.fill()

    def decide(self, free: bool) -> None:
        self.fill()
        num_free = self.num_slots - len(self.running)
        if free:
            num_free += 1
        cfg = self.s.config.preemption
        orders = self.s.preemptions(self.now, num_free, self.worker.get)
        if num_free > 0 or self.s.config.policy == "fifo" or not cfg.enabled:
            assert orders == []
        for o in orders:
            rid, w = o.request_id, o.for_request
            assert rid in self.running and self.worker[rid] == o.worker_id
            if o.request.num_preemptions:  # hysteresis guards continuations only
                assert self.now - self.running[rid] >= cfg.min_run_ms
            assert o.request.num_preemptions < cfg.max_per_request
            assert o.request.tenant != w.tenant
            assert self.s.tiers.index(o.request.tier) >= self.s.tiers.index(w.tier)  # never up
            assert self.s.is_queued(w.request_id)
            # The quiet threshold or the backlogged one, whichever applied to it.
            assert self.now - w.enqueued_ms >= min(cfg.preempt_after_ms,
                                                   cfg.quiet_preempt_after_ms)
            assert all(rid != p.request_id for p in self.orders)
            self.order_times.append(self.now)
        self.orders.extend(orders)
        window = [t for t in self.order_times if t > self.now - 1000]
        assert len(window) <= cfg.max_per_s

    def report(self, i: int) -> None:
        """The worker carries out an outstanding order (if the request still runs)."""
        if not self.orders:
            return
        o = self.orders.pop(i % len(self.orders))
        rid = o.request_id
        if rid not in self.running:
            assert self.s.preempted(rid, 0, self.now) is None  # it finished first
            return
        tokens = self.tokens(rid)
        del self.running[rid]
        self.done_tokens[rid] = tokens
        self.preemptions[rid] += 1
        cont = self.s.preempted(rid, tokens, self.now, worker_id=self.worker[rid])
        assert cont is not None and cont.num_preemptions == self.preemptions[rid]
        assert self.preemptions[rid] <= self.s.config.preemption.max_per_request
        self.fill()

    def charged(self, rid: str) -> float:
        """What the tenant should have paid for `rid` so far: the work done, plus the
        estimate of the work left while it runs — never a run's work twice."""
        r, model = self.accepted[rid], self.s.cost_model
        if rid in self.finished:
            return model.actual(r, ActualUsage(PROMPT, self.work[rid]))
        if not self.preemptions[rid]:
            return model.estimate(r) if rid in self.running else 0.0
        done = model.actual(r, ActualUsage(PROMPT, self.done_tokens[rid]))
        if rid not in self.running:
            return done
        whole = dataclasses.replace(r, expected_output_tokens=max(
            r.expected_output_tokens, self.done_tokens[rid] + 1))
        return done + max(model.estimate(whole) - done, 1e-6)

    def check(self) -> None:
        assert self.s.num_in_flight == len(self.running)
        assert self.s.num_queued == len(self.accepted) - len(self.finished) - len(self.running)
        paid: Counter[str] = Counter()
        for rid, r in self.accepted.items():
            paid[r.tenant] += self.charged(rid)
        for name, load in self.s.tenant_loads().items():
            assert load.dispatched_cost == pytest.approx(paid[name], rel=1e-9, abs=1e-5), name


@pytest.mark.parametrize("policy", ["drr", "vtc", "fifo"])
@settings(max_examples=50, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(ops=st.lists(fleet_op, min_size=10, max_size=70),
       num_slots=st.integers(1, 8), quantum=st.sampled_from([50.0, 3000.0]),
       weights=st.lists(st.integers(1, 3), min_size=3, max_size=3),
       tiers=st.lists(st.integers(0, 1), min_size=3, max_size=3),
       quotas=st.lists(st.none() | st.integers(1, 3), min_size=3, max_size=3),
       floor=st.sampled_from([0.0, 0.4]), recheck_ms=st.sampled_from([0.0, 20.0]),
       pre=st.fixed_dictionaries({
           "preempt_after_ms": st.sampled_from([0.0, 50.0, 200.0]),
           "quiet_preempt_after_ms": st.sampled_from([0.0, 50.0]),
           "min_run_ms": st.sampled_from([0.0, 20.0, 100.0]),
           "max_per_s": st.integers(1, 4),
           "max_per_request": st.integers(1, 3)}))
def test_random_fleet_preemption_invariants(policy, ops, num_slots, weights, tiers, quotas,
                                            floor, recheck_ms, quantum, pre):
    tenants = {n: TenantConfig(n, tier=TIERS[t], weight=w, max_concurrent=q)
               for n, t, w, q in zip(TENANTS, tiers, weights, quotas, strict=True)}
    s = eager(Scheduler(cfg(policy, tenants=tenants, cost_model="tokens", quantum=quantum,
                            tiers=[TierConfig("gold"), TierConfig("free", floor_share=floor,
                                                                  aging_ms=500)], **pre)),
              recheck_ms)
    f = Fleet(s, num_slots)
    for o in ops:
        if o[0] == "submit":
            name = TENANTS[o[1]]
            for _ in range(o[3]):
                r = QueuedRequest(f"r{next(_ids)}", name, tenants[name].tier, PROMPT, o[2],
                                  max(1, o[2] // 2))  # under-declared: true-ups matter
                assert s.submit(r, f.now).accepted
                f.accepted[r.request_id] = r
                f.work[r.request_id] = o[2]
            f.fill()
        elif o[0] == "advance":
            f.advance(o[1])
        elif o[0] == "decide":
            f.decide(o[1])
        else:
            f.report(o[1])
        f.check()
    # Liveness: with no new work, workers carry out orders and everything completes.
    # Each request runs at most max_per_request + 1 times and keeps its tokens, so the
    # slots are busy for at most its work plus that many prefills (plus one 25 ms step).
    runs = pre["max_per_request"] + 1
    limit = f.now + sum(w + runs * (PREFILL_MS + 25) for w in f.work.values()) + 1000
    while len(f.finished) < len(f.accepted):
        assert f.now <= limit, "a request never completed"
        f.decide(False)
        while f.orders:
            f.report(0)
        f.advance(25)
        f.check()
    assert not s.num_queued and not s.num_in_flight
    # Each tenant paid exactly the work its requests did, preemptions or not.
    model = s.cost_model
    for name in TENANTS:
        paid = s.tenant_loads()[name].dispatched_cost if name in s.tenant_loads() else 0.0
        owed = sum(model.actual(r, ActualUsage(PROMPT, f.work[rid]))
                   for rid, r in f.accepted.items() if r.tenant == name)
        assert paid == pytest.approx(owed, rel=1e-9, abs=1e-6), name
    if policy == "fifo":
        assert not f.preemptions
    target(float(sum(f.preemptions.values())))  # steer towards runs that preempt a lot


@pytest.mark.parametrize("policy", ["drr", "vtc"])
@settings(max_examples=40, deadline=None)
@given(weights=st.lists(st.integers(1, 4), min_size=2, max_size=4),
       num_slots=st.integers(2, 12), first=st.integers(0, 3))
def test_tenants_behind_a_flood_get_slots_without_turnover(policy, weights, num_slots, first):
    """No slot ever turns over (requests outlive the test): only preemption lets in the
    tenants that arrive behind the flood. Each one owed a whole slot gets one at once
    (its DRR turn, or VTC's lowest counter after lift); then preemption stops, since
    it never serves a tenant more often than the policy would: no churn."""
    names = [f"n{i}" for i in range(len(weights))]
    w = dict(zip(names, weights, strict=True))
    s = eager(Scheduler(cfg(policy, tenants={n: TenantConfig(n, weight=w[n]) for n in names},
                            min_run_ms=100, preempt_after_ms=50, max_per_s=3,
                            max_per_request=50)))
    f = Fleet(s, num_slots)
    flooder = names[first % len(names)]
    for n in [flooder] + [n for n in names if n != flooder]:
        for _ in range(3 * num_slots):
            r = QueuedRequest(f"r{next(_ids)}", n, "standard", PROMPT, 10**9, 10**9)
            s.submit(r, f.now)
            f.accepted[r.request_id] = r
            f.work[r.request_id] = 10**9
        if n == flooder:
            f.fill()  # the first tenant takes every slot
    rounds = 2 * len(names) + 4  # each newcomer: one order per round, 3 per second
    for _ in range(rounds):
        f.advance(400)
        f.decide(False)
        while f.orders:
            f.report(0)
    num_orders = len(f.order_times)
    running = Counter(s.in_flight_request(r).tenant for r in s.in_flight_ids())
    total = sum(w.values())
    demands = {n: (w[n], 3 * num_slots) for n in names}
    shares = water_fill(demands, num_slots)
    assert shares[flooder] == pytest.approx(num_slots * w[flooder] / total)
    for n in names:
        if n != flooder and shares[n] >= 1 - 1e-9:
            assert running[n] >= 1, (running, w)
    for _ in range(20):  # no churn: nothing changed, so nothing more to do
        f.advance(400)
        f.decide(False)
    assert len(f.order_times) == num_orders


def _flood_with_turnover(policy: str, weights: list[int], quantum: float, max_cost: int,
                         num_slots: int, seed: int, enabled: bool) -> tuple[float, int]:
    """Every tenant backlogged; each step one random running request finishes and
    preemption runs as eagerly as it may. Returns the widest spread of weighted
    dispatched cost seen, and the number of preemptions."""
    rng = random.Random(seed)
    tenants = {f"w{i}": TenantConfig(f"w{i}", weight=w) for i, w in enumerate(weights)}
    s = eager(Scheduler(cfg(policy, tenants=tenants, cost_model="tokens", quantum=quantum,
                            enabled=enabled, preempt_after_ms=0, min_run_ms=0,
                            max_per_s=1000)))
    steps = 300
    for i in range(len(weights)):
        for _ in range(2 * steps):
            out = rng.randint(0, max_cost // 3)
            s.submit(QueuedRequest(f"r{next(_ids)}", f"w{i}", "standard",
                                   rng.randint(1, max_cost - 2 * out), out, out), 0)
    running: dict[str, QueuedRequest] = {}

    def fill(t: float) -> None:
        for d in s.select(num_slots - len(running), t):
            running[d.request.request_id] = d.request
            s.on_started(d.request.request_id, t)

    fill(0)
    widest, num_preempted = 0.0, 0
    for t in range(1, steps):
        r = running.pop(rng.choice(sorted(running)))
        s.on_finished(r.request_id, ActualUsage(r.prompt_tokens, r.expected_output_tokens), t)
        fill(t)
        for o in s.preemptions(t, 0, worker_of):
            r = running.pop(o.request_id)
            s.preempted(o.request_id, rng.randint(r.num_generated_tokens,
                                                  r.expected_output_tokens), t)
            num_preempted += 1
            fill(t)
        norm = [s.tenant_loads()[f"w{i}"].dispatched_cost / w for i, w in enumerate(weights)]
        widest = max(widest, max(norm) - min(norm))
    return widest, num_preempted


@pytest.mark.parametrize("policy", ["drr", "vtc"])
@settings(max_examples=30, deadline=None)
@given(weights=st.lists(st.integers(1, 4), min_size=2, max_size=5),
       quantum=st.sampled_from([1.0, 5.0, 20.0]), max_cost=st.integers(3, 30),
       num_slots=st.integers(2, 8), seed=st.integers(0, 2**16))
def test_fairness_bound_holds_with_preemption(policy, weights, quantum, max_cost, num_slots,
                                              seed):
    """The bounds of `test_weighted_shares_within_bound` (test_scheduler_properties.py)
    on weighted dispatched cost hold with preemption as eager as it can be, slots
    turning over at random: preemption only serves the tenant the policy would serve
    next (DRR's turn, VTC's lowest counter). VTC's is widened by one request: the
    refund of the work a preempted request had not done lowers its tenant's counter."""
    min_w = min(weights)
    # Every tenant is backlogged here, so none is quiet (DRR's early turn never applies).
    bound = (2 * quantum + 2 * max_cost / min_w) if policy == "drr" else 3 * max_cost / min_w
    widest, num_preempted = _flood_with_turnover(policy, weights, quantum, max_cost,
                                                 num_slots, seed, True)
    target(float(num_preempted))  # steer towards runs that preempt a lot
    assert widest <= bound + 1e-6
