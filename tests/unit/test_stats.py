"""The pool's stats snapshot (`dispatcher.stats`): shares against fair shares, queue
wait and TTFT percentiles, windowed rejections and preemptions, the cap on tenant rows.
Pure: the core is driven directly, time is passed in."""

from __future__ import annotations

import pytest

from dispatcher.scheduler.core import Scheduler
from dispatcher.scheduler.pool import PoolCore
from dispatcher.scheduler.types import QueuedRequest
from dispatcher.stats import StatsTracker, percentile
from fairlane.poolconfig import SchedulerConfig, TenantConfig, TierConfig
from fairlane.protocol import decode_pool_stats, encode

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def _core(**cfg) -> tuple[PoolCore, StatsTracker]:
    cfg.setdefault("cost_model", "requests")
    core = PoolCore(Scheduler(SchedulerConfig(policy="drr", **cfg)), 3_000.0)
    tracker = StatsTracker()
    core.observer = tracker
    return core, tracker


def _req(rid: str, tenant: str, tier: str = "standard", **kw) -> QueuedRequest:
    return QueuedRequest(rid, tenant, tier, 10, 20, 20, **kw)


def _run(core: PoolCore, reqs: list[QueuedRequest], now: float) -> list[str]:
    """Submit `reqs` at `now` and dispatch all of them to worker w1."""
    for r in reqs:
        core.submit(r, now)
    core.on_pull("w1", 0, now)
    return [d.request.request_id for d in core.select("w1", len(reqs), now)]


def _rows(snap):
    return {t.tenant: t for t in snap.tenants}, {t.tier: t for t in snap.tiers}


TIERED = dict(
    tiers=[TierConfig("paid", floor_share=0.5), TierConfig("free")],
    tenants={"a": TenantConfig("a", tier="paid", weight=2),
             "b": TenantConfig("b", tier="paid", weight=1),
             "c": TenantConfig("c", tier="free", weight=1),
             "idle": TenantConfig("idle", tier="paid", weight=5)},
    allow_unknown_tenants=False,
)


def test_shares_add_up_per_tier_and_fair_share_splits_the_tier_by_active_weight():
    core, tracker = _core(**TIERED)
    assert len(_run(core, [_req(f"a{i}", "a", "paid") for i in range(3)], 0)) == 3
    assert _run(core, [_req("b1", "b", "paid")], 0) == ["b1"]
    assert _run(core, [_req("c1", "c", "free")], 0) == ["c1"]
    core.submit(_req("a9", "a", "paid"), 0)  # queued: a and b are both active
    core.submit(_req("b9", "b", "paid"), 0)
    snap = tracker.snapshot(core, 0, pool="p", ts_ms=123, epoch=7)
    tenants, tiers = _rows(snap)
    assert (snap.pool, snap.ts_ms, snap.epoch, snap.policy, snap.cost_model) == (
        "p", 123, 7, "drr", "requests")
    # Recent cost: a 3, b 1, c 1 (requests): paid 4/5, free 1/5, as the floors see it.
    assert tiers["paid"].share == pytest.approx(0.8) and tiers["free"].share == pytest.approx(0.2)
    assert tiers["paid"].floor_share == 0.5
    assert tenants["a"].share == pytest.approx(0.6) and tenants["b"].share == pytest.approx(0.2)
    assert tenants["c"].share == pytest.approx(0.2)
    # Fair: the paid tier's 0.8 split 2:1 between its active tenants a and b.
    assert tenants["a"].fair_share == pytest.approx(0.8 * 2 / 3, abs=1e-4)
    assert tenants["b"].fair_share == pytest.approx(0.8 / 3, abs=1e-4)
    assert tenants["c"].fair_share == pytest.approx(0.2)  # alone in its tier
    assert "idle" not in tenants  # never active: no row, and no claim on a's and b's share
    assert (tenants["a"].num_queued, tenants["a"].num_in_flight, tenants["a"].weight) == (1, 3, 2)
    assert (tiers["paid"].num_queued, tiers["paid"].num_in_flight) == (2, 4)
    assert (tiers["paid"].num_tenants_active, tiers["free"].num_tenants_active) == (2, 1)
    assert (snap.num_queued, snap.num_in_flight, snap.num_workers) == (2, 5, 1)
    assert snap.num_tenants_active == 3
    assert decode_pool_stats(encode(snap)) == snap


def test_an_idle_tenant_keeps_its_decaying_share_but_claims_no_fair_share():
    core, tracker = _core(**TIERED)
    _run(core, [_req("a1", "a", "paid")], 0)
    _run(core, [_req("b1", "b", "paid")], 0)
    core.on_started("a1", "w1", 10)
    core.on_finished("a1", "w1", None, 20)  # a: nothing queued or running now
    tenants, _ = _rows(tracker.snapshot(core, 20, pool="p"))
    assert tenants["a"].share == pytest.approx(0.5) and tenants["a"].fair_share == 0
    assert tenants["b"].fair_share == pytest.approx(1.0)  # all of its tier, alone there
    # Later, b keeps dispatching: a's share decays towards 0.
    for i in range(50):
        _run(core, [_req(f"b{i + 2}", "b", "paid")], 1_000 * (i + 1))
        tenants, _ = _rows(tracker.snapshot(core, 1_000 * (i + 1), pool="p"))
    assert tenants["b"].share > 0.95
    assert tenants.get("a") is None or tenants["a"].share < 0.05


def test_queue_wait_and_ttft_percentiles_are_per_tenant_and_per_tier():
    core, tracker = _core()
    for i in range(100):  # arrived at 0, dispatched after i+1 ms, started 100 ms later
        core.submit(_req(f"r{i}", "t"), 0)
    for i in range(100):
        core.on_pull("w1", 0, i + 1)
        (d,) = core.select("w1", 1, i + 1)
        core.on_started(d.request.request_id, "w1", i + 101)
    snap = tracker.snapshot(core, 200, pool="p")
    (t,), (tier,) = snap.tenants, snap.tiers
    assert (t.queue_wait_p50_ms, t.queue_wait_p99_ms) == (50.0, 99.0)
    assert (t.ttft_p50_ms, t.ttft_p99_ms) == (150.0, 199.0)
    assert (tier.queue_wait_p50_ms, tier.ttft_p99_ms) == (50.0, 199.0)
    assert percentile([1.0], 0.99) == 1.0 and percentile([1.0, 2.0], 0.5) == 1.0


def test_rejections_and_preemptions_count_over_the_window_only():
    core, tracker = _core(**TIERED)
    core.submit(_req("x1", "stranger", "paid"), 0)  # unknown tenant: refused
    core.submit(_req("b1", "b", "free"), 0)  # listed in paid: refused (wrong tier)
    core.submit(_req("b2", "b", "paid"), 0)
    core.on_cancel("b2", "client_gone", 0)  # a cancel is not a rejection
    _run(core, [_req("a1", "a", "paid")], 0)
    core.on_started("a1", "w1", 5)
    core.on_preempted("a1", "w1", 3, 2_000)  # handed back as a continuation
    core.on_pull("w1", 0, 2_100)
    core.select("w1", 1, 2_100)
    core.on_started("a1", "w1", 2_200)  # a continuation: no second TTFT sample
    snap = tracker.snapshot(core, 2_500, pool="p")
    tenants, tiers = _rows(snap)
    assert tenants["stranger"].num_rejected == 1 and tenants["b"].num_rejected == 1
    assert tiers["paid"].num_rejected == 1 and tiers["free"].num_rejected == 1
    assert tenants["a"].num_preempted == 1 and tiers["paid"].num_preempted == 1
    assert tenants["a"].ttft_p50_ms == 5.0 and tenants["a"].ttft_p99_ms == 5.0
    # A window on (counts are kept per second), with nothing new: the events are out
    # of it, and so is the rejected stranger (no load, no share, no event).
    snap = tracker.snapshot(core, 3_000 + tracker.window_ms, pool="p")
    tenants, tiers = _rows(snap)
    assert "stranger" not in tenants
    assert tiers["paid"].num_rejected == 0 and tiers["paid"].num_preempted == 0
    assert tenants["a"].num_in_flight == 1 and tenants["a"].num_preempted == 0


def test_tenant_rows_are_capped_to_the_busiest_and_the_message_stays_small():
    core, tracker = _core()
    tracker.max_tenants = 50
    n = 20_000
    for i in range(n):
        core.submit(_req(f"r{i}", f"tenant-{i:05d}"), 0)
    for i in range(5):
        core.submit(_req(f"big{i}", "big"), 0)
    core.on_pull("w1", 0, 1)
    core.select("w1", 10, 1)  # some dispatched: in flight
    snap = tracker.snapshot(core, 2, pool="p")
    assert len(snap.tenants) == 50 and snap.num_tenants_active == n + 1
    assert snap.num_tenants_omitted == n + 1 - 50
    assert snap.tenants[0].tenant == "big" and snap.tenants[0].num_queued == 5
    assert len(snap.tiers) == 1 and snap.tiers[0].num_queued == n + 5 - 10
    assert len(encode(snap)) < 20_000
    tracker.max_tenants = 200
    assert len(encode(tracker.snapshot(core, 3, pool="p"))) < 80_000  # the default cap


def test_the_core_runs_the_same_without_a_tracker():
    core = PoolCore(Scheduler(SchedulerConfig(policy="drr")), 3_000.0)
    core.submit(_req("a", "t"), 0)
    core.on_pull("w1", 0, 1)
    assert [d.request.request_id for d in core.select("w1", 1, 1)] == ["a"]
    assert core.on_started("a", "w1", 2)[0].reason == "started"
