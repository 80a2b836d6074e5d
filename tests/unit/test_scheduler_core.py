"""Example tests of the pure scheduler core: admission, stages, lifecycle, metrics."""

from __future__ import annotations

import itertools

import pytest

from dispatcher.scheduler.core import Scheduler
from dispatcher.scheduler.cost import make_cost_model
from dispatcher.scheduler.policies import DrrPolicy, FifoPolicy, VtcPolicy, make_policy
from dispatcher.scheduler.types import ActualUsage, QueuedRequest, Verdict
from fairlane.poolconfig import SchedulerConfig, TenantConfig, TierConfig
from fairlane.protocol import ErrorCode

pytestmark = pytest.mark.unit

POLICIES = ["fifo", "drr", "vtc"]
_ids = itertools.count()


def req(tenant: str, *, tier: str = "standard", priority: int = 0, prompt: int = 10,
        out: int = 10, deadline: float | None = None, ttft: float | None = None,
        rid: str | None = None) -> QueuedRequest:
    return QueuedRequest(rid or f"{tenant}-{next(_ids)}", tenant, tier, prompt, out, out,
                         priority=priority, deadline_ms=deadline, ttft_budget_ms=ttft)


def ids(dispatches) -> list[str]:
    return [d.request.request_id for d in dispatches]


def tenants_of(dispatches) -> list[str]:
    return [d.request.tenant for d in dispatches]


# --- factory and cost models -------------------------------------------------------------


def test_make_policy_picks_each_strategy():
    assert isinstance(make_policy(SchedulerConfig(policy="fifo")), FifoPolicy)
    assert isinstance(make_policy(SchedulerConfig(policy="drr")), DrrPolicy)
    assert isinstance(make_policy(SchedulerConfig(policy="vtc")), VtcPolicy)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy(SchedulerConfig(policy="lottery"))


def test_cost_models_estimate_and_actual():
    r = req("a", prompt=100, out=50)
    assert make_cost_model(SchedulerConfig(cost_model="requests")).estimate(r) == 1.0
    tokens = make_cost_model(SchedulerConfig(cost_model="tokens"))
    assert tokens.estimate(r) == 100 + 2 * 50
    assert tokens.actual(r, ActualUsage(prompt_tokens=100, completion_tokens=10)) == 120
    kv = make_cost_model(SchedulerConfig(cost_model="kv_seconds", kv_step_ms=10,
                                         kv_prefill_ms_per_token=0))
    assert kv.estimate(r) == pytest.approx(0.01 * (100 * 50 + 50 * 51 / 2))
    assert kv.actual(r, ActualUsage(kv_token_seconds=7.5)) == 7.5
    with pytest.raises(ValueError, match="unknown cost model"):
        make_cost_model(SchedulerConfig(cost_model="dollars"))


# --- admission ---------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_admission_duplicate_unknown_and_caps(policy):
    cfg = SchedulerConfig(policy=policy, allow_unknown_tenants=False, max_queued_total=3,
                          tenants={"a": TenantConfig("a", max_queued=2),
                                   "b": TenantConfig("b")})
    s = Scheduler(cfg)
    assert s.submit(req("a", rid="x"), 0).accepted
    assert s.submit(req("a", rid="x"), 0).verdict is Verdict.DUPLICATE
    bad = s.submit(req("zed"), 0)
    assert bad.code is ErrorCode.UNKNOWN_TENANT
    assert s.submit(req("a"), 0).accepted
    full = s.submit(req("a"), 0)
    assert full.code is ErrorCode.QUEUE_FULL and full.retry_after_ms
    assert s.submit(req("b"), 0).accepted
    over = s.submit(req("b"), 0)
    assert over.code is ErrorCode.OVERLOADED and over.retry_after_ms
    assert s.rejections == {ErrorCode.UNKNOWN_TENANT: 1, ErrorCode.QUEUE_FULL: 1,
                            ErrorCode.OVERLOADED: 1}


def test_throttling_rejects_with_retry_after_once_rate_is_measured():
    s = Scheduler(SchedulerConfig(policy="drr", throttle_window_ms=1_000))
    # Before any measurement nothing is throttled, however tight the budget.
    for _ in range(5):
        assert s.submit(req("early", ttft=1), 0).accepted
    s.select(5, 0)
    # Serve 1 request per 10 ms for a second: rate = 0.1 cost/ms.
    for t in range(10, 1001, 10):
        s.submit(req("filler"), t)
        assert len(s.select(1, t)) == 1
    assert s.service_rate_per_ms(1000) == pytest.approx(0.1, rel=0.1)
    for _ in range(30):
        assert s.submit(req("a"), 1000).accepted  # no budget: never throttled
    wait = s.predicted_wait_ms("a", "standard", 1000)
    assert wait == pytest.approx(30 / 0.1, rel=0.15)
    adm = s.submit(req("a", ttft=100), 1000)
    assert adm.code is ErrorCode.THROTTLED
    assert adm.retry_after_ms == pytest.approx(wait - 100, abs=1)
    # A deadline counts as a budget too; a generous budget is admitted.
    assert s.submit(req("a", deadline=1100), 1000).code is ErrorCode.THROTTLED
    assert s.submit(req("a", ttft=10 * wait), 1000).accepted
    # A tenant with nothing queued waits ~nothing under fair share: admitted.
    assert s.submit(req("b", ttft=1), 1000).accepted
    assert s.rejections[ErrorCode.THROTTLED] == 2


# --- within a tenant -----------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["drr", "vtc"])
def test_order_within_tenant_priority_deadline_arrival(policy):
    s = Scheduler(SchedulerConfig(policy=policy, quantum=100))
    s.submit(req("a", rid="late"), 0)
    s.submit(req("a", rid="dl-far", deadline=500), 1)
    s.submit(req("a", rid="dl-near", deadline=100), 2)
    s.submit(req("a", rid="urgent", priority=5), 3)
    s.submit(req("a", rid="late2"), 4)
    assert ids(s.select(10, 5)) == ["urgent", "dl-near", "dl-far", "late", "late2"]


@pytest.mark.parametrize("policy", POLICIES)
def test_requeue_goes_to_front_of_priority_class_and_refunds(policy):
    s = Scheduler(SchedulerConfig(policy=policy, cost_model="tokens", quantum=1_000))
    s.submit(req("a", rid="first"), 0)
    s.submit(req("a", rid="second"), 1)
    (d,) = s.select(1, 2)
    assert d.request.request_id == "first" and d.cost == 30
    assert s.tenant_loads()["a"].dispatched_cost == 30
    assert s.requeue("first", 3)
    assert s.tenant_loads()["a"].dispatched_cost == 0
    assert s.is_queued("first") and s.num_in_flight == 0
    s.submit(req("a", rid="vip", priority=1), 4)
    # FIFO is plain arrival order (requeued at the front); fair policies honour priority.
    expected = ["first", "second", "vip"] if policy == "fifo" else ["vip", "first", "second"]
    assert ids(s.select(3, 5)) == expected
    # Started work is never requeued.
    s.on_started("first", 6)
    assert not s.requeue("first", 7)
    assert not s.requeue("nope", 7)


@pytest.mark.parametrize("policy", POLICIES)
def test_cancel_only_queued(policy):
    s = Scheduler(SchedulerConfig(policy=policy))
    s.submit(req("a", rid="q1"), 0)
    s.submit(req("a", rid="q2"), 0)
    assert s.cancel("q1").request_id == "q1"
    assert s.cancel("q1") is None
    assert ids(s.select(5, 1)) == ["q2"]
    assert s.cancel("q2") is None  # in flight: the shell aborts it on the worker
    assert s.tenant_loads()["a"].num_queued == 0


# --- deadlines and overload -----------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_expire_drops_past_deadline_cheaply(policy):
    s = Scheduler(SchedulerConfig(policy=policy))
    s.submit(req("a", rid="soon", deadline=10), 0)
    s.submit(req("a", rid="later", deadline=100), 0)
    s.submit(req("a", rid="never"), 0)
    assert s.expire(5) == []
    dropped = s.expire(10)
    assert [d.request.request_id for d in dropped] == ["soon"]
    assert dropped[0].code is ErrorCode.EXPIRED
    assert ids(s.select(5, 11)) == ["later", "never"]
    assert s.expire(1000) == []  # the dispatched one is a stale heap entry, skipped
    assert s.drops[ErrorCode.EXPIRED] == 1


def test_shed_lowest_tier_first_longest_queue_first():
    tiers = [TierConfig("gold", engine_priority=0), TierConfig("free", engine_priority=10)]
    s = Scheduler(SchedulerConfig(policy="drr", tiers=tiers))
    for _ in range(3):
        s.submit(req("g", tier="gold"), 0)
    for _ in range(6):
        s.submit(req("flood", tier="free"), 0)
    for _ in range(2):
        s.submit(req("small", tier="free"), 0)
    dropped = s.shed(1, max_queued_total=6)
    assert len(dropped) == 5 and s.num_queued == 6
    assert all(d.code is ErrorCode.OVERLOADED and d.retry_after_ms for d in dropped)
    assert all(d.request.tier == "free" for d in dropped)
    # Water-filled: the flood is cut to the small tenant's level, then both together.
    left = {t: s.tenant_loads()[t].num_queued for t in ("flood", "small", "g")}
    assert left["g"] == 3 and left["flood"] + left["small"] == 3
    assert abs(left["flood"] - left["small"]) <= 1
    assert s.shed(1, max_queued_total=6) == []
    assert s.drops[ErrorCode.OVERLOADED] == 5


# --- tiers ---------------------------------------------------------------------------------


def test_tier_maps_to_engine_priority_and_highest_tier_wins():
    tiers = [TierConfig("enterprise", engine_priority=0), TierConfig("free", engine_priority=5)]
    s = Scheduler(SchedulerConfig(policy="drr", tiers=tiers))
    s.submit(req("f", tier="free"), 0)
    s.submit(req("e", tier="enterprise"), 1)
    out = s.select(2, 2)
    assert [(d.request.tier, d.engine_priority) for d in out] == [("enterprise", 0), ("free", 5000)]
    assert s.tier_dispatched_cost() == {"enterprise": 1.0, "free": 1.0}


def test_blocked_tier_does_not_idle_slots():
    tiers = [TierConfig("enterprise"), TierConfig("free")]
    cfg = SchedulerConfig(policy="drr", tiers=tiers,
                          tenants={"e": TenantConfig("e", tier="enterprise", max_concurrent=1)})
    s = Scheduler(cfg)
    for _ in range(3):
        s.submit(req("e", tier="enterprise"), 0)
        s.submit(req("f", tier="free"), 0)
    assert tenants_of(s.select(4, 1)) == ["e", "f", "f", "f"]


# --- DRR and VTC -----------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["drr", "vtc"])
def test_small_tenant_not_stuck_behind_flood(policy):
    s = Scheduler(SchedulerConfig(policy=policy))
    for _ in range(1000):
        s.submit(req("A"), 0)
    for _ in range(5):
        s.submit(req("B"), 1)
    first = tenants_of(s.select(10, 2))
    assert first.count("B") == 5


def test_fifo_lets_the_flood_win():
    s = Scheduler(SchedulerConfig(policy="fifo"))
    for _ in range(100):
        s.submit(req("A"), 0)
    s.submit(req("B"), 1)
    assert "B" not in tenants_of(s.select(50, 2))


@pytest.mark.parametrize("policy", ["drr", "vtc"])
def test_quota_blocked_tenant_is_skipped_not_dropped(policy):
    cfg = SchedulerConfig(policy=policy,
                          tenants={"a": TenantConfig("a", max_concurrent=1)})
    s = Scheduler(cfg)
    for _ in range(3):
        s.submit(req("a"), 0)
        s.submit(req("b"), 0)
    first = s.select(10, 1)
    assert tenants_of(first).count("a") == 1 and tenants_of(first).count("b") == 3
    s.on_finished(first[0].request.request_id, None, 2)
    assert tenants_of(s.select(10, 3)) == ["a"]


def test_kv_quota_and_free_kv_budget():
    cfg = SchedulerConfig(policy="drr", quantum=10,
                          tenants={"a": TenantConfig("a", max_kv_tokens=50)})
    s = Scheduler(cfg)
    for _ in range(3):
        s.submit(req("a", prompt=20, out=10), 0)  # 30 KV tokens each
    assert len(s.select(10, 1)) == 1  # a second one would make 60 > 50
    s2 = Scheduler(SchedulerConfig(policy="drr", quantum=10))
    for _ in range(3):
        s2.submit(req("b", prompt=20, out=10), 0)
    assert len(s2.select(10, 1, free_kv_tokens=70)) == 2
    assert s2.num_queued == 1
    # The first pick goes whatever the budget (a lone request must make progress)...
    assert len(s2.select(10, 1, free_kv_tokens=10)) == 1
    # ...except for a pull already served in this pass (`must_fit`): what is left of
    # its budget binds every pick, and the request stays queued, first in line.
    s2.submit(req("b", prompt=20, out=10, rid="b-last"), 0)
    assert s2.select(10, 1, free_kv_tokens=29, must_fit=True) == []
    assert ids(s2.select(10, 1, free_kv_tokens=30, must_fit=True)) == ["b-last"]


@pytest.mark.parametrize("policy", ["drr", "vtc"])  # fifo parks nothing: it scans past
def test_a_kv_blocked_head_that_leaves_unblocks_the_next_request(policy):
    """A tenant parked behind a head too big for its KV quota: when that head is
    cancelled, the next request, which fits, goes at once (found by the property test:
    parked, the tenant waited for a release, and no slot was given to eligible work)."""
    cfg = SchedulerConfig(policy=policy, quantum=10,
                          tenants={"a": TenantConfig("a", max_kv_tokens=60)})
    s = Scheduler(cfg)
    s.submit(req("a", prompt=30, out=10, rid="running"), 0)  # 40 KV tokens
    assert ids(s.select(1, 1)) == ["running"]
    s.submit(req("a", prompt=20, out=10, priority=1, rid="big"), 2)  # 30: 70 > 60
    assert s.select(1, 3) == []  # blocked: the tenant is parked
    s.submit(req("a", prompt=5, out=5, rid="small"), 4)  # 10 fits, but queues behind
    assert s.select(1, 5) == []
    assert s.cancel("big") is not None
    assert ids(s.select(1, 6)) == ["small"]


@pytest.mark.parametrize("policy", ["drr", "vtc"])
def test_true_up_debt_survives_empty_queue(policy):
    cfg = SchedulerConfig(policy=policy, cost_model="tokens", quantum=100)
    s = Scheduler(cfg)
    # "liar" declares 10 output tokens but generates 1000: it owes ~2000 cost units.
    assert s.submit(req("liar", prompt=10, out=10), 0).accepted
    (d,) = s.select(1, 0)
    assert s.num_queued == 0
    s.on_finished(d.request.request_id, ActualUsage(prompt_tokens=10, completion_tokens=1000), 1)
    assert s.tenant_loads()["liar"].dispatched_cost == 2010
    # Its queue is empty. Now both tenants flood with identical requests. (Under VTC a
    # tenant arriving *after* the liar would be lifted to the liar's counter: debt is
    # relative to who is backlogged, so the honest tenant is already waiting here.)
    for _ in range(100):
        s.submit(req("honest", prompt=10, out=10), 2)
    for _ in range(100):
        s.submit(req("liar", prompt=10, out=10), 2)
    first = tenants_of(s.select(60, 3))
    # The debt (~2000 units = ~66 requests of 30) is paid back first.
    assert first.count("honest") >= 55


def test_vtc_counter_lift_on_arrival():
    s = Scheduler(SchedulerConfig(policy="vtc"))
    pol = s.policy
    assert isinstance(pol, VtcPolicy)
    for _ in range(200):
        s.submit(req("busy"), 0)
    s.select(100, 1)  # busy's counter is now 100
    assert pol.counter("standard", "busy") == 100
    s.submit(req("newcomer"), 2)
    # Lifted to the smallest backlogged counter, not left at 0 to bank 100 dispatches.
    assert pol.counter("standard", "newcomer") == 100
    for _ in range(9):
        s.submit(req("newcomer"), 2)
    got = tenants_of(s.select(10, 3))
    assert 4 <= got.count("newcomer") <= 6


def test_vtc_lift_when_tier_idle_uses_last_served_counter():
    s = Scheduler(SchedulerConfig(policy="vtc"))
    for _ in range(50):
        s.submit(req("a"), 0)
    s.select(50, 1)
    s.submit(req("b"), 2)
    assert s.policy.counter("standard", "b") == 50


# --- metrics -----------------------------------------------------------------------------------


def test_metrics_per_tenant_and_tier():
    s = Scheduler(SchedulerConfig(policy="drr", cost_model="tokens", quantum=100))
    s.submit(req("a", prompt=10, out=5), 0)
    s.submit(req("a", prompt=10, out=5), 0)
    load = s.tenant_loads()["a"]
    assert (load.num_queued, load.queued_cost) == (2, 40)
    s.select(1, 1)
    assert (load.num_queued, load.queued_cost, load.num_in_flight, load.dispatched_cost) == (
        1, 20, 1, 20)
    assert s.tier_shares(1) == {"standard": 1.0}
    assert s.tier_queue_depths() == {"standard": 1}
    assert s.num_dispatched == 1


@pytest.mark.parametrize("num_tenants", [10, 3_000])
def test_drr_visits_per_decision_do_not_grow_with_tenants(num_tenants):
    # Half the tenants are quota-blocked after one dispatch: parking them is O(1) each.
    tenants = {f"t{i}": TenantConfig(f"t{i}", max_concurrent=1 if i % 2 else None)
               for i in range(num_tenants)}
    s = Scheduler(SchedulerConfig(policy="drr", tenants=tenants))
    for _ in range(3):
        for i in range(num_tenants):
            s.submit(req(f"t{i}"), 0)
    pol = s.policy
    assert isinstance(pol, DrrPolicy)
    out = s.select(2 * num_tenants, 1)
    assert len(out) == 2 * num_tenants  # blocked tenants skipped, everyone else served
    assert pol.num_visits <= 2 * len(out) + 2


def test_drr_rejects_a_non_positive_quantum():
    with pytest.raises(ValueError, match="positive quantum"):
        Scheduler(SchedulerConfig(policy="drr", quantum=0))


# --- adopt and hot reload (dispatcher restart, tenants file edits) --------------------


@pytest.mark.unit
@pytest.mark.parametrize("policy", ["fifo", "drr", "vtc"])
def test_adopt_moves_a_queued_request_to_in_flight_without_dispatching_it(policy):
    from dispatcher.scheduler.core import Scheduler
    from dispatcher.scheduler.types import QueuedRequest
    from fairlane.poolconfig import SchedulerConfig

    s = Scheduler(SchedulerConfig(policy=policy))
    for rid in ("a", "b"):
        assert s.submit(QueuedRequest(rid, "t", "standard", 10, 10, 10), 0).accepted
    assert s.adopt("a", 1) is not None
    assert s.adopt("a", 1) is None and s.adopt("nope", 1) is None
    assert s.is_known("a") and not s.is_queued("a") and s.num_in_flight == 1
    assert [d.request.request_id for d in s.select(10, 2)] == ["b"]
    assert s.on_started("a", 3) and s.on_finished("a", None, 4) is not None
    assert s.tenant_loads()["t"].num_in_flight == 1  # only b


@pytest.mark.unit
def test_update_config_changes_weights_and_refuses_structural_changes():
    from dispatcher.scheduler.core import Scheduler
    from dispatcher.scheduler.types import QueuedRequest
    from fairlane.poolconfig import SchedulerConfig, TenantConfig

    def cfg(wa: float, wb: float, policy: str = "drr") -> SchedulerConfig:
        return SchedulerConfig(policy=policy, tenants={
            "a": TenantConfig("a", weight=wa), "b": TenantConfig("b", weight=wb)})

    s = Scheduler(cfg(1, 1))
    n = 0
    for _ in range(200):
        for t in ("a", "b"):
            s.submit(QueuedRequest(f"{t}{n}", t, "standard", 1, 1, 1), 0)
            n += 1
    s.update_config(cfg(1, 3))
    picks = [d.request.tenant for d in s.select(80, 1)]
    assert picks.count("b") == 3 * picks.count("a")
    with pytest.raises(ValueError):
        s.update_config(cfg(1, 3, policy="vtc"))


@pytest.mark.unit
def test_a_tenants_only_request_goes_ahead_in_the_engine_queue():
    s = Scheduler(SchedulerConfig(policy="drr"))
    for rid, tenant in [("a1", "a"), ("a2", "a"), ("a3", "a"), ("b1", "b"), ("b2", "b")]:
        assert s.submit(QueuedRequest(rid, tenant, "standard", 1, 1, 1), 0).accepted
    prio = {d.request.request_id: d.engine_priority for d in s.select(5, 1)}
    # Ranked by how much each tenant already runs: b's second request goes ahead of
    # a's third in the engine's waiting queue.
    assert prio == {"a1": 0, "b1": 0, "a2": 1, "b2": 1, "a3": 2}


def test_vtc_charge_out_of_turn_rekeys_the_tenant():
    # An adopted request (or one a preemption freed a slot for) is charged while its
    # tenant waits in VTC's heap: the tenant's key must follow its counter, or it would
    # be served next on a counter it no longer has.
    s = Scheduler(SchedulerConfig(policy="vtc"))
    for rid, tenant in [("a1", "a"), ("a2", "a"), ("b1", "b"), ("b2", "b")]:
        assert s.submit(QueuedRequest(rid, tenant, "standard", 1, 1, 1), 0).accepted
    assert s.adopt("a1", 1) is not None
    assert tenants_of(s.select(2, 1)) == ["b", "a"]


@pytest.mark.parametrize("policy", POLICIES)
def test_shed_victims_match_the_queue_order(policy):
    from dispatcher.scheduler.tenant_queue import shed_victims

    s = Scheduler(SchedulerConfig(policy=policy, tiers=[TierConfig("gold"), TierConfig("free")]))
    for r in (req("a", tier="free", priority=1, rid="a-urgent"), req("a", tier="free", rid="a-late"),
              req("b", tier="free", rid="b-1"), req("g", tier="gold", rid="g-1")):
        assert s.submit(r, 0).accepted
    victims = shed_victims(s.queued(), s.tiers.index, 3)
    # Lowest tier first, the longest line first, its least urgent request first.
    assert [v.request_id for v in victims] == ["a-late", "a-urgent", "b-1"]
