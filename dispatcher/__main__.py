"""`python -m dispatcher`: one dispatcher for one model pool."""

from __future__ import annotations

import asyncio
import contextlib
import sys

import structlog

from dispatcher.config import DispatcherSettings
from dispatcher.service import Dispatcher
from fairlane import otel
from fairlane.gctune import tuned_gc
from fairlane.logs import configure_logging
from fairlane.runtime import Stopped, run, until_stopped
from fairlane.settings import load_settings
from fairlane.tenants import TenantsFileError, TenantsWatcher

log = structlog.get_logger("dispatcher")


def _build(settings: DispatcherSettings) -> Dispatcher:
    tenants = TenantsWatcher(settings.tenants_file or None)
    return Dispatcher(settings, tenants=tenants)


async def serve(settings: DispatcherSettings, stop: asyncio.Event) -> int:
    try:
        if settings.metrics_port:
            from prometheus_client import start_http_server

            start_http_server(settings.metrics_port, addr=settings.metrics_host)
        dispatcher = _build(settings)
    except (TenantsFileError, KeyError, ValueError, OSError) as exc:
        # A bad tenants file, a pool it lacks, a port in use: one line, not a traceback.
        print(f"dispatcher: error: {exc.args[0] if isinstance(exc, KeyError) else exc}",
              file=sys.stderr, flush=True)
        return 2
    while True:
        try:
            await until_stopped(dispatcher.start(), stop)  # NATS may be unreachable for ever
        except Stopped:
            log.info("stopped_during_start")
            return 0
        except Exception as exc:
            # NATS answered but could not serve yet (a timeout or 503 while a cluster
            # elects a stream leader): try again as a fresh standby instead of exiting,
            # which under `fairlane up` would stop the fleet.
            log.warning("start_failed_retrying", error=repr(exc))
            with contextlib.suppress(Exception):
                await asyncio.wait_for(dispatcher.stop(), settings.stop_timeout_s)
            await asyncio.sleep(1.0)
            dispatcher = _build(settings)
            continue
        # A leader that loses its lease (partitioned, NATS gone past the TTL) has
        # already stopped dispatching. It does not exit (nothing may restart it, as
        # under `fairlane up`): it drops its state and rejoins as a standby, which
        # leads again as soon as the lease is free.
        lost = asyncio.create_task(dispatcher.lease_lost.wait())
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait([lost, stopping], return_when=asyncio.FIRST_COMPLETED)
        lost.cancel()
        stopping.cancel()
        reason = "signal" if stop.is_set() else "lease_lost"
        log.info("stopping", reason=reason)
        try:
            # Bounded: with NATS gone, nats-py can wait on a dead connection forever, and
            # nothing is lost by leaving: JetStream redelivers held messages after ack_wait.
            await asyncio.wait_for(dispatcher.stop(), settings.stop_timeout_s)
        except TimeoutError:
            log.warning("stop_timed_out", timeout_s=settings.stop_timeout_s)
        if reason == "signal":
            return 0
        log.info("rejoining_as_standby", pool=settings.pool)
        try:
            dispatcher = _build(settings)
        except (TenantsFileError, KeyError, ValueError, OSError) as exc:
            print(f"dispatcher: error: {exc}", file=sys.stderr, flush=True)
            return 2


def main(argv: list[str] | None = None) -> int:
    settings = load_settings(DispatcherSettings, argv, prog="dispatcher",
                             description="fairlane dispatcher for one model pool")
    configure_logging(settings.log_level, settings.log_json)
    otel.setup("dispatcher")  # only if the otel extra is installed and OTEL_* asks
    try:
        with tuned_gc(settings.gc_young_objects):  # after the imports and settings: frozen
            return run(lambda stop: serve(settings, stop))
    finally:
        otel.shutdown()


if __name__ == "__main__":
    sys.exit(main())
