"""Throttling: refuse at admission the work we cannot serve within its latency target.

`RateMeter` measures the service rate (cost units per ms) from dispatches over a
sliding window of fixed buckets — O(1) to record, O(buckets) to read, passed-in time
only. `predict_wait_ms` turns the cost queued ahead of a request into a wait:

    ahead = min(tenant's queued cost × W / w,  queued cost of its tier and the tiers above)
    wait  = ahead / rate

where w is the tenant's weight and W the total weight of its tier's backlogged tenants
(itself included): under a fair policy the tenant drains at rate × w / W, but never
slower than draining everything that can go ahead of it. Before any measurement (no
dispatches in the window) the rate is unknown and nothing is throttled.
"""

from __future__ import annotations

import math


class RateMeter:
    def __init__(self, window_ms: float, num_buckets: int = 20) -> None:
        self.window_ms = max(window_ms, 1.0)
        self.num_buckets = num_buckets
        self._width_ms = self.window_ms / num_buckets
        self._stamps = [-1] * num_buckets
        self._sums = [0.0] * num_buckets
        self._first_ms: float | None = None

    def add(self, now_ms: float, cost: float) -> None:
        if self._first_ms is None:
            self._first_ms = now_ms
        idx = int(now_ms // self._width_ms)
        slot = idx % self.num_buckets
        if self._stamps[slot] != idx:
            self._stamps[slot] = idx
            self._sums[slot] = 0.0
        self._sums[slot] += cost

    def rate_per_ms(self, now_ms: float) -> float | None:
        """Cost per ms over the window, or None before any measurement."""
        if self._first_ms is None:
            return None
        idx = int(now_ms // self._width_ms)
        oldest = idx - self.num_buckets + 1
        total = sum(s for stamp, s in zip(self._stamps, self._sums, strict=True)
                    if oldest <= stamp <= idx)
        if total <= 0:
            return None
        # The window's current bucket is partly elapsed, and a meter younger than its
        # window has seen less: divide by the time actually covered.
        span_ms = min(self.window_ms - self._width_ms + (now_ms - idx * self._width_ms),
                      now_ms - self._first_ms)
        return total / max(span_ms, self._width_ms)


def predict_wait_ms(*, rate_per_ms: float | None, tenant_queued_cost: float, weight: float,
                    tier_weight: float, ahead_cost: float) -> float | None:
    if rate_per_ms is None or rate_per_ms <= 0:
        return None
    fair = tenant_queued_cost * max(tier_weight, weight) / max(weight, 1e-9)
    return min(fair, ahead_cost) / rate_per_ms


def retry_after_ms(excess_ms: float) -> int:
    """A retry hint: when enough of the backlog should have drained (at least 1 ms)."""
    return max(1, math.ceil(excess_ms))
