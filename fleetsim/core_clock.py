"""How much CPU the dispatcher's scheduling core would spend on a simulated pool.

The simulator assumes a dispatcher that keeps up: a message reaches the core the
moment it arrives and every decision takes no time. Whether one real dispatcher
process does keep up is a question of its CPU: the fleet simulator runs the very core
the dispatcher runs (`PoolCore`, interpreted, as the dispatcher runs it), so timing its
calls during a run measures that core's own share of a dispatcher's work for this
traffic on this machine's CPU. `fairlane simulate --time-dispatcher` reports it.

What it leaves out, so what it is: a lower bound on the dispatcher's CPU. The
dispatcher's shell does more per request (JetStream fetch and acks, msgspec decoding
and encoding, NATS publishes, metrics; BENCHMARKS §1 measures it), and the pull
spread (`dispatcher.scheduler.spread`) runs outside the core.

The clock wraps the core's entry points on the instance (interpreted only: a compiled
`PoolCore` has no instance attributes to shadow its methods, and compiled code is
faster than the dispatcher, so its time would understate the dispatcher's).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

# PoolCore's entry points: every call the dispatcher's shell (and the fleet) makes.
ENTRY_POINTS = ("submit", "select", "on_pull", "on_started", "on_finished", "on_preempted",
                "on_heartbeat", "on_handed_back", "on_start_checked", "on_cancel", "tick",
                "preemptions")


class CoreClock:
    """Wall time (`time.perf_counter`) and calls per entry point of one `PoolCore`.
    The simulation is one thread doing only CPU work, so wall time is its CPU time."""

    def __init__(self, core: Any) -> None:
        self.seconds = dict.fromkeys(ENTRY_POINTS, 0.0)
        self.calls = dict.fromkeys(ENTRY_POINTS, 0)
        self._depth = 0  # an entry point calling another is counted once, outermost
        for name in ENTRY_POINTS:
            setattr(core, name, self._timed(name, getattr(core, name)))

    def _timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock, seconds, calls = time.perf_counter, self.seconds, self.calls

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return fn(*args, **kwargs)
            self._depth = 1
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[name] += clock() - t0
                calls[name] += 1
                self._depth = 0

        return timed

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    def report(self, simulated_s: float, num_requests: int) -> dict[str, Any]:
        """The report's meta: seconds in the core; that per simulated second, as a
        percentage of one CPU core (what the core alone would take in real time); per
        request; and the entry points that took the most."""
        total = self.total_s
        busiest = sorted((n for n in ENTRY_POINTS if self.calls[n]),
                         key=lambda n: -self.seconds[n])
        return {
            "dispatcher_core_s": round(total, 3),
            "dispatcher_core_pct_of_a_core": (round(100 * total / simulated_s, 2)
                                              if simulated_s > 0 else None),
            "dispatcher_core_us_per_request": (round(total / num_requests * 1e6, 1)
                                               if num_requests else None),
            "dispatcher_core_by_call": ", ".join(
                f"{n} {self.seconds[n] / total:.0%} ({self.calls[n]:,} calls)"
                for n in busiest[:6]) if total > 0 else "",
        }
