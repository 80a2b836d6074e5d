"""The dispatcher's asyncio shell: all I/O around the pure scheduler core.

Message lifecycle (DESIGN.md section 4). A request's JetStream message is fetched,
decoded and checked, then *held un-acked* while the request waits (touched with
``in_progress`` well inside ``ack_wait``). It is acked once a worker reports
``Started`` (so started work is never replayed), or terminated when the request is
refused, expires or is cancelled. If this process dies, JetStream redelivers every
held message to the next dispatcher after ``ack_wait``. `dispatcher.held` holds them and
decides acks; `dispatcher.ingest` fetches, decodes and checks them.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque
from dataclasses import dataclass, field
from functools import partial

import msgspec
import nats
import structlog
from nats.aio.msg import Msg

from dispatcher import metrics
from dispatcher.config import DispatcherSettings
from dispatcher.held import Held, HeldMessages, usage_of, work_item
from dispatcher.ingest import Ingest
from dispatcher.janitor import Janitor
from dispatcher.leader import LeaderLease, pool_lease
from dispatcher.matching import Matching, WaitingPull
from dispatcher.queries import answer_info, answer_status
from dispatcher.scheduler import actions as act
from dispatcher.scheduler.core import Scheduler
from dispatcher.scheduler.pool import PoolCore
from dispatcher.stats_publisher import publish_stats
from fairlane.looplag import watch_loop_lag
from fairlane.natsconn import connect_options
from fairlane.poolconfig import SchedulerConfig, check_policy
from fairlane.protocol import (
    ErrorInfo,
    Finished,
    Heartbeat,
    HeartbeatAck,
    Preempt,
    Preempted,
    ProtocolError,
    Requeue,
    Started,
    TokenChunk,
    WorkBatch,
    decode_cancel,
    decode_event,
    encode,
)
from fairlane.runtime import cancel_and_wait, log_nats_error, mono_ms, now_ms
from fairlane.streams import ensure_streams
from fairlane.subjects import Subjects
from fairlane.tenants import TenantsWatcher, resolve_pool_config
from fairlane.validation import RequestLimits

log = structlog.get_logger(__name__)


@dataclass
class Dispatcher(Ingest, Matching):
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
        if self.scheduler_config is None:
            # The same resolution (file + pool + --policy) runs on every reload.
            self.scheduler_config = resolve_pool_config(
                self.tenants.current if self.tenants is not None else None, s.pool,
                policy_override=s.policy or None)
        elif s.policy:
            self.scheduler_config.policy = check_policy(s.policy)
        self.scheduler = Scheduler(self.scheduler_config)
        self.limits = self._limits()
        self._reload_every_ms = 2_000.0
        self._next_reload_ms = 0.0
        # Every recovery decision (worker loss, reconciliation, restart grace,
        # adoption) is the pure core's; this shell executes its actions (`_apply`).
        self.core = PoolCore(self.scheduler, s.worker_timeout_ms)
        self.core.tenant_idle_ms = s.tenant_idle_s * 1000
        metrics.configure(s.metrics_max_tenants, s.tenant_idle_s)
        self.workers = self.core.workers
        self._held = HeldMessages(s.ack_wait_s)
        self._pulls: deque[WaitingPull] = deque()
        self._pull_of: dict[str, WaitingPull] = {}
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._checks: set[asyncio.Task] = set()  # CheckStarted look-ups in progress
        self._pull_subs: list = []  # one JetStream pull subscription per tier
        self._subs: list = []
        self._stopping = False
        self.ready = asyncio.Event()
        # Leader lease (dispatcher/leader.py); `epoch` stamps WorkBatch and heartbeat acks.
        self.epoch = 0
        self.lease: LeaderLease | None = None
        self.lease_lost = asyncio.Event()
        self._cut_off = False  # NATS unreachable at the last housekeeping pass
        self._preempted_at: dict[str, float] = {}  # request id -> when it was handed back

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
                **connect_options(s), name=f"fairlane-dispatcher-{s.pool}",
                max_reconnect_attempts=-1, error_cb=log_nats_error,
            )
        self.js = self.nc.jetstream()
        # A cluster may still be electing its JetStream leader: wait, don't exit.
        await ensure_streams(self.js, self.subjects, s, patience_s=math.inf)
        # A standby waits here: no consumers, no pull/info answers until it leads.
        self.lease = pool_lease(self.js, s.prefix, s.pool, s.leader_lease_ttl_s, self._fenced,
                                replicas=s.stream_replicas or 1)
        self.epoch = await self.lease.acquire()
        if not self.lease.predecessor_released:
            # After a crash, redeliveries may be running on workers already: wait one
            # worker timeout for their heartbeats before dispatching them. A graceful
            # predecessor handed back only queued requests: serve them at once (a
            # redelivery a worker does run is still adopted from its heartbeats).
            self.core.begin_grace(mono_ms())
        else:
            log.info("graceful_takeover", pool=s.pool, epoch=self.epoch)
        for tier in self.scheduler.config.tiers:
            sub = await self._consumer(tier.name)
            self._subs.append(sub)
            self._pull_subs.append(sub)
            self._tasks.append(asyncio.create_task(self._fetch_loop(tier.name, sub)))
        self._subs.append(await self.nc.subscribe(
            self.subjects.work(s.pool), queue="dispatchers", cb=self._on_pull))
        self._subs.append(await self.nc.subscribe(self.subjects.events(s.pool), cb=self._on_event))
        for subject in self.subjects.cancel_subscriptions(s.pool):
            self._subs.append(await self.nc.subscribe(subject, cb=self._on_cancel))
        self._subs.append(await self.nc.subscribe(
            self.subjects.info(s.pool), queue="dispatchers", cb=partial(answer_info, self)))
        self._subs.append(await self.nc.subscribe(
            self.subjects.status(s.pool), queue="dispatchers", cb=partial(answer_status, self)))
        self._tasks.append(asyncio.create_task(self._match_loop()))
        self._tasks.append(asyncio.create_task(self._housekeeping_loop()))
        self._tasks.append(asyncio.create_task(publish_stats(self)))  # fl.stats.<pool>
        self.janitor = Janitor(
            self.js, self.subjects, s.pool, lambda: [t.name for t in self.scheduler.config.tiers],
            self.nc.publish, stranded_after_s=s.stranded_after_s,
            reply_allowed=self._reply_allowed)
        self._tasks.append(asyncio.create_task(self._janitor_loop()))
        self._tasks.append(asyncio.create_task(
            watch_loop_lag(metrics.LOOP_LAG.observe, role="dispatcher")))
        # Ready = reachable: the server has our subscriptions (a pull on another
        # connection right after a takeover would otherwise find no responders).
        await self.nc.flush(timeout=5)
        self.ready.set()
        log.info("dispatcher_started", pool=s.pool, policy=self.scheduler.config.policy,
                 tiers=[t.name for t in self.scheduler.config.tiers])

    async def _fenced(self) -> None:
        """Lease lost: answer nothing more, and never lead again (the lease resigns;
        `__main__` rejoins with a fresh one): re-taking an expired key would serve pulls
        stamped epoch 0, which every worker refuses and hands back, for ever."""
        self.epoch = 0
        if self.lease is not None:
            self.lease.resign()
        self.lease_lost.set()

    async def stop(self) -> None:
        """Stop fetching and answering; held messages stay un-acked for the next
        dispatcher (they come back after ack_wait, or at once when nak'ed here)."""
        self._stopping = True
        if self.lease is not None:  # release first: a standby takes over, gets the naks below
            await self.lease.stop()
        await asyncio.gather(*(cancel_and_wait(t) for t in (*self._tasks, *self._checks)))
        if self.nc is not None and self.nc.is_connected and self._pull_subs:
            late = await self.nak_late_deliveries(self._pull_subs)
            if late:
                log.info("late_deliveries_handed_back", num_messages=late)
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        for p in self._pulls:
            with contextlib.suppress(Exception):
                await self.nc.publish(p.reply, encode(WorkBatch()))
        # Hand queued (not dispatched) work straight back to JetStream: nak = redeliver now.
        await self._apply(self.core.shutdown())
        if self.nc is not None:
            # Not drain(): naks may already be redelivered into the (closed) pull
            # subscriptions' inboxes, and drain would wait on them for its timeout.
            with contextlib.suppress(Exception):
                await self.nc.flush(timeout=2)
            await self.nc.close()
        log.info("dispatcher_stopped")

    # --- events from workers -----------------------------------------------------------

    async def _on_event(self, msg: Msg) -> None:
        try:
            ev = decode_event(msg.data)
        except ProtocolError as exc:
            log.warning("bad_event", error=exc.message)
            return
        now = mono_ms()
        inc = ev.incarnation
        if isinstance(ev, Heartbeat):
            actions = self.core.on_heartbeat(
                ev.worker_id, ev.in_flight_ids, now, interval_ms=ev.interval_ms,
                draining=ev.draining, load=ev.load, incarnation=inc,
                started_ids=ev.started_ids)
            if msg.reply:
                # The worker's lease: without an ack it stops publishing for its work
                # before we could declare it lost; "unknown" makes it fence at once.
                ack = HeartbeatAck(known=self.core.knows(inc), epoch=self.epoch,
                                   worker_timeout_ms=int(self.settings.worker_timeout_ms))
                with contextlib.suppress(Exception):
                    await self.nc.publish(msg.reply, encode(ack))
                if not ack.known:
                    log.warning("worker_fenced", worker_id=ev.worker_id, incarnation=inc)
        elif isinstance(ev, Started):
            actions = self.core.on_started(ev.request_id, ev.worker_id, now, incarnation=inc)
            metrics.started(actions, self._preempted_at.pop(ev.request_id, None), now)
        elif isinstance(ev, Finished):
            if ev.usage is not None and ev.usage.num_recomputed_tokens:
                metrics.RECOMPUTED_TOKENS.labels(tier=ev.usage.tier).inc(
                    ev.usage.num_recomputed_tokens)
            actions = self.core.on_finished(ev.request_id, ev.worker_id, usage_of(ev), now,
                                            incarnation=inc)
        elif isinstance(ev, Requeue):
            actions = self.core.on_handed_back(ev.request_id, ev.worker_id, now,
                                               incarnation=inc)
        elif isinstance(ev, Preempted):
            actions = self._on_preempted(ev, now)
        else:
            return
        await self._apply(actions)

    def _on_preempted(self, ev: Preempted, now: float) -> list[act.Action]:
        """A worker stopped a request we preempted: its continuation (the token ids the
        client has, the next seq) replaces the request the next worker gets."""
        req = self.scheduler.in_flight_request(ev.request_id)
        if req is None:
            return []
        held: Held = req.payload
        held.request = msgspec.structs.replace(held.request, resume=ev.resume)
        actions = self.core.on_preempted(ev.request_id, ev.worker_id,
                                         len(ev.resume.generated_token_ids), now,
                                         incarnation=ev.incarnation)
        if any(isinstance(a, act.Requeued) for a in actions):
            self._preempted_at[ev.request_id] = now
            metrics.preempted(req.tenant, req.tier)
        return actions

    # --- cancel ------------------------------------------------------------------------

    async def _on_cancel(self, msg: Msg) -> None:
        try:
            cancel = decode_cancel(msg.data)
        except ProtocolError as exc:
            log.warning("bad_cancel", error=exc.message)
            return
        if not self.cancel_allowed(msg.subject, cancel.request_id):
            return
        # Queued: ended here. Running: the worker (subscribed too) aborts it.
        await self._apply(self.core.on_cancel(cancel.request_id, cancel.reason, mono_ms()))

    # --- housekeeping ------------------------------------------------------------------

    async def _janitor_loop(self) -> None:
        """Answer requests on subjects nobody serves (`dispatcher.janitor`)."""
        while True:
            await asyncio.sleep(self.settings.janitor_every_s)
            if self.lease is not None and not self.lease.leading():
                continue
            try:
                await self.janitor.sweep()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a blip: the next sweep tries again
                log.warning("janitor_sweep_failed", error=repr(exc))

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

    async def _housekeeping(self, now: float) -> None:
        if not self.nc.is_connected:
            # Cut off from NATS ourselves: workers' silence proves nothing, and no
            # decision could be carried out anyway. Liveness restarts on reconnect.
            if not self._cut_off:
                log.warning("nats_disconnected", pool=self.settings.pool)
            self._cut_off = True
            return
        if self._cut_off:
            self._cut_off = False
            self.core.on_reconnected(now)
            log.info("nats_reconnected", pool=self.settings.pool)
        await self._apply(self.core.tick(now))
        metrics.observe_scheduler(self.scheduler, now, self.core.tenant_changes)
        await self._maybe_preempt(now)
        await self._held.keep_alive(now)
        if self.tenants is not None and now >= self._next_reload_ms:
            self._next_reload_ms = now + self._reload_every_ms
            self._reload_tenants()

    def _reload_tenants(self) -> None:
        try:
            changed = self.tenants.maybe_reload()
        except Exception as exc:  # the watcher keeps the old config; never stop serving
            log.warning("tenants_reload_failed", error=str(exc))
            return
        if not changed:
            return
        try:
            self.scheduler.update_config(resolve_pool_config(
                self.tenants.current, self.settings.pool,
                policy_override=self.settings.policy or None))
            self.limits = self._limits()
            log.info("tenants_applied", pool=self.settings.pool)
        except (KeyError, ValueError) as exc:
            log.error("tenants_not_applied", error=str(exc), hint="restart the dispatcher")

    # --- executing the core's decisions ------------------------------------------------

    async def _apply(self, actions: list[act.Action]) -> None:
        """Execute what the core decided: the one place messages are settled and
        clients are told why their request ended."""
        wake = False
        for a in actions:
            held: Held = a.request.payload if hasattr(a, "request") else None
            match a:
                case act.Hold():
                    self._held.hold(held)
                case act.Ack(reason=reason):
                    if reason != "started":
                        log.info("request_settled", **held.ids,
                                 reason=reason)
                    await self._held.settle(held, "ack")
                case act.Term(reason=reason):
                    metrics.rejected(a.request.tenant, reason)
                    await self._held.settle(held, "term")
                case act.Nak():
                    await self._held.settle(held, "nak")
                case act.Defer(delay_ms=delay_ms):
                    await self._held.settle(held, "nak", delay_s=delay_ms / 1000)
                case act.CheckStarted(reason=reason):
                    self._spawn(self._check_started(held, reason))
                case act.Preempt(worker_id=worker_id, for_request=waiting, dispatch=d):
                    log.info("preempt_ordered", **held.ids,
                             tenant=held.request.tenant, worker_id=worker_id,
                             for_request_id=waiting.request_id, for_tenant=waiting.tenant,
                             handed_over=d is not None)
                    # The waiter rides with the order (a lost order: the worker's
                    # heartbeat lacks it, and reconciliation requeues it).
                    order = Preempt(request_id=held.request.request_id, worker_id=worker_id,
                                    epoch=self.epoch, replacement=None if d is None
                                    else work_item(d, mono_ms(), now_ms()))
                    with contextlib.suppress(Exception):
                        await self.nc.publish(self.subjects.preempt(self.settings.pool),
                                              encode(order))
                case act.SendError(code=code, message=message, retry_after_ms=retry_ms):
                    log.info("request_ended", **held.ids,
                             tenant=held.request.tenant, code=code.value, reason=message)
                    await self._send_error(held.request.reply_to, held.request.request_id,
                                           ErrorInfo.of(code, message, retry_ms))
                case act.Requeued(reason=reason):
                    log.info("request_requeued", **held.ids,
                             reason=reason)
                    wake = True
                case act.Adopted(worker_id=worker_id):
                    log.info("request_adopted", **held.ids,
                             worker_id=worker_id)
                case act.Released(num_requests=n):
                    log.info("redeliveries_released", num_messages=n)
                    wake = True
        if wake:
            self._wake.set()

    def _spawn(self, coro) -> None:
        t = asyncio.create_task(coro)
        self._checks.add(t)
        t.add_done_callback(self._checks.discard)

    async def _check_started(self, held: Held, reason: str) -> None:
        """Did a worker ack this request's message (start it) although we never heard
        Started? The WorkQueue stream deleted the message then: the one record of
        "started" that survives lost events and broker restarts."""
        rid = held.request.request_id
        started = await self._held.was_acked(self.js, self.subjects.requests_stream, held)
        log.info("start_checked", request_id=rid, reason=reason, started=started)
        await self._apply(self.core.on_start_checked(rid, started, mono_ms()))

    async def _send_error(self, reply_to: str, request_id: str, error: ErrorInfo) -> None:
        chunk = TokenChunk(request_id=request_id, seq=0, error=error)
        try:
            await self.nc.publish(reply_to, encode(chunk))
        except Exception as exc:  # a bad reply subject must not stop the dispatcher
            log.warning("error_reply_failed", request_id=request_id, reply_to=reply_to,
                        error=str(exc))
