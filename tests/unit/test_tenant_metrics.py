"""Bounded tenant labels (`fairlane.metrics_labels`) and the dispatcher's per-tenant
series (`dispatcher.metrics`): rejections by reason, queue wait and TTFT per tier and
per tenant, ``_other`` beyond the bound (gauges summed), series gone with the tenant.

The dispatcher's series live on the process's default registry: each test names its
tenants uniquely and swaps in a fresh `TenantLabels` (and ``_other``'s sums)."""

from __future__ import annotations

import uuid

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, Counter

from dispatcher import metrics
from dispatcher.scheduler.actions import Ack
from dispatcher.scheduler.types import QueuedRequest
from fairlane.metrics_labels import OTHER_TENANT, UNKNOWN_TENANT, TenantLabels
from streamer import metrics as edge_metrics
from tests.unit.test_tenant_idle import IDLE_MS, TIER, _core, _housekeeping, _req

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _sample(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


@pytest.fixture
def labels(monkeypatch) -> tuple[TenantLabels, Clock]:
    """The dispatcher's bound, fresh: 2 tenants, 60 s idle, a clock of our own."""
    clock = Clock()
    fresh = TenantLabels(max_tenants=2, idle_s=60.0, clock=clock)
    monkeypatch.setattr(metrics, "TENANTS", fresh)
    monkeypatch.setattr(metrics, "_overflow", {})
    monkeypatch.setattr(metrics, "_overflow_sum", [0, 0])
    return fresh, clock


def _names(n: int) -> list[str]:
    tag = uuid.uuid4().hex[:6]
    return [f"t{i}-{tag}" for i in range(n)]


# --- TenantLabels -----------------------------------------------------------------------


def test_kept_tenants_are_never_given_up_for_idleness_and_forget_removes_series():
    clock = Clock()
    reg = CollectorRegistry()
    counter = Counter("c_total", "c", ["tenant", "reason"], registry=reg)
    held = {"a"}
    lab = TenantLabels(max_tenants=2, idle_s=60.0, clock=clock, keep=held.__contains__)
    lab.child(counter, "a", "x").inc()
    lab.child(counter, "b", "x").inc()
    clock.t += 100  # both idle; a is kept (held), b is not
    assert lab.label("c") == OTHER_TENANT  # the oldest (a) is kept: its clock restarts
    assert "a" in lab and reg.get_sample_value("c_total", {"tenant": "a", "reason": "x"}) == 1
    assert lab.expire() == 1  # b
    assert reg.get_sample_value("c_total", {"tenant": "b", "reason": "x"}) is None
    assert lab.label("c") == "c"  # room again
    lab.forget("a")
    assert reg.get_sample_value("c_total", {"tenant": "a", "reason": "x"}) is None
    # The shared values take no place and are never removed.
    for shared in (OTHER_TENANT, UNKNOWN_TENANT):
        lab.child(counter, shared, "x").inc()
    assert len(lab) == 1 and lab.expire() == 0
    clock.t += 100
    held.clear()
    assert lab.expire() == 1 and len(lab) == 0
    assert reg.get_sample_value("c_total", {"tenant": UNKNOWN_TENANT, "reason": "x"}) == 1


def test_a_child_is_looked_up_once_and_a_forgotten_tenant_counts_from_zero_again():
    """`child` keeps each series' child (the hot paths skip prometheus_client's label
    checks); a tenant's go with its series, so it never counts into a removed one."""
    clock = Clock()
    reg = CollectorRegistry()
    counter = Counter("c_total", "c", ["tenant", "reason"], registry=reg)
    lab = TenantLabels(max_tenants=2, idle_s=60.0, clock=clock)
    first = lab.child(counter, "a", "x")
    assert lab.child(counter, "a", "x") is first
    assert lab.child(counter, "a", "y") is not first  # another label set, another child
    first.inc(3)
    lab.forget("a")
    assert reg.get_sample_value("c_total", {"tenant": "a", "reason": "x"}) is None
    again = lab.child(counter, "a", "x")
    assert again is not first
    again.inc()
    assert reg.get_sample_value("c_total", {"tenant": "a", "reason": "x"}) == 1
    # Idle expiry drops them too; beyond the bound a tenant counts under _other's child.
    lab.child(counter, "b", "x").inc()
    clock.t += 100
    assert lab.expire() == 2
    lab.child(counter, "c", "x").inc()
    lab.child(counter, "d", "x").inc()
    lab.child(counter, "e", "x").inc()  # the bound is 2, nobody idle: counted as _other
    assert reg.get_sample_value("c_total", {"tenant": "b", "reason": "x"}) is None
    assert reg.get_sample_value("c_total", {"tenant": "a", "reason": "x"}) is None
    assert reg.get_sample_value("c_total", {"tenant": OTHER_TENANT, "reason": "x"}) == 1
    assert lab.child(counter, "b", "x") is lab.child(counter, OTHER_TENANT, "x")


def test_expire_terminates_when_every_tenant_is_kept_with_no_idle_period():
    clock = Clock()
    lab = TenantLabels(max_tenants=5, idle_s=0.0, clock=clock, keep=lambda t: True)
    for t in "abc":
        lab.label(t)
    assert lab.expire() == 0 and len(lab) == 3


# --- the dispatcher ---------------------------------------------------------------------


def test_beyond_the_bound_tenants_count_as_other_and_forgotten_ones_lose_every_series(labels):
    lab, _ = labels
    names = _names(3)
    core = _core("drr")
    for i, tenant in enumerate(names):
        core.submit(_req(f"{tenant}-q", tenant), float(i))
    _housekeeping(core, 3.0)
    # Two of them (whichever the pass met first) have their own series; the third not.
    (a, b), (c,) = [t for t in names if t in lab], [t for t in names if t not in lab]
    assert _sample("fairlane_dispatcher_queue_depth", tenant=a) == 1
    assert _sample("fairlane_dispatcher_queue_depth", tenant=b) == 1
    assert _sample("fairlane_dispatcher_queue_depth", tenant=c) is None  # over the bound
    assert _sample("fairlane_dispatcher_queue_depth", tenant=OTHER_TENANT) == 1
    assert _sample("fairlane_dispatcher_metric_tenants") == 2

    metrics.rejected(c, "queue_full")
    metrics.rejected(None, "malformed")
    assert _sample("fairlane_dispatcher_rejected_total", tenant=c, reason="queue_full") is None
    assert _sample("fairlane_dispatcher_rejected_total", tenant=UNKNOWN_TENANT,
                   reason="malformed") >= 1

    # Dispatched at 10 ms, started at 30 ms: what the shell records for each.
    core.on_pull("w1", 0, 10.0)
    for d in core.select("w1", 3, 10.0):
        metrics.dispatched(d.request, (10.0 - d.request.arrival_ms) / 1000, d.cost)
    _housekeeping(core, 11.0)
    assert _sample("fairlane_dispatcher_in_flight", tenant=a) == 1
    assert _sample("fairlane_dispatcher_in_flight", tenant=OTHER_TENANT) == 1
    assert _sample("fairlane_dispatcher_queue_depth", tenant=OTHER_TENANT) == 0
    arrival_a_ms = float(names.index(a))  # submitted at 0, 1 and 2 ms, in `names` order
    assert _sample("fairlane_dispatcher_tenant_queue_wait_seconds_sum",
                   tenant=a) == pytest.approx((10.0 - arrival_a_ms) / 1000)
    assert _sample("fairlane_dispatcher_dispatched_cost_total", tenant=b, tier=TIER) == 50
    for tenant in (a, b, c):
        metrics.started(core.on_started(f"{tenant}-q", "w1", 30.0), None, 30.0)
    assert _sample("fairlane_dispatcher_tenant_ttft_seconds_count", tenant=a) == 1
    assert _sample("fairlane_dispatcher_tenant_ttft_seconds_sum",
                   tenant=a) == pytest.approx((30.0 - arrival_a_ms) / 1000)
    assert _sample("fairlane_dispatcher_tenant_ttft_seconds_count", tenant=c) is None

    for tenant in (a, b, c):
        core.on_finished(f"{tenant}-q", "w1", None, 40.0)
    _housekeeping(core, 41.0)
    _housekeeping(core, 42.0 + IDLE_MS)  # idle long enough: the scheduler forgets them
    for name in ("queue_depth", "in_flight", "tenant_queue_wait_seconds_count",
                 "tenant_ttft_seconds_count"):
        assert _sample(f"fairlane_dispatcher_{name}", tenant=a) is None, name
    assert _sample("fairlane_dispatcher_dispatched_cost_total", tenant=b, tier=TIER) is None
    assert _sample("fairlane_dispatcher_in_flight", tenant=OTHER_TENANT) == 0
    assert len(lab) == 0 and _sample("fairlane_dispatcher_metric_tenants") == 0


def test_a_tenant_only_ever_refused_loses_its_series_after_the_idle_period(labels):
    lab, clock = labels
    refused, held = _names(2)
    core = _core("drr")
    core.submit(_req(f"{held}-q", held), 0.0)  # queued for ever (no worker)
    _housekeeping(core, 1.0)
    metrics.rejected(refused, "unknown_tenant")
    assert _sample("fairlane_dispatcher_rejected_total", tenant=refused,
                   reason="unknown_tenant") == 1
    clock.t += 61
    _housekeeping(core, 2.0)
    assert _sample("fairlane_dispatcher_rejected_total", tenant=refused,
                   reason="unknown_tenant") is None
    assert held in lab  # the scheduler still holds it: kept, however long idle
    assert _sample("fairlane_dispatcher_queue_depth", tenant=held) == 1


def test_ttft_leaves_continuations_out_and_times_their_resume(labels):
    tenant = _names(1)[0]
    fresh = QueuedRequest("r1", tenant, "ttft-tier", 10, 20, 20, arrival_ms=100.0)
    cont = QueuedRequest("r2", tenant, "ttft-tier", 10, 20, 20, arrival_ms=100.0,
                         num_preemptions=1)

    def count(name: str) -> float:
        return _sample(name, tier="ttft-tier") or 0.0

    ttft, resume = count("fairlane_dispatcher_ttft_seconds_count"), count(
        "fairlane_dispatcher_resume_seconds_count")
    metrics.started([Ack(fresh, "started")], None, 350.0)
    metrics.started([Ack(cont, "started")], 300.0, 350.0)
    metrics.started([], None, 400.0)  # a repeat the core ignored: nothing
    assert count("fairlane_dispatcher_ttft_seconds_count") == ttft + 1
    assert count("fairlane_dispatcher_resume_seconds_count") == resume + 1
    assert _sample("fairlane_dispatcher_tenant_ttft_seconds_sum",
                   tenant=tenant) == pytest.approx(0.25)


# --- the streamer -------------------------------------------------------------------------


def test_streamer_requests_count_refusals_by_tenant_with_the_bound(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(edge_metrics, "TENANTS", TenantLabels(1, 60.0, clock=clock))
    a, b = _names(2)
    edge_metrics.request(a, "chat", "accepted")
    edge_metrics.request(b, "chat", "rate_limited")  # over the bound
    edge_metrics.request(None, "ws", "unauthorized")
    get = REGISTRY.get_sample_value
    name = "fairlane_streamer_requests_total"
    assert get(name, {"tenant": a, "endpoint": "chat", "outcome": "accepted"}) == 1
    assert get(name, {"tenant": OTHER_TENANT, "endpoint": "chat", "outcome": "rate_limited"}) >= 1
    assert get(name, {"tenant": UNKNOWN_TENANT, "endpoint": "ws", "outcome": "unauthorized"}) >= 1
    clock.t += 61
    edge_metrics.expire()  # what a scrape does first
    assert get(name, {"tenant": a, "endpoint": "chat", "outcome": "accepted"}) is None
