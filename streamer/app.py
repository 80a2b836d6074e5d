"""The streamer's ASGI app: routes, lifespan, ops endpoints.

``create_app(settings)`` connects everything in its lifespan; tests may pass their
own ``client`` / ``limiter`` / ``tenants`` (those are then not closed by the app). The
client submits every request and applies the rate limits with the app's limiter.

Routes
    POST /v1/completions, /v1/chat/completions   OpenAI-compatible (SSE when stream=true)
    GET  /v1/models                              the pools of the tenants file (the key may use)
    GET  /v1/models/{id}                         one of them (404 model_not_found otherwise)
    WS   /v1/stream                              websocket proxy (see streamer.schema)
    GET  /healthz                                liveness: the process is serving
    GET  /readyz                                 NATS connected and streams present
    GET  /metrics                                Prometheus (admin key: streamer.dashboard)
    GET  /dashboard, /dashboard/data             live per-tier/tenant dashboard (admin key)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import nats
import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, WebSocketRoute
from starlette.types import ASGIApp

from fairlane.errors import ErrorCode
from fairlane.gctune import refreeze
from fairlane.looplag import watch_loop_lag
from fairlane.natsconn import connect_options
from fairlane.ratelimit import RateLimiter, UsageSettler
from fairlane.runtime import cancel_and_wait, log_nats_error
from fairlane.tenants import TenantsWatcher
from fairlane.validation import RequestLimits
from producer.client import FairlaneClient
from streamer import dashboard, metrics
from streamer.access import AccessLog
from streamer.config import StreamerSettings
from streamer.errors import METHOD_NOT_ALLOWED, NOT_FOUND, EdgeError
from streamer.http_api import OpenAIApi, error_response, json_response
from streamer.service import Edge
from streamer.ws import websocket_endpoint

log = structlog.get_logger(__name__)


async def healthz(request: Request) -> Response:
    return json_response({"status": "ok"})


async def readyz(request: Request) -> Response:
    state = request.app.state
    client: FairlaneClient | None = getattr(state, "client", None)
    checks: dict[str, bool] = {"nats": False, "streams": False}
    if client is not None and client.nc.is_connected:
        checks["nats"] = True
        try:
            for name in (client.subjects.requests_stream, client.subjects.usage_stream):
                await asyncio.wait_for(client.js.stream_info(name), 1.0)
            checks["streams"] = True
        except Exception:  # not found, timeout, reconnecting: all "not ready"
            pass
    ready = all(checks.values())
    limiter: RateLimiter | None = getattr(state, "limiter", None)
    body = {
        "status": "ready" if ready else "not_ready",
        "checks": checks,
        # Informational: the limiter fails open, so Redis never makes us unready.
        "ratelimit_degraded": bool(limiter and limiter.degraded),
    }
    return json_response(body, 200 if ready else 503)


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        err = EdgeError(f"no route for {request.url.path}", NOT_FOUND)
    elif exc.status_code == 405:
        err = EdgeError(f"method {request.method} not allowed here", METHOD_NOT_ALLOWED)
    else:
        err = EdgeError(str(exc.detail), status=exc.status_code)
    return error_response(err)


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("unhandled_error", path=request.url.path, error=repr(exc))
    return error_response(EdgeError("internal error", ErrorCode.INTERNAL))


class _EdgeApp(Starlette):
    """The access log outermost: it sees, and stamps ``X-Request-Id`` on, every answer,
    the 500s of Starlette's error middleware included (`streamer.access`)."""

    def build_middleware_stack(self) -> ASGIApp:
        return AccessLog(super().build_middleware_stack())


def create_app(
    settings: StreamerSettings,
    *,
    client: FairlaneClient | None = None,
    limiter: RateLimiter | None = None,
    tenants: TenantsWatcher | None = None,
) -> Starlette:
    metrics.configure(settings.metrics_max_tenants, settings.metrics_tenant_idle_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state = app.state
        own_client = client is None
        own_limiter = limiter is None
        lim = limiter
        if lim is None:
            lim = (RateLimiter.from_url(settings.redis_url, key_prefix=settings.prefix)
                   if settings.redis_url else RateLimiter(None, key_prefix=settings.prefix))
        c = client
        if c is None:
            nc = await nats.connect(**connect_options(settings), name="fairlane-streamer",
                                    max_reconnect_attempts=-1, error_cb=log_nats_error)
            c = FairlaneClient(
                nc,
                prefix=settings.prefix,
                owner=settings.owner or None,
                limits=RequestLimits(),
                max_buffered_chunks=settings.max_buffered_chunks,
                owns_connection=True,
                limiter=lim,
            )
            await c.start(stream_settings=settings)
        elif c.limiter is None:
            c.limiter = lim
        watcher = tenants or TenantsWatcher(settings.tenants_file or None)
        edge = Edge(
            c,
            watcher,
            default_max_tokens=settings.default_max_tokens,
            anonymous_tenant=settings.anonymous_tenant,
            tenants_reload_s=settings.tenants_reload_s,
        )
        settler = None
        if settings.usage_settler:
            settler = UsageSettler(c.js, c.subjects, lim, durable=settings.settler_durable)
            await settler.start()
        state.settings, state.client, state.limiter, state.edge = settings, c, lim, edge
        state.settler = settler
        state.stats_feed = feed = dashboard.StatsFeed()  # fl.stats.*: the dashboard's
        await feed.start(c.nc, c.subjects)
        api = OpenAIApi(edge, settings.max_body_bytes)
        state.api = api
        lag_task = asyncio.get_running_loop().create_task(
            watch_loop_lag(metrics.LOOP_LAG.observe, role="streamer"))
        refreeze()  # what start-up made (connections, tenants): no collection walks it
        log.info("streamer_started", prefix=settings.prefix, inbox=c.inbox)
        try:
            yield
        finally:
            await cancel_and_wait(lag_task)
            if settler is not None:
                await settler.stop()
            await feed.stop()
            await edge.aclose()
            if own_client:
                await c.close()
            if own_limiter:
                await lim.close()
            log.info("streamer_stopped")

    async def completions(request: Request) -> Response:
        return await request.app.state.api.completions(request)

    async def chat_completions(request: Request) -> Response:
        return await request.app.state.api.chat_completions(request)

    async def models(request: Request) -> Response:
        return await request.app.state.api.models(request)

    async def model(request: Request) -> Response:
        return await request.app.state.api.model(request)

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        # `path`: an id with a slash (org/model, as OpenAI clients name models) is an
        # unknown model (404 model_not_found), not an unknown route.
        Route("/v1/models/{model_id:path}", model, methods=["GET"]),
        WebSocketRoute("/v1/stream", websocket_endpoint),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", dashboard.metrics, methods=["GET"]),
        Route("/dashboard", dashboard.dashboard, methods=["GET"]),
        Route("/dashboard/data", dashboard.dashboard_data, methods=["GET"]),
    ]
    return _EdgeApp(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_exception, Exception: _internal_error},
    )
