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
from collections import OrderedDict

import nats
import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.errors import APIError

from fairlane.protocol import (
    Cancel,
    ErrorCode,
    ErrorInfo,
    InferenceRequest,
    PoolInfo,
    PoolInfoRequest,
    ProtocolError,
    RequestState,
    RequestStatus,
    SamplingParams,
    decode_chunk,
    decode_pool_info,
    encode,
)
from fairlane.ratelimit import RateLimiter, RateLimits
from fairlane.runtime import cancel_and_wait, now_ms
from fairlane.streams import StreamSettings, ensure_streams
from fairlane.subjects import REPLY_HEADER, Subjects, check_id
from fairlane.trace import TRACEPARENT_HEADER, traceparent_or_new
from fairlane.validation import RequestLimits, check_request, estimate_prompt_tokens
from producer.auth import FAILOVER_RETRY_S, connect_client, guard_publish
from producer.migrate import resume_stream
from producer.silence import SilenceWatch
from producer.spec import RequestSpec, new_request_id
from producer.stream import Completion, RequestError, RequestStream
from producer.watch import (
    DEFAULT_MAX_SILENCE_S,
    DEFAULT_SILENCE_S,
    Action,
    dedupe_key,
    duplicate_action,
)

# The library's public names: callers import the request description from here.
__all__ = ["Completion", "FairlaneClient", "RequestError", "RequestSpec", "RequestStream",
           "SamplingParams"]

log = structlog.get_logger(__name__)

# Pauses before asking a pool's dispatcher again after "no responders" (a takeover).
INFO_NO_RESPONDERS_RETRY_S = (0.05, 0.2)


class FairlaneClient(SilenceWatch):
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
        silence_s: float = DEFAULT_SILENCE_S,
        max_silence_s: float = DEFAULT_MAX_SILENCE_S,
        max_resumes: int = 2,
        tenant: str | None = None,
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.subjects = Subjects(prefix)
        self.owner = owner or uuid.uuid4().hex[:12]
        self.inbox = self.subjects.inbox_prefix(self.owner)
        # Acting for ONE tenant (its NATS user may read only that tenant's inboxes and
        # publish only its requests and cancels): other tenants' requests are refused.
        self.tenant = check_id("tenant", tenant) if tenant else None
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
        # A stream with no chunk for `silence_s` asks the dispatcher for its status;
        # after `max_silence_s` with nobody vouching it ends with `stream_lost`.
        self.silence_s = silence_s
        self.max_silence_s = max_silence_s
        # A stream whose worker is lost (or that went silent) resumes on another worker
        # from the tokens already read, up to this many times, before the caller sees
        # the retryable error (DESIGN.md section 5b). 0 turns migration off.
        self.max_resumes = max_resumes
        self.num_resumes = 0
        self._watchdog: asyncio.Task | None = None
        # request id -> last attempt this client published; and the ids whose last
        # attempt ended with a retryable error, so resubmitting them uses attempt + 1
        # (JetStream would drop a same-key publish as a duplicate).
        # Bounded (oldest forgotten first): a long-running edge submits millions; the
        # dedupe window (2 min) is what matters, not history.
        self._attempts: OrderedDict[str, int] = OrderedDict()
        self.max_remembered_ids = 100_000
        self._retry_next: set[str] = set()
        # Cancels that could not be sent (connection down): resent on reconnect.
        self._pending_cancels: dict[str, Cancel] = {}
        self._pending_pools: dict[str, str] = {}

    @classmethod
    async def connect(cls, nats_url: str, **kwargs) -> FairlaneClient:
        """Connect and start a client; ``user=``, ``password=`` log in (a tenant's or
        a service's NATS user) and ``tls_ca_file=`` verifies the server's TLS
        certificate (`producer.auth.connect_client`); ``connect_wait_s=`` bounds the
        first connect (default 10 s, then `ConnectionError`; None waits for NATS for
        ever; once connected the client reconnects for ever); other keywords go to the
        client."""
        return await connect_client(cls, nats_url, **kwargs)

    async def start(self, provision_streams: bool | None = None,
                    stream_settings: StreamSettings | None = None) -> None:
        # A tenant's credentials may not touch the JetStream API: services provision.
        if self.tenant is None if provision_streams is None else provision_streams:
            await ensure_streams(self.js, self.subjects, stream_settings)
        if self._sub is None:
            self._sub = await self.nc.subscribe(
                self.subjects.inbox_subscription(self.owner, self.tenant), cb=self._on_chunk,
                # The relay must never be the slow one: let NATS buffer generously;
                # per-request queues are the real bound.
                pending_msgs_limit=1_000_000, pending_bytes_limit=1 << 30,
            )
        if self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().create_task(self._watch_silence())

    async def close(self) -> None:
        if self._watchdog is not None:
            await cancel_and_wait(self._watchdog)
            self._watchdog = None
        # Cancel upstream first, so no GPU work continues for a closed client.
        open_streams = list(self._streams.values())
        for stream in open_streams:
            with contextlib.suppress(Exception):
                await self.cancel(stream.request_id, stream.pool, stream.tenant, "client_closed")
        if open_streams and self.nc.is_connected:
            with contextlib.suppress(Exception):
                await self.nc.flush(timeout=1)
        for stream in open_streams:
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
        # Only the stream's own tenant's inbox may feed it (the dispatcher sends a
        # tenant's chunks nowhere else), whatever request id a chunk names.
        if stream is not None and Subjects.reply_tenant(msg.subject) in (None, stream.tenant):
            stream._offer(chunk)

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def _remember(self, request_id: str, attempt: int) -> None:
        self._attempts[request_id] = attempt
        self._attempts.move_to_end(request_id)
        self._retry_next.discard(request_id)
        while len(self._attempts) > self.max_remembered_ids:
            old, _ = self._attempts.popitem(last=False)
            self._retry_next.discard(old)

    def _note_end(self, stream: RequestStream) -> None:
        """Remember a retryable failure: resubmitting the id then uses attempt + 1."""
        if stream.failure is not None and stream.failure.retryable:
            self._retry_next.add(stream.request_id)

    def _spawn_cancel(self, stream: RequestStream, reason: str) -> None:
        self._forget(stream.request_id)
        task = asyncio.get_running_loop().create_task(
            self.cancel(stream.request_id, stream.pool, stream.tenant, reason))
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    async def cancel(self, request_id: str, pool: str, tenant: str = "",
                     reason: str = "client_gone") -> None:
        msg = Cancel(request_id=request_id, tenant=tenant or self.tenant or "", reason=reason)
        if not self.nc.is_connected:
            # Would be lost or stuck in the reconnect buffer: resend after reconnect.
            self._pending_cancels[request_id] = msg
            self._pending_pools[request_id] = pool
            return
        await self.nc.publish(self.subjects.cancel(pool, msg.tenant), encode(msg))

    async def _send_pending_cancels(self) -> None:
        pending, self._pending_cancels = self._pending_cancels, {}
        for rid, msg in pending.items():
            pool = self._pending_pools.pop(rid, "default")
            with contextlib.suppress(Exception):
                await self.nc.publish(self.subjects.cancel(pool, msg.tenant), encode(msg))
        if pending:
            log.info("pending_cancels_sent", count=len(pending))
            with contextlib.suppress(Exception):
                await self.nc.flush(timeout=1)

    def _fail_all(self, code: ErrorCode, message: str) -> None:
        for stream in list(self._streams.values()):
            stream._fail(ErrorInfo.of(code, message))
        self._streams.clear()

    async def submit(
        self,
        spec: RequestSpec,
        *,
        rate_limits: RateLimits | None = None,
        limits: RequestLimits | None = None,
        traceparent: str | None = None,
    ) -> RequestStream:
        """Validate, admit and publish one request; returns its token stream.

        The tenant's tier is asked of the pool's dispatcher when `spec.tier` is None.
        `rate_limits` (with the client's `limiter`) applies the tenant's requests/min
        and tokens/min; `limits` overrides the pool's request limits (the edge reads
        them from the tenants file). Raises `RequestError` if the request is invalid
        or refused (e.g. ``rate_limited``, or ``queue_full`` at the tenant's queue cap).
        `traceparent` (W3C trace context) travels with the request to its worker; an
        absent or invalid one is replaced by a fresh trace.
        """
        tier = spec.tier if spec.tier is not None else await self.resolve_tier(
            spec.pool, spec.tenant)
        rid = spec.request_id or new_request_id()
        req = spec.to_request(request_id=rid, tier=tier, reply_to=f"{self.inbox}.{rid}",
                              created_ms=now_ms())
        if rid in self._retry_next:  # our earlier attempt ended retryably: a new attempt
            req.attempt = self._attempts.get(rid, 0) + 1
        return await self.submit_request(req, rate_limits, limits=limits,
                                         traceparent=traceparent)

    async def pool_info(self, pool: str, tenant: str) -> PoolInfo | None:
        """The pool dispatcher's view of `tenant` (cached), or None if no dispatcher
        answers (requests can still be published: JetStream keeps them)."""
        key = (pool, tenant)
        now = asyncio.get_running_loop().time()
        hit = self._info.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]
        info: PoolInfo | None = None
        ask = encode(PoolInfoRequest(tenant=tenant))
        for retry_s in (*INFO_NO_RESPONDERS_RETRY_S, None):
            try:
                msg = await self.nc.request(self.subjects.info(pool), ask, timeout=1.0)
                info = decode_pool_info(msg.data)
            except nats.errors.NoRespondersError:
                # Right after a leader takeover "no responders" can come back for a
                # moment (seen in CI just after the new leader flushed its
                # subscriptions): ask again briefly before calling the pool unserved.
                if retry_s is not None:
                    await asyncio.sleep(retry_s)
                    continue
            except (nats.errors.TimeoutError, ProtocolError):
                pass
            break
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
                             limits: RequestLimits | None = None,
                             traceparent: str | None = None) -> RequestStream:
        """Check, admit and publish a prepared request (its reply_to is pointed at
        this client). `submit` builds one from a `RequestSpec` and lands here.

        With a `limiter` and `rate_limits`, the request and its estimated tokens are
        reserved first (refused with ``rate_limited`` and a retry hint when spent) and
        settled later from the usage stream; a refused publish gives them back.
        """
        try:
            if self.tenant is not None and req.tenant != self.tenant:
                raise ProtocolError(f"this client acts for tenant {self.tenant!r} only, not "
                                    f"{req.tenant!r}", ErrorCode.UNAUTHORIZED)
            req.reply_to = self.subjects.reply_subject(self.owner, req.tenant, req.request_id)
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
            return await self._publish(req, subject, traceparent_or_new(traceparent))
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

    async def _resume(self, stream: RequestStream, error: ErrorInfo) -> bool:
        return await resume_stream(self, stream, error)

    async def _await_attempt_end(self, stream: RequestStream, max_wait_s: float = 5.0) -> None:
        """Until the pool's dispatcher no longer runs the stream's current attempt
        (bounded): its continuation is then admitted as the next attempt."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max_wait_s
        while loop.time() < deadline:
            st = await self.request_status(stream.pool, stream.request_id, stream.tenant)
            if st is None or st.state not in (RequestState.QUEUED, RequestState.RUNNING):
                return
            await asyncio.sleep(0.05)

    async def _status_of_stored(self, req: InferenceRequest) -> RequestStatus | None:
        """The status of the copy JetStream kept when our publish was answered
        "duplicate". A copy stored moments ago (a publish flushed late after a failover)
        may not be ingested yet: asked again for a while, so "nobody knows it" is not
        taken for "ended" (a second attempt) or for another client's (`duplicate`)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + FAILOVER_RETRY_S
        while True:
            st = await self.request_status(req.pool, req.request_id, req.tenant)
            known = st is not None and st.state != RequestState.UNKNOWN
            if known or loop.time() >= deadline:
                return st
            await asyncio.sleep(0.25)

    async def _publish(self, req: InferenceRequest, subject: str,
                       traceparent: str) -> RequestStream:
        # Register before publishing, so no early chunk can miss its queue.
        stream = RequestStream(req.request_id, req.tenant, req.pool, self,
                               asyncio.Queue(maxsize=self.max_buffered_chunks),
                               attempt=req.attempt, traceparent=traceparent)
        stream._last_chunk_s = asyncio.get_running_loop().time()
        # Migration needs every output token id: always asked for, shown only if wanted.
        stream._wants_token_ids = req.return_token_ids
        req.return_token_ids = True
        stream._request = req
        stream._resumes_left = self.max_resumes
        ours = req.request_id in self._attempts
        self._streams[req.request_id] = stream
        try:
            # Bounded: every duplicate answer either attaches, fails or moves on.
            for _ in range(4):
                num_sends = 0

                def send():
                    nonlocal num_sends
                    num_sends += 1
                    return self.js.publish(subject, encode(req), headers={
                        "Nats-Msg-Id": dedupe_key(req.request_id, req.attempt),
                        # Lets the dispatcher answer even if the body arrives unreadable.
                        REPLY_HEADER: req.reply_to,
                        TRACEPARENT_HEADER: traceparent})

                ack = await guard_publish(self.nc, subject, send)
                self._remember(req.request_id, req.attempt)
                if not getattr(ack, "duplicate", False):
                    break
                if num_sends > 1:
                    # guard_publish sent this attempt again (its PubAck was lost: a
                    # leader election, a node cut off): the copy JetStream kept is our
                    # own, and its tokens come to this stream whatever the dispatcher
                    # says of it yet (it may not have ingested it, and "unknown" must
                    # not make it a second attempt that would run beside the first).
                    log.info("publish_duplicate_of_own_resend", request_id=req.request_id,
                             attempt=req.attempt)
                    break
                status = await self._status_of_stored(req)
                if status is not None and status.reply_to == req.reply_to:
                    ours = True  # our own earlier copy (e.g. flushed late by a failover)
                action, error = duplicate_action(status, req.attempt, ours)
                log.info("publish_duplicate", request_id=req.request_id,
                         attempt=req.attempt, action=str(action),
                         state=status.state if status else None)
                if action is Action.ATTACH:
                    break
                if action is Action.FAIL:
                    assert error is not None
                    raise RequestError.from_info(error)
                # REPUBLISH: deduped but not live; a fresh attempt is served anew.
                req.attempt = max(req.attempt, status.attempt if status else 0) + 1
                stream.attempt = req.attempt
                ours = True
        except APIError as exc:
            self._forget(req.request_id)
            raise _publish_error(exc) from None
        except RequestError:
            self._forget(req.request_id)
            raise
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
