"""The event-loop lag watch (`fairlane.looplag`): a blocked loop shows, and is logged once."""

from __future__ import annotations

import asyncio
import time

import pytest
from structlog.testing import capture_logs

from fairlane.looplag import watch_loop_lag
from fairlane.runtime import cancel_and_wait

pytestmark = pytest.mark.unit

INTERVAL_S = 0.02
BLOCK_S = 0.3


class Samples:
    """What the watch observed, and a way to await its next sample."""

    def __init__(self) -> None:
        self.lags_s: list[float] = []
        self._new = asyncio.Event()

    def observe(self, lag_s: float) -> None:
        self.lags_s.append(lag_s)
        self._new.set()

    async def next(self) -> float:
        self._new.clear()
        await asyncio.wait_for(self._new.wait(), 5)
        return self.lags_s[-1]


async def test_a_blocked_loop_is_seen_as_lag():
    samples = Samples()
    task = asyncio.create_task(watch_loop_lag(samples.observe, role="test", interval_s=INTERVAL_S))
    try:
        await samples.next()  # the watch's next timer is armed now
        # Holding the loop on purpose, as a callback of a saturated process does.
        time.sleep(BLOCK_S)  # noqa: ASYNC251
        lag_s = await samples.next()
        # Armed at most INTERVAL_S before the block began, it fired after the block.
        assert lag_s >= BLOCK_S - INTERVAL_S
        assert all(s >= 0 for s in samples.lags_s)
    finally:
        await cancel_and_wait(task)


async def test_a_lagging_loop_is_logged_at_most_once_per_period():
    samples = Samples()
    with capture_logs() as logs:
        task = asyncio.create_task(watch_loop_lag(
            samples.observe, role="dispatcher", interval_s=INTERVAL_S, warn_s=0.1,
            warn_every_s=60))
        try:
            for _ in range(2):  # two stalls within one period: one line
                await samples.next()
                time.sleep(BLOCK_S)  # noqa: ASYNC251 (holding the loop on purpose)
                await samples.next()
        finally:
            await cancel_and_wait(task)
    lines = [e for e in logs if e["event"] == "event_loop_lagging"]
    assert len(lines) == 1, lines
    assert lines[0]["log_level"] == "warning" and lines[0]["role"] == "dispatcher"
    assert lines[0]["lag_ms"] >= (BLOCK_S - INTERVAL_S) * 1000


async def test_a_loop_within_bounds_logs_nothing():
    samples = Samples()
    with capture_logs() as logs:
        task = asyncio.create_task(watch_loop_lag(
            samples.observe, role="worker", interval_s=INTERVAL_S, warn_s=3600))
        try:
            for _ in range(3):
                await samples.next()
        finally:
            await cancel_and_wait(task)
    assert len(samples.lags_s) >= 3
    assert not [e for e in logs if e["event"] == "event_loop_lagging"]
