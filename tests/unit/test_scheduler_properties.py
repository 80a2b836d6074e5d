"""Property tests (hypothesis) of the scheduler core's invariants, for every policy.

- each request is dispatched exactly once (requeue, cancel, expire, shed interleaved);
- work conservation: no slot is left idle while an eligible request waits;
- order within a tenant: (priority desc, deadline asc, arrival asc), requeued first;
- quotas are never exceeded;
- no starvation for a within-quota tenant;
- weighted shares of continuously backlogged tenants stay within the DRR (VTC) bound;
- tier floors are honoured under overload, and aging lets a lower tier through;
- throttling admits exactly when the predicted wait fits the budget.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dispatcher.scheduler.core import Scheduler
from dispatcher.scheduler.types import ActualUsage, QueuedRequest
from fairlane.poolconfig import SchedulerConfig, TenantConfig, TierConfig
from fairlane.protocol import ErrorCode

pytestmark = pytest.mark.unit

FAST = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TENANTS = ["t0", "t1", "t2", "t3"]
TIERS = ["gold", "free"]


# --- random operation sequences ---------------------------------------------------------------

submit_op = st.tuples(st.just("submit"), st.integers(0, 3), st.integers(0, 1),
                      st.integers(0, 1), st.none() | st.integers(1, 400), st.integers(1, 40))
select_op = st.tuples(st.just("select"), st.integers(1, 4))
op = st.one_of(
    submit_op, submit_op, submit_op, select_op, select_op,
    st.tuples(st.just("start"), st.integers(0, 50)),
    st.tuples(st.just("finish"), st.integers(0, 50), st.integers(0, 80)),
    st.tuples(st.just("requeue"), st.integers(0, 50)),
    st.tuples(st.just("cancel"), st.integers(0, 50)),
    st.tuples(st.just("tick"), st.integers(1, 20)),
    st.tuples(st.just("shed"), st.integers(0, 12)),
)

tenant_cfg = st.tuples(st.none() | st.integers(1, 2), st.none() | st.just(60),
                       st.integers(1, 3))


class Model:
    """What the scheduler should hold, kept independently by the test."""

    def __init__(self) -> None:
        self.queued: dict[str, QueuedRequest] = {}
        self.in_flight: dict[str, QueuedRequest] = {}
        self.started: set[str] = set()
        self.front: dict[str, int] = {}  # request_id -> front rank (requeued)
        self.num_front = 0
        self.done: dict[str, str] = {}  # request_id -> terminal state
        self.accepted: set[str] = set()

    def key(self, r: QueuedRequest) -> tuple:
        dl = math.inf if r.deadline_ms is None else r.deadline_ms
        return (-r.priority, self.front.get(r.request_id, 0), dl, r.seq)


def _check_loads(s: Scheduler, m: Model, cfg: SchedulerConfig) -> None:
    assert s.num_queued == len(m.queued)
    assert s.num_in_flight == len(m.in_flight)
    for name in TENANTS:
        load = s.tenant_loads().get(name)
        nq = sum(r.tenant == name for r in m.queued.values())
        fl = [r for r in m.in_flight.values() if r.tenant == name]
        if load is None:
            assert nq == 0 and not fl
            continue
        assert load.num_queued == nq and load.num_in_flight == len(fl)
        assert load.kv_tokens_in_flight == sum(r.kv_tokens for r in fl)
        tcfg = cfg.tenants[name]
        if tcfg.max_concurrent is not None:
            assert load.num_in_flight <= tcfg.max_concurrent
        if tcfg.max_kv_tokens is not None and load.num_in_flight > 1:
            assert load.kv_tokens_in_flight <= tcfg.max_kv_tokens


def _heads(m: Model) -> dict[tuple[str, str], QueuedRequest]:
    heads: dict[tuple[str, str], QueuedRequest] = {}
    for r in m.queued.values():
        k = (r.tier, r.tenant)
        if k not in heads or m.key(r) < m.key(heads[k]):
            heads[k] = r
    return heads


@pytest.mark.parametrize("policy", ["fifo", "drr", "vtc"])
@FAST
@given(ops=st.lists(op, min_size=20, max_size=80), tcfgs=st.lists(tenant_cfg, min_size=4, max_size=4),
       cost_model=st.sampled_from(["requests", "tokens", "kv_seconds"]),
       floor=st.sampled_from([0.0, 0.3]), aging=st.sampled_from([0.0, 15.0]))
def test_random_operations_keep_every_invariant(policy, ops, tcfgs, cost_model, floor, aging):
    cfg = SchedulerConfig(
        policy=policy, cost_model=cost_model, quantum=25.0,
        tiers=[TierConfig("gold", engine_priority=0),
               TierConfig("free", floor_share=floor, aging_ms=aging, engine_priority=2)],
        tenants={name: TenantConfig(name, max_concurrent=mc, max_kv_tokens=kv, weight=w)
                 for name, (mc, kv, w) in zip(TENANTS, tcfgs, strict=True)},
        share_window_ms=100.0, throttle_window_ms=0,
    )
    s, m = Scheduler(cfg), Model()
    now, ids = 0.0, itertools.count()
    fair = policy != "fifo"

    def pick(pool: dict, i: int) -> str | None:
        return sorted(pool)[i % len(pool)] if pool else None

    def dispatch_checks(out) -> None:
        for d in out:
            r = d.request
            rid = r.request_id
            assert rid in m.queued, f"{rid} dispatched but not queued (twice? dropped?)"
            if fair:  # the best of its tenant's line in its tier
                rivals = [q for q in m.queued.values()
                          if (q.tier, q.tenant) == (r.tier, r.tenant) and q is not r]
                assert all(m.key(r) < m.key(q) for q in rivals)
            # Tier x 1000 + the tenant's requests already in flight (engine-queue
            # fairness within the tier).
            busy = sum(q.tenant == r.tenant for q in m.in_flight.values())
            assert d.engine_priority == 1000 * 2 * TIERS.index(r.tier) + busy
            del m.queued[rid]
            m.front.pop(rid, None)
            m.in_flight[rid] = r

    for o in ops:
        kind = o[0]
        if kind == "submit":
            _, ti, tier, prio, dl, prompt = o
            r = QueuedRequest(f"r{next(ids)}", TENANTS[ti], TIERS[tier], prompt, 10, 10,
                              priority=prio, deadline_ms=None if dl is None else now + dl)
            assert s.submit(r, now).accepted
            assert s.submit(r, now).code is None  # duplicate
            m.queued[r.request_id] = r
            m.accepted.add(r.request_id)
        elif kind == "select":
            out = s.select(o[1], now)
            dispatch_checks(out)
            if len(out) < o[1]:  # work conservation: nothing eligible is left
                if fair:
                    for r in _heads(m).values():
                        assert not s.within_quota(r.tenant, r.kv_tokens), r
                else:
                    for r in m.queued.values():
                        assert not s.within_quota(r.tenant, r.kv_tokens), r
        elif kind == "start":
            rid = pick(m.in_flight, o[1])
            if rid:
                assert s.on_started(rid, now)
                m.started.add(rid)
        elif kind == "finish":
            rid = pick(m.in_flight, o[1])
            if rid:
                usage = ActualUsage(prompt_tokens=m.in_flight[rid].prompt_tokens,
                                    completion_tokens=o[2])
                assert s.on_finished(rid, usage, now) is m.in_flight.pop(rid)
                m.done[rid] = "finished"
        elif kind == "requeue":
            rid = pick(m.in_flight, o[1])
            if rid:
                ok = s.requeue(rid, now)
                assert ok == (rid not in m.started)
                if ok:
                    m.num_front += 1
                    m.front[rid] = -m.num_front
                    m.queued[rid] = m.in_flight.pop(rid)
        elif kind == "cancel":
            rid = pick(m.queued, o[1])
            if rid:
                assert s.cancel(rid) is m.queued.pop(rid)
                m.done[rid] = "cancelled"
        elif kind == "tick":
            now += o[1]
            for d in s.expire(now):
                rid = d.request.request_id
                assert d.code is ErrorCode.EXPIRED and d.request.deadline_ms <= now
                assert m.queued.pop(rid) is d.request
                m.done[rid] = "expired"
            assert all(r.deadline_ms is None or r.deadline_ms > now for r in m.queued.values())
        elif kind == "shed":
            dropped = s.shed(now, o[1])
            assert s.num_queued <= o[1]
            for d in dropped:
                assert d.code is ErrorCode.OVERLOADED and d.retry_after_ms
                m.queued.pop(d.request.request_id)
                m.done[d.request.request_id] = "shed"
            if dropped:  # lowest tier first: nothing of a lower tier is left
                worst = max(TIERS.index(d.request.tier) for d in dropped)
                assert all(TIERS.index(r.tier) <= worst for r in m.queued.values())
        _check_loads(s, m, cfg)

    # Drain: everything still queued is dispatched exactly once.
    for _ in range(1000):
        for rid in list(m.in_flight):
            s.on_finished(rid, None, now)
            m.done[rid] = "finished"
            del m.in_flight[rid]
        if not m.queued:
            break
        now += 1
        out = s.select(8, now)
        assert out, "queued work but nothing dispatched with every quota free"
        dispatch_checks(out)
    assert not m.queued and s.num_queued == 0
    assert set(m.done) == m.accepted


# --- fairness bounds ---------------------------------------------------------------------------


def _flood(s: Scheduler, weights: list[int], n: int, rng: random.Random, max_cost: int) -> None:
    for i in range(len(weights)):
        for j in range(n):
            s.submit(QueuedRequest(f"w{i}-{j}", f"w{i}", "standard", rng.randint(1, max_cost),
                                   0, 0), 0)


@pytest.mark.parametrize("policy", ["drr", "vtc"])
@settings(max_examples=30, deadline=None)
@given(weights=st.lists(st.integers(1, 4), min_size=2, max_size=6),
       quantum=st.sampled_from([1.0, 5.0, 20.0]), max_cost=st.integers(1, 30),
       seed=st.integers(0, 2**16))
def test_weighted_shares_within_bound(policy, weights, quantum, max_cost, seed):
    cfg = SchedulerConfig(policy=policy, cost_model="tokens", quantum=quantum,
                          tenants={f"w{i}": TenantConfig(f"w{i}", weight=w)
                                   for i, w in enumerate(weights)})
    s = Scheduler(cfg)
    n = 300
    _flood(s, weights, n, random.Random(seed), max_cost)
    served = [0.0] * len(weights)
    # DRR: a tenant's service is (rounds ± 1) × quantum × weight, minus a leftover
    # deficit under one request's cost. VTC: counters stay within one request's cost.
    min_w = min(weights)
    bound = (2 * quantum + 2 * max_cost / min_w) if policy == "drr" else max_cost / min_w
    for step in range(n):  # every tenant stays backlogged: each has n requests
        (d,) = s.select(1, step)
        served[int(d.request.tenant[1:])] += d.cost
        norm = [sv / w for sv, w in zip(served, weights, strict=True)]
        assert max(norm) - min(norm) <= bound + 1e-6, (step, norm)


@settings(max_examples=30, deadline=None)
@given(weights=st.lists(st.integers(1, 3), min_size=2, max_size=5),
       quotas=st.lists(st.none() | st.integers(1, 2), min_size=5, max_size=5),
       slots=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_no_starvation_for_within_quota_tenants(weights, quotas, slots, seed):
    rng = random.Random(seed)
    names = [f"n{i}" for i in range(len(weights))]
    cfg = SchedulerConfig(policy="drr", tenants={
        n: TenantConfig(n, weight=w, max_concurrent=q)
        for n, w, q in zip(names, weights, quotas, strict=False)})
    s = Scheduler(cfg)
    ids = itertools.count()
    for _ in range(200):  # n0 floods
        s.submit(QueuedRequest(f"x{next(ids)}", "n0", "standard", 1, 1, 1), 0)
    waited = dict.fromkeys(names, 0)
    bound = sum(weights) + len(weights)
    in_flight: list[str] = []
    for step in range(300):
        for n in names[1:]:
            if rng.random() < 0.3:
                s.submit(QueuedRequest(f"x{next(ids)}", n, "standard", 1, 1, 1), step)
        while in_flight and (len(in_flight) >= slots or rng.random() < 0.5):
            s.on_finished(in_flight.pop(rng.randrange(len(in_flight))), None, step)
        while len(in_flight) < slots:
            eligible = {n for n in names
                        if s.tenant_loads().get(n) and s.tenant_loads()[n].num_queued
                        and s.within_quota(n, 2)}
            out = s.select(1, step)
            if not out:
                assert not eligible  # work conservation
                break
            got = out[0].request.tenant
            in_flight.append(out[0].request.request_id)
            for n in eligible:
                waited[n] = 0 if n == got else waited[n] + 1
                assert waited[n] <= bound, (n, waited)


# --- tiers -----------------------------------------------------------------------------------


def _two_tier(floor: float, aging: float) -> Scheduler:
    cfg = SchedulerConfig(policy="drr", share_window_ms=500.0, tiers=[
        TierConfig("gold"), TierConfig("free", floor_share=floor, aging_ms=aging)])
    s = Scheduler(cfg)
    for i in range(4000):
        s.submit(QueuedRequest(f"g{i}", "g", "gold", 1, 1, 1), 0)
        s.submit(QueuedRequest(f"f{i}", "f", "free", 1, 1, 1), 0)
    return s


@settings(max_examples=15, deadline=None)
@given(floor=st.floats(0.05, 0.6))
def test_floor_honoured_under_overload(floor):
    s = _two_tier(floor, aging=0.0)
    free = total = 0
    for t in range(3000):  # one dispatch per ms, both tiers flooded
        (d,) = s.select(1, float(t))
        if t >= 1000:
            total += 1
            free += d.request.tier == "free"
    assert free / total >= floor - 0.02
    assert free / total <= floor + 0.02  # soft floor: the higher tier gets the rest
    assert s.tier_shares(3000.0)["free"] == pytest.approx(floor, abs=0.03)


def test_idle_floor_is_borrowed():
    cfg = SchedulerConfig(policy="drr", tiers=[TierConfig("gold"),
                                               TierConfig("free", floor_share=0.5)])
    s = Scheduler(cfg)
    for i in range(100):
        s.submit(QueuedRequest(f"g{i}", "g", "gold", 1, 1, 1), 0)
    assert len(s.select(100, 1)) == 100


def test_aging_lets_a_waiting_lower_tier_through():
    s = _two_tier(0.0, aging=50.0)
    last_free, gaps = 0, []
    for t in range(2000):
        (d,) = s.select(1, float(t))
        if d.request.tier == "free":
            gaps.append(t - last_free)
            last_free = t
    assert gaps and max(gaps) <= 51  # one tier level per 50 ms of waiting
    # Without aging, the higher tier takes everything.
    s = _two_tier(0.0, aging=0.0)
    assert all(d.request.tier == "gold" for d in s.select(500, 1.0))


# --- throttling --------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(period=st.integers(1, 20), backlog=st.integers(1, 60), budget=st.integers(1, 2000))
def test_throttle_admits_iff_predicted_wait_fits(period, backlog, budget):
    s = Scheduler(SchedulerConfig(policy="drr", throttle_window_ms=1_000))
    for t in range(0, 1000 + 1, period):  # measured rate: 1 / period cost per ms
        s.submit(QueuedRequest(f"m{t}", "meter", "standard", 1, 1, 1), t)
        s.select(1, t)
    for i in range(backlog):
        s.submit(QueuedRequest(f"b{i}", "a", "standard", 1, 1, 1), 1000)
    wait = s.predicted_wait_ms("a", "standard", 1000)
    assert wait == pytest.approx(backlog * period, rel=0.15)
    adm = s.submit(QueuedRequest("probe", "a", "standard", 1, 1, 1, ttft_budget_ms=budget), 1000)
    if wait > budget:
        assert adm.code is ErrorCode.THROTTLED
        assert adm.retry_after_ms == max(1, math.ceil(wait - budget))
    else:
        assert adm.accepted
