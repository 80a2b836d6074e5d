"""Recovery decisions of the pure pool core: events in, actions out, no I/O, no clock."""

from __future__ import annotations

import pytest

from dispatcher.scheduler.actions import (
    Ack,
    Adopted,
    CheckStarted,
    Defer,
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
    assert by_kind["SendError"].request.request_id == "a"
    assert by_kind["SendError"].code is ErrorCode.WORKER_LOST
    assert by_kind["Ack"].request.request_id == "a"
    # "b" never said Started, but that event may have been lost: JetStream decides.
    assert by_kind["CheckStarted"].request.request_id == "b"
    (requeued,) = core.on_start_checked("b", False, TIMEOUT_MS + 4)
    assert isinstance(requeued, Requeued) and requeued.reason == "worker_lost"
    assert core.scheduler.is_queued("b") and not core.scheduler.is_known("a")
    # The lost worker gets nothing more; a live one gets the requeued request.
    assert _dispatch(core, "w1", TIMEOUT_MS + 5) == ["b"]  # a pull is a sign of life


def test_lost_worker_whose_started_event_was_lost_is_not_generated_twice():
    core = _core()
    core.submit(_req("a"), 0)
    _dispatch(core, "w1", 1)
    (check,) = core.tick(TIMEOUT_MS + 2)  # no Started ever arrived
    assert isinstance(check, CheckStarted) and check.reason == "worker_lost"
    assert core.tick(TIMEOUT_MS + 3) == []  # asked once
    send, ack = core.on_start_checked("a", True, TIMEOUT_MS + 4)  # its message is gone
    assert isinstance(send, SendError) and send.code is ErrorCode.WORKER_LOST
    assert isinstance(ack, Ack) and not core.scheduler.is_known("a")
    assert core.on_start_checked("a", False, TIMEOUT_MS + 5) == []  # a late answer


def test_restarted_worker_under_the_same_id_loses_the_old_incarnations_work():
    core = _core()
    for rid in ("a", "b"):
        core.submit(_req(rid), 0)
    core.on_pull("w1", 0, 1, incarnation="old")
    assert len(core.select("w1", 10, 1, incarnation="old")) == 2
    core.on_started("a", "w1", 2, incarnation="old")
    # The new process heartbeats under the same id at once: no timeout to wait for.
    actions = core.on_heartbeat("w1", [], 3, incarnation="new")
    kinds = sorted((type(a).__name__, a.request.request_id) for a in actions)
    assert kinds == [("Ack", "a"), ("CheckStarted", "b"), ("SendError", "a")]
    assert core.knows("new") and not core.knows("old")
    # The old process, if it was only stalled, is refused everything from now on.
    assert core.on_finished("b", "w1", None, 4, incarnation="old") == []
    assert core.select("w1", 10, 4, incarnation="old") == []
    assert core.on_heartbeat("w1", ["b"], 5, incarnation="old") == []
    assert core.workers.workers["w1"].incarnation == "new"


def test_stalled_worker_declared_lost_is_unknown_when_it_wakes():
    core = _core()
    core.submit(_req("a"), 0)
    core.on_pull("w1", 0, 0, incarnation="i1")
    core.select("w1", 1, 0, incarnation="i1")
    core.on_started("a", "w1", 1, incarnation="i1")
    assert _kinds(core.tick(TIMEOUT_MS + 2)) == ["SendError", "Ack"]
    assert not core.knows("i1")
    assert core.on_heartbeat("w1", ["a"], TIMEOUT_MS + 3, incarnation="i1") == []
    assert "w1" not in core.workers.workers
    core.on_heartbeat("w1", [], TIMEOUT_MS + 4, incarnation="i2")  # it rejoined anew
    assert core.knows("i2") and core.is_alive("w1", "i2")


def test_heartbeat_started_ids_stand_in_for_a_lost_started_event():
    core = _core()
    core.submit(_req("a"), 0)
    _dispatch(core, "w1", 1)
    (ack,) = core.on_heartbeat("w1", ["a"], 2, started_ids=["a"])
    assert isinstance(ack, Ack) and ack.reason == "started"
    assert core.scheduler.is_started("a")
    assert core.on_started("a", "w1", 3) == []  # the late event changes nothing


def test_no_worker_is_lost_while_the_dispatcher_itself_was_cut_off():
    core = _core()
    core.on_heartbeat("w1", [], 0)
    core.on_reconnected(TIMEOUT_MS * 2)  # NATS was down: nobody could reach us
    assert core.tick(TIMEOUT_MS * 2 + 1) == [] and core.is_alive("w1")
    core.tick(TIMEOUT_MS * 3 + 2)
    assert not core.is_alive("w1")


def test_select_for_a_worker_declared_lost_returns_nothing():
    core = _core()
    core.on_pull("w1", 0, 0)
    core.tick(TIMEOUT_MS + 1)
    core.submit(_req("a"), TIMEOUT_MS + 2)
    assert core.select("w1", 10, TIMEOUT_MS + 2) == []
    assert core.scheduler.is_queued("a")


def test_heartbeat_reconciles_requests_the_worker_no_longer_reports():
    core = _core()
    for rid in ("started", "lost_reply", "lost_events"):
        core.submit(_req(rid), 0)
    _dispatch(core, "w1", 0)
    core.on_started("started", "w1", 1)
    # Within two heartbeat intervals a missing id may be in transit: nothing happens.
    assert core.on_heartbeat("w1", [], 1_500, interval_ms=1_000) == []
    actions = core.on_heartbeat("w1", [], 2_500, interval_ms=1_000)
    kinds = {(type(a).__name__, a.request.request_id) for a in actions}
    assert kinds == {("Ack", "started"), ("CheckStarted", "lost_reply"),
                     ("CheckStarted", "lost_events")}
    # Its WorkBatch reply was lost: its message is still in the stream.
    (requeued,) = core.on_start_checked("lost_reply", False, 2_600)
    assert isinstance(requeued, Requeued) and core.scheduler.is_queued("lost_reply")
    # It ran and finished, Started and Finished both lost: the worker acked it.
    (ack,) = core.on_start_checked("lost_events", True, 2_600)
    assert isinstance(ack, Ack) and ack.reason == "reconciled"
    assert core.scheduler.tenant_loads()["t"].num_in_flight == 0  # no quota leaks


def test_restart_grace_defers_redeliveries_then_adopts_what_workers_report():
    core = _core()
    core.begin_grace(0)
    # Redeliveries after a restart are handed back until the grace ends; a first
    # delivery is not (no worker can have it).
    (defer,) = core.submit(_req("running"), 10, redelivered=True)
    assert isinstance(defer, Defer) and defer.delay_ms >= TIMEOUT_MS - 10
    assert _kinds(core.submit(_req("queued"), 10, redelivered=True)) == ["Defer"]
    assert _kinds(core.submit(_req("fresh"), 10)) == ["Hold"]
    assert _kinds(core.submit(_req("queued"), 20, redelivered=True)) == ["Defer"]  # again
    assert core.status("queued", 20).state.value == "queued"
    assert _dispatch(core, "w2", 20) == ["fresh"]  # deferred ones are not served yet
    assert core.on_heartbeat("w1", ["running"], 100) == []
    (released,) = core.tick(TIMEOUT_MS + 1)
    assert isinstance(released, Released) and released.num_requests == 2
    # They come back from JetStream after the grace: adopted, or admitted.
    hold, adopted = core.submit(_req("running"), TIMEOUT_MS + 300, redelivered=True)
    assert isinstance(hold, Hold) and isinstance(adopted, Adopted)
    assert adopted.worker_id == "w1" and core.workers.worker_of("running") == "w1"
    assert _kinds(core.submit(_req("queued"), TIMEOUT_MS + 300, redelivered=True)) == ["Hold"]
    assert _dispatch(core, "w2", TIMEOUT_MS + 302) == ["queued"]


def test_redelivery_of_an_ended_request_is_termed_without_a_second_answer():
    core = _core()
    core.submit(_req("a"), 0)
    _dispatch(core, "w1", 1)
    core.on_finished("a", "w1", None, 2)
    (term,) = core.submit(_req("a"), 3, redelivered=True)
    assert isinstance(term, Term)


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
    # When JetStream brings it back, it is ended without a second answer.
    assert _kinds(core.submit(_req("a"), TIMEOUT_MS + 300, redelivered=True)) == ["Term"]


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


def test_shutdown_naks_queued_work_only():
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
    # The deferred one is not held (JetStream already has it back).
    assert sorted(a.request.request_id for a in naks) == ["queued"]


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


def _flooded_worker() -> tuple[PoolCore, list[str]]:
    """Tenant a holds both slots of worker w1 (started at 1 ms) and has 2 more queued;
    preemption on, no hysteresis."""
    from fairlane.poolconfig import PreemptionConfig
    core = _core(preemption=PreemptionConfig(min_run_ms=0))
    for i in range(4):
        core.submit(_req(f"a{i}", tenant="a"), 0)
    core.on_pull("w1", 0, 0)
    running = [d.request.request_id for d in core.select("w1", 2, 0)]
    for rid in running:
        core.on_started(rid, "w1", 1)
    return core, running


def test_preemption_hands_the_waiter_to_the_victims_worker_with_the_order():
    """The waiting request is dispatched with the order, to the worker whose slot the
    victim frees; if that order is lost, the worker's heartbeat lacks the waiter and
    reconciliation puts it back in the queue (its message was never acked)."""
    from dispatcher.scheduler.actions import Preempt
    core, running = _flooded_worker()
    core.submit(_req("b1", tenant="b"), 100)
    (order,) = [a for a in core.preemptions(100, 0) if isinstance(a, Preempt)]
    assert order.worker_id == "w1" and order.request.request_id in running
    assert order.dispatch is not None and order.dispatch.request.request_id == "b1"
    assert not core.scheduler.is_queued("b1") and core.workers.worker_of("b1") == "w1"
    assert core.preemptions(100, 0) == []  # b is at its share now
    # The order never arrived: the victim runs on, the heartbeat lacks b1.
    actions = core.on_heartbeat("w1", running, 2_500, interval_ms=1_000)
    assert [(type(a).__name__, a.request.request_id) for a in actions] == [
        ("CheckStarted", "b1")]
    (requeued,) = core.on_start_checked("b1", False, 2_600)
    assert isinstance(requeued, Requeued) and core.scheduler.is_queued("b1")


def test_a_preemptions_replacement_does_not_keep_a_silent_worker_alive():
    """Work sent to a worker with a preemption order is not contact from it: a stalled
    worker is declared lost on time even while orders keep going to it."""
    from dispatcher.scheduler.actions import Preempt
    core, running = _flooded_worker()
    core.on_heartbeat("w1", running, 1_000, interval_ms=1_000)  # its last sign of life
    core.submit(_req("b1", tenant="b"), 2_500)
    assert any(isinstance(a, Preempt) for a in core.preemptions(2_500, 0))
    lost = core.tick(1_000 + TIMEOUT_MS + 50)  # on time, order or not
    assert any(isinstance(a, SendError) and a.code is ErrorCode.WORKER_LOST for a in lost)


def test_no_preemption_order_goes_to_a_worker_silent_for_two_heartbeats():
    core, running = _flooded_worker()
    core.on_heartbeat("w1", running, 1_000, interval_ms=1_000)
    core.submit(_req("b1", tenant="b"), 3_100)
    assert core.preemptions(3_100, 0) == []  # 2.1 s of silence: maybe stalled


def test_a_new_request_is_decided_at_once_despite_a_recent_empty_decision():
    """A decision that found nothing pauses the next ones for recheck_ms; a request
    arriving inside that pause must not wait for the next event to be preempted for."""
    from dispatcher.scheduler.actions import Preempt
    core, running = _flooded_worker()
    core.on_heartbeat("w1", running, 100, interval_ms=1_000)
    assert core.preemptions(100, 0) == []  # a's own queue: nothing to do; pause 20 ms
    core.submit(_req("b1", tenant="b"), 105)
    assert any(isinstance(a, Preempt) for a in core.preemptions(105, 0))


def test_a_backlogged_tenants_new_request_does_not_undo_the_recheck_pause():
    """Only a tenant with nothing queued is a new waiter: another request of a tenant
    already waiting leaves the pause alone (each such arrival used to force a fresh
    O(tenants) decision in an overloaded pool), and the recheck still comes."""
    from dispatcher.scheduler.actions import Preempt
    core, running = _flooded_worker()
    core.on_heartbeat("w1", running, 100, interval_ms=1_000)
    assert core.preemptions(100, 0) == []  # a's own queue: nothing to do; pause 20 ms
    pre = core.scheduler.preemptor
    paused_until_ms = pre._idle_until_ms
    core.submit(_req("a9", tenant="a"), 105)  # a had 2 queued: not a new waiter
    assert pre._idle_until_ms == paused_until_ms
    core.submit(_req("b1", tenant="b"), 106)  # b had nothing queued: decided at once
    assert any(isinstance(a, Preempt) for a in core.preemptions(106, 0))
