"""Which worker holds which request, and who is alive. Pure: time is passed in.

The shell feeds it pulls, events and heartbeats; it answers what to do about dead
workers and about requests a live worker no longer reports (a lost WorkBatch reply or
a lost Finished event), so no tenant's quota leaks forever.

Each worker process start is a new *incarnation* (a random id the worker sends with
every message). A worker id seen with a new incarnation is a restart under the same
name: the old process is gone, and so is its work. Incarnations declared lost are
remembered, so a stalled process that wakes up is told it is unknown and fences itself
instead of finishing (and billing) work that was already handed elsewhere.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(slots=True)
class WorkerState:
    worker_id: str
    last_seen_ms: float
    interval_ms: float = 1_000.0
    draining: bool = False
    incarnation: str = ""
    request_ids: set[str] = field(default_factory=set)  # assigned by this dispatcher
    reported_ids: frozenset[str] = frozenset()  # its last heartbeat's in-flight ids
    num_running: int = 0
    num_waiting: int = 0
    kv_tokens_used: int = 0
    kv_tokens_total: int = 0


@dataclass(slots=True, init=False)
class _Assignment:
    # One per dispatch: `__init__` written, for mypyc (as types.InFlight).
    worker_id: str
    assigned_ms: float

    def __init__(self, worker_id: str, assigned_ms: float) -> None:
        self.worker_id, self.assigned_ms = worker_id, assigned_ms


class WorkerRegistry:
    max_lost_incarnations = 10_000  # bound on that memory (oldest forgotten first)

    def __init__(self, timeout_ms: float) -> None:
        self.timeout_ms = timeout_ms
        self.workers: dict[str, WorkerState] = {}
        self._assigned: dict[str, _Assignment] = {}
        self._reporter: dict[str, str] = {}  # request id -> live worker that reports it
        self._lost: OrderedDict[str, None] = OrderedDict()  # incarnations declared lost

    def seen(self, worker_id: str, now_ms: float) -> WorkerState:
        w = self.workers.get(worker_id)
        if w is None:
            w = self.workers[worker_id] = WorkerState(worker_id, now_ms)
        w.last_seen_ms = now_ms
        return w

    # --- incarnations ------------------------------------------------------------------

    def is_lost(self, incarnation: str) -> bool:
        return bool(incarnation) and incarnation in self._lost

    def replaced(self, worker_id: str, incarnation: str) -> WorkerState | None:
        """The registered state of `worker_id` if `incarnation` is a different, newer
        process (a restart under the same name), else None."""
        w = self.workers.get(worker_id)
        if w is None or not incarnation or not w.incarnation or w.incarnation == incarnation:
            return None
        return w

    def remove(self, worker_id: str) -> WorkerState | None:
        """Forget a worker (lost or replaced); its incarnation is remembered as lost."""
        w = self.workers.pop(worker_id, None)
        if w is None:
            return None
        for rid in w.request_ids:
            self._assigned.pop(rid, None)
        for rid in w.reported_ids:
            if self._reporter.get(rid) == worker_id:
                del self._reporter[rid]
        if w.incarnation:
            self._lost[w.incarnation] = None
            while len(self._lost) > self.max_lost_incarnations:
                self._lost.popitem(last=False)
        return w

    # --- assignments -------------------------------------------------------------------

    def assign(self, request_id: str, worker_id: str, now_ms: float, *,
               contact: bool = True) -> None:
        """`request_id` now runs on `worker_id`. `contact`: the worker asked for it (a
        pull); False for work sent unasked (a preemption's replacement), which says
        nothing about whether the worker is alive."""
        w = self.workers.get(worker_id)
        if contact or w is None:
            w = self.seen(worker_id, now_ms)
        w.request_ids.add(request_id)
        self._assigned[request_id] = _Assignment(worker_id, now_ms)

    def unassign(self, request_id: str) -> str | None:
        a = self._assigned.pop(request_id, None)
        if a is None:
            return None
        w = self.workers.get(a.worker_id)
        if w is not None:
            w.request_ids.discard(request_id)
        return a.worker_id

    def responsive(self, worker_id: str, now_ms: float) -> bool:
        """Heard from within two of its heartbeat intervals (not maybe stalled)."""
        w = self.workers.get(worker_id)
        return w is not None and now_ms - w.last_seen_ms <= 2 * w.interval_ms

    def worker_of(self, request_id: str) -> str | None:
        a = self._assigned.get(request_id)
        return a.worker_id if a else None

    def reporter_of(self, request_id: str) -> str | None:
        """A live worker whose last heartbeat lists this request (it runs it)."""
        return self._reporter.get(request_id)

    # --- liveness ----------------------------------------------------------------------

    def heartbeat(self, worker_id: str, in_flight_ids: list[str], now_ms: float,
                  interval_ms: float, draining: bool) -> list[str]:
        """Record a heartbeat; return ids we assigned to this worker that it no longer
        reports and that are older than two intervals (so not merely in transit)."""
        w = self.seen(worker_id, now_ms)
        w.interval_ms, w.draining = interval_ms, draining
        reported = frozenset(in_flight_ids)
        for rid in w.reported_ids - reported:
            if self._reporter.get(rid) == worker_id:
                del self._reporter[rid]
        for rid in reported:
            self._reporter[rid] = worker_id
        w.reported_ids = reported
        grace_ms = 2 * interval_ms
        return [
            rid for rid in w.request_ids
            if rid not in reported and now_ms - self._assigned[rid].assigned_ms > grace_ms
        ]

    def refresh_all(self, now_ms: float) -> None:
        """The dispatcher itself was cut off from NATS: nobody could reach it, so
        silence proves nothing. Every worker gets a full timeout from now."""
        for w in self.workers.values():
            w.last_seen_ms = now_ms

    def dead_workers(self, now_ms: float) -> list[WorkerState]:
        """Remove and return workers silent for longer than the timeout."""
        dead = [w for w in self.workers.values() if now_ms - w.last_seen_ms > self.timeout_ms]
        for w in dead:
            self.remove(w.worker_id)
        return dead
