"""The edge's access log, ``X-Request-Id`` and ``traceparent``: one pure ASGI middleware.

Outermost in the app (`streamer.app`), so it sees every response, the 500s Starlette's
error middleware sends included. For each HTTP request (and websocket session) it

- draws the request id and puts it in the scope (`access_info`): the completions
  handlers submit under it, so the ``X-Request-Id`` of every answer is the id the
  fleet ran the request under (other routes: an id of the same shape). A valid
  incoming ``X-Request-Id`` is not adopted (request ids are the fleet-wide JetStream
  dedupe key, so a client-chosen one could collide with another tenant's request);
  it is logged as ``client_request_id``;
- reads a valid ``traceparent`` (an invalid one is ignored); the completions handlers
  run the request in that trace, or in a fresh one (`use_traceparent`), and a
  websocket's requests join the upgrade request's trace (or each gets its own). With
  OpenTelemetry on (`fairlane.otel`), `use_traceparent` also starts the request's
  server span (a child of the client's span), the trace the fleet then runs it in
  names that span as parent, and this middleware ends it with the response;
- binds ``request_id`` (and the trace) into the structlog context for the request's
  own log lines, and adds ``X-Request-Id`` to the response headers (for a websocket:
  to the accept, or to the denial response);
- writes ONE ``http_request`` line when the request is over (for a streamed answer,
  when its stream ends): method, path, status, duration_ms, request_id, client
  address, and the tenant and traceparent when known. uvicorn's own access log is off.

Bodies are never touched or buffered, so SSE streams and websockets flow as before.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import structlog
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fairlane import otel
from fairlane.trace import parse_traceparent, traceparent_or_new, valid_request_id
from producer.spec import new_request_id

log = structlog.get_logger("streamer.access")

SCOPE_KEY = "fairlane.access"
_HEADER = b"x-request-id"


@dataclass(slots=True)
class AccessInfo:
    """What the access log knows of one request; handlers fill in the tenant."""

    request_id: str
    # The client's valid one, else None; a completion's, once `use_traceparent` chose.
    traceparent: str | None
    client_request_id: str | None = None
    tenant: str | None = None
    start_ns: int = 0  # wall clock, for the request's span
    span: Any = None  # its OpenTelemetry server span (None: tracing off, or not begun)


def access_info(scope: Scope) -> AccessInfo | None:
    """The request's `AccessInfo` (None when the app runs without the middleware)."""
    return scope.get(SCOPE_KEY)


def note_tenant(scope: Scope, tenant: str) -> None:
    """The request's tenant is known (authenticated): its access line names it."""
    info = access_info(scope)
    if info is not None:
        info.tenant = tenant


def use_traceparent(scope: Scope, fallback: str | None = None,
                    span_attributes: dict[str, Any] | None = None) -> str:
    """The trace a request runs in: the client's valid ``traceparent``, else a fresh
    one; recorded for the access line and bound for the request's log lines.
    `fallback`: the raw header when the app runs without the middleware. With tracing
    on, the request's server span starts here (with `span_attributes`) and the
    answer is its ``traceparent``: the fleet's spans become the span's children."""
    info = access_info(scope)
    client = info.traceparent if info is not None else fallback
    traceparent = traceparent_or_new(client)
    if info is not None and otel.enabled() and info.span is None:
        method, path = scope.get("method", "POST"), scope.get("path", "")
        info.span = otel.start_span(
            f"{method} {path}", client, server=True, start_ns=info.start_ns or None,
            attributes={"http.request.method": method, "url.path": path, "http.route": path,
                        "fairlane.request_id": info.request_id, **(span_attributes or {})})
        traceparent = otel.traceparent_of(info.span, traceparent) or traceparent
    if info is not None:
        info.traceparent = traceparent
    structlog.contextvars.bind_contextvars(traceparent=traceparent)
    return traceparent


def _client(scope: Scope) -> str | None:
    client = scope.get("client")
    if not client:
        return None
    host, port = client[0], client[1]
    return f"{host}:{port}" if port is not None else str(host)


class AccessLog:
    """Pure ASGI (not Starlette's `BaseHTTPMiddleware`, which runs the app in a task of
    its own and relays streamed bodies through a queue)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):  # lifespan
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        incoming = headers.get("x-request-id")
        info = AccessInfo(
            request_id=new_request_id(),
            traceparent=parse_traceparent(headers.get("traceparent")),
            client_request_id=incoming if valid_request_id(incoming) else None,
            start_ns=time.time_ns(),
        )
        scope[SCOPE_KEY] = info
        rid_header = (_HEADER, info.request_id.encode("ascii"))
        status: int | None = None
        started = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            t = message["type"]
            if t in ("http.response.start", "websocket.http.response.start"):
                status = message["status"]
                message = {**message, "headers": _with_id(message.get("headers"), rid_header)}
            elif t == "websocket.accept":
                status = 101
                message = {**message, "headers": _with_id(message.get("headers"), rid_header)}
            elif t == "websocket.close" and status is None:
                status = 403  # closed before the accept: the server answers the upgrade 403
            await send(message)

        ctx: Any = contextlib.nullcontext()
        if kind == "http":
            # Not for a websocket: its requests each have their own fleet request id.
            bind = {"request_id": info.request_id}
            if info.traceparent is not None:
                bind["traceparent"] = info.traceparent
            ctx = structlog.contextvars.bound_contextvars(**bind)
        try:
            with ctx:
                await self.app(scope, receive, send_with_id)
        except BaseException:
            if status is None:
                status = 500  # nothing was sent; the server answers 500 (or drops it)
            raise
        finally:
            if info.span is not None:
                otel.end_span(info.span, error=None if status and status < 500 else
                              f"HTTP {status}", attributes={"http.response.status_code": status})
            fields: dict[str, Any] = {
                "method": scope.get("method", "GET"),
                "path": scope.get("path", ""),
                "status": status,
                "duration_ms": round((time.perf_counter() - started) * 1000, 2),
                "request_id": info.request_id,
                "client": _client(scope),
            }
            if kind == "websocket":
                fields["websocket"] = True
            if info.tenant is not None:
                fields["tenant"] = info.tenant
            if info.traceparent is not None:
                fields["traceparent"] = info.traceparent
            if info.client_request_id is not None:
                fields["client_request_id"] = info.client_request_id
            log.info("http_request", **fields)


def _with_id(headers: Any, rid_header: tuple[bytes, bytes]) -> list:
    out = [h for h in (headers or ()) if bytes(h[0]).lower() != _HEADER]
    out.append(rid_header)
    return out
