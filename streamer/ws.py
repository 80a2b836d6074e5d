"""Websocket proxy on ``/v1/stream`` (frame schema and close codes: `streamer.schema`).

One session per socket. Each request gets a pump task that reads its
`RequestStream` (the client library's per-request queue) and puts encoded frames on
the socket's bounded send queue with ``put_nowait``; one sender task drains that queue
into the socket. A pump therefore never waits on the network, so one slow socket
never slows the relay or any other stream. When the send queue is full (the client
does not read fast enough) the session cancels every request of the socket upstream
and closes it with 4008 and a reason, rather than ever dropping a frame silently.
A socket that goes away cancels its requests upstream too.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import msgspec
import structlog
from starlette.websockets import WebSocket

from fairlane import otel
from fairlane.errors import ErrorCode, FairlaneError
from producer.client import RequestError, RequestStream
from streamer import metrics
from streamer.access import access_info, note_tenant
from streamer.errors import EdgeError, validation_message
from streamer.http_api import error_response
from streamer.schema import (
    CLOSE_SLOW_CONSUMER,
    CLOSE_UNAUTHORIZED,
    FIELD_RANGES,
    AcceptedFrame,
    EndFrame,
    ErrorBody,
    ErrorFrame,
    TokenFrame,
    UsageOut,
    WsCancel,
    WsRequest,
    decode_client_frame,
    encode_frame,
)
from streamer.service import Edge, Principal

log = structlog.get_logger(__name__)


@dataclass(eq=False, slots=True)
class _Req:
    cid: str
    task: asyncio.Task | None = None
    stream: RequestStream | None = None
    cancel_reason: str | None = None


def _error_frame(cid: str | None, err: FairlaneError) -> ErrorFrame:
    return ErrorFrame(
        id=cid,
        error=ErrorBody(
            code=err.code.value,
            message=err.message,
            retryable=err.retryable,
            retry_after_ms=err.retry_after_ms,
            param=err.param,
        ),
    )


class WsSession:
    def __init__(
        self,
        ws: WebSocket,
        edge: Edge,
        principal: Principal,
        *,
        default_model: str,
        send_buffer: int,
        max_requests: int,
        close_timeout_s: float,
        traceparent: str | None = None,
    ) -> None:
        self.ws = ws
        self.edge = edge
        self.principal = principal
        self.default_model = default_model
        self.max_requests = max_requests
        self.close_timeout_s = close_timeout_s
        # The upgrade request's valid traceparent (every request on the socket joins
        # that trace), else None: each request gets a fresh one.
        self.traceparent = traceparent
        self.out: asyncio.Queue[str] = asyncio.Queue(maxsize=send_buffer)
        self.reqs: dict[str, _Req] = {}
        self.slow = asyncio.Event()
        self.slow_reason = ""
        # metric children resolved once per socket (the tenant's: once per request, as
        # its label may expire in between; streamer.metrics), not once per token
        self._ttft = metrics.TTFT.labels(principal.tier)

    # --- outgoing -------------------------------------------------------------------

    def emit(self, frame: msgspec.Struct) -> None:
        if self.slow.is_set():
            return
        try:
            self.out.put_nowait(encode_frame(frame))
        except asyncio.QueueFull:
            self.mark_slow(f"slow consumer: {self.out.maxsize} frames unread")

    def mark_slow(self, reason: str) -> None:
        if not self.slow.is_set():
            self.slow_reason = reason[:120]  # close reasons are at most 123 bytes
            self.slow.set()

    async def _send_loop(self) -> None:
        while True:
            text = await self.out.get()
            await self.ws.send_text(text)

    # --- incoming -------------------------------------------------------------------

    async def _recv_loop(self) -> None:
        while True:
            msg = await self.ws.receive()
            if msg["type"] == "websocket.disconnect":
                return
            data = msg.get("text")
            if data is None:
                data = msg.get("bytes") or b""
            self._on_frame(data)

    def _on_frame(self, data: str | bytes) -> None:
        try:
            frame = decode_client_frame.decode(data)
        except msgspec.ValidationError as exc:  # (a subclass of DecodeError: first)
            text, param = validation_message(exc, ranges=FIELD_RANGES, body=data)
            cid = _peek_id(data)
            self._refuse(cid, EdgeError(f"invalid frame: {text}", param=param))
            return
        except msgspec.DecodeError as exc:
            self._refuse(None, EdgeError(f"frame is not valid JSON: {exc}"))
            return
        if isinstance(frame, WsCancel):
            req = self.reqs.get(frame.id)
            if req is not None:
                self.cancel(req, "client_cancel")
                self.emit(EndFrame(id=frame.id, finish_reason="cancelled", usage=None))
            return
        assert isinstance(frame, WsRequest)
        if frame.id in self.reqs:
            self._refuse(frame.id, EdgeError(
                f"a request with id {frame.id!r} is already in flight on this socket", param="id"))
            return
        if len(self.reqs) >= self.max_requests:
            self._refuse(frame.id, EdgeError(
                f"too many requests in flight on this socket (max {self.max_requests})"))
            return
        req = _Req(frame.id)
        self.reqs[frame.id] = req
        req.task = asyncio.get_running_loop().create_task(self._pump(req, frame))

    def _refuse(self, cid: str | None, err: EdgeError) -> None:
        """A frame refused before it reached `Edge.start` (which counts the rest)."""
        metrics.request(self.principal.tenant, "ws", err.code.value)
        self.emit(_error_frame(cid, err))

    # --- one request ------------------------------------------------------------------

    async def _pump(self, req: _Req, frame: WsRequest) -> None:
        cid = req.cid
        model = frame.model or self.default_model
        # Each request's own span (tracing on, `fairlane.otel`), in the socket's trace.
        span = otel.start_span("fairlane.ws_request", self.traceparent, server=True, attributes={
            "fairlane.tenant": self.principal.tenant, "fairlane.tier": self.principal.tier,
            "fairlane.pool": model, "fairlane.endpoint": "ws"}) if otel.enabled() else None
        try:
            started = time.monotonic()
            try:
                stream = await self.edge.start(self.principal, frame, "ws", model,
                                               traceparent=otel.traceparent_of(
                                                   span, self.traceparent))
            except FairlaneError as err:
                otel.mark_error(span, f"{err.code.value}: {err.message}")
                self.emit(_error_frame(cid, err))
                return
            otel.set_attributes(span, {"fairlane.request_id": stream.request_id})
            req.stream = stream
            if req.cancel_reason is not None:  # cancelled while it was being admitted
                await stream.cancel(req.cancel_reason)
                return
            self.emit(AcceptedFrame(id=cid, request_id=stream.request_id))
            first = True
            tokens = metrics.tenant_child(metrics.TOKENS, self.principal.tenant)
            async for chunk in stream:
                if first:
                    first = False
                    self._ttft.observe(time.monotonic() - started)
                if chunk.num_tokens:
                    tokens.inc(chunk.num_tokens)
                if chunk.text or chunk.token_ids:
                    self.emit(TokenFrame(id=cid, seq=chunk.seq, text=chunk.text,
                                         num_tokens=chunk.num_tokens, token_ids=chunk.token_ids))
                if chunk.finish_reason is not None:
                    u = chunk.usage
                    if span is not None:
                        otel.set_attributes(span, {
                            "fairlane.finish_reason": chunk.finish_reason,
                            **otel.usage_attributes(u and u.prompt_tokens,
                                                    u and u.completion_tokens)})
                    usage = None if u is None else UsageOut(
                        prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                        total_tokens=u.prompt_tokens + u.completion_tokens)
                    self.emit(EndFrame(id=cid, finish_reason=chunk.finish_reason, usage=usage))
        except RequestError as exc:
            otel.mark_error(span, f"{exc.code.value}: {exc.message}")
            if exc.code == ErrorCode.SLOW_CONSUMER:
                self.mark_slow("slow consumer: request buffer overflowed")
            else:
                self.emit(_error_frame(cid, exc))
        except Exception as exc:  # a bug must still end the request with a frame
            log.exception("ws_pump_failed", tenant=self.principal.tenant, error=repr(exc))
            otel.mark_error(span, repr(exc))
            self.emit(_error_frame(cid, EdgeError("internal error", ErrorCode.INTERNAL)))
            if req.stream is not None and not req.stream.is_done:
                self.edge.spawn(req.stream.cancel("internal_error"))
        finally:
            otel.end_span(span)
            if self.reqs.get(cid) is req:
                del self.reqs[cid]

    def cancel(self, req: _Req, reason: str) -> None:
        """Stop relaying `req` and cancel it upstream (once)."""
        if req.cancel_reason is not None:
            return
        req.cancel_reason = reason
        self.reqs.pop(req.cid, None)
        if req.stream is None:
            return  # still being admitted: _pump cancels it once it has a stream
        if req.task is not None:
            req.task.cancel()
        if not req.stream.is_done:
            self.edge.spawn(req.stream.cancel(reason))

    # --- the session ------------------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        sender = loop.create_task(self._send_loop())
        reader = loop.create_task(self._recv_loop())
        slow = loop.create_task(self.slow.wait())
        try:
            await asyncio.wait({sender, reader, slow}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (sender, reader, slow):
                t.cancel()
            await asyncio.gather(sender, reader, slow, return_exceptions=True)
            is_slow = self.slow.is_set()
            reason = "slow_consumer" if is_slow else "client_gone"
            reqs = list(self.reqs.values())
            for req in reqs:
                self.cancel(req, reason)
            if reqs:
                metrics.tenant_child(metrics.SLOW_CONSUMERS if is_slow else metrics.CLIENT_GONE,
                                     self.principal.tenant, "ws").inc()
            tasks = [r.task for r in reqs if r.task is not None]
            if tasks:
                await asyncio.wait(tasks, timeout=self.close_timeout_s)
        if is_slow:
            log.info("ws_slow_consumer", tenant=self.principal.tenant, reason=self.slow_reason,
                     num_cancelled=len(reqs))
            try:
                await asyncio.wait_for(
                    self.ws.close(CLOSE_SLOW_CONSUMER, self.slow_reason), self.close_timeout_s)
            except (TimeoutError, Exception):
                pass


def _peek_id(data: str | bytes) -> str | None:
    try:
        raw = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return None
    if isinstance(raw, dict) and isinstance(raw.get("id"), str):
        return raw["id"][:128]
    return None


async def websocket_endpoint(ws: WebSocket) -> None:
    state = ws.app.state
    edge: Edge = state.edge
    settings = state.settings
    try:
        principal = edge.authenticate(ws.headers.get("authorization"))
    except EdgeError as err:
        metrics.request(None, "ws", err.code.value)
        if "websocket.http.response" in ws.scope.get("extensions", {}):
            await ws.send_denial_response(error_response(err))
        else:
            await ws.accept()
            await ws.close(CLOSE_UNAUTHORIZED, err.message[:120])
        return
    note_tenant(ws.scope, principal.tenant)
    info = access_info(ws.scope)
    await ws.accept()
    session = WsSession(
        ws,
        edge,
        principal,
        default_model=settings.pool,
        send_buffer=settings.ws_send_buffer,
        max_requests=settings.ws_max_requests,
        close_timeout_s=settings.ws_close_timeout_s,
        traceparent=info.traceparent if info else ws.headers.get("traceparent"),
    )
    await session.run()
