"""The pool's decision state: scheduler, worker registry and restart grace. Pure.

`PoolCore` is what the dispatcher shell talks to. Every event the shell sees (a
request fetched, a worker's pull, Started/Finished/handed-back, a heartbeat, a
cancel, a housekeeping tick, shutdown) becomes one call here, which returns the
`actions` to execute. So every recovery decision — requeue or error on worker loss,
reconciliation against heartbeats, adoption after a restart, what to ack, term or
nak — is made in this module, testable without NATS and without a clock.

Recovery rules (DESIGN.md section 4):
- a worker silent past `worker_timeout_ms`, or replaced by a new incarnation under the
  same id (a restart), is lost: its unstarted requests go back to the front of their
  tenants' queues; its started ones end with a retryable `worker_lost` (and their
  messages are acked: never replayed from scratch). Its incarnation is remembered: if
  it was only stalled, its next heartbeat is answered "unknown" and it fences itself;
- "started" is whatever says so first: the Started event, the heartbeat's
  `started_ids`, or — when both may be lost (broker restart) — the request's JetStream
  message being gone (the worker acks it at the first token). Before anything not
  known to have started is requeued, the shell checks that (`CheckStarted`), so a lost
  event never turns started work into a second generation;
- a live worker that no longer reports a request it was given: unstarted → requeue
  (the WorkBatch reply was lost); started → finished (the Finished event was lost), so
  a tenant's quota never leaks;
- after a (re)start, redelivered requests wait one worker timeout (the *grace*), long
  enough for every live worker to heartbeat what it runs; they are handed back to
  JetStream with a delay instead of held, so a crash during the grace does not park
  them for another ``ack_wait``. A redelivery that a live worker reports is adopted
  as in flight instead of being dispatched a second time.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from dispatcher.scheduler.actions import (
    Ack,
    Action,
    Adopted,
    CheckStarted,
    Defer,
    Hold,
    Nak,
    Preempt,
    Released,
    Requeued,
    SendError,
    Term,
    refuse,
)
from dispatcher.scheduler.core import Scheduler
from dispatcher.scheduler.ended import EndedMemory
from dispatcher.scheduler.loads import TenantChanges
from dispatcher.scheduler.types import ActualUsage, Dispatch, QueuedRequest, Verdict
from dispatcher.scheduler.workers import WorkerRegistry, WorkerState
from fairlane.protocol import ErrorCode, RequestState


class LoadReport(Protocol):
    """What a heartbeat says about the engine (`fairlane.protocol.EngineLoad`)."""

    num_running: int
    num_waiting: int
    kv_tokens_used: int
    kv_tokens_total: int


class PoolObserver:
    """Sees decisions as the core makes them, for the pool's stats snapshot
    (`dispatcher.stats.StatsTracker`); this one ignores them. Pure, like the core."""

    def dispatched(self, req: QueuedRequest, now_ms: float) -> None: ...
    def started(self, req: QueuedRequest, now_ms: float) -> None: ...  # Started event
    def preempted(self, req: QueuedRequest, now_ms: float) -> None: ...
    def ended(self, actions: list[Action], now_ms: float) -> None: ...  # refusals, drops


@dataclass(slots=True, frozen=True)
class Status:
    """Where a request is (`fairlane.protocol.RequestStatus` without the wire)."""

    state: RequestState
    attempt: int = 0
    worker_id: str = ""
    error: SendError | None = None  # ENDED with an error: how


class PoolCore:
    # How long ended requests are remembered: the JetStream dedupe window, inside which
    # a repeat of the same attempt is answered with its status, never run again.
    ended_ttl_ms = 120_000.0
    max_ended = 200_000  # bound on that memory (oldest forgotten first)
    defer_margin_ms = 250.0  # a deferred redelivery comes back this long after the grace
    # A tenant with nothing queued or in flight this long is forgotten (its load, the
    # policy state it owes nothing on, its metrics series): --tenant-idle-s.
    tenant_idle_ms = 600_000.0

    def __init__(self, scheduler: Scheduler, worker_timeout_ms: float) -> None:
        self.scheduler = scheduler
        self.workers = WorkerRegistry(worker_timeout_ms)
        self._ended = EndedMemory(self.ended_ttl_ms, self.max_ended)
        self._grace_until_ms = 0.0
        self._deferred: dict[str, QueuedRequest] = {}  # redeliveries handed back in grace
        self._checking: dict[str, str] = {}  # request id -> why its start is being checked
        self._forget_deferred_ms = 0.0
        self.observer = PoolObserver()
        # What the last `tick` found: tenants whose load changed, tenants forgotten
        # (the dispatcher's per-tenant metrics follow it, `dispatcher.metrics`).
        self.tenant_changes = TenantChanges()

    # --- restart grace -----------------------------------------------------------------

    def begin_grace(self, now_ms: float) -> None:
        """Call at (re)start: redeliveries wait one worker timeout before dispatch."""
        self._grace_until_ms = now_ms + self.workers.timeout_ms

    def in_grace(self, now_ms: float) -> bool:
        return bool(self._grace_until_ms) and now_ms < self._grace_until_ms

    def live_request(self, request_id: str) -> QueuedRequest | None:
        """The request if it is queued or in flight here (deferred ones are not)."""
        return (self.scheduler.queued_request(request_id)
                or self.scheduler.in_flight_request(request_id))

    def is_known(self, request_id: str) -> bool:
        return request_id in self._deferred or self.scheduler.is_known(request_id)

    # --- admission ---------------------------------------------------------------------

    def submit(self, req: QueuedRequest, now_ms: float, redelivered: bool = False) -> list[Action]:
        """A decoded, checked request from JetStream. Returns [Hold] if it waits here,
        the refusal actions if not, [] for a duplicate of one already known."""
        rid = req.request_id
        if redelivered and self.in_grace(now_ms) and not self.scheduler.is_known(rid):
            # Maybe a worker already runs it: decide once heartbeats had their chance.
            # Handed back, not held: a crash now must not park it for ack_wait again.
            self._deferred[rid] = req
            return [Defer(req, self._grace_until_ms - now_ms + self.defer_margin_ms)]
        # A deferred one is back after the grace (or published again): admit it now.
        self._deferred.pop(rid, None)
        if self.scheduler.is_known(rid):
            return []
        ended = self._ended.get(req.request_id, now_ms)
        if ended is not None and req.attempt <= ended.attempt and redelivered:
            # We ended it, but its message came back (a settle was lost): the client
            # already has its answer.
            return [Term(req, "ended")]
        if ended is not None and req.attempt <= ended.attempt:
            # A repeat that escaped JetStream's dedupe (published without Nats-Msg-Id,
            # or by another client): answer with its status, never generate twice.
            how = f"failed with {ended.error.code.value}" if ended.error else "finished"
            return refuse(req, ErrorCode.DUPLICATE,
                          f"attempt {ended.attempt} of request {req.request_id} already "
                          f"{how}; submit attempt {ended.attempt + 1} to run it again")
        # A new waiter: a decision that found nothing to do before it is stale now
        # (its recheck pause would delay this request's preemption to the next event).
        # Only a tenant with nothing queued is new: one with work queued was a waiter
        # at that decision already, and its recheck comes within recheck_ms. (A
        # decision is O(tenants): in bench/capacity_plan.py's overloaded 12-worker run,
        # 2,000 backlogged tenants, this made 27% fewer decisions, same outcome.)
        load = self.scheduler.tenant_loads().get(req.tenant)
        if load is None or load.num_queued == 0:
            self.scheduler.preemptor.poke(req.tier, self.scheduler.config.weight(req.tenant))
        return self._remember(self._admit(req, now_ms), now_ms)

    def _admit(self, req: QueuedRequest, now_ms: float) -> list[Action]:
        listed = self.scheduler.config.tenants.get(req.tenant)
        if listed is not None and listed.tier != req.tier:
            # The subject's tier is the client's claim; the tenants file decides.
            return refuse(req, ErrorCode.INVALID_REQUEST,
                          f"tenant {req.tenant!r} is in tier {listed.tier!r}, not {req.tier!r}")
        verdict = self.scheduler.submit(req, now_ms)
        if verdict.verdict is Verdict.DUPLICATE:
            return []
        if verdict.verdict is Verdict.REJECTED:
            assert verdict.code is not None
            return refuse(req, verdict.code, verdict.message, verdict.retry_after_ms)
        out: list[Action] = [Hold(req)]
        worker_id = self.workers.reporter_of(req.request_id)
        if worker_id is not None:  # a worker already runs it (we restarted)
            out.extend(self._adopt(req.request_id, worker_id, now_ms))
        return out

    def _adopt(self, request_id: str, worker_id: str, now_ms: float) -> list[Action]:
        req = self.scheduler.adopt(request_id, now_ms)
        if req is None:
            return []
        self.workers.assign(request_id, worker_id, now_ms)
        return [Adopted(req, worker_id)]

    # --- request status ----------------------------------------------------------------

    def status(self, request_id: str, now_ms: float) -> Status:
        if request_id in self._deferred or self.scheduler.is_queued(request_id):
            req = self._deferred.get(request_id) or self.scheduler.queued_request(request_id)
            return Status(RequestState.QUEUED, req.attempt if req else 0)
        req = self.scheduler.in_flight_request(request_id)
        if req is not None:
            return Status(RequestState.RUNNING, req.attempt,
                          self.workers.worker_of(request_id) or "")
        ended = self._ended.get(request_id, now_ms)
        if ended is not None:
            return Status(RequestState.ENDED, ended.attempt, error=ended.error)
        return Status(RequestState.UNKNOWN)

    def _remember(self, actions: list[Action], now_ms: float) -> list[Action]:
        """Note every request these actions end (finished, failed, dropped, cancelled)."""
        if not actions:
            # Most calls (every worker message passes here): nothing ended. Entries past
            # their TTL wait for the next call with actions (`get` checks the TTL).
            return actions
        self.observer.ended(actions, now_ms)
        errors = {a.request.request_id: a for a in actions if isinstance(a, SendError)}
        for a in actions:
            if isinstance(a, Term) or (isinstance(a, Ack) and a.reason != "started"):
                rid = a.request.request_id
                self._ended.add(rid, a.request.attempt, errors.get(rid), now_ms)
        self._ended.trim(now_ms)
        return actions

    # --- worker contact ----------------------------------------------------------------

    def contact(self, worker_id: str, incarnation: str, now_ms: float) -> tuple[bool, list[Action]]:
        """Every message from a worker passes here first: (known, actions).

        Not known: an incarnation declared lost (a stalled or partitioned process that
        came back); its messages are ignored and its heartbeat is answered "unknown",
        so it fences itself. A new incarnation under a registered id is a restart: the
        old process's work is lost now, not after a timeout (its successor would
        otherwise heartbeat under the old id and hide that loss)."""
        if self.workers.is_lost(incarnation):
            return False, []
        out: list[Action] = []
        old = self.workers.replaced(worker_id, incarnation)
        if old is not None:
            self.workers.remove(worker_id)
            out = self._worker_lost(old, now_ms)
        w = self.workers.seen(worker_id, now_ms)
        if incarnation:
            w.incarnation = incarnation
        return True, self._remember(out, now_ms)

    def knows(self, incarnation: str) -> bool:
        return not self.workers.is_lost(incarnation)

    def on_reconnected(self, now_ms: float) -> None:
        """This dispatcher was cut off from NATS: no worker could reach it, so their
        silence proves nothing. Each gets a full timeout from now."""
        self.workers.refresh_all(now_ms)

    # --- pulls -------------------------------------------------------------------------

    def on_pull(self, worker_id: str, free_kv_tokens: int, now_ms: float,
                incarnation: str = "") -> list[Action]:
        known, out = self.contact(worker_id, incarnation, now_ms)
        if known:
            w = self.workers.workers[worker_id]
            w.kv_tokens_total = max(w.kv_tokens_total, free_kv_tokens)
        return out

    def is_alive(self, worker_id: str, incarnation: str = "") -> bool:
        w = self.workers.workers.get(worker_id)
        return w is not None and (not incarnation or not w.incarnation
                                  or w.incarnation == incarnation)

    def select(self, worker_id: str, max_items: int, now_ms: float,
               free_kv_tokens: int | None = None, incarnation: str = "",
               must_fit: bool = False) -> list[Dispatch]:
        """Work for one pulling worker; nothing for a worker declared lost since.
        `must_fit`: see `Scheduler.select` (a pull served a second time in one pass)."""
        if not self.is_alive(worker_id, incarnation) or not self.scheduler.num_queued:
            return []
        out = self.scheduler.select(max_items, now_ms, free_kv_tokens, worker_id, must_fit)
        for d in out:
            self.workers.assign(d.request.request_id, worker_id, now_ms)
            self.observer.dispatched(d.request, now_ms)
        return out

    # --- worker events -----------------------------------------------------------------

    def on_started(self, request_id: str, worker_id: str, now_ms: float,
                   incarnation: str = "") -> list[Action]:
        known, out = self.contact(worker_id, incarnation, now_ms)
        if not known:
            return out
        started = self._mark_started(request_id, now_ms)
        if started:
            self.observer.started(started[0].request, now_ms)
        return out + started

    def _mark_started(self, request_id: str, now_ms: float) -> list[Ack]:
        # The start time is what min_run_ms (preemption hysteresis) counts from.
        if (self.scheduler.is_started(request_id)
                or not self.scheduler.on_started(request_id, now_ms)):
            return []
        req = self.scheduler.in_flight_request(request_id)
        assert req is not None
        return [Ack(req, "started")]

    def on_finished(self, request_id: str, worker_id: str, usage: ActualUsage | None,
                    now_ms: float, incarnation: str = "") -> list[Action]:
        known, out = self.contact(worker_id, incarnation, now_ms)
        if not known:
            return out
        return out + self._remember(self._finish(request_id, usage, now_ms, "finished"), now_ms)

    def _finish(self, request_id: str, usage: ActualUsage | None, now_ms: float,
                reason: str) -> list[Action]:
        self.workers.unassign(request_id)
        self._checking.pop(request_id, None)
        req = self.scheduler.on_finished(request_id, usage, now_ms)
        # Finished without Started (it failed before its first token and the client has
        # its error) is settled the same way: done either way, never replayed.
        return [Ack(req, reason)] if req is not None else []

    def on_handed_back(self, request_id: str, worker_id: str, now_ms: float,
                       incarnation: str = "") -> list[Action]:
        """The worker returns a request it accepted but never started (drain, no room)."""
        known, out = self.contact(worker_id, incarnation, now_ms)
        if not known:
            return out
        return out + self._requeue(request_id, now_ms, "handed_back")

    def _requeue(self, request_id: str, now_ms: float, reason: str) -> list[Action]:
        self.workers.unassign(request_id)
        self._checking.pop(request_id, None)
        req = self.scheduler.in_flight_request(request_id)
        if req is None or not self.scheduler.requeue(request_id, now_ms):
            return []
        return [Requeued(req, reason)]

    # --- preemption (DESIGN.md section 5b; decided by `dispatcher.scheduler.preempt`) ---

    def preemptions(self, now_ms: float, num_free_slots: int) -> list[Action]:
        """Running requests to stop now so that waiting requests below their tenants'
        fair share get the slots (none while a pulled slot waits for work)."""
        orders = self.scheduler.preemptions(
            now_ms, num_free_slots, lambda rid: self._preemptible_on(rid, now_ms))
        out: list[Action] = []
        for o in orders:
            # The waiter goes with the order, to the worker whose slot it frees.
            d = self.scheduler.dispatch_held(o.for_request.request_id, now_ms)
            if d is not None:
                self.workers.assign(d.request.request_id, o.worker_id, now_ms, contact=False)
                self.observer.dispatched(d.request, now_ms)
            out.append(Preempt(o.request, o.worker_id, o.for_request, d))
        return out

    def _preemptible_on(self, request_id: str, now_ms: float) -> str | None:
        """The live worker running it, if any (a request being checked is not, nor
        one on a worker silent for two heartbeats: it may be stalled, and an order
        there would strand the waiter sent with it until the worker is declared lost)."""
        if request_id in self._checking:
            return None
        worker_id = self.workers.worker_of(request_id)
        if worker_id is None or not self.workers.responsive(worker_id, now_ms):
            return None
        return worker_id

    def on_preempted(self, request_id: str, worker_id: str, num_generated_tokens: int,
                     now_ms: float, incarnation: str = "") -> list[Action]:
        """The worker stopped it and handed back its continuation: to the front of its
        tenant's queue, charged only for what is left."""
        known, out = self.contact(worker_id, incarnation, now_ms)
        if not known or self.workers.worker_of(request_id) != worker_id:
            return out
        self.workers.unassign(request_id)
        req = self.scheduler.preempted(request_id, num_generated_tokens, now_ms, worker_id)
        if req is not None:
            self.observer.preempted(req, now_ms)
        return out + ([Requeued(req, "preempted")] if req is not None else [])

    def on_heartbeat(self, worker_id: str, in_flight_ids: Iterable[str], now_ms: float, *,
                     interval_ms: float = 1_000.0, draining: bool = False,
                     load: LoadReport | None = None, incarnation: str = "",
                     started_ids: Iterable[str] = ()) -> list[Action]:
        known, out = self.contact(worker_id, incarnation, now_ms)
        if not known:
            return out
        w = self.workers.workers[worker_id]
        if load is not None:
            w.num_running, w.num_waiting = load.num_running, load.num_waiting
            w.kv_tokens_used, w.kv_tokens_total = load.kv_tokens_used, load.kv_tokens_total
        for rid in started_ids:  # its Started event may have been lost (else: no-op)
            if not self.scheduler.is_started(rid) and self.workers.worker_of(rid) == worker_id:
                out.extend(self._mark_started(rid, now_ms))
        ids = list(in_flight_ids)
        for rid in ids:
            # After a restart JetStream redelivers requests a worker already holds:
            # adopt them as in flight instead of dispatching them again.
            if self.scheduler.is_queued(rid):
                out.extend(self._adopt(rid, worker_id, now_ms))
        for rid in self.workers.heartbeat(worker_id, ids, now_ms, interval_ms, draining):
            # Reconciliation: the worker does not have it. Either its WorkBatch reply
            # was lost (never started: requeue) or its Finished was (release quota).
            if self.scheduler.is_started(rid):
                out.extend(self._finish(rid, None, now_ms, "reconciled"))
            else:
                out.extend(self._check_started(rid, "reconciled"))
        return self._remember(out, now_ms)

    def _check_started(self, request_id: str, reason: str) -> list[Action]:
        """Not known to have started: ask JetStream before requeueing (both its
        Started event and the heartbeat saying so may have been lost)."""
        self.workers.unassign(request_id)
        req = self.scheduler.in_flight_request(request_id)
        if req is None or request_id in self._checking:
            return []
        self._checking[request_id] = reason
        return [CheckStarted(req, reason)]

    def on_start_checked(self, request_id: str, started: bool, now_ms: float) -> list[Action]:
        """The shell's answer to `CheckStarted`: was the message acked by a worker?"""
        reason = self._checking.pop(request_id, None)
        req = self.scheduler.in_flight_request(request_id)
        if reason is None or req is None:
            return []  # decided meanwhile (a late Finished, a cancel)
        if not started:
            return self._requeue(request_id, now_ms, reason)
        self.scheduler.on_started(request_id, now_ms)
        if reason == "reconciled":  # it started and its worker no longer has it: done
            return self._remember(self._finish(request_id, None, now_ms, reason), now_ms)
        return self._remember(self._lost_started(req, now_ms), now_ms)

    def on_cancel(self, request_id: str, reason: str, now_ms: float) -> list[Action]:
        """Queued: removed and ended. Running (the worker aborts it) or unknown: []."""
        req = self._deferred.pop(request_id, None) or self.scheduler.cancel(request_id)
        if req is None:
            return []
        return self._remember(refuse(req, ErrorCode.CANCELLED, f"cancelled: {reason}"), now_ms)

    # --- time --------------------------------------------------------------------------

    def tick(self, now_ms: float) -> list[Action]:
        """Housekeeping: end the restart grace, expire and shed queued work, declare
        silent workers lost, forget idle tenants (`tenant_changes`)."""
        out: list[Action] = []
        if self._grace_until_ms and now_ms >= self._grace_until_ms:
            out.extend(self._end_grace(now_ms))
        elif self._deferred and not self._grace_until_ms and now_ms >= self._forget_deferred_ms:
            self._deferred.clear()  # long back, or taken by another dispatcher
        for error in (*self.scheduler.expire(now_ms), *self.scheduler.shed(now_ms)):
            out += [error, Term(error.request, error.code.value)]
        for w in self.workers.dead_workers(now_ms):
            out.extend(self._worker_lost(w, now_ms))
        self.tenant_changes = self.scheduler.sweep_tenants(now_ms, self.tenant_idle_ms)
        return self._remember(out, now_ms)

    def _end_grace(self, now_ms: float) -> list[Action]:
        """The deferred redeliveries come back from JetStream by themselves; from now
        on they are admitted (or adopted, if a live worker reports them). Until they
        are back, status still says "queued" (a silent client must not give up)."""
        self._grace_until_ms = 0.0
        self._forget_deferred_ms = now_ms + self.ended_ttl_ms
        return [Released(len(self._deferred))] if self._deferred else []

    def _worker_lost(self, w: WorkerState, now_ms: float) -> list[Action]:
        out: list[Action] = []
        for rid in list(w.request_ids):
            self.workers.unassign(rid)
            req = self.scheduler.in_flight_request(rid)
            if req is None or rid in self._checking:
                continue
            if self.scheduler.is_started(rid):
                out.extend(self._lost_started(req, now_ms, w.worker_id))
            else:
                self._checking[rid] = "worker_lost"
                out.append(CheckStarted(req, "worker_lost"))
        return out

    def _lost_started(self, req: QueuedRequest, now_ms: float,
                      worker_id: str = "") -> list[Action]:
        self.scheduler.on_finished(req.request_id, None, now_ms)
        who = f"worker {worker_id}" if worker_id else "its worker"
        return [SendError(req, ErrorCode.WORKER_LOST,
                          f"{who} stopped responding after the request started; retry it"),
                Ack(req, "worker_lost")]

    def shutdown(self) -> list[Action]:
        """Queued (not dispatched) work goes straight back to JetStream."""
        return [Nak(r) for r in self.scheduler.queued()]
