"""Publishes the pool's stats snapshot (`dispatcher.stats`) on ``<prefix>.stats.<pool>``.

The one I/O part of the stats: a task of the dispatcher that, every
``--stats-interval-s`` while it leads, asks its `StatsTracker` for a `PoolStats` and
publishes it on core NATS (no stream: the next one replaces a lost one). The streamer's
admin dashboard subscribes to ``<prefix>.stats.*``.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import structlog

from dispatcher.stats import StatsTracker
from fairlane.protocol import encode
from fairlane.runtime import mono_ms, now_ms

if TYPE_CHECKING:
    from dispatcher.service import Dispatcher

log = structlog.get_logger(__name__)

MAX_LOOP_SHARE_INV = 10  # the snapshot takes at most 1/10 of the event loop's time


async def publish_stats(dispatcher: Dispatcher) -> None:
    """Run for the dispatcher's life (cancelled at its stop); 0 s interval: nothing."""
    s = dispatcher.settings
    if s.stats_interval_s <= 0:
        return
    tracker = StatsTracker()
    dispatcher.core.observer = tracker  # from now on the core reports its decisions
    subject = dispatcher.subjects.stats(s.pool)
    took_ms = 0.0
    while True:
        # A snapshot is one pass over the recently active tenants, on the event loop
        # that dispatches: with very many of them, publish less often rather than let
        # the stats take more than a tenth of the loop.
        await asyncio.sleep(max(s.stats_interval_s, took_ms * MAX_LOOP_SHARE_INV / 1000))
        nc, lease = dispatcher.nc, dispatcher.lease
        if nc is None or not nc.is_connected or (lease is not None and not lease.leading()):
            continue
        try:
            t0 = mono_ms()
            snap = tracker.snapshot(dispatcher.core, t0, pool=s.pool, ts_ms=now_ms(),
                                    epoch=dispatcher.epoch)
            took_ms = mono_ms() - t0
            await nc.publish(subject, encode(snap))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a blip (or a bug): the next interval tries again
            log.warning("stats_publish_failed", pool=s.pool, error=repr(exc))
