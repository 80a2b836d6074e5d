"""Fleet-level preemption decided in the pure core (DESIGN.md 5b, `dispatcher.scheduler.preempt`):
scenarios of who is preempted, when, for whom, and what the continuation costs. The
hypothesis properties are in test_preempt_properties.py."""

from __future__ import annotations

import copy
import itertools
from collections import Counter

import pytest

from dispatcher.scheduler.core import Scheduler
from dispatcher.scheduler.types import ActualUsage, QueuedRequest
from fairlane.poolconfig import PreemptionConfig, SchedulerConfig, TenantConfig, TierConfig

pytestmark = pytest.mark.unit

_ids = itertools.count()


def cfg(policy: str = "drr", *, tenants: dict[str, TenantConfig] | None = None,
        tiers: list[TierConfig] | None = None, cost_model: str = "requests",
        quantum: float = 1.0, **pre) -> SchedulerConfig:
    # The scenarios below time one threshold; quiet tenants get their own only where
    # a test names it.
    pre.setdefault("preempt_after_ms", 200.0)
    pre.setdefault("quiet_preempt_after_ms", pre["preempt_after_ms"])
    return SchedulerConfig(
        policy=policy, cost_model=cost_model, quantum=quantum, throttle_window_ms=0,
        tiers=tiers or [TierConfig("standard")], tenants=tenants or {},
        preemption=PreemptionConfig(**pre))


def req(tenant: str, *, tier: str = "standard", prompt: int = 10, out: int = 100) -> QueuedRequest:
    return QueuedRequest(f"{tenant}-{next(_ids)}", tenant, tier, prompt, out, out)


def worker_of(rid: str) -> str:
    return "w0"


def flood(s: Scheduler, tenant: str, n: int, now: float, **kw) -> list[QueuedRequest]:
    out = [req(tenant, **kw) for _ in range(n)]
    for r in out:
        assert s.submit(r, now).accepted
    return out


def run(s: Scheduler, n: int, start_ms: list[float] | float) -> list[str]:
    """Dispatch n requests and start them (at the given times)."""
    out = [d.request.request_id for d in s.select(n, 0.0 if isinstance(start_ms, list) else start_ms)]
    assert len(out) == n
    times = start_ms if isinstance(start_ms, list) else [start_ms] * n
    for rid, t in zip(out, times, strict=True):
        assert s.on_started(rid, t)
    return out


# --- scenarios ---------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["drr", "vtc"])
def test_waiting_tenant_preempts_the_floods_most_recent_request(policy):
    s = Scheduler(cfg(policy, quiet_preempt_after_ms=200))
    flood(s, "a", 10, 0)
    a_ids = run(s, 4, [0, 10, 30, 20])
    (b1,) = flood(s, "b", 1, 1500)
    assert s.preemptions(1500, 0, worker_of) == []  # b has not waited 200 ms
    assert s.preemptions(1650, 0, worker_of) == []
    (order,) = s.preemptions(1700, 0, worker_of)
    assert (order.request_id, order.worker_id, order.for_request) == (a_ids[2], "w0", b1)
    assert order.for_tenant == "b"
    assert s.preemptions(1700, 0, worker_of) == []  # one order per waiting request
    assert s.preemptions(5000, 0, worker_of) == []  # still outstanding
    cont = s.preempted(a_ids[2], 7, 1710)
    assert cont is not None and s.is_queued(a_ids[2]) and cont.requeued
    assert (cont.num_preemptions, cont.num_generated_tokens) == (1, 7)
    assert s.tenant_loads()["a"].num_in_flight == 3
    assert s.preemptor.preempted == Counter({("standard", "a"): 1})
    # The freed slot goes to b, not back to a's continuation.
    assert [d.request for d in s.select(1, 1710)] == [b1]
    # a's continuation is at the front of a's queue: the next slot of a's is its.
    s.on_finished(a_ids[0], None, 1800)
    assert [d.request.request_id for d in s.select(1, 1800)] == [a_ids[2]]
    # a 2 + continuation, b 1: shares 2/2 with b's demand 1 -> b at its share: done.
    assert s.preemptions(9000, 0, worker_of) == []


def test_no_preemption_while_a_worker_has_room():
    s = Scheduler(cfg())
    flood(s, "a", 10, 0)
    run(s, 4, 0)
    flood(s, "b", 1, 1500)
    assert s.preemptions(5000, 1, worker_of) == []
    assert len(s.preemptions(5000, 0, worker_of)) == 1


def test_a_decision_that_found_nothing_is_rechecked_after_recheck_ms():
    s = Scheduler(cfg(min_run_ms=0))
    flood(s, "a", 10, 0)
    run(s, 4, 0)
    flood(s, "b", 1, 100)
    assert s.preemptions(290, 0, worker_of) == []  # b waited 190 ms
    assert s.preemptions(300, 0, worker_of) == []  # 200 ms, but rechecked at 310
    assert len(s.preemptions(310, 0, worker_of)) == 1


def test_min_run_ms_guards_continuations_not_first_runs():
    s = Scheduler(cfg(min_run_ms=1000))
    flood(s, "a", 10, 0)
    a_ids = run(s, 4, [1500, 1600, 1700, 1800])
    for rid in a_ids[1:]:  # three continuations, restarted 200-400 ms before 2000
        s.in_flight_request(rid).num_preemptions = 1
    flood(s, "b", 1, 1500)
    # A first run is preempted at once (the batch may have just turned over);
    # the continuations restarted under 1000 ms ago are not.
    (order,) = s.preemptions(2000, 0, worker_of)
    assert order.request_id == a_ids[0]
    flood(s, "c", 1, 2000)
    assert s.preemptions(2000, 0, worker_of) == []  # c waits for a continuation's 1000 ms
    (order,) = s.preemptions(2600, 0, worker_of)
    assert order.request_id == a_ids[1]  # the only one that ran 1000 ms since its restart


def test_a_request_preempted_max_per_request_times_runs_to_its_end():
    s = Scheduler(cfg(max_per_request=2))
    flood(s, "a", 10, 0)
    a_ids = run(s, 4, [0, 1, 2, 3])
    for rid in a_ids:  # as if each had been preempted twice before this run
        s.in_flight_request(rid).num_preemptions = 2
    flood(s, "b", 1, 100)
    assert s.preemptions(5000, 0, worker_of) == []
    s.in_flight_request(a_ids[1]).num_preemptions = 1
    (order,) = s.preemptions(5100, 0, worker_of)
    assert order.request_id == a_ids[1]


def test_victim_prefers_fewest_preemptions_then_the_latest_start():
    s = Scheduler(cfg())
    flood(s, "a", 10, 0)
    a_ids = run(s, 4, [0, 30, 20, 10])
    s.in_flight_request(a_ids[1]).num_preemptions = 1
    flood(s, "b", 1, 100)
    (order,) = s.preemptions(5000, 0, worker_of)
    assert order.request_id == a_ids[2]


@pytest.mark.parametrize("policy", ["drr", "vtc"])
def test_quiet_tenant_preempts_at_once_and_a_backlogged_one_after_preempt_after_ms(policy):
    """b's one request fits in its share (2 of 4 slots): it is quiet and, by default,
    preempts at once. c then floods: its demand exceeds its share, so its head waits
    preempt_after_ms for turnover first."""
    s = Scheduler(cfg(policy, preempt_after_ms=200, quiet_preempt_after_ms=0, min_run_ms=0))
    flood(s, "a", 10, 0)
    run(s, 4, 0)
    (b1,) = flood(s, "b", 1, 1000)
    (order,) = s.preemptions(1000, 0, worker_of)
    assert order.for_request is b1
    s.preempted(order.request_id, 1, 1000)
    (d,) = s.select(1, 1000)
    assert d.request is b1 and s.on_started(b1.request_id, 1000)
    flood(s, "c", 10, 2000)  # shares 4/3 each: c short by a whole slot, but backlogged
    assert s.preemptions(2000, 0, worker_of) == []
    assert s.preemptions(2150, 0, worker_of) == []
    (order,) = s.preemptions(2200, 0, worker_of)
    assert order.for_tenant == "c" and order.request.tenant == "a"


def test_drr_lets_a_quiet_tenant_take_its_next_turn_early_once():
    """b is quiet (2 requests; share 2 of 4) but its DRR turn is spent (quantum 1, cost
    1): it may borrow its next turn's quantum once, so both of its requests preempt
    without waiting for the round to come back; a third would wait for its turn."""
    s = Scheduler(cfg(min_run_ms=0, quiet_preempt_after_ms=0))
    flood(s, "a", 20, 0)
    run(s, 4, 0)
    for t in (1000, 2000):
        (b,) = flood(s, "b", 1, t)
        (order,) = s.preemptions(t, 0, worker_of)
        assert order.for_request is b
        s.preempted(order.request_id, 1, t)
        (d,) = s.select(1, t)
        assert d.request is b and s.on_started(b.request_id, t)
    assert s.policy.deficit("standard", "b") == pytest.approx(-1.0)  # one turn of debt
    flood(s, "b", 1, 3000)  # b at its share now (2 of 4): not owed anyway
    assert s.preemptions(3000, 0, worker_of) == []


def test_drr_preempts_for_a_backlogged_tenant_in_its_turn_only():
    """b, behind a's flood, is short of its share (2 of 4) by two slots and backlogged
    (5 queued), and DRR gives it one request per turn (quantum 1, cost 1): preemption
    takes that turn's slot at once, and the next only when DRR's round comes back."""
    s = Scheduler(cfg(preempt_after_ms=0))
    flood(s, "a", 20, 0)
    a_ids = run(s, 4, [0, 1, 2, 3])
    flood(s, "b", 5, 100)
    (order,) = s.preemptions(2000, 0, worker_of)
    s.preempted(order.request_id, 3, 2000)
    (d,) = s.select(1, 2000)
    assert d.request.tenant == "b"
    s.on_started(d.request.request_id, 2000)
    assert s.preemptions(10_000, 0, worker_of) == []  # b's turn is spent
    # A slot turns over: DRR's round goes on (a's turn), then it is b's turn again.
    s.on_finished(a_ids[0], None, 10_000)
    (d,) = s.select(1, 10_000)
    assert d.request.tenant == "a"
    s.on_started(d.request.request_id, 10_000)
    (order,) = s.preemptions(11_000, 0, worker_of)
    assert order.for_tenant == "b"


def test_victim_is_the_tenant_furthest_above_its_share_and_never_at_share():
    # 3 slots: a runs 2, b runs 1, c waits -> shares 1/1/1: a is above, b is not.
    s = Scheduler(cfg())
    flood(s, "a", 5, 0)
    flood(s, "b", 5, 0)
    a_b = run(s, 3, 0)
    assert sorted(r[0] for r in a_b) == ["a", "a", "b"]
    flood(s, "c", 1, 100)
    (order,) = s.preemptions(2000, 0, worker_of)
    assert order.request.tenant == "a" and order.for_tenant == "c"


def test_no_preemption_when_no_move_makes_occupancy_fairer():
    # 2 slots held by a and b, c waits: shares 2/3 each, and moving a slot would only
    # change who is short.
    s = Scheduler(cfg())
    flood(s, "a", 5, 0)
    flood(s, "b", 5, 0)
    run(s, 2, 0)
    flood(s, "c", 5, 100)
    assert s.preemptions(5000, 0, worker_of) == []


def test_a_tenant_is_never_preempted_for_itself():
    s = Scheduler(cfg())
    flood(s, "a", 10, 0)
    run(s, 4, 0)
    assert s.preemptions(5000, 0, worker_of) == []


def test_weights_set_the_shares():
    # a (weight 3) holds 3 of 4 slots, b (weight 1) holds 1: exactly their shares.
    tenants = {"a": TenantConfig("a", weight=3), "b": TenantConfig("b")}
    s = Scheduler(cfg(tenants=tenants))
    flood(s, "b", 1, 0)
    flood(s, "a", 10, 0)
    run(s, 4, 0)
    flood(s, "b", 5, 100)
    assert s.preemptions(5000, 0, worker_of) == []
    # Equal weights: b is owed a slot; backlogged, it must stay short preempt_after_ms.
    s.update_config(cfg(tenants={"a": TenantConfig("a"), "b": TenantConfig("b")}))
    assert s.preemptions(5100, 0, worker_of) == []
    (order,) = s.preemptions(5300, 0, worker_of)
    assert (order.request.tenant, order.for_tenant) == ("a", "b")


def test_rate_cap_counts_orders_per_second():
    s = Scheduler(cfg(max_per_s=2))
    flood(s, "a", 20, 0)
    run(s, 8, 0)
    for t in "bcde":
        flood(s, t, 1, 100)
    assert len(s.preemptions(2000, 0, worker_of)) == 2
    assert s.preemptions(2500, 0, worker_of) == []
    assert s.preemptions(2999, 0, worker_of) == []
    assert len(s.preemptions(3000, 0, worker_of)) == 2


@pytest.mark.parametrize("enabled", [True, False])
def test_fifo_never_preempts_and_disabled_means_never(enabled):
    for policy in ("fifo", "drr"):
        s = Scheduler(cfg(policy, enabled=enabled if policy == "drr" else True))
        flood(s, "a", 10, 0)
        run(s, 4, 0)
        flood(s, "b", 1, 100)
        orders = s.preemptions(5000, 0, worker_of)
        assert len(orders) == (1 if policy == "drr" and enabled else 0)


def two_tiers(floor: float = 0.0, aging_ms: float = 0.0) -> list[TierConfig]:
    return [TierConfig("enterprise"), TierConfig("free", floor_share=floor, aging_ms=aging_ms)]


def test_a_higher_tier_reclaims_what_a_lower_one_borrowed():
    s = Scheduler(cfg(tiers=two_tiers()))
    flood(s, "e", 2, 0, tier="enterprise")
    run(s, 2, 0)
    flood(s, "f", 4, 0, tier="free")
    f_ids = run(s, 2, [0, 50])
    (e3,) = flood(s, "e", 1, 1000, tier="enterprise")
    (order,) = s.preemptions(2000, 0, worker_of)
    assert order.request_id == f_ids[1] and order.for_request is e3
    s.preempted(f_ids[1], 3, 2000)
    assert s.select(1, 2000)[0].request is e3


def test_a_higher_tier_tenant_whose_demand_fits_the_pool_reclaims_at_once():
    """e's three requests fit in what the free tier borrowed (4 slots): e is quiet, so
    each reclaims a slot at once, not after the backlogged preempt_after_ms."""
    s = Scheduler(cfg(tiers=two_tiers(), preempt_after_ms=200, quiet_preempt_after_ms=0,
                      min_run_ms=0))
    flood(s, "f", 10, 0, tier="free")
    run(s, 4, 0)
    e = flood(s, "e", 3, 1000, tier="enterprise")
    for want in e:
        (order,) = s.preemptions(1000, 0, worker_of)
        assert order.for_request is want and order.request.tenant == "f"
        s.preempted(order.request_id, 1, 1000)
        (d,) = s.select(1, 1000)
        assert d.request is want and s.on_started(want.request_id, 1000)


def test_a_lower_tier_never_preempts_a_higher_one():
    s = Scheduler(cfg(tiers=two_tiers(aging_ms=10)))
    flood(s, "e", 10, 0, tier="enterprise")
    run(s, 4, 0)
    flood(s, "f", 3, 100, tier="free")
    assert s.preemptions(60_000, 0, worker_of) == []


def test_a_lower_tier_keeps_its_floor():
    s = Scheduler(cfg(tiers=two_tiers(floor=0.5)))
    flood(s, "f", 3, 0, tier="free")
    f_ids = run(s, 3, [0, 10, 20])
    flood(s, "e", 10, 0, tier="enterprise")
    run(s, 1, 0)
    flood(s, "e", 1, 100, tier="enterprise")
    # free holds 3 of 4: one above its floor of 2. e is backlogged: short 200 ms first.
    assert s.preemptions(1800, 0, worker_of) == []
    (order,) = s.preemptions(2000, 0, worker_of)
    assert order.request_id == f_ids[2]
    s.preempted(f_ids[2], 1, 2000)
    s.on_started(s.select(1, 2000)[0].request.request_id, 2000)
    # free holds 2 of 4 = its floor: not reclaimed further (and its continuation waits).
    assert s.preemptions(10_000, 0, worker_of) == []


@pytest.mark.parametrize("cost_model", ["tokens", "kv_seconds", "requests"])
def test_continuation_is_charged_for_the_work_left_only(cost_model):
    s = Scheduler(cfg(cost_model=cost_model, quantum=10_000))
    model = s.cost_model
    (a1,) = flood(s, "a", 1, 0, prompt=100, out=50)
    run(s, 1, 0)
    full = model.estimate(a1)
    assert s.tenant_loads()["a"].dispatched_cost == pytest.approx(full)
    cont = s.preempted(a1.request_id, 20, 1000)
    so_far = model.actual(a1, ActualUsage(100, 20))
    assert s.tenant_loads()["a"].dispatched_cost == pytest.approx(so_far)  # refunded
    assert cont.paid_cost == pytest.approx(so_far)
    left = max(full - so_far, 1e-6)
    assert cont.resume_cost == pytest.approx(left) and s.tenant_loads()["a"].queued_cost == pytest.approx(left)
    (d,) = s.select(1, 1000)
    assert d.request is a1 and d.cost == pytest.approx(left)
    assert s.tenant_loads()["a"].dispatched_cost == pytest.approx(max(full, so_far + 1e-6))
    # Finished: the counts are the whole request's, and the total is trued up to them
    # (measured KV-seconds would cover the last run only).
    s.on_finished(a1.request_id, ActualUsage(100, 60, kv_token_seconds=5.0), 2000)
    assert s.tenant_loads()["a"].dispatched_cost == pytest.approx(model.actual(a1, ActualUsage(100, 60)))


def test_held_slot_beats_the_victims_drr_deficit():
    """Why the core holds the freed slot: DRR alone would hand it back to the victim.

    a is in its DRR turn with credit left; preempting refunds the work a's request did
    not do (a paid for it in a turn c contended), and its cheap continuation sits at the
    front of a's queue, so DRR's next pick is a's continuation. The hold gives the slot
    to b, the tenant it was freed for.
    """
    s = Scheduler(cfg(cost_model="tokens", quantum=1000))
    flood(s, "a", 10, 0, prompt=10, out=100)
    flood(s, "c", 10, 0, prompt=10, out=100)
    ids = run(s, 12, list(range(12)))  # a and c: 6 slots each, a's turn is on
    a_ids = [r for r in ids if r.startswith("a")]
    (b1,) = flood(s, "b", 1, 100, prompt=10, out=100)
    (order,) = s.preemptions(2000, 0, worker_of)
    assert order.request_id == a_ids[-1]
    s.preempted(a_ids[-1], 5, 2000)
    unheld = copy.deepcopy(s)
    unheld.preemptor.held.clear()
    assert unheld.select(1, 2000)[0].request.request_id == a_ids[-1]  # DRR's own pick
    assert s.select(1, 2000)[0].request.request_id == b1.request_id


def test_hold_is_dropped_when_its_request_leaves_the_queue():
    s = Scheduler(cfg())
    flood(s, "a", 10, 0)
    a_ids = run(s, 4, 0)
    (b1,) = flood(s, "b", 1, 100)
    (order,) = s.preemptions(2000, 0, worker_of)
    assert s.cancel(b1.request_id) is b1
    s.preempted(order.request_id, 1, 2000)
    (d,) = s.select(1, 2000)
    assert d.request.request_id == a_ids[-1] and not s.preemptor.held  # a's continuation


def test_victim_that_finished_first_still_frees_the_slot_for_the_waiter():
    s = Scheduler(cfg())
    flood(s, "a", 10, 0)
    run(s, 4, 0)
    (b1,) = flood(s, "b", 1, 100)
    (order,) = s.preemptions(2000, 0, worker_of)
    s.on_finished(order.request_id, None, 2001)  # raced the abort
    assert s.preempted(order.request_id, 5, 2002) is None
    assert not s.preemptor.pending
    assert s.select(1, 2002)[0].request is b1


def test_victims_without_a_known_worker_are_skipped():
    s = Scheduler(cfg())
    flood(s, "a", 10, 0)
    a_ids = run(s, 4, [0, 1, 2, 3])
    flood(s, "b", 1, 100)
    (order,) = s.preemptions(2000, 0, lambda rid: None if rid == a_ids[3] else "w1")
    assert (order.request_id, order.worker_id) == (a_ids[2], "w1")


def test_a_continuation_resumes_on_the_worker_that_preempted_it():
    """Two of a's requests preempted, one on each worker: whichever worker pulls a's
    next turn gets the continuation whose tokens its prefix cache holds, not the one
    at the front of a's queue; another tenant's turn is not touched."""
    s = Scheduler(cfg(min_run_ms=0, quiet_preempt_after_ms=0))
    flood(s, "a", 10, 0)
    a_ids = run(s, 4, 0)
    c1, c2 = a_ids[0], a_ids[1]
    s.preempted(c1, 5, 100, worker_id="w1")
    s.preempted(c2, 5, 100, worker_id="w2")
    front = s.select(1, 100, worker_id="w2")[0].request
    assert front.request_id == c2 and front.home_worker == "w2"
    assert s.select(1, 100, worker_id="w1")[0].request.request_id == c1
    # Nothing homed left: the policy's own pick again.
    assert s.select(1, 100, worker_id="w2")[0].request.num_preemptions == 0


def test_a_homed_continuation_that_left_the_queue_is_forgotten():
    s = Scheduler(cfg(min_run_ms=0))
    flood(s, "a", 10, 0)
    a_ids = run(s, 4, 0)
    s.preempted(a_ids[0], 5, 100, worker_id="w1")
    s.preempted(a_ids[1], 5, 100, worker_id="w2")
    assert s.cancel(a_ids[1]) is not None  # the w2 one, cancelled while queued
    assert s.select(1, 100, worker_id="w2")[0].request.request_id == a_ids[0]
    assert not s.preemptor._homed


def test_a_backlogged_tenant_preempts_only_after_being_short_for_preempt_after_ms():
    """Heads of backlogged tenants always waited long (behind their own queues), so
    the clock is how long the tenant has been short of its share: a shortfall that
    turnover makes up within preempt_after_ms costs no preemption."""
    s = Scheduler(cfg(preempt_after_ms=200, quiet_preempt_after_ms=0, min_run_ms=0))
    flood(s, "a", 20, 0)
    flood(s, "b", 20, 0)
    ids = run(s, 4, 0)  # a and b: 2 slots each (their shares), both backlogged
    b_ids = [r for r in ids if r.startswith("b")]
    s.on_finished(b_ids[0], None, 1000)  # b's slot turns over ...
    (d,) = s.select(1, 1000)  # ... DRR hands it to a: b is short by a whole slot
    assert d.request.tenant == "a" and s.on_started(d.request.request_id, 1000)
    assert s.preemptions(1000, 0, worker_of) == []
    assert s.preemptions(1150, 0, worker_of) == []
    (order,) = s.preemptions(1200, 0, worker_of)
    assert order.for_tenant == "b" and order.request.tenant == "a"
    # A free slot resets the clock: the next shortfall starts from zero.
    s.preempted(order.request_id, 1, 1200)
    assert s.preemptions(1300, 1, worker_of) == [] and not s.preemptor.short_since


@pytest.mark.parametrize("with_order", [True, False])
def test_the_request_a_slot_was_freed_for_goes_first_in_its_tier_in_the_engine(with_order):
    """Ranked by its tenant's count in flight, a backlogged waiter would queue in the
    engine behind work prefetched for lighter tenants, and that work would take the
    freed slot: the held request gets its tier's first engine priority, whether it
    rides with the order or a pull takes it first."""
    s = Scheduler(cfg(tiers=[TierConfig("free", engine_priority=10)], preempt_after_ms=200,
                      quiet_preempt_after_ms=0, min_run_ms=0))
    flood(s, "a", 20, 0, tier="free")
    flood(s, "b", 20, 0, tier="free")
    ids = run(s, 4, 0)  # a and b: 2 slots each, both backlogged
    s.on_finished(next(r for r in ids if r.startswith("b")), None, 1000)
    (d,) = s.select(1, 1000)  # DRR hands the slot to a: b is short by a whole slot
    assert d.request.tenant == "a" and s.on_started(d.request.request_id, 1000)
    assert s.preemptions(1000, 0, worker_of) == []
    (order,) = s.preemptions(1200, 0, worker_of)
    assert order.for_tenant == "b"
    if with_order:
        held = s.dispatch_held(order.for_request.request_id, 1200)
    else:
        s.preempted(order.request_id, 1, 1200)
        (held,) = s.select(1, 1200)
    assert held.request is order.for_request and held.engine_priority == 10_000
    (later,) = s.select(1, 1200)  # the policy's next pick: ranked by its tenant's count
    assert later.request.tenant == "a" and later.engine_priority > 10_000
