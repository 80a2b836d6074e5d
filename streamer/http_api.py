"""OpenAI-compatible HTTP: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
``/v1/models/{id}``.

As in vLLM's OpenAI server, a body field the schema does not know is ignored, not
refused: the answer carries ``X-Fairlane-Ignored-Fields: a,b`` and the streamer logs
``ignored_request_fields`` (once per tenant, endpoint and set of fields, so a client
that always sends one extra field does not flood the log). A known feature the fleet
cannot honour is a 400 naming it (`streamer.schema`).

Non-streaming answers are one JSON body; ``"stream": true`` answers Server-Sent
Events, one ``data: {chunk}`` per token chunk, ending with ``data: [DONE]``. An error
after the stream started is one ``data: {"error": {...}}`` event (OpenAI's SDKs raise
it as an APIError) and no ``[DONE]``. A client that goes away cancels its request
upstream; one too slow to read (its per-request buffer of ``max_buffered_chunks``
overflowed) gets the ``slow_consumer`` error event and its request is cancelled.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import structlog
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from fairlane import otel
from fairlane.errors import ErrorCode, FairlaneError
from producer.client import RequestError, RequestStream
from streamer import metrics
from streamer.access import access_info, note_tenant, use_traceparent
from streamer.errors import BODY_TOO_LARGE, EdgeError, validation_message
from streamer.schema import (
    FIELD_CHOICES,
    FIELD_RANGES,
    decode_chat,
    decode_completion,
    ignored_fields,
)
from streamer.service import Edge, Principal, usage_dict

log = structlog.get_logger(__name__)

_json = msgspec.json.Encoder()
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def json_response(body: Any, status: int = 200, headers: dict | None = None) -> Response:
    return Response(_json.encode(body), status, headers, media_type="application/json")


def error_response(exc: FairlaneError) -> Response:
    err = EdgeError.of(exc)
    return json_response(err.openai_body(), err.status, err.headers())


async def read_body(request: Request, max_bytes: int) -> bytes:
    too_big = EdgeError(f"request body is larger than the limit of {max_bytes} bytes",
                        BODY_TOO_LARGE)
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > max_bytes:
                raise too_big
        except ValueError:
            raise EdgeError("invalid Content-Length header") from None
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > max_bytes:
            raise too_big
    return bytes(body)


def decode_body(decoder: msgspec.json.Decoder, body: bytes) -> Any:
    if not body.strip():
        raise EdgeError("request body is empty: expected a JSON object")
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:  # (a subclass of DecodeError: first)
        msg, param = validation_message(exc, FIELD_CHOICES, FIELD_RANGES, body)
        raise EdgeError(f"invalid request: {msg}", param=param) from None
    except msgspec.DecodeError as exc:
        raise EdgeError(f"request body is not valid JSON: {exc}") from None


IGNORED_HEADER = "X-Fairlane-Ignored-Fields"
_MAX_NAMES_IN_HEADER = 16
_HEADER_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-\[\]]{1,64}$")
_MAX_WARNED = 4096


def ignored_header(names: list[str]) -> str:
    """The header value: names a header can carry (no control characters, commas or
    non-ASCII from a hostile body), at most `_MAX_NAMES_IN_HEADER`, and a count of the
    rest; the log line has them all."""
    shown = [n for n in names if _HEADER_NAME_RE.match(n)][:_MAX_NAMES_IN_HEADER]
    rest = len(names) - len(shown)
    return ",".join(shown + ([f"+{rest} more"] if rest else []))


def _finish(reason: str | None) -> str:
    # OpenAI knows stop/length; anything else the engine says ends as "stop".
    return reason if reason in ("stop", "length") else "stop"


def model_object(model_id: str) -> dict[str, Any]:
    """OpenAI's model object; a model is a pool of the tenants file."""
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "fairlane"}


class OpenAIApi:
    def __init__(self, edge: Edge, max_body_bytes: int) -> None:
        self.edge = edge
        self.max_body_bytes = max_body_bytes
        # (tenant, endpoint, fields) already warned about; bounded, cleared when full.
        self._warned: set[tuple[str, str, tuple[str, ...]]] = set()

    def principal(self, request: Request) -> Principal:
        principal = self.edge.authenticate(request.headers.get("authorization"))
        note_tenant(request.scope, principal.tenant)  # the access log names it
        return principal

    async def models(self, request: Request) -> Response:
        """The pools this key may use (the ones a request naming them would reach)."""
        try:
            principal = self.principal(request)
        except EdgeError as err:
            return error_response(err)
        data = [model_object(m) for m in self.edge.models()
                if principal.record is None or principal.record.allows_pool(m)]
        return json_response({"object": "list", "data": data})

    async def model(self, request: Request) -> Response:
        """``GET /v1/models/{id}``: the model object, or 404 ``model_not_found``."""
        try:
            principal = self.principal(request)
            model_id = request.path_params["model_id"]
            self.edge.check_model(principal, model_id)
        except EdgeError as err:
            return error_response(err)
        return json_response(model_object(model_id))

    async def completions(self, request: Request) -> Response:
        return await self._handle(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, chat=True)

    async def _handle(self, request: Request, chat: bool) -> Response:
        ignored: list[str] = []
        response = await self._answer(request, chat, ignored)
        if ignored:
            response.headers[IGNORED_HEADER] = ignored_header(ignored)
        return response

    def _note_ignored(self, tenant: str, endpoint: str, names: list[str]) -> None:
        key = (tenant, endpoint, tuple(names))
        if key in self._warned:
            return
        if len(self._warned) >= _MAX_WARNED:
            self._warned.clear()
        self._warned.add(key)
        log.warning("ignored_request_fields", tenant=tenant, endpoint=endpoint, fields=names)

    async def _answer(self, request: Request, chat: bool, ignored: list[str]) -> Response:
        endpoint = "chat" if chat else "completions"
        decoder = decode_chat if chat else decode_completion
        principal, submitting = None, False
        try:
            principal = self.principal(request)
            body = await read_body(request, self.max_body_bytes)
            req: Any = decode_body(decoder, body)
            ignored += ignored_fields(body, decoder.type)
            if ignored:
                self._note_ignored(principal.tenant, endpoint, ignored)
            started = time.monotonic()
            # Run under the id the answer's X-Request-Id names, in the client's trace
            # or a fresh one (streamer.access).
            info = access_info(request.scope)
            traceparent = use_traceparent(
                request.scope, request.headers.get("traceparent"), span_attributes={
                    "fairlane.tenant": principal.tenant, "fairlane.tier": principal.tier,
                    "fairlane.pool": req.model, "fairlane.endpoint": endpoint,
                    "fairlane.stream": bool(req.stream)})
            submitting = True  # from here on, Edge.start counts a refusal itself
            stream = await self.edge.start(principal, req, endpoint, req.model,
                                           request_id=info.request_id if info else None,
                                           traceparent=traceparent)
        except FairlaneError as err:
            if not submitting:
                metrics.request(principal and principal.tenant, endpoint, err.code.value)
            return error_response(err)
        meta = _Meta(
            id=("chatcmpl-" if chat else "cmpl-") + stream.request_id,
            model=req.model,
            chat=chat,
            tenant=principal.tenant,
            tier=principal.tier,
            started=started,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            span=info.span if info else None,
        )
        if req.stream:
            return StreamingResponse(
                self._sse(stream, meta), media_type="text/event-stream", headers=SSE_HEADERS
            )
        return await self._whole(request, stream, meta)

    async def _whole(self, request: Request, stream: RequestStream, meta: _Meta) -> Response:
        collect = asyncio.ensure_future(stream.collect())
        gone = asyncio.ensure_future(_wait_disconnect(request))
        metrics.ACTIVE.labels(meta.endpoint).inc()
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not collect.done():
                collect.cancel()
                metrics.tenant_child(metrics.CLIENT_GONE, meta.tenant, "http").inc()
                await stream.cancel("client_gone")
                return Response(status_code=499)
            try:
                done = collect.result()
            except RequestError as exc:
                return error_response(exc)
        finally:
            gone.cancel()
            metrics.ACTIVE.labels(meta.endpoint).dec()
        metrics.tenant_child(metrics.TOKENS, meta.tenant).inc(
            done.usage.completion_tokens if done.usage else 0)
        usage = usage_dict(done.usage) or {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        meta.trace_end(done.finish_reason, usage)
        if meta.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": done.text},
                "logprobs": None,
                "finish_reason": _finish(done.finish_reason),
            }
            obj = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": done.text,
                "logprobs": None,
                "finish_reason": _finish(done.finish_reason),
            }
            obj = "text_completion"
        return json_response(
            {
                "id": meta.id,
                "object": obj,
                "created": meta.created,
                "model": meta.model,
                "choices": [choice],
                "usage": usage,
            }
        )

    async def _sse(self, stream: RequestStream, meta: _Meta) -> AsyncIterator[bytes]:
        finished = False
        first = True
        tokens = metrics.tenant_child(metrics.TOKENS, meta.tenant)
        metrics.ACTIVE.labels(meta.endpoint).inc()
        try:
            if meta.chat:
                yield meta.event({"role": "assistant", "content": ""}, None)
            async for chunk in stream:
                if first:
                    first = False
                    metrics.TTFT.labels(meta.tier).observe(time.monotonic() - meta.started)
                if chunk.num_tokens:
                    tokens.inc(chunk.num_tokens)
                if chunk.text:
                    yield meta.event(chunk.text, None)
                if chunk.finish_reason is not None:
                    finished = True
                    meta.trace_end(chunk.finish_reason, usage_dict(chunk.usage))
                    yield meta.event("", _finish(chunk.finish_reason))
                    if meta.include_usage:
                        yield meta.usage_event(usage_dict(chunk.usage))
            finished = True
            yield b"data: [DONE]\n\n"
        except RequestError as exc:
            finished = True  # the stream is over (the client lib cancels what it must)
            if exc.code == ErrorCode.SLOW_CONSUMER:
                metrics.tenant_child(metrics.SLOW_CONSUMERS, meta.tenant, "sse").inc()
            otel.mark_error(meta.span, f"{exc.code.value}: {exc.message}")
            yield b"data: " + _json.encode(EdgeError.of(exc).openai_body()) + b"\n\n"
        finally:
            metrics.ACTIVE.labels(meta.endpoint).dec()
            if not finished and not stream.is_done:
                # Client went away mid-stream (we are being cancelled): cancel upstream
                # from a task of its own, since awaiting here would be cancelled too.
                metrics.tenant_child(metrics.CLIENT_GONE, meta.tenant, "sse").inc()
                self.edge.spawn(stream.cancel("client_gone"))


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _Meta:
    __slots__ = ("id", "model", "chat", "tenant", "tier", "started", "created", "include_usage",
                 "span")

    def __init__(self, *, id: str, model: str, chat: bool, tenant: str, tier: str,
                 started: float, include_usage: bool, span: Any = None) -> None:
        self.id = id
        self.model = model
        self.chat = chat
        self.tenant = tenant
        self.tier = tier
        self.started = started
        self.created = int(time.time())
        self.include_usage = include_usage
        self.span = span  # the request's server span (`streamer.access`), or None

    def trace_end(self, finish_reason: str | None, usage: dict | None) -> None:
        """How the answer ended, on its span (once, at the end; not per chunk)."""
        if self.span is not None:
            u = usage or {}
            otel.set_attributes(self.span, {
                "fairlane.finish_reason": finish_reason,
                **otel.usage_attributes(u.get("prompt_tokens"), u.get("completion_tokens"))})

    @property
    def endpoint(self) -> str:
        return "chat" if self.chat else "completions"

    def event(self, delta: Any, finish: str | None) -> bytes:
        if self.chat:
            d = delta if isinstance(delta, dict) else ({"content": delta} if delta else {})
            choice: dict = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": [choice]}
        return b"data: " + _json.encode(body) + b"\n\n"

    def usage_event(self, usage: dict | None) -> bytes:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": [], "usage": usage}
        return b"data: " + _json.encode(body) + b"\n\n"
