"""How late a process's asyncio event loop runs: the sign that it is out of CPU.

Every fairlane process does its work on one asyncio loop, so one core bounds it. A
dispatcher whose pool outgrows that core shows no error: every pull, first token and
heartbeat just waits longer for the callbacks ahead of it (BENCHMARKS §9 measured the
scheduling core alone at ~0.3-0.7 of a core for 1,000 workers). This makes that wait
visible. A timer asks to wake every `interval_s`; how much later than asked it wakes is
the loop's lag, the time a message arriving at that moment would have waited. An idle
loop lags a millisecond or two; a saturated one by whole callbacks' worth (a dispatcher
ingesting and dispatching a backlog as fast as it can, ~3,500 requests/s on one core
of the 2-core dev machine, three ad hoc runs: a median of 5-10 ms, a mean of 9-26 ms,
single wakes of 100-250 ms).

Each process observes it into its own histogram
(``fairlane_<role>_event_loop_lag_seconds``) and logs ``event_loop_lagging`` at warning
level when one wake is later than `warn_s`, at most once per `warn_every_s` (with the
worst lag since the last such line), so an operator without Prometheus sees it too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

log = structlog.get_logger("fairlane.looplag")

# Seconds: from "nothing to see" (1 ms) to "this process has stalled" (5 s).
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
LAG_HELP = ("How late the event loop ran a timer (sampled every 0.25 s): the wait a "
            "message arriving then had before this process could handle it; sustained "
            "tens of ms mean the process is out of CPU")


async def watch_loop_lag(observe: Callable[[float], None], *, role: str,
                         interval_s: float = 0.25, warn_s: float = 0.5,
                         warn_every_s: float = 60.0) -> None:
    """Runs until cancelled: samples the running loop's lag into `observe` (seconds)."""
    loop = asyncio.get_running_loop()
    last_warn_s = -warn_every_s
    worst_s = 0.0
    while True:
        asked_s = loop.time() + interval_s
        await asyncio.sleep(interval_s)
        now_s = loop.time()
        # A timer may fire up to the clock's resolution early: that is no lag.
        lag_s = max(0.0, now_s - asked_s)
        observe(lag_s)
        if lag_s >= warn_s:
            worst_s = max(worst_s, lag_s)
            if now_s - last_warn_s >= warn_every_s:
                log.warning("event_loop_lagging", role=role, lag_ms=round(worst_s * 1000, 1),
                            hint="this process is out of CPU: its messages wait that long")
                last_warn_s, worst_s = now_s, 0.0
