"""The worker's lease: its right to publish for the work it holds (DESIGN.md section 4).

The dispatcher declares a worker lost after ``worker_timeout_ms`` without hearing from
it, and then hands its work elsewhere (requeue, or a retryable error to the client).
So a worker may publish tokens, events or usage for its work only while it is sure it
has not been declared lost yet: within ``margin × timeout`` of the *send* time of its
last acknowledged heartbeat (the dispatcher counts from the receipt, which is later).

- Lease expired (stalled, partitioned, or no dispatcher reachable): the worker keeps
  generating but withholds every publish for its work, and pulls nothing new.
- A later acknowledgement renews it: the withheld output goes out (a pause, not an
  error) — the usual case after a NATS blip or a dispatcher failover.
- Told "unknown" (its incarnation was declared lost and its work handed elsewhere), or
  expired for longer than ``abandon_after_ms``: it fences: aborts its work without
  publishing anything for it and rejoins as a new incarnation.

Pure state and decisions; times are monotonic seconds passed in. The asyncio part is
one event that wakes publishers blocked on the lease.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field


def new_incarnation() -> str:
    """A fresh incarnation id: one per worker process start (and per rejoin)."""
    return uuid.uuid4().hex[:16]


@dataclass
class WorkerLease:
    timeout_ms: float  # the dispatcher's worker timeout (updated from its acks)
    abandon_after_ms: float = 10_000.0
    margin: float = 0.8  # publish only within this fraction of the timeout
    valid_until_s: float = 0.0
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def renew(self, sent_s: float, timeout_ms: float = 0.0) -> None:
        """A heartbeat sent at `sent_s` was acknowledged (known)."""
        if timeout_ms > 0:
            self.timeout_ms = timeout_ms
        self.valid_until_s = max(self.valid_until_s, sent_s + self.margin * self.timeout_ms / 1000)
        self._changed.set()

    def revoke(self) -> None:
        """A new incarnation starts unacknowledged."""
        self.valid_until_s = 0.0
        self._changed.set()

    def valid(self, now_s: float) -> bool:
        return now_s < self.valid_until_s

    def should_abandon(self, now_s: float) -> bool:
        """Expired for so long that the dispatcher surely handed the work elsewhere
        (unless it was itself cut off that long: then the client's retry recovers)."""
        return bool(self.valid_until_s) and (
            now_s - self.valid_until_s) * 1000 > self.abandon_after_ms

    async def wait_changed(self, timeout_s: float) -> None:
        self._changed.clear()
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        except TimeoutError:
            pass
