"""Selection policies: strategies behind one small interface, chosen by `make_policy`.

A policy decides *which queued request goes next*; the `Scheduler` core owns the
bookkeeping (what is queued, in flight, quotas). `eligible(tenant, kv_tokens)` tells
the policy whether a tenant is within its quotas right now; an ineligible tenant is
skipped, never dropped.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

from dispatcher.scheduler.config import SchedulerConfig
from dispatcher.scheduler.types import ActualUsage, QueuedRequest

Eligible = Callable[[str, int], bool]


class Policy(Protocol):
    name: str

    def push(self, req: QueuedRequest, now_ms: float) -> None: ...
    def push_front(self, req: QueuedRequest, now_ms: float) -> None: ...
    def pop(self, eligible: Eligible, now_ms: float) -> QueuedRequest | None: ...
    def remove(self, req: QueuedRequest) -> None: ...
    def charge(self, req: QueuedRequest, now_ms: float) -> float:
        """Cost charged when `req` is dispatched (returned for metrics)."""
        ...
    def refund(self, req: QueuedRequest, now_ms: float) -> float:
        """Undo `charge` for a request that went back to the queue; returns the amount."""
        ...
    def true_up(self, req: QueuedRequest, usage: ActualUsage, now_ms: float) -> float:
        """Correct the charge to the actual usage; returns actual - estimate."""
        ...


class FifoPolicy:
    """One shared line in arrival order: the baseline that lets a flood win.

    Quota-blocked heads are skipped (scanning at most `max_scan` entries), so FIFO
    honours quotas too and the comparison with fair policies is only about order.
    """

    name = "fifo"
    max_scan = 4096

    def __init__(self, config: SchedulerConfig) -> None:
        self._line: deque[QueuedRequest] = deque()
        self._removed: set[str] = set()

    def __len__(self) -> int:
        return len(self._line) - len(self._removed)

    def push(self, req: QueuedRequest, now_ms: float) -> None:
        self._removed.discard(req.request_id)
        self._line.append(req)

    def push_front(self, req: QueuedRequest, now_ms: float) -> None:
        self._removed.discard(req.request_id)
        self._line.appendleft(req)

    def remove(self, req: QueuedRequest) -> None:
        self._removed.add(req.request_id)

    def pop(self, eligible: Eligible, now_ms: float) -> QueuedRequest | None:
        skipped: list[QueuedRequest] = []
        found: QueuedRequest | None = None
        while self._line and len(skipped) < self.max_scan:
            req = self._line.popleft()
            if req.request_id in self._removed:
                self._removed.discard(req.request_id)
                continue
            if eligible(req.tenant, req.kv_tokens):
                found = req
                break
            skipped.append(req)
        self._line.extendleft(reversed(skipped))
        return found

    def charge(self, req: QueuedRequest, now_ms: float) -> float:
        return 1.0

    def refund(self, req: QueuedRequest, now_ms: float) -> float:
        return 1.0

    def true_up(self, req: QueuedRequest, usage: ActualUsage, now_ms: float) -> float:
        return 0.0


_POLICIES: dict[str, Callable[[SchedulerConfig], Policy]] = {
    "fifo": FifoPolicy,
}


def make_policy(config: SchedulerConfig) -> Policy:
    try:
        factory = _POLICIES[config.policy]
    except KeyError:
        raise ValueError(
            f"unknown policy {config.policy!r}; choose one of {sorted(_POLICIES)}"
        ) from None
    return factory(config)
