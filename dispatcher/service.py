"""The dispatcher's asyncio shell: all I/O around the pure scheduler core.

Message lifecycle (DESIGN.md section 4). A request's JetStream message is fetched,
decoded and checked, then *held un-acked* while the request waits (touched with
``in_progress`` well inside ``ack_wait``). It is acked once a worker reports
``Started`` (so started work is never replayed), or terminated when the request is
refused, expires or is cancelled. If this process dies, JetStream redelivers every
held message to the next dispatcher after ``ack_wait``. `dispatcher.held` holds them and
decides acks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from dataclasses import dataclass, field

import nats
import structlog
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from dispatcher import metrics
from dispatcher.config import DispatcherSettings
from dispatcher.held import Held, HeldMessages
from dispatcher.scheduler.config import SchedulerConfig
from dispatcher.scheduler.core import Scheduler
from dispatcher.scheduler.types import ActualUsage, Dropped, QueuedRequest, Verdict
from dispatcher.workers import WorkerRegistry
from fairlane.protocol import (
    ErrorCode,
    ErrorInfo,
    Finished,
    Heartbeat,
    PoolInfo,
    ProtocolError,
    PullRequest,
    Requeue,
    Started,
    TokenChunk,
    WorkBatch,
    WorkItem,
    decode_cancel,
    decode_event,
    decode_pool_info_request,
    decode_pull,
    decode_request,
    encode,
    peek_reply_fields,
)
from fairlane.runtime import mono_ms, now_ms
from fairlane.streams import ensure_streams
from fairlane.subjects import REPLY_HEADER, Subjects, check_reply_subject
from fairlane.tenants import TenantsWatcher
from fairlane.validation import RequestLimits, check_request, estimate_prompt_tokens

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class _Pull:
    pull: PullRequest
    reply: str
    expires_ms: float


@dataclass
class Dispatcher:
    settings: DispatcherSettings
    scheduler_config: SchedulerConfig | None = None
    nc: nats.NATS | None = None
    # The tenants file, re-read on change: tenants, weights and quotas apply live.
    tenants: TenantsWatcher | None = None
    subjects: Subjects = field(init=False)
    scheduler: Scheduler = field(init=False)

    def __post_init__(self) -> None:
        s = self.settings
        self.subjects = Subjects(s.prefix)
        if self.scheduler_config is None and self.tenants is not None:
            self.scheduler_config = self.tenants.current.scheduler_config(s.pool)
        cfg = self.scheduler_config or SchedulerConfig(policy="drr")
        if s.policy:
            cfg.policy = s.policy
        self.scheduler = Scheduler(cfg)  # ValueError on an unknown policy: fail at start
        self.limits = self._limits()
        self._reload_every_ms = 2_000.0
        self._next_reload_ms = 0.0
        # After a (re)start, messages JetStream redelivers may belong to requests a
        # worker already holds. They wait one worker timeout, long enough for every
        # live worker to heartbeat its in-flight ids, before they can be dispatched.
        self._grace_until_ms = 0.0
        self._grace: list[Msg] = []
        self._reported: dict[str, str] = {}  # request id -> worker, from heartbeats
        self.workers = WorkerRegistry(s.worker_timeout_ms)
        self._held = HeldMessages(s.ack_wait_s)
        self._pulls: deque[_Pull] = deque()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._subs: list = []
        self._stopping = False
        self.ready = asyncio.Event()

    def _limits(self) -> RequestLimits:
        s = self.settings
        base = RequestLimits(max_tokens=s.max_tokens, max_prompt_chars=s.max_prompt_chars)
        if self.tenants is None:
            return base
        try:
            return self.tenants.current.request_limits(s.pool, base)
        except KeyError:
            return base

    # --- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        s = self.settings
        if self.nc is None:
            self.nc = await nats.connect(
                s.nats_url, name=f"fairlane-dispatcher-{s.pool}", max_reconnect_attempts=-1
            )
        self.js = self.nc.jetstream()
        self._grace_until_ms = mono_ms() + s.worker_timeout_ms
        await ensure_streams(self.js, self.subjects)
        for tier in self.scheduler.config.tiers:
            sub = await self._consumer(tier.name)
            self._subs.append(sub)
            self._tasks.append(asyncio.create_task(self._fetch_loop(tier.name, sub)))
        self._subs.append(await self.nc.subscribe(
            self.subjects.work(s.pool), queue="dispatchers", cb=self._on_pull))
        self._subs.append(await self.nc.subscribe(self.subjects.events(s.pool), cb=self._on_event))
        self._subs.append(await self.nc.subscribe(self.subjects.cancel(s.pool), cb=self._on_cancel))
        self._subs.append(await self.nc.subscribe(
            self.subjects.info(s.pool), queue="dispatchers", cb=self._on_info))
        self._tasks.append(asyncio.create_task(self._match_loop()))
        self._tasks.append(asyncio.create_task(self._housekeeping_loop()))
        self.ready.set()
        log.info("dispatcher_started", pool=s.pool, policy=self.scheduler.config.policy,
                 tiers=[t.name for t in self.scheduler.config.tiers])

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

    async def stop(self) -> None:
        """Stop fetching and answering; held messages stay un-acked for the next
        dispatcher (they come back after ack_wait, or at once when nak'ed here)."""
        self._stopping = True
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        for p in self._pulls:
            with contextlib.suppress(Exception):
                await self.nc.publish(p.reply, encode(WorkBatch()))
        # Hand queued (not dispatched) work straight back to JetStream: nak = redeliver now.
        for req in list(self.scheduler.queued()):
            held = self._held.get(req.request_id)
            if held is not None:
                await self._held.settle(held, "nak")
        if self.nc is not None:
            # Not drain(): naks may already be redelivered into the (closed) pull
            # subscriptions' inboxes, and drain would wait on them for its timeout.
            with contextlib.suppress(Exception):
                await self.nc.flush(timeout=2)
            await self.nc.close()
        log.info("dispatcher_stopped")

    # --- ingest ------------------------------------------------------------------------

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
                msgs = await sub.fetch(1, timeout=1.0)
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
            for msg in msgs:
                await self._ingest(msg)
            self._wake.set()

    async def _ingest(self, msg: Msg) -> None:
        metrics.INGESTED.inc()
        if self._grace_until_ms and mono_ms() < self._grace_until_ms and _redelivered(msg):
            self._grace.append(msg)
            return
        try:
            req = decode_request(msg.data)
            pool, tier, tenant = Subjects.parse_request(msg.subject)
            if (req.pool, req.tier, req.tenant) != (pool, tier, tenant):
                raise ProtocolError(
                    f"body says {req.pool}/{req.tier}/{req.tenant} but subject is {msg.subject}",
                    ErrorCode.INVALID_REQUEST,
                )
            check_request(req, self.limits)
            tcfg = self.scheduler.tenant_config(req.tenant)
            if tcfg is not None and tcfg.tier != req.tier:
                # The subject's tier is the client's claim; the tenants file decides.
                raise ProtocolError(
                    f"tenant {req.tenant!r} is in tier {tcfg.tier!r}, not {req.tier!r}",
                    ErrorCode.INVALID_REQUEST,
                )
        except ProtocolError as exc:
            rid, reply = peek_reply_fields(msg.data)
            if reply is None and msg.headers:
                reply = msg.headers.get(REPLY_HEADER)
            if reply is not None:
                try:
                    check_reply_subject(reply)
                except ProtocolError:
                    reply = None
            log.warning("request_refused", subject=msg.subject, request_id=rid,
                        code=exc.code.value, error=exc.message)
            metrics.REJECTED.labels(reason=exc.code.value).inc()
            if reply:
                await self._send_error(reply, rid or "", ErrorInfo.of(exc.code, exc.message))
            await _term(msg)
            return

        known = self._held.get(req.request_id)
        if known is not None or self.scheduler.is_known(req.request_id):
            # A redelivery of a request we already hold: keep the newest handle.
            if known is not None:
                self._held.redelivered(known, msg, mono_ms())
            return

        now = mono_ms()
        deadline = None
        if req.deadline_ms is not None:
            deadline = now + (req.deadline_ms - now_ms())
        q = QueuedRequest(
            request_id=req.request_id, tenant=req.tenant, tier=req.tier,
            prompt_tokens=estimate_prompt_tokens(req), max_output_tokens=req.max_tokens,
            expected_output_tokens=req.expected_output_tokens or req.max_tokens,
            priority=req.priority, arrival_ms=now, deadline_ms=deadline,
            ttft_budget_ms=req.ttft_budget_ms,
        )
        held = Held(msg, req, now)
        q.payload = held
        verdict = self.scheduler.submit(q, now)
        if verdict.accepted and req.request_id in self._reported:
            # A worker already runs it (we restarted): in flight, not queued.
            worker_id = self._reported[req.request_id]
            self.scheduler.adopt(req.request_id, now)
            self.workers.assign(req.request_id, worker_id, now)
            log.info("request_adopted", request_id=req.request_id, worker_id=worker_id)
        if verdict.verdict is Verdict.REJECTED:
            assert verdict.code is not None
            metrics.REJECTED.labels(reason=verdict.code.value).inc()
            log.info("request_rejected", request_id=req.request_id, tenant=req.tenant,
                     code=verdict.code.value, reason=verdict.message)
            await self._send_error(req.reply_to, req.request_id,
                                   ErrorInfo.of(verdict.code, verdict.message, verdict.retry_after_ms))
            await _term(msg)
            return
        self._held.hold(held)

    # --- pulls: matching queued work to workers with room ------------------------------

    async def _on_pull(self, msg: Msg) -> None:
        try:
            pull = decode_pull(msg.data)
        except ProtocolError as exc:
            log.warning("bad_pull", error=exc.message)
            if msg.reply:
                await self.nc.publish(msg.reply, encode(WorkBatch()))
            return
        now = mono_ms()
        w = self.workers.seen(pull.worker_id, now)
        w.kv_tokens_total = max(w.kv_tokens_total, pull.free_kv_tokens)
        self._pulls.append(_Pull(pull, msg.reply, now + pull.wait_ms))
        self._wake.set()

    async def _match_loop(self) -> None:
        """Serve waiting pulls in arrival order whenever work or a pull arrives."""
        while True:
            timeout = None
            if self._pulls:
                timeout = max(0.0, min(p.expires_ms for p in self._pulls) - mono_ms()) / 1000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
            self._wake.clear()
            await self._serve_pulls()

    async def _serve_pulls(self) -> None:
        now = mono_ms()
        pending: deque[_Pull] = deque()
        while self._pulls:
            p = self._pulls.popleft()
            alive = p.pull.worker_id in self.workers.workers  # not declared dead since
            batch = self._select_for(p.pull, now) if alive and self.scheduler.num_queued else []
            if batch or now >= p.expires_ms or not alive:
                await self.nc.publish(p.reply, encode(WorkBatch(items=batch)))
            else:
                pending.append(p)
        self._pulls = pending

    def _select_for(self, pull: PullRequest, now: float) -> list[WorkItem]:
        free_kv = pull.free_kv_tokens if pull.free_kv_tokens > 0 else None
        items: list[WorkItem] = []
        epoch = now_ms()
        for d in self.scheduler.select(pull.max_items, now, free_kv):
            held: Held = d.request.payload
            queue_ms = int(now - d.request.arrival_ms)
            metrics.QUEUE_WAIT.labels(tier=d.request.tier).observe(queue_ms / 1000)
            metrics.DISPATCHED_COST.labels(tenant=d.request.tenant, tier=d.request.tier).inc(d.cost)
            self.workers.assign(d.request.request_id, pull.worker_id, now)
            items.append(WorkItem(
                request=held.request, engine_priority=d.engine_priority,
                dispatched_ms=epoch, queue_ms=queue_ms, cache_salt=held.request.tenant,
                ack_subject=held.msg.reply or None,
            ))
        return items

    # --- events from workers -----------------------------------------------------------

    async def _on_event(self, msg: Msg) -> None:
        try:
            ev = decode_event(msg.data)
        except ProtocolError as exc:
            log.warning("bad_event", error=exc.message)
            return
        now = mono_ms()
        if isinstance(ev, Heartbeat):
            await self._on_heartbeat(ev, now)
        elif isinstance(ev, Started):
            self.workers.seen(ev.worker_id, now)
            if self.scheduler.on_started(ev.request_id, now):
                held = self._held.get(ev.request_id)
                if held is not None:
                    await self._held.settle(held, "ack")
        elif isinstance(ev, Finished):
            self.workers.seen(ev.worker_id, now)
            await self._finish(ev.request_id, ev, now)
        elif isinstance(ev, Requeue):
            self.workers.unassign(ev.request_id)
            if self.scheduler.requeue(ev.request_id, now):
                log.info("request_requeued", request_id=ev.request_id, worker_id=ev.worker_id,
                         reason=ev.reason)
                self._wake.set()

    async def _finish(self, request_id: str, ev: Finished | None, now: float) -> None:
        self.workers.unassign(request_id)
        usage = None
        if ev is not None and ev.usage is not None:
            u = ev.usage
            usage = ActualUsage(u.prompt_tokens, u.completion_tokens, u.kv_token_seconds, u.e2e_ms)
        self.scheduler.on_finished(request_id, usage, now)
        held = self._held.get(request_id)
        if held is not None:
            # Finished without Started: it failed before its first token (e.g. prompt
            # too long) and the client has its error. Done either way: never replay.
            await self._held.settle(held, "ack")

    async def _on_heartbeat(self, hb: Heartbeat, now: float) -> None:
        w = self.workers.seen(hb.worker_id, now)
        w.num_running, w.num_waiting = hb.load.num_running, hb.load.num_waiting
        w.kv_tokens_used, w.kv_tokens_total = hb.load.kv_tokens_used, hb.load.kv_tokens_total
        if self._grace_until_ms:
            for rid in hb.in_flight_ids:
                self._reported[rid] = hb.worker_id
        for rid in hb.in_flight_ids:
            # After a dispatcher restart JetStream redelivers requests that a worker
            # already holds: adopt them as in flight instead of dispatching them again.
            if self.scheduler.adopt(rid, now):
                self.workers.assign(rid, hb.worker_id, now)
                log.info("request_adopted", request_id=rid, worker_id=hb.worker_id)
        missing = self.workers.heartbeat(hb.worker_id, hb.in_flight_ids, now,
                                         hb.interval_ms, hb.draining)
        for rid in missing:
            # Reconciliation: the worker does not have it. Either its WorkBatch reply
            # was lost (never started: requeue) or its Finished was (release quota).
            if self.scheduler.is_started(rid):
                log.warning("reconciled_finished", request_id=rid, worker_id=hb.worker_id)
                await self._finish(rid, None, now)
            else:
                self.workers.unassign(rid)
                if self.scheduler.requeue(rid, now):
                    log.warning("reconciled_requeue", request_id=rid, worker_id=hb.worker_id)
                    self._wake.set()

    # --- cancel ------------------------------------------------------------------------

    async def _on_cancel(self, msg: Msg) -> None:
        try:
            cancel = decode_cancel(msg.data)
        except ProtocolError as exc:
            log.warning("bad_cancel", error=exc.message)
            return
        req = self.scheduler.cancel(cancel.request_id)
        if req is None:
            return  # running (the worker aborts it) or unknown
        held = self._held.get(cancel.request_id)
        log.info("request_cancelled", request_id=cancel.request_id, reason=cancel.reason)
        if held is not None:
            await self._send_error(held.request.reply_to, cancel.request_id,
                                   ErrorInfo.of(ErrorCode.CANCELLED, f"cancelled: {cancel.reason}"))
            await self._held.settle(held, "term")

    async def _on_info(self, msg: Msg) -> None:
        """Answer a producer's question: which tier is this tenant in, what limits?"""
        if not msg.reply:
            return
        try:
            tenant = decode_pool_info_request(msg.data).tenant
        except ProtocolError as exc:
            log.warning("bad_info_request", error=exc.message)
            tenant = ""
        tcfg = self.scheduler.tenant_config(tenant) if tenant else None
        info = PoolInfo(
            pool=self.settings.pool, tiers=[t.name for t in self.scheduler.config.tiers],
            tenant=tenant, tier=tcfg.tier if tcfg else None,
            max_tokens=self.limits.max_tokens, max_prompt_tokens=self.limits.max_prompt_tokens,
            max_prompt_chars=self.limits.max_prompt_chars,
        )
        await self.nc.publish(msg.reply, encode(info))

    # --- housekeeping ------------------------------------------------------------------

    async def _housekeeping_loop(self) -> None:
        period_s = self.settings.housekeeping_ms / 1000
        while True:
            await asyncio.sleep(period_s)
            try:
                await self._housekeeping(mono_ms())
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("housekeeping_failed")

    async def _end_grace(self, now: float) -> None:
        self._grace_until_ms = 0.0
        held_back, self._grace = self._grace, []
        for msg in held_back:
            await self._ingest(msg)
        self._reported.clear()
        if held_back:
            log.info("redeliveries_released", num_messages=len(held_back))
            self._wake.set()

    async def _housekeeping(self, now: float) -> None:
        if self._grace_until_ms and now >= self._grace_until_ms:
            await self._end_grace(now)
        for dropped in self.scheduler.expire(now):
            await self._drop(dropped)
        for dropped in self.scheduler.shed(now):
            await self._drop(dropped)
        for w in self.workers.dead_workers(now):
            await self._worker_lost(w.worker_id, w.request_ids, now)
        await self._held.keep_alive(now)
        if self.tenants is not None and now >= self._next_reload_ms:
            self._next_reload_ms = now + self._reload_every_ms
            self._reload_tenants()
        metrics.observe_scheduler(self.scheduler, now)

    async def _drop(self, dropped: Dropped) -> None:
        """A queued request the core removed (expired, shed): tell the client, term it."""
        metrics.REJECTED.labels(reason=dropped.code.value).inc()
        held = self._held.get(dropped.request.request_id)
        if held is not None:
            await self._send_error(held.request.reply_to, dropped.request.request_id,
                                   ErrorInfo.of(dropped.code, dropped.message,
                                                dropped.retry_after_ms))
            await self._held.settle(held, "term")

    def _reload_tenants(self) -> None:
        try:
            changed = self.tenants.maybe_reload()
        except Exception as exc:  # the watcher keeps the old config; never stop serving
            log.warning("tenants_reload_failed", error=str(exc))
            return
        if not changed:
            return
        try:
            self.scheduler.update_config(self.tenants.current.scheduler_config(self.settings.pool))
            self.limits = self._limits()
            log.info("tenants_applied", pool=self.settings.pool)
        except (KeyError, ValueError) as exc:
            log.error("tenants_not_applied", error=str(exc), hint="restart the dispatcher")

    async def _worker_lost(self, worker_id: str, request_ids: set[str], now: float) -> None:
        log.warning("worker_lost", worker_id=worker_id, num_requests=len(request_ids))
        requeued = 0
        for rid in request_ids:
            if self.scheduler.requeue(rid, now):
                requeued += 1
                continue
            req = self.scheduler.in_flight_request(rid)
            self.scheduler.on_finished(rid, None, now)
            if req is not None:
                held: Held = req.payload
                await self._send_error(
                    held.request.reply_to, rid,
                    ErrorInfo.of(ErrorCode.WORKER_LOST,
                                 f"worker {worker_id} stopped responding; retry the request"),
                )
                await self._held.settle(held, "ack")
        if requeued:
            self._wake.set()

    async def _send_error(self, reply_to: str, request_id: str, error: ErrorInfo) -> None:
        chunk = TokenChunk(request_id=request_id, seq=0, error=error)
        try:
            await self.nc.publish(reply_to, encode(chunk))
        except Exception as exc:  # a bad reply subject must not stop the dispatcher
            log.warning("error_reply_failed", request_id=request_id, reply_to=reply_to,
                        error=str(exc))


def _num_pending(msg: Msg) -> int:
    try:
        return int(msg.metadata.num_pending)
    except Exception:
        return 0


def _redelivered(msg: Msg) -> bool:
    try:
        return msg.metadata.num_delivered > 1
    except Exception:  # not a JetStream message (tests feeding _ingest directly)
        return False


async def _term(msg: Msg) -> None:
    with contextlib.suppress(Exception):
        await msg.term()
