"""Process scaffolding shared by every `python -m <package>` entry point."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import structlog

log = structlog.get_logger(__name__)

T = TypeVar("T")


def now_ms() -> int:
    """Wall-clock unix epoch milliseconds (for timestamps that cross processes)."""
    return time.time_ns() // 1_000_000


def mono_ms() -> float:
    """Monotonic milliseconds (for durations within one process)."""
    return time.monotonic_ns() / 1e6


async def cancel_and_wait(task: asyncio.Task | None, retry_s: float = 0.5) -> None:
    """Cancel a background task and wait until it has really stopped.

    Cancels again every `retry_s`: on Python 3.11 an `asyncio.wait_for` (nats-py's
    fetch and request use it) can swallow a cancellation, and a loop around such an
    await would then run on and a single cancel-then-await would hang forever.
    """
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=retry_s)
    if not task.cancelled():
        with contextlib.suppress(Exception):
            task.exception()  # retrieved: no "exception never retrieved" noise


async def log_nats_error(exc: Exception) -> None:
    """nats-py `error_cb`: one log line per error (its default logs a traceback for
    every refused connection attempt, several a second while NATS is down)."""
    log.warning("nats_error", error=repr(exc))


class Stopped(Exception):
    """A stop signal arrived before the awaited start-up step finished."""


async def until_stopped(aw: Awaitable[T], stop: asyncio.Event) -> T:
    """Await `aw` unless `stop` is set first: then cancel it and raise `Stopped`.

    Start-up steps wait on things that may never come (NATS unreachable: nats-py
    retries forever), and a process must still exit promptly on SIGTERM/SIGINT.
    There is nothing to drain before start-up has finished, so abandoning it is safe.
    """
    task = asyncio.ensure_future(aw)
    stop_wait = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # we were cancelled ourselves: take the step with us
        task.cancel()
        raise
    finally:
        stop_wait.cancel()
    if task.done():
        return task.result()
    # Cancel until it takes: Python 3.11's wait_for swallows a cancel that lands as its
    # inner future completes (nats-py's connect is built on it), and the step would run
    # on for seconds.
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.05)
    with contextlib.suppress(asyncio.CancelledError, Exception):
        task.result()
    raise Stopped


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


def run_in_foreground(cmd: list[str], env: dict[str, str] | None = None) -> int:
    """Run `cmd` to its end and return its exit status, leaving Ctrl-C to it.

    The terminal sends SIGINT to the whole foreground process group, this process and
    the child alike. Left as is, the wait here would raise KeyboardInterrupt and
    `subprocess` would kill the child, so a child that handles Ctrl-C gracefully
    (`fairlane simulate` writes the report of what it ran) never could. Ignored here
    while the child runs; the child, which inherits the ignore, sets its own handler."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return subprocess.run(cmd, env=env, check=False).returncode
    finally:
        signal.signal(signal.SIGINT, previous)
