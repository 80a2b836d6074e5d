"""Preemption decisions at many tenants (`dispatcher.scheduler.preempt`): what a
decision costs is O(tenants with demand), so a request that cannot change its outcome
must not force one."""

from __future__ import annotations

import pytest

from dispatcher.scheduler.core import Scheduler
from dispatcher.scheduler.pool import PoolCore
from fairlane.poolconfig import TenantConfig
from tests.unit.test_preempt import cfg, req, run, worker_of

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
