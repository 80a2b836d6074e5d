"""``python -m streamer``: the public edge (websocket + OpenAI-compatible HTTP)."""

from __future__ import annotations

import asyncio
import sys

import structlog
import uvicorn

from fairlane import otel
from fairlane.gctune import tuned_gc
from fairlane.logs import configure_logging
from fairlane.runtime import run
from fairlane.settings import load_settings
from streamer.app import create_app
from streamer.config import StreamerSettings

log = structlog.get_logger(__name__)


def uvicorn_config(settings: StreamerSettings, app) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        lifespan="on",
        ws="websockets-sansio",  # has write flow control: slow sockets apply backpressure
        ws_max_size=settings.max_body_bytes,
        ws_per_message_deflate=settings.ws_per_message_deflate,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=10,
    )


class _Server(uvicorn.Server):
    """Also abandons start-up on SIGTERM/SIGINT: uvicorn looks at `should_exit` only
    once it serves, and the lifespan's NATS connect may wait for ever."""

    serve_task: asyncio.Task | None = None

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        if not self.started and self.serve_task is not None:
            # A signal handler: hand the cancel to the loop rather than touch it here.
            self.serve_task.get_loop().call_soon_threadsafe(self.serve_task.cancel)


def main(argv: list[str] | None = None) -> int:
    settings = load_settings(StreamerSettings, argv, prog="python -m streamer",
                             description="fairlane streamer: the public edge")
    configure_logging(settings.log_level, json=settings.log_json)
    otel.setup("streamer")  # only if the otel extra is installed and OTEL_* asks

    async def _main(stop: asyncio.Event) -> int:
        server = _Server(uvicorn_config(settings, create_app(settings)))
        # uvicorn captures SIGINT/SIGTERM itself while serving (graceful shutdown), then
        # re-raises them, which also sets `stop`.
        task = server.serve_task = asyncio.create_task(server.serve())
        log.info("streamer_listening", host=settings.host, port=settings.port)
        stop_wait = asyncio.create_task(stop.wait())
        await asyncio.wait({task, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        server.should_exit = True
        stop_wait.cancel()
        try:
            await task
        except asyncio.CancelledError:
            log.info("stopped_during_start")
            return 0
        return 0 if server.started else 1

    try:
        with tuned_gc(settings.gc_young_objects):  # after the imports: frozen
            return run(_main)
    finally:
        otel.shutdown()


if __name__ == "__main__":
    sys.exit(main())
