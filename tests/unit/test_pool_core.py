"""Recovery decisions of the pure pool core: events in, actions out, no I/O, no clock."""

from __future__ import annotations

import pytest

from dispatcher.scheduler.actions import (
    Ack,
    Adopted,
    Hold,
    Nak,
    Released,
    Requeued,
    SendError,
    Term,
)
from dispatcher.scheduler.core import Scheduler
from dispatcher.scheduler.pool import PoolCore
from dispatcher.scheduler.types import QueuedRequest
from fairlane.poolconfig import SchedulerConfig, TenantConfig
from fairlane.protocol import ErrorCode

pytestmark = pytest.mark.unit

TIMEOUT_MS = 3_000.0


def _core(policy: str = "drr", **cfg) -> PoolCore:
    cfg.setdefault("allow_unknown_tenants", True)
    return PoolCore(Scheduler(SchedulerConfig(policy=policy, **cfg)), TIMEOUT_MS)


def _req(rid: str, tenant: str = "t", tier: str = "standard", **kw) -> QueuedRequest:
    return QueuedRequest(rid, tenant, tier, 10, 20, 20, **kw)


def _kinds(actions) -> list[str]:
    return [type(a).__name__ for a in actions]


def _dispatch(core: PoolCore, worker: str, now: float, n: int = 10) -> list[str]:
    core.on_pull(worker, 0, now)
    return [d.request.request_id for d in core.select(worker, n, now)]


@pytest.mark.parametrize("policy", ["fifo", "drr", "vtc"])
def test_admitted_request_is_held_then_acked_at_start_and_finish(policy):
    core = _core(policy)
    assert _kinds(core.submit(_req("a"), 0)) == ["Hold"]
    assert _dispatch(core, "w1", 1) == ["a"]
    (ack,) = core.on_started("a", "w1", 2)
    assert isinstance(ack, Ack) and ack.reason == "started"
    (ack,) = core.on_finished("a", "w1", None, 3)
    assert isinstance(ack, Ack) and ack.reason == "finished"
    assert core.scheduler.num_in_flight == 0
    assert core.on_finished("a", "w1", None, 4) == []  # a duplicate event changes nothing


def test_duplicate_submit_is_ignored():
    core = _core()
    core.submit(_req("a"), 0)
    assert core.submit(_req("a"), 1) == []
    assert core.scheduler.num_queued == 1


def test_refusal_tells_the_client_and_terms_the_message():
    core = _core(allow_unknown_tenants=False)
    send, term = core.submit(_req("a", tenant="nobody"), 0)
    assert isinstance(send, SendError) and send.code is ErrorCode.UNKNOWN_TENANT
    assert isinstance(term, Term) and term.reason == "unknown_tenant"


def test_wrong_tier_for_a_listed_tenant_is_refused():
    core = _core(tenants={"acme": TenantConfig("acme", tier="paid")})
    send, term = core.submit(_req("a", tenant="acme", tier="free"), 0)
    assert isinstance(send, SendError) and send.code is ErrorCode.INVALID_REQUEST
    assert "paid" in send.message and isinstance(term, Term)


def test_lost_worker_requeues_unstarted_and_fails_started_work():
    core = _core()
    for rid in ("a", "b"):
        core.submit(_req(rid), 0)
    assert sorted(_dispatch(core, "w1", 1)) == ["a", "b"]
    core.on_started("a", "w1", 2)
    actions = core.tick(2 + TIMEOUT_MS + 1)
    by_kind = {type(a).__name__: a for a in actions}
    assert by_kind["Requeued"].request.request_id == "b"
    assert by_kind["Requeued"].reason == "worker_lost"
    assert by_kind["SendError"].request.request_id == "a"
    assert by_kind["SendError"].code is ErrorCode.WORKER_LOST
    assert by_kind["Ack"].request.request_id == "a"
    assert core.scheduler.is_queued("b") and not core.scheduler.is_known("a")
    # The lost worker gets nothing more; a live one gets the requeued request.
    assert _dispatch(core, "w1", 1) == ["b"]  # a pull is a sign of life: it rejoined


def test_select_for_a_worker_declared_lost_returns_nothing():
    core = _core()
    core.on_pull("w1", 0, 0)
    core.tick(TIMEOUT_MS + 1)
    core.submit(_req("a"), TIMEOUT_MS + 2)
    assert core.select("w1", 10, TIMEOUT_MS + 2) == []
    assert core.scheduler.is_queued("a")


def test_heartbeat_reconciles_requests_the_worker_no_longer_reports():
    core = _core()
    for rid in ("started", "lost_reply"):
        core.submit(_req(rid), 0)
    _dispatch(core, "w1", 0)
    core.on_started("started", "w1", 1)
    # Within two heartbeat intervals a missing id may be in transit: nothing happens.
    assert core.on_heartbeat("w1", [], 1_500, interval_ms=1_000) == []
    actions = core.on_heartbeat("w1", [], 2_500, interval_ms=1_000)
    kinds = {(type(a).__name__, a.request.request_id) for a in actions}
    assert kinds == {("Ack", "started"), ("Requeued", "lost_reply")}
    assert core.scheduler.tenant_loads()["t"].num_in_flight == 0  # no quota leaks
    assert core.scheduler.is_queued("lost_reply")


def test_restart_grace_adopts_what_workers_report_and_releases_the_rest():
    core = _core()
    core.begin_grace(0)
    # Redeliveries after a restart wait; a first delivery does not.
    assert _kinds(core.submit(_req("running"), 10, redelivered=True)) == ["Hold"]
    assert _kinds(core.submit(_req("queued"), 10, redelivered=True)) == ["Hold"]
    assert _kinds(core.submit(_req("fresh"), 10)) == ["Hold"]
    assert _dispatch(core, "w2", 20) == ["fresh"]  # deferred ones are not served yet
    assert core.on_heartbeat("w1", ["running"], 100) == []
    actions = core.tick(TIMEOUT_MS + 1)
    adopted = [a for a in actions if isinstance(a, Adopted)]
    assert [(a.request.request_id, a.worker_id) for a in adopted] == [("running", "w1")]
    assert any(isinstance(a, Released) and a.num_requests == 2 for a in actions)
    assert not any(isinstance(a, Hold) for a in actions)  # already held
    assert _dispatch(core, "w2", TIMEOUT_MS + 2) == ["queued"]
    assert core.workers.worker_of("running") == "w1"


def test_heartbeat_adopts_a_queued_request_after_grace():
    core = _core()
    core.submit(_req("a"), 0)
    (adopted,) = core.on_heartbeat("w1", ["a"], 1)
    assert isinstance(adopted, Adopted) and adopted.worker_id == "w1"
    assert not core.scheduler.is_queued("a") and core.scheduler.num_in_flight == 1


def test_cancel_ends_a_queued_request_and_leaves_a_running_one_to_the_worker():
    core = _core()
    core.submit(_req("q"), 0)
    core.submit(_req("r"), 0)
    assert _dispatch(core, "w1", 1, n=1) == ["q"]
    assert core.on_cancel("q", "client_gone", 5) == []  # running: the worker aborts it
    send, term = core.on_cancel("r", "client_gone", 5)
    assert isinstance(send, SendError) and send.code is ErrorCode.CANCELLED
    assert isinstance(term, Term)
    assert core.on_cancel("r", "client_gone", 5) == []


def test_cancel_of_a_deferred_redelivery():
    core = _core()
    core.begin_grace(0)
    core.submit(_req("a"), 1, redelivered=True)
    assert _kinds(core.on_cancel("a", "client_gone", 5)) == ["SendError", "Term"]
    assert not core.is_known("a")


def test_handed_back_request_goes_to_the_front_again():
    core = _core()
    core.submit(_req("a"), 0)
    core.submit(_req("b"), 0)
    assert _dispatch(core, "w1", 1, n=1) == ["a"]
    (requeued,) = core.on_handed_back("a", "w1", 2)
    assert isinstance(requeued, Requeued) and requeued.reason == "handed_back"
    assert _dispatch(core, "w1", 3, n=1) == ["a"]


def test_expired_request_is_refused_on_tick():
    core = _core()
    core.submit(_req("a", deadline_ms=100.0), 0)
    send, term = core.tick(101)
    assert isinstance(send, SendError) and send.code is ErrorCode.EXPIRED
    assert isinstance(term, Term)


def test_shutdown_naks_queued_and_deferred_work_only():
    core = _core()
    core.begin_grace(0)
    core.submit(_req("deferred"), 1, redelivered=True)
    core.submit(_req("queued"), 1)
    core.submit(_req("running"), 1)
    core.on_pull("w1", 0, 2)
    core.scheduler.select(10, 2)  # both non-deferred leave the queue ...
    core.scheduler.requeue("queued", 3)  # ... and one comes back
    naks = core.shutdown()
    assert all(isinstance(a, Nak) for a in naks)
    assert sorted(a.request.request_id for a in naks) == ["deferred", "queued"]


def test_status_follows_a_request_from_queued_to_ended():
    from fairlane.protocol import RequestState

    core = _core()
    assert core.status("a", 0).state is RequestState.UNKNOWN
    core.submit(_req("a"), 0)
    assert core.status("a", 1).state is RequestState.QUEUED
    _dispatch(core, "w1", 2)
    st = core.status("a", 3)
    assert st.state is RequestState.RUNNING and st.worker_id == "w1"
    core.on_started("a", "w1", 4)
    core.on_finished("a", "w1", None, 5)
    st = core.status("a", 6)
    assert st.state is RequestState.ENDED and st.error is None
    # Remembered for the dedupe window only.
    assert core.status("a", 6 + core.ended_ttl_ms + 1).state is RequestState.UNKNOWN


def test_status_of_a_failed_request_carries_its_error():
    from fairlane.protocol import RequestState

    core = _core()
    core.submit(_req("a"), 0)
    _dispatch(core, "w1", 1)
    core.on_started("a", "w1", 2)
    core.tick(2 + TIMEOUT_MS + 1)
    st = core.status("a", TIMEOUT_MS + 10)
    assert st.state is RequestState.ENDED and st.error.code is ErrorCode.WORKER_LOST


def test_a_repeat_of_an_ended_attempt_is_answered_not_run_and_a_new_attempt_runs():
    core = _core()
    core.submit(_req("a"), 0)
    _dispatch(core, "w1", 1)
    core.on_started("a", "w1", 2)
    core.on_finished("a", "w1", None, 3)
    send, term = core.submit(_req("a"), 4)  # same attempt, e.g. published without dedupe
    assert isinstance(send, SendError) and send.code is ErrorCode.DUPLICATE
    assert "attempt 1" in send.message and isinstance(term, Term)
    assert _kinds(core.submit(_req("a", attempt=1), 5)) == ["Hold"]  # a deliberate retry
    assert _dispatch(core, "w1", 6) == ["a"]


def test_status_of_a_request_refused_at_admission_says_why():
    from fairlane.protocol import RequestState

    core = _core(tenants={"acme": TenantConfig("acme", max_queued=1)})
    core.submit(_req("a", tenant="acme"), 0)
    send, _ = core.submit(_req("b", tenant="acme"), 0)
    assert send.code is ErrorCode.QUEUE_FULL
    st = core.status("b", 1)
    assert st.state is RequestState.ENDED and st.error.code is ErrorCode.QUEUE_FULL
    assert core.status("a", 1).state is RequestState.QUEUED
