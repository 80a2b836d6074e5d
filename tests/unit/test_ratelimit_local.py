"""The in-process fallback buckets: same semantics as the Lua scripts."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fairlane.ratelimit_local import Decision, LocalBuckets, RateLimits

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_requests_per_min_and_refill():
    b = LocalBuckets()
    lim = RateLimits(requests_per_min=2)
    assert b.admit("k", lim, 0, "r1", now=0).allowed
    assert b.admit("k", lim, 0, "r2", now=0).allowed
    d = b.admit("k", lim, 0, "r3", now=0)
    assert not d.allowed and d.degraded
    assert d.retry_after_ms == 30_000  # one request refills in 60s / 2
    assert b.admit("k", lim, 0, "r3", now=30_000).allowed


def test_tokens_settle_refund_and_debt_cap():
    b = LocalBuckets()
    lim = RateLimits(tokens_per_min=1000)
    assert b.admit("k", lim, 600, "r1", now=0).allowed
    assert not b.admit("k", lim, 600, "r2", now=0).allowed
    # actual was 100: 500 come back
    assert b.settle("k", "r1", 100, False, 1.0, now=0)
    assert not b.settle("k", "r1", 100, False, 1.0, now=0)  # exactly once
    assert b.admit("k", lim, 600, "r2", now=0).allowed
    # a runaway request: debt capped at one minute of tokens
    b.settle("k", "r2", 1_000_000, False, 1.0, now=0)
    assert b._buckets["k"][1] == -1000


def test_estimate_larger_than_budget_still_runs_when_full():
    b = LocalBuckets()
    assert b.admit("k", RateLimits(tokens_per_min=100), 10_000, "r", now=0).allowed


def test_retry_after_seconds_rounds_up():
    assert Decision(False, 1).retry_after_s == 1
    assert Decision(False, 1001).retry_after_s == 2


@given(
    rpm=st.integers(1, 100),
    steps=st.lists(st.tuples(st.integers(0, 5_000), st.booleans()), max_size=60),
)
def test_never_admits_more_than_capacity_plus_refill(rpm, steps):
    b = LocalBuckets()
    lim = RateLimits(requests_per_min=rpm)
    now = 0
    admitted = 0
    for i, (dt, _) in enumerate(steps):
        now += dt
        if b.admit("k", lim, 0, f"r{i}", now=now).allowed:
            admitted += 1
    assert admitted <= rpm + now * rpm / 60_000 + 1e-9
