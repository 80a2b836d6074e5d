"""The pool's decision state: scheduler, worker registry and restart grace. Pure.

`PoolCore` is what the dispatcher shell talks to. Every event the shell sees (a
request fetched, a worker's pull, Started/Finished/handed-back, a heartbeat, a
cancel, a housekeeping tick, shutdown) becomes one call here, which returns the
`actions` to execute. So every recovery decision — requeue or error on worker loss,
reconciliation against heartbeats, adoption after a restart, what to ack, term or
nak — is made in this module, testable without NATS and without a clock.

Recovery rules (DESIGN.md section 4):
- a worker silent past `worker_timeout_ms` is lost: its unstarted requests go back to
  the front of their tenants' queues; its started ones end with a retryable
  `worker_lost` (and their messages are acked: never replayed from scratch);
- a live worker that no longer reports a request it was given: unstarted → requeue
  (the WorkBatch reply was lost); started → finished (the Finished event was lost), so
  a tenant's quota never leaks;
- after a (re)start, redelivered requests wait one worker timeout (the *grace*), long
  enough for every live worker to heartbeat what it runs; reported ones are adopted
  as in flight instead of being dispatched a second time.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from dispatcher.scheduler.actions import (
    Ack,
    Action,
    Adopted,
    Hold,
    Nak,
    Released,
    Requeued,
    SendError,
    Term,
    refuse,
)
from dispatcher.scheduler.core import Scheduler
from dispatcher.scheduler.types import ActualUsage, Dispatch, QueuedRequest, Verdict
from dispatcher.scheduler.workers import WorkerRegistry, WorkerState
from fairlane.protocol import ErrorCode, RequestState


class LoadReport(Protocol):
    """What a heartbeat says about the engine (`fairlane.protocol.EngineLoad`)."""

    num_running: int
    num_waiting: int
    kv_tokens_used: int
    kv_tokens_total: int


@dataclass(slots=True, frozen=True)
class Status:
    """Where a request is (`fairlane.protocol.RequestStatus` without the wire)."""

    state: RequestState
    attempt: int = 0
    worker_id: str = ""
    error: SendError | None = None  # ENDED with an error: how


@dataclass(slots=True, frozen=True)
class _Ended:
    attempt: int
    error: SendError | None
    ended_ms: float


class PoolCore:
    # How long ended requests are remembered: the JetStream dedupe window, inside which
    # a repeat of the same attempt is answered with its status, never run again.
    ended_ttl_ms = 120_000.0
    max_ended = 200_000  # bound on that memory (oldest forgotten first)

    def __init__(self, scheduler: Scheduler, worker_timeout_ms: float) -> None:
        self.scheduler = scheduler
        self.workers = WorkerRegistry(worker_timeout_ms)
        self._ended: OrderedDict[str, _Ended] = OrderedDict()
        self._grace_until_ms = 0.0
        self._deferred: dict[str, QueuedRequest] = {}  # redeliveries held during grace
        self._reported: dict[str, str] = {}  # request id -> worker, heartbeats in grace

    # --- restart grace -----------------------------------------------------------------

    def begin_grace(self, now_ms: float) -> None:
        """Call at (re)start: redeliveries wait one worker timeout before dispatch."""
        self._grace_until_ms = now_ms + self.workers.timeout_ms

    def in_grace(self, now_ms: float) -> bool:
        return bool(self._grace_until_ms) and now_ms < self._grace_until_ms

    def is_known(self, request_id: str) -> bool:
        return request_id in self._deferred or self.scheduler.is_known(request_id)

    # --- admission ---------------------------------------------------------------------

    def submit(self, req: QueuedRequest, now_ms: float, redelivered: bool = False) -> list[Action]:
        """A decoded, checked request from JetStream. Returns [Hold] if it waits here,
        the refusal actions if not, [] for a duplicate of one already known."""
        if self.is_known(req.request_id):
            return []
        ended = self._ended_entry(req.request_id, now_ms)
        if ended is not None and req.attempt <= ended.attempt:
            # A repeat that escaped JetStream's dedupe (published without Nats-Msg-Id,
            # or by another client): answer with its status, never generate twice.
            how = f"failed with {ended.error.code.value}" if ended.error else "finished"
            return refuse(req, ErrorCode.DUPLICATE,
                          f"attempt {ended.attempt} of request {req.request_id} already "
                          f"{how}; submit attempt {ended.attempt + 1} to run it again")
        if redelivered and self.in_grace(now_ms):
            # Maybe a worker already runs it: decide once heartbeats had their chance.
            self._deferred[req.request_id] = req
            return [Hold(req)]
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
        worker_id = self._reported.get(req.request_id)
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
        ended = self._ended_entry(request_id, now_ms)
        if ended is not None:
            return Status(RequestState.ENDED, ended.attempt, error=ended.error)
        return Status(RequestState.UNKNOWN)

    def _ended_entry(self, request_id: str, now_ms: float) -> _Ended | None:
        e = self._ended.get(request_id)
        return e if e is not None and now_ms - e.ended_ms <= self.ended_ttl_ms else None

    def _remember(self, actions: list[Action], now_ms: float) -> list[Action]:
        """Note every request these actions end (finished, failed, dropped, cancelled)."""
        errors = {a.request.request_id: a for a in actions if isinstance(a, SendError)}
        for a in actions:
            if isinstance(a, Term) or (isinstance(a, Ack) and a.reason != "started"):
                rid = a.request.request_id
                self._ended.pop(rid, None)
                self._ended[rid] = _Ended(a.request.attempt, errors.get(rid), now_ms)
        while self._ended and (len(self._ended) > self.max_ended or now_ms - next(
                iter(self._ended.values())).ended_ms > self.ended_ttl_ms):
            self._ended.popitem(last=False)
        return actions

    # --- pulls -------------------------------------------------------------------------

    def on_pull(self, worker_id: str, free_kv_tokens: int, now_ms: float) -> None:
        w = self.workers.seen(worker_id, now_ms)
        w.kv_tokens_total = max(w.kv_tokens_total, free_kv_tokens)

    def is_alive(self, worker_id: str) -> bool:
        return worker_id in self.workers.workers

    def select(self, worker_id: str, max_items: int, now_ms: float,
               free_kv_tokens: int | None = None) -> list[Dispatch]:
        """Work for one pulling worker; nothing for a worker declared lost since."""
        if not self.is_alive(worker_id) or not self.scheduler.num_queued:
            return []
        out = self.scheduler.select(max_items, now_ms, free_kv_tokens)
        for d in out:
            self.workers.assign(d.request.request_id, worker_id, now_ms)
        return out

    # --- worker events -----------------------------------------------------------------

    def on_started(self, request_id: str, worker_id: str, now_ms: float) -> list[Action]:
        self.workers.seen(worker_id, now_ms)
        if not self.scheduler.on_started(request_id, now_ms):
            return []
        req = self.scheduler.in_flight_request(request_id)
        assert req is not None
        return [Ack(req, "started")]

    def on_finished(self, request_id: str, worker_id: str, usage: ActualUsage | None,
                    now_ms: float) -> list[Action]:
        self.workers.seen(worker_id, now_ms)
        return self._remember(self._finish(request_id, usage, now_ms, "finished"), now_ms)

    def _finish(self, request_id: str, usage: ActualUsage | None, now_ms: float,
                reason: str) -> list[Action]:
        self.workers.unassign(request_id)
        req = self.scheduler.on_finished(request_id, usage, now_ms)
        # Finished without Started (it failed before its first token and the client has
        # its error) is settled the same way: done either way, never replayed.
        return [Ack(req, reason)] if req is not None else []

    def on_handed_back(self, request_id: str, worker_id: str, now_ms: float) -> list[Action]:
        """The worker returns a request it accepted but never started (drain, no room)."""
        self.workers.seen(worker_id, now_ms)
        return self._requeue(request_id, now_ms, "handed_back")

    def _requeue(self, request_id: str, now_ms: float, reason: str) -> list[Action]:
        self.workers.unassign(request_id)
        req = self.scheduler.in_flight_request(request_id)
        if req is None or not self.scheduler.requeue(request_id, now_ms):
            return []
        return [Requeued(req, reason)]

    def on_heartbeat(self, worker_id: str, in_flight_ids: Iterable[str], now_ms: float, *,
                     interval_ms: float = 1_000.0, draining: bool = False,
                     load: LoadReport | None = None) -> list[Action]:
        w = self.workers.seen(worker_id, now_ms)
        if load is not None:
            w.num_running, w.num_waiting = load.num_running, load.num_waiting
            w.kv_tokens_used, w.kv_tokens_total = load.kv_tokens_used, load.kv_tokens_total
        ids = list(in_flight_ids)
        out: list[Action] = []
        for rid in ids:
            if self.in_grace(now_ms):
                self._reported[rid] = worker_id
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
                out.extend(self._requeue(rid, now_ms, "reconciled"))
        return self._remember(out, now_ms)

    def on_cancel(self, request_id: str, reason: str, now_ms: float) -> list[Action]:
        """Queued: removed and ended. Running (the worker aborts it) or unknown: []."""
        req = self._deferred.pop(request_id, None) or self.scheduler.cancel(request_id)
        if req is None:
            return []
        return self._remember(refuse(req, ErrorCode.CANCELLED, f"cancelled: {reason}"), now_ms)

    # --- time --------------------------------------------------------------------------

    def tick(self, now_ms: float) -> list[Action]:
        """Housekeeping: end the restart grace, expire and shed queued work, declare
        silent workers lost."""
        out: list[Action] = []
        if self._grace_until_ms and now_ms >= self._grace_until_ms:
            out.extend(self._end_grace(now_ms))
        for error in (*self.scheduler.expire(now_ms), *self.scheduler.shed(now_ms)):
            out += [error, Term(error.request, error.code.value)]
        for w in self.workers.dead_workers(now_ms):
            out.extend(self._worker_lost(w, now_ms))
        return self._remember(out, now_ms)

    def _end_grace(self, now_ms: float) -> list[Action]:
        self._grace_until_ms = 0.0
        deferred, self._deferred = self._deferred, {}
        out: list[Action] = []
        for req in deferred.values():
            # Already held: only refusals and adoptions matter now.
            out.extend(a for a in self._admit(req, now_ms) if not isinstance(a, Hold))
        self._reported.clear()
        if deferred:
            out.append(Released(len(deferred)))
        return out

    def _worker_lost(self, w: WorkerState, now_ms: float) -> list[Action]:
        out: list[Action] = []
        for rid in w.request_ids:
            req = self.scheduler.in_flight_request(rid)
            if req is None:
                continue
            if self.scheduler.requeue(rid, now_ms):
                out.append(Requeued(req, "worker_lost"))
                continue
            self.scheduler.on_finished(rid, None, now_ms)
            out.append(SendError(req, ErrorCode.WORKER_LOST,
                                 f"worker {w.worker_id} stopped responding; retry the request"))
            out.append(Ack(req, "worker_lost"))
        return out

    def shutdown(self) -> list[Action]:
        """Queued (not dispatched) work goes straight back to JetStream."""
        return [Nak(r) for r in (*self._deferred.values(), *self.scheduler.queued())]
