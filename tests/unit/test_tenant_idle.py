"""Bounded per-tenant state (issue 11): idle tenants leave the scheduler, the policy and
the dispatcher's /metrics after the idle period, come back as new, and keep their debt.
Pure: the core is driven directly, time is passed in."""

from __future__ import annotations

import uuid

import pytest
from prometheus_client import REGISTRY

from dispatcher import metrics
from dispatcher.scheduler.core import Scheduler
from dispatcher.scheduler.loads import TenantLoads
from dispatcher.scheduler.pool import PoolCore
from dispatcher.scheduler.types import ActualUsage, QueuedRequest
from dispatcher.stats import StatsTracker
from fairlane import poolconfig
from fairlane.poolconfig import SchedulerConfig

pytestmark = pytest.mark.unit

IDLE_MS = 1_000.0
TIER = "standard"


def _core(policy: str = "drr", **cfg) -> PoolCore:
    cfg.setdefault("cost_model", "tokens")
    cfg.setdefault("quantum", 100.0)
    core = PoolCore(Scheduler(SchedulerConfig(policy=policy, **cfg)), 1e12)
    core.tenant_idle_ms = IDLE_MS
    return core


def _req(rid: str, tenant: str) -> QueuedRequest:
    return QueuedRequest(rid, tenant, TIER, 10, 20, 20)  # tokens cost: 10 + 2 × 20 = 50


def _serve(core: PoolCore, tenant: str, n: int, now: float, usage: ActualUsage | None = None,
           prefix: str = "") -> list[str]:
    """Submit `n` requests of `tenant`, dispatch them to w1, finish them at `now`."""
    rids = [f"{prefix or tenant}-{i}-{now}" for i in range(n)]
    for rid in rids:
        core.submit(_req(rid, tenant), now)
    core.on_pull("w1", 0, now)
    got = [d.request.request_id for d in core.select("w1", n, now)]
    assert sorted(got) == sorted(rids)
    for rid in rids:
        core.on_finished(rid, "w1", usage or ActualUsage(10, 20), now)
    return rids


def _states(core: PoolCore) -> dict:
    return core.scheduler.policy._book.states


def _housekeeping(core: PoolCore, now: float) -> None:
    """What `Dispatcher._housekeeping` does that is not I/O."""
    core.tick(now)
    metrics.observe_scheduler(core.scheduler, now, core.tenant_changes)


def _sample(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


# --- the loads' idle index ----------------------------------------------------------------


def test_loads_forget_only_after_the_idle_period_and_a_busy_tenant_never():
    loads = TenantLoads()
    loads.touch("a")  # a load with nothing in it: idle from the next sweep
    loads.touch("b").num_in_flight = 1
    first = loads.sweep(0.0, IDLE_MS)
    assert set(first.changed) == {"a", "b"} and first.forgotten == []
    assert loads.sweep(IDLE_MS - 1, IDLE_MS).forgotten == []
    later = loads.sweep(IDLE_MS, IDLE_MS)
    assert later.forgotten == ["a"] and later.changed == {}
    assert loads.get("a") is None and loads.get("b") is not None
    assert loads.sweep(100 * IDLE_MS, IDLE_MS).forgotten == []  # b is busy


def test_a_change_restarts_the_idle_period():
    loads = TenantLoads()
    loads.touch("a")
    loads.touch("b")
    loads.sweep(0.0, IDLE_MS)
    loads.touch("a")  # active again (e.g. a rejected submit), still idle
    loads.sweep(500.0, IDLE_MS)
    assert loads.sweep(IDLE_MS, IDLE_MS).forgotten == ["b"]
    assert loads.sweep(IDLE_MS + 500, IDLE_MS).forgotten == ["a"]


def test_a_pass_sees_only_the_tenants_that_changed():
    core = _core()
    for i in range(1_000):
        _serve(core, f"t{i}", 1, 0.0)
    core.tick(1.0)
    assert len(core.tenant_changes.changed) == 1_000
    core.submit(_req("x1", "t7"), 2.0)
    core.tick(3.0)
    assert set(core.tenant_changes.changed) == {"t7"}
    assert core.tenant_changes.forgotten == []
    core.tick(4.0)
    assert core.tenant_changes.changed == {} and core.tenant_changes.forgotten == []


# --- the scheduler and the policies -------------------------------------------------------


@pytest.mark.parametrize("policy", ["fifo", "drr", "vtc"])
def test_idle_tenants_leave_the_scheduler_and_come_back_as_new(policy):
    core = _core(policy)
    for i in range(50):
        _serve(core, f"t{i}", 2, 0.0)
    core.tick(10.0)
    sched = core.scheduler
    assert len(sched.tenant_loads()) == 50
    core.tick(10.0 + IDLE_MS - 1)
    assert len(sched.tenant_loads()) == 50  # not yet
    core.tick(10.0 + IDLE_MS)
    assert sched.tenant_loads() == {}
    assert sorted(core.tenant_changes.forgotten) == sorted(f"t{i}" for i in range(50))
    if policy != "fifo":
        # Gone, but for DRR's last-served state: its emptied queue leaves the ring at
        # the ring's next visit (the next dispatch in its tier).
        left = _states(core)
        assert len(left) <= (1 if policy == "drr" else 0)
        assert all(st.active and not st.queue for st in left.values())
    assert not sched.config._unknown  # the unlisted tenants' cached settings too
    # Back: served as a new tenant, with fresh counters.
    now = 20.0 + IDLE_MS
    _serve(core, "t3", 1, now, prefix="again")
    load = sched.tenant_loads()["t3"]
    assert load.num_in_flight == 0 and load.dispatched_cost == pytest.approx(50.0)


def test_drr_debt_survives_the_tenant_being_forgotten_and_is_repaid_on_return():
    core = _core("drr")
    policy = core.scheduler.policy
    # Declared 20 output tokens, used 100: actual 10 + 200 = 210 against 50 charged.
    _serve(core, "liar", 1, 0.0, usage=ActualUsage(10, 100))
    _serve(core, "honest", 1, 0.0, usage=ActualUsage(10, 5))
    _serve(core, "other", 1, 1.0)  # its turn visits the emptied ones: they leave the ring
    debt = policy.deficit(TIER, "liar")
    assert debt == pytest.approx(100 - 50 - 160)  # quantum - charge - true-up
    core.tick(2.0)
    core.tick(2.0 + IDLE_MS)
    assert "liar" not in core.scheduler.tenant_loads()
    assert (TIER, "liar") in _states(core) and (TIER, "honest") not in _states(core)
    assert policy.deficit(TIER, "liar") == pytest.approx(debt)
    # Back: it pays its debt off before its credit counts (forgiven, it would have 50).
    _serve(core, "liar", 1, 10 * IDLE_MS, prefix="back")
    assert policy.deficit(TIER, "liar") == pytest.approx(debt + 2 * 100 - 50)


def test_drr_true_up_of_a_forgotten_tenant_makes_no_state_unless_in_debt():
    core = _core("drr")
    policy = core.scheduler.policy
    for name in ("a", "b"):
        core.submit(_req(f"{name}1", name), 0.0)
    core.on_pull("w1", 0, 0.0)
    core.select("w1", 2, 0.0)
    _serve(core, "c", 1, 0.0)  # the ring visits a and b: idle, owing nothing, gone
    assert (TIER, "a") not in _states(core) and (TIER, "b") not in _states(core)
    core.on_finished("a1", "w1", ActualUsage(10, 5), 1.0)  # used less: nothing to keep
    core.on_finished("b1", "w1", ActualUsage(10, 100), 1.0)  # used more: debt
    assert (TIER, "a") not in _states(core)
    assert policy.deficit(TIER, "b") == pytest.approx(-160)


def test_vtc_keeps_a_counter_above_the_floor_until_the_floor_passes_it():
    core = _core("vtc")
    policy = core.scheduler.policy
    _serve(core, "x", 1, 0.0, usage=ActualUsage(10, 100))  # counter 50 + 160 = 210
    assert policy.counter(TIER, "x") == pytest.approx(210)
    core.tick(1.0)
    core.tick(1.0 + IDLE_MS)
    assert "x" not in core.scheduler.tenant_loads()
    assert policy.counter(TIER, "x") == pytest.approx(210)  # above the floor (50): kept
    # Others are served: the floor rises past 210 and x's state goes.
    now = 2 * IDLE_MS
    _serve(core, "y", 5, now)  # lifted to 50, then 5 × 50
    core.tick(now + 1)
    assert (TIER, "x") not in _states(core)
    # Back, it is lifted to the floor like any newcomer.
    _serve(core, "x", 1, now + 2, prefix="back")
    assert policy.counter(TIER, "x") == pytest.approx(300 + 50)


# --- /metrics --------------------------------------------------------------------------------


def test_metrics_label_sets_go_after_the_idle_period_and_come_back():
    core = _core("drr")
    t = f"m-{uuid.uuid4().hex[:8]}"  # the registry is the process's: a name of its own
    core.submit(_req("q1", t), 0.0)
    _housekeeping(core, 1.0)
    assert _sample("fairlane_dispatcher_queue_depth", tenant=t) == 1
    core.on_pull("w1", 0, 2.0)
    (d,) = core.select("w1", 1, 2.0)
    # What the shell records per dispatch and per preemption.
    metrics.DISPATCHED_COST.labels(tenant=t, tier=TIER).inc(d.cost)
    metrics.PREEMPTIONS.labels(tier=TIER, tenant=t).inc()
    _housekeeping(core, 3.0)
    assert _sample("fairlane_dispatcher_queue_depth", tenant=t) == 0
    assert _sample("fairlane_dispatcher_in_flight", tenant=t) == 1
    core.on_finished("q1", "w1", ActualUsage(10, 20), 4.0)
    _housekeeping(core, 5.0)
    assert _sample("fairlane_dispatcher_in_flight", tenant=t) == 0  # idle: still there
    assert _sample("fairlane_dispatcher_dispatched_cost_total", tenant=t, tier=TIER) == 50
    _housekeeping(core, 5.0 + IDLE_MS)
    for name, labels in [("fairlane_dispatcher_queue_depth", {"tenant": t}),
                         ("fairlane_dispatcher_in_flight", {"tenant": t}),
                         ("fairlane_dispatcher_dispatched_cost_total", {"tenant": t, "tier": TIER}),
                         ("fairlane_dispatcher_preemptions_total", {"tenant": t, "tier": TIER})]:
        assert _sample(name, **labels) is None, name
    # Back: its series are made again.
    core.submit(_req("q2", t), 10 * IDLE_MS)
    _housekeeping(core, 10 * IDLE_MS + 1)
    assert _sample("fairlane_dispatcher_queue_depth", tenant=t) == 1


def test_a_busy_tenant_keeps_its_series():
    core = _core("drr")
    t = f"m-{uuid.uuid4().hex[:8]}"
    core.submit(_req("q1", t), 0.0)
    _housekeeping(core, 1.0)
    _housekeeping(core, 100 * IDLE_MS)  # queued all along (no worker): not idle
    assert _sample("fairlane_dispatcher_queue_depth", tenant=t) == 1


# --- the stats snapshot and the config cache ------------------------------------------------


def test_stats_count_a_returning_tenants_cost_from_its_fresh_load():
    core = _core("drr", cost_model="requests", quantum=1.0, share_window_ms=1e12)
    tracker = StatsTracker()
    core.observer = tracker
    _serve(core, "x", 3, 0.0)
    tracker.snapshot(core, 1.0, pool="p")
    assert tracker._recent["x"] == pytest.approx(3)
    core.tick(2.0)
    core.tick(2.0 + IDLE_MS)
    assert "x" not in core.scheduler.tenant_loads()
    _serve(core, "x", 1, 3.0 + IDLE_MS, prefix="back")
    tracker.snapshot(core, 4.0 + IDLE_MS, pool="p")
    assert tracker._recent["x"] == pytest.approx(4)  # 3 before + 1 since, none lost


def test_unlisted_tenants_settings_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(poolconfig, "MAX_UNKNOWN_CACHED", 3)
    cfg = SchedulerConfig()
    for i in range(10):
        assert cfg.tenant(f"u{i}").name == f"u{i}"
    assert len(cfg._unknown) == 3 and "u9" in cfg._unknown
    cfg.forget_unknown(["u9", "nobody"])
    assert "u9" not in cfg._unknown


def test_preemption_counts_of_forgotten_tenants_go_too():
    core = _core("drr")
    _serve(core, "a", 1, 0.0)
    core.scheduler.preemptor.preempted[(TIER, "a")] += 1
    core.tick(1.0)
    core.tick(1.0 + IDLE_MS)
    assert (TIER, "a") not in core.scheduler.preemptor.preempted
