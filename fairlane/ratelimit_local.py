"""The rate limiter's in-process side: limits, decisions, and the local buckets that
answer while Redis is down (fail-open; see `fairlane.ratelimit`).

Pure: no I/O, the caller passes the time. The buckets mirror the Lua scripts in
`fairlane.ratelimit` step for step, so a fail-open decision is the one Redis would
have made for this process alone.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class RateLimits:
    """Absolute caps for one tenant; 0 means unlimited."""

    requests_per_min: int = 0
    tokens_per_min: int = 0

    @classmethod
    def of(cls, record: Any) -> RateLimits:
        """From anything with ``requests_per_min`` / ``tokens_per_min`` (a TenantRecord)."""
        return cls(
            requests_per_min=int(getattr(record, "requests_per_min", 0) or 0),
            tokens_per_min=int(getattr(record, "tokens_per_min", 0) or 0),
        )

    @property
    def unlimited(self) -> bool:
        return self.requests_per_min <= 0 and self.tokens_per_min <= 0


@dataclass(frozen=True, slots=True)
class Decision:
    allowed: bool
    retry_after_ms: int = 0
    degraded: bool = False  # decided by the local fallback (Redis unavailable)

    @property
    def retry_after_s(self) -> int:
        """For the ``Retry-After`` header: whole seconds, at least 1."""
        return max(1, math.ceil(self.retry_after_ms / 1000))


class LocalBuckets:
    """The same buckets as the Lua scripts, in process memory, for fail-open mode.

    Approximate by design: per process, not shared, and forgotten on restart. Bounded
    (LRU) so a flood of tenants or request ids cannot grow it without limit.
    """

    def __init__(self, max_entries: int = 100_000) -> None:
        self._buckets: OrderedDict[str, list[float]] = OrderedDict()  # r, t, ts, rcap, tcap
        self._reserved: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._settled: OrderedDict[str, None] = OrderedDict()
        self._max = max_entries

    @staticmethod
    def _refill(b: list[float], now: float) -> None:
        dt = max(0.0, now - b[2])
        if b[3] > 0:
            b[0] = min(b[3], b[0] + dt * b[3] / 60000.0)
        if b[4] > 0:
            b[1] = min(b[4], b[1] + dt * b[4] / 60000.0)
        b[2] = now

    def _bound(self, d: OrderedDict) -> None:
        while len(d) > self._max:
            d.popitem(last=False)

    def admit(self, key: str, limits: RateLimits, est: int, request_id: str, now: float) -> Decision:
        rcap, tcap = float(limits.requests_per_min), float(limits.tokens_per_min)
        b = self._buckets.get(key)
        if b is None:
            b = [rcap, tcap, now, rcap, tcap]
            self._buckets[key] = b
        self._buckets.move_to_end(key)
        self._bound(self._buckets)
        b[3], b[4] = rcap, tcap
        self._refill(b, now)
        if tcap > 0:
            est = min(est, int(tcap))
        wait = 0.0
        if rcap > 0 and b[0] < 1:
            wait = max(wait, (1 - b[0]) * 60000.0 / rcap)
        if tcap > 0 and b[1] < est:
            wait = max(wait, (est - b[1]) * 60000.0 / tcap)
        if wait > 0:
            return Decision(False, math.ceil(wait), degraded=True)
        if rcap > 0:
            b[0] -= 1
        if tcap > 0:
            b[1] -= est
        self._reserved[request_id] = (key, est)
        self._bound(self._reserved)
        return Decision(True, 0, degraded=True)

    def settle(
        self, key: str, request_id: str, actual: int, refund: bool, max_debt_minutes: float, now: float
    ) -> bool:
        if request_id in self._settled:
            return False
        self._settled[request_id] = None
        self._bound(self._settled)
        _, reserved = self._reserved.pop(request_id, (key, 0))
        b = self._buckets.get(key)
        if b is None:
            return True
        self._refill(b, now)
        if b[4] > 0:
            b[1] = min(b[4], max(-b[4] * max_debt_minutes, b[1] - (actual - reserved)))
        if refund and b[3] > 0:
            b[0] = min(b[3], b[0] + 1)
        return True
