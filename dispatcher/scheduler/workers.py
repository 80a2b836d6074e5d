"""Which worker holds which request, and who is alive. Pure: time is passed in.

The shell feeds it pulls, events and heartbeats; it answers what to do about dead
workers and about requests a live worker no longer reports (a lost WorkBatch reply or
a lost Finished event), so no tenant's quota leaks forever.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class WorkerState:
    worker_id: str
    last_seen_ms: float
    interval_ms: float = 1_000.0
    draining: bool = False
    request_ids: set[str] = field(default_factory=set)
    num_running: int = 0
    num_waiting: int = 0
    kv_tokens_used: int = 0
    kv_tokens_total: int = 0


@dataclass(slots=True)
class _Assignment:
    worker_id: str
    assigned_ms: float


class WorkerRegistry:
    def __init__(self, timeout_ms: float) -> None:
        self.timeout_ms = timeout_ms
        self.workers: dict[str, WorkerState] = {}
        self._assigned: dict[str, _Assignment] = {}

    def seen(self, worker_id: str, now_ms: float) -> WorkerState:
        w = self.workers.get(worker_id)
        if w is None:
            w = self.workers[worker_id] = WorkerState(worker_id, now_ms)
        w.last_seen_ms = now_ms
        return w

    def assign(self, request_id: str, worker_id: str, now_ms: float) -> None:
        self.seen(worker_id, now_ms).request_ids.add(request_id)
        self._assigned[request_id] = _Assignment(worker_id, now_ms)

    def unassign(self, request_id: str) -> str | None:
        a = self._assigned.pop(request_id, None)
        if a is None:
            return None
        w = self.workers.get(a.worker_id)
        if w is not None:
            w.request_ids.discard(request_id)
        return a.worker_id

    def worker_of(self, request_id: str) -> str | None:
        a = self._assigned.get(request_id)
        return a.worker_id if a else None

    def heartbeat(self, worker_id: str, in_flight_ids: list[str], now_ms: float,
                  interval_ms: float, draining: bool) -> list[str]:
        """Record a heartbeat; return ids we assigned to this worker that it no longer
        reports and that are older than two intervals (so not merely in transit)."""
        w = self.seen(worker_id, now_ms)
        w.interval_ms, w.draining = interval_ms, draining
        reported = set(in_flight_ids)
        grace_ms = 2 * interval_ms
        return [
            rid for rid in w.request_ids
            if rid not in reported and now_ms - self._assigned[rid].assigned_ms > grace_ms
        ]

    def dead_workers(self, now_ms: float) -> list[WorkerState]:
        """Remove and return workers silent for longer than the timeout."""
        dead = [w for w in self.workers.values() if now_ms - w.last_seen_ms > self.timeout_ms]
        for w in dead:
            del self.workers[w.worker_id]
            for rid in w.request_ids:
                self._assigned.pop(rid, None)
        return dead
