"""Preemption decisions at many tenants (`dispatcher.scheduler.preempt`): what a
decision costs is O(tenants with demand), so a request that cannot change its outcome
must not force one, a decision that weighed many tenants spaces the next one, and the
running counts come from the core's index, not from walking every request."""

from __future__ import annotations

import pytest

from dispatcher.scheduler.core import Scheduler
from dispatcher.scheduler.pool import PoolCore
from fairlane.poolconfig import TenantConfig, TierConfig
from tests.unit.test_preempt import cfg, flood, req, run, worker_of

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("policy", ["drr", "vtc"])
def test_a_new_tenant_that_cannot_be_owed_a_slot_does_not_force_a_decision(policy):
    """After a decision that found nothing, a request from a tenant with nothing queued
    decides anew at once only if that tenant could be owed a slot: its share is at most
    weight x the tier's level, which a new demand only lowers. Twelve one-request
    tenants on four slots hold a third of a slot each; a thirteenth cannot be owed one
    (no decision until the recheck), a tenant of weight 40 can (decided, and served)."""
    s = Scheduler(cfg(policy, min_run_ms=0, quiet_preempt_after_ms=0,
                      tenants={"vip": TenantConfig("vip", weight=40)}))
    core = PoolCore(s, 3_500.0)
    for i in range(12):
        core.submit(req(f"t{i}"), 0.0)
    run(s, 4, 0.0)
    decided = []
    weigh = s.policy.fair_shares
    s.policy.fair_shares = lambda *a: decided.append(a[0]) or weigh(*a)
    assert s.preemptions(1_000.0, 0, worker_of) == []  # nobody is short by a whole slot
    assert decided == ["standard"]
    core.submit(req("new"), 1_005.0)
    assert s.preemptions(1_005.0, 0, worker_of) == [] and decided == ["standard"]
    assert s.preemptions(1_021.0, 0, worker_of) == [] and len(decided) == 2  # the recheck
    core.submit(req("vip"), 1_025.0)
    (order,) = s.preemptions(1_025.0, 0, worker_of)
    assert order.for_tenant == "vip" and len(decided) > 2  # decided at once


def test_a_decision_that_weighed_many_tenants_spaces_the_next_one():
    """Above `spacing_from` tenants weighed, the next decision waits
    `spacing_ms_per_tenant` per tenant weighed, whether the decision ordered or not and
    even for a new waiter; at or below it, the next decision may follow at once."""
    s = Scheduler(cfg(min_run_ms=0, quiet_preempt_after_ms=0))
    s.preemptor.spacing_from, s.preemptor.spacing_ms_per_tenant = 2, 10.0
    flood(s, "a", 10, 0)
    run(s, 4, 0)
    flood(s, "b", 1, 100)
    (order,) = s.preemptions(100, 0, worker_of)
    # Weighed: a's running count, then a and b's shares twice (for b's order, and the
    # look for another after it).
    weighed = s.preemptor.num_weighed
    assert (s.preemptor.num_decisions, weighed) == (1, 5)
    flood(s, "c", 1, 101)  # quiet and owed a slot, and it pokes: still spaced
    assert s.preemptions(101, 0, worker_of) == []
    assert s.preemptions(100 + weighed * 10.0 - 1, 0, worker_of) == []
    assert s.preemptor.num_decisions == 1
    (order,) = s.preemptions(100 + weighed * 10.0, 0, worker_of)
    assert order.for_tenant == "c"
    # Not spaced when it weighs no more than spacing_from.
    s2 = Scheduler(cfg(min_run_ms=0, quiet_preempt_after_ms=0))
    s2.preemptor.spacing_from = 5  # its first decision weighs 5
    flood(s2, "a", 10, 0)
    run(s2, 4, 0)
    flood(s2, "b", 1, 100)
    assert len(s2.preemptions(100, 0, worker_of)) == 1
    flood(s2, "c", 1, 100)
    assert len(s2.preemptions(100, 0, worker_of)) == 1


def test_the_running_index_follows_dispatches_and_releases():
    """`Scheduler.running` (what decisions count) agrees with the requests in flight."""
    s = Scheduler(cfg(tiers=[TierConfig("gold"), TierConfig("standard")]))
    flood(s, "a", 3, 0)
    flood(s, "b", 2, 0, tier="gold")
    ids = [d.request.request_id for d in s.select(5, 0)]

    def index() -> dict[tuple[int, str], list[str]]:
        return {(i, t): list(m) for i in (0, 1) for t, m in s.running.tier(i).items()}

    def expected() -> dict[tuple[int, str], list[str]]:
        out: dict[tuple[int, str], list[str]] = {}
        for rid, f in s.in_flight_entries():
            out.setdefault((f.tier_index, f.request.tenant), []).append(rid)
        return out

    assert index() == expected() and len(index()) == 2
    s.on_finished(ids[0], None, 1)
    assert s.requeue(ids[1], 2)
    s.on_started(ids[2], 3)
    s.preempted(ids[2], 5, 4)
    assert index() == expected()
    for rid in list(s.in_flight_ids()):
        s.on_finished(rid, None, 5)
    assert index() == {} and s.running.tier(7) == {}


def test_the_dispatchers_metrics_count_decisions_and_tenants_weighed():
    """`fairlane_dispatcher_preemption_decisions_total` and `..._tenants_weighed_total`
    follow the preemptors' counts, per pass; a second scheduler in the process (a
    takeover, a standby) counts from its own 0, passes interleaved or not."""
    from prometheus_client import REGISTRY

    from dispatcher import metrics
    from dispatcher.scheduler.loads import TenantChanges

    def sample(name: str) -> float:
        return REGISTRY.get_sample_value(f"fairlane_dispatcher_{name}_total") or 0.0

    def preempting() -> Scheduler:
        s = Scheduler(cfg(min_run_ms=0, quiet_preempt_after_ms=0))
        flood(s, "a", 10, 0)
        run(s, 4, 0)
        flood(s, "b", 1, 100)
        assert len(s.preemptions(100, 0, worker_of)) == 1  # one decision, 5 weighed
        return s

    before = sample("preemption_decisions"), sample("preemption_tenants_weighed")
    first, second = preempting(), preempting()
    for s in (first, second, first, second):  # a pass with nothing new adds nothing
        metrics.observe_scheduler(s, 100, TenantChanges())
    assert sample("preemption_decisions") - before[0] == 2
    assert sample("preemption_tenants_weighed") - before[1] == 2 * 5
