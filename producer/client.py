"""The producer library: submit requests to JetStream, read tokens from core NATS.

One `FairlaneClient` per process holds ONE wildcard subscription on its inbox prefix
(``<prefix>.inbox.<owner>.>``) and demultiplexes chunks into a bounded queue per
request. That is the whole token relay: the streamer uses this client too.

    client = await FairlaneClient.connect("nats://127.0.0.1:4222")
    stream = await client.submit(tenant="acme", prompt="hi", max_tokens=64)
    async for chunk in stream:
        print(chunk.text, end="")
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import nats
import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.errors import APIError

from fairlane.protocol import (
    Cancel,
    ChatMessage,
    ErrorCode,
    ErrorInfo,
    InferenceRequest,
    PoolInfo,
    PoolInfoRequest,
    ProtocolError,
    TokenChunk,
    Usage,
    decode_chunk,
    decode_pool_info,
    encode,
)
from fairlane.ratelimit import RateLimiter, RateLimits
from fairlane.runtime import now_ms
from fairlane.streams import ensure_streams
from fairlane.subjects import REPLY_HEADER, Subjects, check_id
from fairlane.validation import RequestLimits, check_request, estimate_prompt_tokens

log = structlog.get_logger(__name__)


class RequestError(Exception):
    """A request was refused or failed. `error.code` is a stable `ErrorCode`."""

    def __init__(self, error: ErrorInfo) -> None:
        super().__init__(f"{error.code.value}: {error.message}")
        self.error = error


@dataclass(slots=True)
class Completion:
    """A whole response, as returned by `RequestStream.collect()`."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage | None
    num_chunks: int
    first_chunk_ms: float  # monotonic ms of the first chunk (TTFT measurements)


@dataclass(eq=False)
class RequestStream:
    """Chunks of one request, in order. Iterate it, or `collect()` it."""

    request_id: str
    tenant: str
    pool: str
    _client: FairlaneClient = field(repr=False)
    _queue: asyncio.Queue = field(repr=False)
    _next_seq: int = 0
    _done: bool = False
    failure: ErrorInfo | None = None

    @property
    def is_done(self) -> bool:
        return self._done

    def _fail(self, error: ErrorInfo) -> None:
        """Fail the stream from the relay side (gap, slow consumer)."""
        if self._done or self.failure is not None:
            return
        self.failure = error
        # Wake the reader even if the queue is full: drop what is buffered.
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queue.put_nowait(None)

    def _offer(self, chunk: TokenChunk) -> None:
        """Called by the relay for every chunk of this request (any order)."""
        if self._done or self.failure is not None:
            return
        try:
            self._queue.put_nowait(chunk)
        except asyncio.QueueFull:
            self._fail(ErrorInfo.of(ErrorCode.SLOW_CONSUMER,
                                    "consumer fell too far behind the token stream"))
            self._client._spawn_cancel(self, "slow_consumer")

    def __aiter__(self) -> AsyncIterator[TokenChunk]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[TokenChunk]:
        try:
            while not self._done:
                chunk = await self._queue.get()
                if chunk is None:
                    assert self.failure is not None
                    raise RequestError(self.failure)
                if chunk.error is not None:  # terminal, accepted whatever its seq
                    self._done = True
                    self.failure = chunk.error
                    raise RequestError(chunk.error)
                if chunk.seq < self._next_seq:
                    continue  # duplicate delivery: drop
                if chunk.seq > self._next_seq:
                    self.failure = ErrorInfo.of(
                        ErrorCode.INTERNAL,
                        f"token stream gap: expected seq {self._next_seq}, got {chunk.seq}",
                    )
                    await self.cancel("stream_gap")
                    raise RequestError(self.failure)
                self._next_seq += 1
                if chunk.finish_reason is not None:
                    self._done = True
                yield chunk
        finally:
            self._client._forget(self.request_id)

    async def cancel(self, reason: str = "client_gone") -> None:
        """Tell the fleet to drop (queued) or abort (running) this request."""
        if self._done:
            return
        self._done = True
        self._client._forget(self.request_id)
        await self._client.cancel(self.request_id, self.pool, self.tenant, reason)

    async def collect(self) -> Completion:
        text: list[str] = []
        token_ids: list[int] = []
        finish, usage, n, first = "", None, 0, 0.0
        loop = asyncio.get_running_loop()
        async for chunk in self:
            if n == 0:
                first = loop.time() * 1000
            n += 1
            text.append(chunk.text)
            if chunk.token_ids:
                token_ids.extend(chunk.token_ids)
            if chunk.finish_reason is not None:
                finish, usage = chunk.finish_reason, chunk.usage
        return Completion(self.request_id, "".join(text), token_ids, finish, usage, n, first)


class FairlaneClient:
    """Submits requests and relays their tokens. Safe for many concurrent requests."""

    def __init__(
        self,
        nc: NatsClient,
        *,
        prefix: str = "fl",
        owner: str | None = None,
        limits: RequestLimits | None = None,
        max_buffered_chunks: int = 1024,
        owns_connection: bool = False,
        limiter: RateLimiter | None = None,
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.subjects = Subjects(prefix)
        self.owner = owner or uuid.uuid4().hex[:12]
        self.inbox = self.subjects.inbox_prefix(self.owner)
        self.limits = limits or RequestLimits()
        self.max_buffered_chunks = max_buffered_chunks
        self._owns_connection = owns_connection
        # Requests/min and tokens/min per tenant (Redis, fails open); applied to
        # submissions that pass `rate_limits`.
        self.limiter = limiter
        self._streams: dict[str, RequestStream] = {}
        self._sub = None
        self._bg: set[asyncio.Task] = set()
        # (pool, tenant) -> (expires monotonic s, PoolInfo | None): the dispatcher's
        # answer on the tenant's tier and the pool's limits, cached briefly so tenants
        # file edits reach producers within `info_ttl_s`.
        self._info: dict[tuple[str, str], tuple[float, PoolInfo | None]] = {}
        self.info_ttl_s = 10.0
        self.num_malformed_chunks = 0

    @classmethod
    async def connect(cls, nats_url: str, **kwargs) -> FairlaneClient:
        nc = await nats.connect(nats_url, name="fairlane-producer", max_reconnect_attempts=-1)
        client = cls(nc, owns_connection=True, **kwargs)
        await client.start()
        return client

    async def start(self, provision_streams: bool = True) -> None:
        if provision_streams:
            await ensure_streams(self.js, self.subjects)
        if self._sub is None:
            self._sub = await self.nc.subscribe(
                f"{self.inbox}.>", cb=self._on_chunk,
                # The relay must never be the slow one: let NATS buffer generously;
                # per-request queues are the real bound.
                pending_msgs_limit=1_000_000, pending_bytes_limit=1 << 30,
            )

    async def close(self) -> None:
        for stream in list(self._streams.values()):
            stream._fail(ErrorInfo.of(ErrorCode.CANCELLED, "client closed"))
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
        if self._bg:
            await asyncio.gather(*self._bg, return_exceptions=True)
        if self._owns_connection:
            await self.nc.drain()

    @property
    def num_open_streams(self) -> int:
        return len(self._streams)

    async def _on_chunk(self, msg: Msg) -> None:
        try:
            chunk = decode_chunk(msg.data)
        except ProtocolError as exc:
            self.num_malformed_chunks += 1
            log.warning("malformed_chunk", subject=msg.subject, error=str(exc))
            return
        stream = self._streams.get(chunk.request_id)
        if stream is not None:
            stream._offer(chunk)

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def _spawn_cancel(self, stream: RequestStream, reason: str) -> None:
        self._forget(stream.request_id)
        task = asyncio.get_running_loop().create_task(
            self.cancel(stream.request_id, stream.pool, stream.tenant, reason))
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    async def cancel(self, request_id: str, pool: str, tenant: str = "",
                     reason: str = "client_gone") -> None:
        msg = Cancel(request_id=request_id, tenant=tenant, reason=reason)
        await self.nc.publish(self.subjects.cancel(pool), encode(msg))

    async def submit(
        self,
        *,
        tenant: str,
        pool: str = "default",
        tier: str | None = None,
        prompt: str | None = None,
        messages: Sequence[ChatMessage] | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        max_tokens: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop: Sequence[str] = (),
        seed: int | None = None,
        priority: int = 0,
        deadline_ms: int | None = None,
        ttft_budget_ms: int | None = None,
        request_id: str | None = None,
        return_token_ids: bool = False,
        expected_output_tokens: int | None = None,
        rate_limits: RateLimits | None = None,
    ) -> RequestStream:
        """Validate and publish one request; returns its token stream.

        `tier` defaults to the tenant's tier as the pool's dispatcher knows it.
        Raises `RequestError` if the request is invalid or the fleet refuses it
        (e.g. ``queue_full`` when the tenant's queue cap is reached).
        """
        rid = request_id or uuid.uuid4().hex
        if tier is None:
            tier = await self.resolve_tier(pool, tenant)
        try:
            req = InferenceRequest(
                request_id=rid, tenant=tenant, pool=pool, tier=tier,
                reply_to=f"{self.inbox}.{rid}",
                prompt=prompt,
                messages=list(messages) if messages is not None else None,
                prompt_token_ids=list(prompt_token_ids) if prompt_token_ids is not None else None,
                max_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=list(stop),
                seed=seed, priority=priority, deadline_ms=deadline_ms,
                ttft_budget_ms=ttft_budget_ms, created_ms=now_ms(),
                return_token_ids=return_token_ids,
                expected_output_tokens=expected_output_tokens,
            )
        except (TypeError, ValueError) as exc:
            raise RequestError(ErrorInfo.of(ErrorCode.INVALID_REQUEST, str(exc))) from None
        return await self.submit_request(req, rate_limits)

    async def pool_info(self, pool: str, tenant: str) -> PoolInfo | None:
        """The pool dispatcher's view of `tenant` (cached), or None if no dispatcher
        answers (requests can still be published: JetStream keeps them)."""
        key = (pool, tenant)
        now = asyncio.get_running_loop().time()
        hit = self._info.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]
        info: PoolInfo | None = None
        try:
            msg = await self.nc.request(
                self.subjects.info(pool), encode(PoolInfoRequest(tenant=tenant)), timeout=1.0)
            info = decode_pool_info(msg.data)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError, ProtocolError):
            info = None
        self._info[key] = (now + (self.info_ttl_s if info else 1.0), info)
        return info

    async def resolve_tier(self, pool: str, tenant: str) -> str:
        try:
            check_id("pool", pool)
            check_id("tenant", tenant)
        except ProtocolError as exc:
            raise RequestError(ErrorInfo.of(exc.code, exc.message)) from None
        info = await self.pool_info(pool, tenant)
        if info is None:
            raise RequestError(ErrorInfo.of(
                ErrorCode.OVERLOADED,
                f"no dispatcher answers for pool {pool!r}: pass tier= explicitly to queue "
                f"the request anyway", retry_after_ms=1_000))
        if info.tier is None:
            raise RequestError(ErrorInfo.of(
                ErrorCode.UNKNOWN_TENANT, f"tenant {tenant!r} may not use pool {pool!r}"))
        return info.tier

    async def submit_request(self, req: InferenceRequest,
                             rate_limits: RateLimits | None = None) -> RequestStream:
        """Publish a prepared request (its reply_to is pointed at this client).

        With a `limiter` and `rate_limits`, the request and its estimated tokens are
        reserved first (refused with ``rate_limited`` and a retry hint when spent) and
        settled later from the usage stream; a refused publish gives them back.
        """
        req.reply_to = f"{self.inbox}.{req.request_id}"
        try:
            subject = self.subjects.request(req.pool, req.tier, req.tenant)
        except ProtocolError as exc:
            raise RequestError(ErrorInfo.of(exc.code, exc.message)) from None
        info = await self.pool_info(req.pool, req.tenant)
        limits = self.limits
        if info is not None:
            if info.tier is None:
                raise RequestError(ErrorInfo.of(
                    ErrorCode.UNKNOWN_TENANT,
                    f"tenant {req.tenant!r} may not use pool {req.pool!r}"))
            if info.tier != req.tier:
                raise RequestError(ErrorInfo.of(
                    ErrorCode.INVALID_REQUEST,
                    f"tenant {req.tenant!r} is in tier {info.tier!r}, not {req.tier!r}"))
            limits = RequestLimits(
                max_tokens=info.max_tokens or limits.max_tokens,
                max_prompt_chars=info.max_prompt_chars or limits.max_prompt_chars,
                max_prompt_tokens=info.max_prompt_tokens or limits.max_prompt_tokens,
            )
        try:
            check_request(req, limits)
        except ProtocolError as exc:
            raise RequestError(ErrorInfo.of(exc.code, exc.message)) from None
        if req.request_id in self._streams:
            raise RequestError(ErrorInfo.of(ErrorCode.INVALID_REQUEST,
                                            f"request {req.request_id} is already streaming"))
        limited = self.limiter is not None and rate_limits is not None and not rate_limits.unlimited
        if limited:
            est_tokens = estimate_prompt_tokens(req) + req.max_tokens
            decision = await self.limiter.admit(req.tenant, rate_limits, est_tokens,
                                                req.request_id, klass=req.pool)
            if not decision.allowed:
                raise RequestError(ErrorInfo.of(
                    ErrorCode.RATE_LIMITED, f"tenant {req.tenant!r} is over its rate limit",
                    retry_after_ms=decision.retry_after_ms))
        try:
            return await self._publish(req, subject)
        except BaseException:
            if limited:
                with contextlib.suppress(Exception):
                    await self.limiter.refund(req.tenant, req.request_id, klass=req.pool)
            raise

    async def _publish(self, req: InferenceRequest, subject: str) -> RequestStream:
        # Register before publishing, so no early chunk can miss its queue.
        stream = RequestStream(req.request_id, req.tenant, req.pool, self,
                               asyncio.Queue(maxsize=self.max_buffered_chunks))
        self._streams[req.request_id] = stream
        try:
            await self.js.publish(subject, encode(req), headers={
                "Nats-Msg-Id": req.request_id,
                # Lets the dispatcher answer even if the body arrives unreadable.
                REPLY_HEADER: req.reply_to,
            })
        except APIError as exc:
            self._forget(req.request_id)
            raise RequestError(_publish_error(exc)) from None
        except BaseException:  # incl. cancellation mid-publish: never leak the entry
            self._forget(req.request_id)
            raise
        return stream


def _publish_error(exc: APIError) -> ErrorInfo:
    text = str(exc.description or exc)
    if "maximum messages per subject" in text or exc.err_code == 10077:
        return ErrorInfo.of(ErrorCode.QUEUE_FULL,
                            "this tenant's queue is full; retry later", retry_after_ms=1_000)
    if "maximum" in text:
        return ErrorInfo.of(ErrorCode.OVERLOADED, f"request stream is full: {text}",
                            retry_after_ms=1_000)
    return ErrorInfo.of(ErrorCode.INTERNAL, f"publish failed: {text}")
