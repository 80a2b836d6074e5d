"""The dispatcher's ingest: JetStream consumers, fetching, decoding and checking.

A request's JetStream message is fetched, decoded and checked here, then handed to
the pure core (`PoolCore.submit`), whose actions the shell executes. Split from
`dispatcher.service` (`Dispatcher` mixes it in) for size.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

import nats
import structlog
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from dispatcher import metrics
from dispatcher.held import Held
from dispatcher.scheduler.types import QueuedRequest
from fairlane.protocol import (
    ErrorCode,
    ErrorInfo,
    ProtocolError,
    decode_request,
)
from fairlane.runtime import mono_ms, now_ms
from fairlane.subjects import Subjects, reply_of
from fairlane.trace import TRACEPARENT_HEADER, parse_traceparent
from fairlane.validation import check_request, estimate_prompt_tokens

if TYPE_CHECKING:
    from dispatcher.config import DispatcherSettings
    from dispatcher.held import HeldMessages
    from dispatcher.scheduler.pool import PoolCore

log = structlog.get_logger("dispatcher.service")

# A fetch's pull request stays open at the server this long: short, because one still
# open when the dispatcher stops delivers into its inbox after it stopped reading, and
# the stop waits that long to hand such late deliveries back (`nak_late_deliveries`).
FETCH_WAIT_S = 0.25


class Ingest:
    """Mixin of `dispatcher.service.Dispatcher`: consuming FL_REQUESTS."""

    settings: DispatcherSettings
    subjects: Subjects
    core: PoolCore
    _held: HeldMessages
    _wake: asyncio.Event
    js: Any
    nc: Any
    limits: Any

    async def _consumer(self, tier: str):
        """One durable pull consumer per tier: a free-tier backlog never blocks paid
        fetches, because each tier's loop fetches on its own."""
        s = self.settings
        name = f"disp_{s.pool}_{tier}"
        cfg = ConsumerConfig(
            durable_name=name, name=name,
            filter_subject=self.subjects.requests_tier(s.pool, tier),
            ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL,
            ack_wait=s.ack_wait_s, max_ack_pending=s.max_held_messages, max_deliver=-1,
            max_waiting=16,
        )
        stream = self.subjects.requests_stream
        await self.js.add_consumer(stream, config=cfg)
        return await self.js.pull_subscribe_bind(durable=name, stream=stream)


    async def _fetch_loop(self, tier: str, sub) -> None:
        s = self.settings
        while True:
            # Backpressure: past the bound, leave messages in JetStream.
            room = s.max_held_messages - len(self._held)
            if room <= 0:
                await asyncio.sleep(0.05)
                continue
            try:
                # Wait for the first message alone: a batched fetch that got one message
                # keeps waiting for the rest of its batch until its deadline, which
                # would hold a lone request for up to the whole timeout.
                msgs = await sub.fetch(1, timeout=FETCH_WAIT_S)
                # Then take what is already waiting, asking for exactly that many so
                # the fetch returns as soon as they arrive.
                pending = _num_pending(msgs[0])
                if room > 1 and pending > 0:
                    with contextlib.suppress(nats.errors.TimeoutError, TimeoutError):
                        msgs += await sub.fetch(min(s.fetch_batch, room - 1, pending),
                                                timeout=0.05)
            except (nats.errors.TimeoutError, TimeoutError):
                # nats-py raises either on an idle fetch; neither is a failure, and
                # backing off here would delay the next request by the back-off.
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # connection blips: retry, never die
                log.warning("fetch_failed", tier=tier, error=repr(exc))
                await asyncio.sleep(0.2)
                continue
            done = 0
            try:
                for msg in msgs:
                    await self._ingest(msg)
                    done += 1
            except asyncio.CancelledError:
                # Stopping mid-batch: fetched but not yet held, these would wait out
                # ack_wait; hand them straight back (a held one is nak'ed twice: harmless).
                for msg in msgs[done:]:
                    with contextlib.suppress(Exception):
                        await msg.nak()
                raise
            self._wake.set()

    async def nak_late_deliveries(self, subs: list) -> int:
        """Stopping: a pull request still open at the server (up to FETCH_WAIT_S) may
        deliver after the fetch loops stopped; nak what arrives, or it would wait out
        ack_wait before the next leader gets it. No new pull request is made here (one
        could deliver after we stopped looking, the race this closes): wait until the
        open ones expired, then nak what they delivered into each subscription's
        queue (nats-py keeps it unread in the underlying subscription)."""
        await asyncio.sleep(FETCH_WAIT_S + 0.1)
        n = 0
        for sub in subs:
            queue = getattr(getattr(sub, "_sub", None), "_pending_queue", None)
            while queue is not None and not queue.empty():
                msg = queue.get_nowait()
                if nats.js.JetStreamContext.is_status_msg(msg):
                    continue  # a 408/404 ending a pull request, not a message
                with contextlib.suppress(Exception):
                    await msg.nak()
                n += 1
        return n

    def reply_scoped(self) -> bool:
        """Whether reply subjects must lie in their tenant's inboxes (`reply_scope`;
        "auto": when the broker authenticates clients, so tenants are told apart)."""
        mode = self.settings.reply_scope
        if mode == "auto":
            info = getattr(self.nc, "_server_info", None) or {}
            return bool(self.settings.nats_user or info.get("auth_required"))
        return mode == "tenant"

    def _reply_allowed(self, reply: str, tenant: str | None) -> bool:
        """With auth on a tenant could otherwise aim its request's tokens, or our
        errors about it, at another tenant's inbox (DESIGN.md section 8, Trust)."""
        if not self.reply_scoped():
            return True
        return tenant is not None and self.subjects.reply_in_tenant_inbox(reply, tenant)

    def cancel_allowed(self, subject: str, request_id: str) -> bool:
        """A cancel published as a tenant (``<prefix>.cancel.<pool>.<tenant>``, the
        broker checked that tenant) ends only that tenant's requests; the tenant-less
        subject is for services and producers from before per-tenant auth."""
        tenant = self.subjects.cancel_tenant(subject)
        if tenant is None:
            return True
        # Deferred requests are cancellable too, and live_request does not see them.
        req = self.core.live_request(request_id) or self.core._deferred.get(request_id)
        if req is None or req.tenant == tenant:
            return True
        log.warning("cancel_refused", request_id=request_id, as_tenant=tenant,
                    owner=req.tenant)
        return False

    async def _duplicate_of_live(self, msg: Msg, req: Any, original: Any) -> None:
        """The same request published again (another message) while it is queued or
        running: the original's stream already goes to its reply subject, so the same
        reply subject just attaches; another one is told it is a duplicate. Either way
        this message leaves the stream now instead of waiting for ack_wait."""
        if req.reply_to != original.reply_to:
            state = "running" if self.core.scheduler.in_flight_request(req.request_id) else "queued"
            await self._send_error(req.reply_to, req.request_id, ErrorInfo.of(
                ErrorCode.DUPLICATE, f"request {req.request_id} is already {state} (attempt "
                f"{original.attempt}); its tokens go to the first submitter's reply subject"))
        log.info("duplicate_of_live_request", request_id=req.request_id,
                 same_reply=req.reply_to == original.reply_to)
        await _term(msg)

    async def _ingest(self, msg: Msg) -> None:
        metrics.INGESTED.inc()
        # Read before the message is held (holding drops its headers); an invalid one
        # (a tenant may publish its own requests) is dropped, never an error.
        traceparent = parse_traceparent((msg.headers or {}).get(TRACEPARENT_HEADER)) or ""
        try:
            req = decode_request(msg.data)
            pool, tier, tenant = Subjects.parse_request(msg.subject)
            if (req.pool, req.tier, req.tenant) != (pool, tier, tenant):
                raise ProtocolError(
                    f"body says {req.pool}/{req.tier}/{req.tenant} but subject is {msg.subject}",
                    ErrorCode.INVALID_REQUEST,
                )
            check_request(req, self.limits)
            if not self._reply_allowed(req.reply_to, tenant):
                raise ProtocolError(
                    f"reply subject {req.reply_to!r} is outside tenant {tenant!r}'s inboxes "
                    f"({self.subjects.tenant_inboxes(tenant)})", ErrorCode.INVALID_REQUEST)
        except ProtocolError as exc:
            rid, reply = reply_of(msg.data, msg.headers)
            if reply and not self._reply_allowed(reply, _subject_tenant(msg.subject)):
                # Never aim even an error at another tenant's inbox: drop it, say why here.
                log.warning("request_reply_outside_inbox", subject=msg.subject,
                            request_id=rid, reply_to=reply)
                reply = None
            log.warning("request_refused", subject=msg.subject, request_id=rid,
                        code=exc.code.value, error=exc.message, traceparent=traceparent or None)
            metrics.rejected(_subject_tenant(msg.subject), exc.code.value)
            if reply:
                await self._send_error(reply, rid or "", exc.info())
            await _term(msg)
            return

        known = self._held.get(req.request_id)
        if known is not None and _redelivered(msg):
            # A redelivery of a request we already hold: keep the newest handle.
            self._held.redelivered(known, msg, mono_ms())
            return
        live = self.core.live_request(req.request_id)
        if live is not None and req.attempt <= live.attempt:
            await self._duplicate_of_live(msg, req, live.payload.request)
            return
        log.debug("request_received", request_id=req.request_id, tenant=tenant, tier=tier,
                  attempt=req.attempt, traceparent=traceparent or None)

        now = mono_ms()
        deadline = None
        if req.deadline_ms is not None:
            deadline = now + (req.deadline_ms - now_ms())
        # A continuation (resumed after its worker was lost) is charged for what is
        # left to generate, not again for what its client already has.
        done = len(req.resume.generated_token_ids) if req.resume is not None else 0
        expected = req.expected_output_tokens or req.sampling.max_tokens
        q = QueuedRequest(
            request_id=req.request_id, tenant=req.tenant, tier=req.tier,
            prompt_tokens=estimate_prompt_tokens(req) + done,
            max_output_tokens=max(1, req.sampling.max_tokens - done),
            expected_output_tokens=max(1, expected - done),
            priority=req.priority, arrival_ms=now, deadline_ms=deadline,
            ttft_budget_ms=req.ttft_budget_ms, attempt=req.attempt,
        )
        q.payload = Held(msg, req, now, traceparent=traceparent)
        await self._apply(self.core.submit(q, now, redelivered=_redelivered(msg)))


def _subject_tenant(subject: str) -> str | None:
    try:
        return Subjects.parse_request(subject)[2]
    except ProtocolError:
        return None


def _num_pending(msg: Msg) -> int:
    try:
        return int(msg.metadata.num_pending)
    except Exception:
        return 0


def _redelivered(msg: Msg) -> bool:
    return num_delivered(msg.reply) > 1


# A JetStream ack subject: $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer
# seq>.<ns>.<pending> (9 tokens), or with <domain>.<account hash> after ACK (11, or 12
# with a trailing token); nats-py's `Msg.Metadata` reads the same layouts.
_V1_TOKENS, _V1_DELIVERED, _V2_MIN_TOKENS, _V2_DELIVERED = 9, 4, 11, 6


def num_delivered(reply: str | None) -> int:
    """How many times JetStream has delivered the message with this ack subject; 0 if
    it is not one (tests feeding `_ingest` directly). One token, where nats-py's
    `msg.metadata` parses all of them, a timestamp included (~9 µs a message)."""
    if not reply or not reply.startswith("$JS.ACK."):
        return 0
    tokens = reply.split(".")
    n = len(tokens)
    index = _V1_DELIVERED if n == _V1_TOKENS else _V2_DELIVERED if n >= _V2_MIN_TOKENS else -1
    try:
        return int(tokens[index]) if index >= 0 else 0
    except ValueError:
        return 0


async def _term(msg: Msg) -> None:
    with contextlib.suppress(Exception):
        await msg.term()
