"""The producer library: submit requests to JetStream, read tokens from core NATS.

The one admission path of the fleet: `FairlaneClient.submit` validates a
`RequestSpec` (`fairlane.validation.check_request`), reserves it against the rate
limiter, publishes it idempotently and gives the reservation back if the publish is
refused. The producer CLI and the streamer's HTTP and websocket edge all submit
through it.

One `FairlaneClient` per process holds ONE wildcard subscription on its inbox prefix
(``<prefix>.inbox.<owner>.>``) and demultiplexes chunks into a bounded queue per
request. That is the whole token relay.

    client = await FairlaneClient.connect("nats://127.0.0.1:4222")
    spec = RequestSpec(tenant="acme", prompt="hi", sampling=SamplingParams(max_tokens=64))
    async for chunk in await client.submit(spec):
        print(chunk.text, end="")
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import nats
import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.errors import APIError

from fairlane.errors import FairlaneError
from fairlane.protocol import (
    Cancel,
    ErrorCode,
    ErrorInfo,
    InferenceRequest,
    PoolInfo,
    PoolInfoRequest,
    ProtocolError,
    SamplingParams,
    TokenChunk,
    Usage,
    decode_chunk,
    decode_pool_info,
    encode,
)
from fairlane.ratelimit import RateLimiter, RateLimits
from fairlane.runtime import log_nats_error, now_ms
from fairlane.streams import StreamSettings, ensure_streams
from fairlane.subjects import REPLY_HEADER, Subjects, check_id
from fairlane.validation import RequestLimits, check_request, estimate_prompt_tokens
from producer.spec import RequestSpec, new_request_id

# The library's public names: callers import the request description from here.
__all__ = ["Completion", "FairlaneClient", "RequestError", "RequestSpec", "RequestStream",
           "SamplingParams"]

log = structlog.get_logger(__name__)


class RequestError(FairlaneError):
    """A request was refused or failed: `code`, `message`, `retry_after_ms`, and the
    same as one `ErrorInfo` in `error` (`exc.error.code` is a stable `ErrorCode`)."""

    @property
    def error(self) -> ErrorInfo:
        return self.info()

    def __str__(self) -> str:
        return f"{self.code.value}: {self.message}"


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
                    raise RequestError.from_info(self.failure)
                if chunk.error is not None:  # terminal, accepted whatever its seq
                    self._done = True
                    self.failure = chunk.error
                    raise RequestError.from_info(chunk.error)
                if chunk.seq < self._next_seq:
                    continue  # duplicate delivery: drop
                if chunk.seq > self._next_seq:
                    self.failure = ErrorInfo.of(
                        ErrorCode.INTERNAL,
                        f"token stream gap: expected seq {self._next_seq}, got {chunk.seq}",
                    )
                    await self.cancel("stream_gap")
                    raise RequestError.from_info(self.failure)
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
        nc = await nats.connect(nats_url, name="fairlane-producer", max_reconnect_attempts=-1,
                                error_cb=log_nats_error)
        client = cls(nc, owns_connection=True, **kwargs)
        await client.start()
        return client

    async def start(self, provision_streams: bool = True,
                    stream_settings: StreamSettings | None = None) -> None:
        if provision_streams:
            await ensure_streams(self.js, self.subjects, stream_settings)
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
        spec: RequestSpec,
        *,
        rate_limits: RateLimits | None = None,
        limits: RequestLimits | None = None,
    ) -> RequestStream:
        """Validate, admit and publish one request; returns its token stream.

        The tenant's tier is asked of the pool's dispatcher when `spec.tier` is None.
        `rate_limits` (with the client's `limiter`) applies the tenant's requests/min
        and tokens/min; `limits` overrides the pool's request limits (the edge reads
        them from the tenants file). Raises `RequestError` if the request is invalid
        or refused (e.g. ``rate_limited``, or ``queue_full`` at the tenant's queue cap).
        """
        tier = spec.tier if spec.tier is not None else await self.resolve_tier(
            spec.pool, spec.tenant)
        rid = spec.request_id or new_request_id()
        req = spec.to_request(request_id=rid, tier=tier, reply_to=f"{self.inbox}.{rid}",
                              created_ms=now_ms())
        return await self.submit_request(req, rate_limits, limits=limits)

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
            raise RequestError.from_error(exc) from None
        info = await self.pool_info(pool, tenant)
        if info is None:
            raise RequestError(
                f"no dispatcher answers for pool {pool!r}: set the spec's tier to queue "
                f"the request anyway", ErrorCode.OVERLOADED, retry_after_ms=1_000)
        if info.tier is None:
            raise RequestError(f"tenant {tenant!r} may not use pool {pool!r}",
                               ErrorCode.UNKNOWN_TENANT)
        return info.tier

    async def submit_request(self, req: InferenceRequest,
                             rate_limits: RateLimits | None = None, *,
                             limits: RequestLimits | None = None) -> RequestStream:
        """Check, admit and publish a prepared request (its reply_to is pointed at
        this client). `submit` builds one from a `RequestSpec` and lands here.

        With a `limiter` and `rate_limits`, the request and its estimated tokens are
        reserved first (refused with ``rate_limited`` and a retry hint when spent) and
        settled later from the usage stream; a refused publish gives them back.
        """
        req.reply_to = f"{self.inbox}.{req.request_id}"
        try:
            subject = self.subjects.request(req.pool, req.tier, req.tenant)
            pool_limits = await self._pool_limits(req)
            check_request(req, limits or pool_limits)
        except ProtocolError as exc:
            raise RequestError.from_error(exc) from None
        if req.request_id in self._streams:
            raise RequestError(f"request {req.request_id} is already streaming",
                               ErrorCode.INVALID_REQUEST)
        limited = self.limiter is not None and rate_limits is not None and not rate_limits.unlimited
        if limited:
            est_tokens = estimate_prompt_tokens(req) + req.sampling.max_tokens
            decision = await self.limiter.admit(req.tenant, rate_limits, est_tokens,
                                                req.request_id, klass=req.pool)
            if not decision.allowed:
                raise RequestError(f"tenant {req.tenant!r} is over its rate limit",
                                   ErrorCode.RATE_LIMITED,
                                   retry_after_ms=decision.retry_after_ms)
        try:
            return await self._publish(req, subject)
        except BaseException:
            if limited:
                with contextlib.suppress(Exception):  # best effort: reservations expire
                    await self.limiter.refund(req.tenant, req.request_id, klass=req.pool)
            raise

    async def _pool_limits(self, req: InferenceRequest) -> RequestLimits:
        """The pool's limits as its dispatcher states them (else the client's own);
        refuses a tenant the dispatcher does not place in `req.tier`."""
        info = await self.pool_info(req.pool, req.tenant)
        if info is None:
            return self.limits
        if info.tier is None:
            raise ProtocolError(f"tenant {req.tenant!r} may not use pool {req.pool!r}",
                                ErrorCode.UNKNOWN_TENANT)
        if info.tier != req.tier:
            raise ProtocolError(f"tenant {req.tenant!r} is in tier {info.tier!r}, not {req.tier!r}",
                                ErrorCode.INVALID_REQUEST)
        return RequestLimits(
            max_tokens=info.max_tokens or self.limits.max_tokens,
            max_prompt_chars=info.max_prompt_chars or self.limits.max_prompt_chars,
            max_prompt_tokens=info.max_prompt_tokens or self.limits.max_prompt_tokens,
        )

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
            raise _publish_error(exc) from None
        except BaseException:  # incl. cancellation mid-publish: never leak the entry
            self._forget(req.request_id)
            raise
        return stream


def _publish_error(exc: APIError) -> RequestError:
    text = str(exc.description or exc)
    if "maximum messages per subject" in text or exc.err_code == 10077:
        return RequestError("this tenant's queue is full; retry later", ErrorCode.QUEUE_FULL,
                            retry_after_ms=1_000)
    if "maximum" in text:
        return RequestError(f"request stream is full: {text}", ErrorCode.OVERLOADED,
                            retry_after_ms=1_000)
    return RequestError(f"publish failed: {text}", ErrorCode.INTERNAL)
