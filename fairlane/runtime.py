"""Process scaffolding shared by every `python -m <package>` entry point."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Awaitable, Callable

import structlog

log = structlog.get_logger(__name__)


def now_ms() -> int:
    """Wall-clock unix epoch milliseconds (for timestamps that cross processes)."""
    return time.time_ns() // 1_000_000


def mono_ms() -> float:
    """Monotonic milliseconds (for durations within one process)."""
    return time.monotonic_ns() / 1e6


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel a background task and wait until it has really stopped."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


def install_stop_signals(stop: asyncio.Event) -> None:
    """SIGINT/SIGTERM set `stop`; the service then shuts down in order."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


def run(main: Callable[[asyncio.Event], Awaitable[int | None]]) -> int:
    """Run ``main(stop_event)`` under uvloop with stop signals installed."""
    import uvloop

    async def _wrapped() -> int:
        stop = asyncio.Event()
        install_stop_signals(stop)
        rc = await main(stop)
        return int(rc or 0)

    return uvloop.run(_wrapped())
