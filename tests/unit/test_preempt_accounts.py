"""Who pays for work a preemption stopped: the refunds of a charge made while no other
tenant of the tier waited are not credit (`DrrPolicy.true_up`, `VtcPolicy.true_up`).
Scenarios in the pure core; the rest of preemption is in test_preempt.py."""

from __future__ import annotations

import pytest

from dispatcher.scheduler.core import Scheduler
from dispatcher.scheduler.types import ActualUsage
from tests.unit.test_preempt import cfg, flood, run, worker_of

pytestmark = pytest.mark.unit


def _credit(s: Scheduler, tenant: str, tier: str = "standard") -> float:
    return s.policy._book.states[(tier, tenant)].credit


@pytest.mark.parametrize("policy", ["drr", "vtc"])
@pytest.mark.parametrize("contended", [False, True])
def test_overpayment_comes_back_only_if_others_contended_the_charge(policy, contended):
    """A tenant alone in its tier pays from quanta (DRR) or a counter (VTC) nobody else
    wanted; handed back later, what its preempted or finished requests did not use would
    become credit against tenants that waited meanwhile: it is not handed back."""
    s = Scheduler(cfg(policy, cost_model="tokens", quantum=210, min_run_ms=0))
    flood(s, "a", 20, 0, prompt=10, out=100)
    if contended:
        flood(s, "c", 20, 0, prompt=10, out=100)
    ids = [r for r in run(s, 4, 0) if r.startswith("a")]
    before = _credit(s, "a")
    s.preempted(ids[0], 5, 1000)  # did 10 + 5 of its 10 + 100 tokens
    s.on_finished(ids[1], ActualUsage(10, 50), 1000)
    refunded = _credit(s, "a") - before
    if contended:
        assert refunded > 0
    else:
        assert refunded == 0


def test_work_a_tenant_began_on_an_idle_fleet_is_served_again_within_its_share():
    """a fills the idle fleet alone; b arrives and a preemption gives it one of a's
    slots. a's continuation then takes a's next turn (a pays for the work left again:
    its first payment came from quanta nobody contended), rather than running on top
    of it, so the turns alternate from the start."""
    s = Scheduler(cfg(cost_model="tokens", quantum=210, preempt_after_ms=0, min_run_ms=0))
    flood(s, "a", 20, 0, prompt=10, out=100)
    run(s, 4, [0, 1, 2, 3])
    flood(s, "b", 20, 100, prompt=10, out=100)
    (order,) = s.preemptions(2000, 0, worker_of)
    assert s.dispatch_held(order.for_request.request_id, 2000) is not None
    s.preempted(order.request_id, 5, 2000)
    picks = [d.request.tenant for d in s.select(8, 2000)]
    assert picks == ["a", "b"] * 4  # a's continuation first, in a's turn
