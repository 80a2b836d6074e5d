"""The GPU worker's asyncio shell: pulls work, streams tokens, reports events.

The engine (`gpu_worker.engine.Engine`) does the generating; this module owns every
NATS interaction (DESIGN.md sections 3, 4 and 6):

- pull loop (`gpu_worker.pulling.Pulling`, mixed into `Worker`): a core request on
  ``fl.work.<pool>`` only while there is headroom; never polls.
- per request (`gpu_worker.serving.RequestServing`, mixed into `Worker`): one task
  streams coalesced `TokenChunk`s (``seq`` from 0) to the request's ``reply_to``;
  `Started` on the first token, `Finished` at the end, and the `Usage` to JetStream
  with ``Nats-Msg-Id = request_id`` (idempotent metering).
- cancel subscription, heartbeats, drain on stop, and fail-everything on engine death.
"""

from __future__ import annotations

import asyncio
import contextlib
import math

import nats
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from fairlane.gctune import refreeze
from fairlane.looplag import watch_loop_lag
from fairlane.natsconn import connect_options
from fairlane.protocol import (
    GAP_CANCEL_REASON,
    ErrorCode,
    ErrorInfo,
    Heartbeat,
    ProtocolError,
    Requeue,
    WorkItem,
    decode_cancel,
    decode_heartbeat_ack,
    decode_preempt,
    encode,
)
from fairlane.runtime import Stopped, cancel_and_wait, log_nats_error, now_ms, until_stopped
from fairlane.streams import ensure_streams
from fairlane.subjects import Subjects
from gpu_worker.config import WorkerSettings
from gpu_worker.engine import Engine, EngineDead
from gpu_worker.epoch import EpochGuard
from gpu_worker.inflight import InFlight, mono_s
from gpu_worker.lease import WorkerLease, new_incarnation
from gpu_worker.metrics import WorkerMetrics
from gpu_worker.pulling import PULL_TIMEOUT_MARGIN_MS, Pulling
from gpu_worker.serving import RequestServing

log = structlog.get_logger(__name__)

EXIT_OK = 0
EXIT_ENGINE_DEAD = 3
EXIT_FAILED = 1


class Worker(Pulling, RequestServing):
    def __init__(self, settings: WorkerSettings, engine: Engine, nc: NATS | None = None,
                 owns_engine: bool = True) -> None:
        self.s = settings
        self.engine = engine
        # A borrowed engine (tests, benchmarks sharing one vLLM) is not closed on exit.
        self._owns_engine = owns_engine
        self.subjects = Subjects(settings.prefix)
        self.worker_id = settings.worker_id
        self._nc = nc
        self._own_nc = nc is None
        self._reqs: dict[str, InFlight] = {}
        self._background: set[asyncio.Task] = set()
        self._slot_event = asyncio.Event()  # a request started or finished, or drain
        self._draining = False
        self._closing = False  # run() is tearing down: every loop ends
        self._drain_event = asyncio.Event()
        self._dead = asyncio.Event()
        self._dead_reason = ""
        self._pulls_out: set[asyncio.Task] = set()
        self._asked = 0
        self._epochs = EpochGuard()  # newest dispatcher lease epoch seen (fencing)
        # One incarnation per process start (and per rejoin after fencing): the
        # dispatcher tells a restart under the same worker id from the old process.
        self.incarnation = new_incarnation()
        self._lease = WorkerLease(settings.lease_timeout_ms,
                                  abandon_after_ms=settings.abandon_after_ms)
        self.num_fenced = 0
        self.metrics = WorkerMetrics(settings)  # served by serve() with --metrics-port
        self.log = log.bind(worker_id=self.worker_id, pool=settings.pool)

    # --- lifecycle ----------------------------------------------------------------

    async def _start(self) -> None:
        if self._nc is None:
            self._nc = await nats.connect(
                **connect_options(self.s),
                name=f"gpu_worker:{self.worker_id}",
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                drain_timeout=5,  # on exit with NATS gone, don't wait the default 30 s
                error_cb=log_nats_error,
            )
        self.js = self._nc.jetstream()
        # A cluster may still be electing its JetStream leader: wait, don't exit.
        await ensure_streams(self.js, self.subjects, self.s, patience_s=math.inf)
        await self.engine.start()
        refreeze()  # the engine's start-up objects (vLLM's): no collection walks them

    async def run(self, stop: asyncio.Event) -> int:
        try:
            await until_stopped(self._start(), stop)  # NATS may be unreachable for ever
        except Stopped:
            self.log.info("stopped_during_start")
            return 0
        nc = self._nc
        cancel_subs = [await nc.subscribe(subject, cb=self._on_cancel)
                       for subject in self.subjects.cancel_subscriptions(self.s.pool)]
        preempt_sub = await nc.subscribe(self.subjects.preempt(self.s.pool), cb=self._on_preempt)
        hb_task = asyncio.create_task(self._heartbeat_loop(), name="heartbeat")
        pull_task = asyncio.create_task(self._pull_loop(), name="pull")
        # Tokens, heartbeats and pulls share this loop with the engine's output handling.
        lag_task = asyncio.create_task(
            watch_loop_lag(self.metrics.loop_lag.observe, role="worker"), name="loop-lag")
        self.log.info(
            "worker_started",
            incarnation=self.incarnation,
            engine=self.s.engine,
            max_num_seqs=self.s.max_num_seqs,
            prefetch_seqs=self.s.prefetch_seqs,
            work_subject=self.subjects.work(self.s.pool),
        )
        stop_task = asyncio.create_task(stop.wait())
        dead_task = asyncio.create_task(self._dead.wait())
        try:
            await asyncio.wait(
                {stop_task, dead_task, pull_task}, return_when=asyncio.FIRST_COMPLETED
            )
            if pull_task.done() and not pull_task.cancelled() and pull_task.exception():
                self._engine_died(f"pull loop crashed: {pull_task.exception()!r}")
            if self._dead.is_set():
                rc = await self._die(pull_task)
            else:
                rc = await self._drain(pull_task)
        finally:
            self._closing = True
            await asyncio.gather(*(cancel_and_wait(t)
                                   for t in (stop_task, dead_task, hb_task, pull_task,
                                             lag_task, *self._pulls_out)))
            with contextlib.suppress(Exception):
                for sub in cancel_subs:
                    await sub.unsubscribe()
                await preempt_sub.unsubscribe()
            if self._owns_engine:
                with contextlib.suppress(Exception):
                    await self.engine.close()
            if self._own_nc:
                with contextlib.suppress(Exception):
                    await nc.drain()
        self.log.info("worker_stopped", exit_code=rc)
        return rc

    async def _drain(self, pull_task: asyncio.Task) -> int:
        """Stop pulling, hand back unstarted work, let started work finish (bounded)."""
        self.log.info("drain_started", num_in_flight=len(self._reqs))
        self._draining = True
        self._drain_event.set()
        self._slot_event.set()
        # Unstarted work goes back first: waiting for the long-poll below can take
        # pull_wait_ms, and meanwhile the engine would start what it had queued.
        for r in list(self._reqs.values()):
            if not r.started:
                r.requeue_reason = "draining"
                r.signal()
        await self._heartbeat(timeout_s=0.3)  # stop may be due to NATS being gone
        # An outstanding long-poll may still bring items; they are handed back on arrival.
        # (A pull a newer one replaced is answered at once; it is waited for too.)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(
                asyncio.shield(asyncio.gather(pull_task, *self._pulls_out,
                                              return_exceptions=True)),
                (self.s.pull_wait_ms + PULL_TIMEOUT_MARGIN_MS) / 1000)
        tasks = [r.task for r in self._reqs.values() if r.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self.s.drain_timeout_s)
            if pending:
                self.log.warning("drain_timeout", num_unfinished=len(pending),
                                 drain_timeout_s=self.s.drain_timeout_s)
                info = ErrorInfo.of(ErrorCode.WORKER_LOST, "worker stopped before finishing")
                # Without a lease nothing may be published for them: they end silently
                # (the dispatcher hands them on when it declares this worker lost).
                valid = self._lease.valid(mono_s())
                for r in list(self._reqs.values()):
                    if valid:
                        r.fail = info
                    else:
                        r.fenced = True
                    r.signal()
                await asyncio.wait(pending, timeout=5.0)
        await self._wait_background()
        await self._heartbeat(timeout_s=0.3)
        self.log.info("drain_done", engine_dead=self._dead.is_set())
        # The engine dying mid-drain still means a broken worker: exit non-zero.
        return EXIT_ENGINE_DEAD if self._dead.is_set() else EXIT_OK

    async def _die(self, pull_task: asyncio.Task) -> int:
        """The engine is gone: every in-flight request gets an explicit error."""
        self.log.error("engine_dead", reason=self._dead_reason, num_in_flight=len(self._reqs))
        self._draining = True
        self._drain_event.set()
        pull_task.cancel()
        for task in self._pulls_out:
            task.cancel()
        info = ErrorInfo.of(ErrorCode.ENGINE_ERROR, f"engine failed: {self._dead_reason}")
        for r in list(self._reqs.values()):
            r.fail = info
            r.signal()
        tasks = [r.task for r in self._reqs.values() if r.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=10.0)
        await self._wait_background()
        return EXIT_ENGINE_DEAD

    def _engine_died(self, reason: str) -> None:
        if not self._dead.is_set():
            self._dead_reason = reason
            self._dead.set()

    async def _wait_background(self) -> None:
        if self._background:
            await asyncio.wait(list(self._background), timeout=10.0)

    # --- pulling: `gpu_worker.pulling` ----------------------------------------------

    async def _accept(self, item: WorkItem) -> None:
        rid = item.request.request_id
        if rid in self._reqs:
            self.log.warning("duplicate_work_item", request_id=rid)
            return
        if self._draining:
            reason = "engine_dead" if self._dead.is_set() else "draining"
            await self._event(Requeue(request_id=rid, worker_id=self.worker_id, reason=reason))
            self.log.info("requeued", request_id=rid, reason=reason)
            return
        r = InFlight(item=item)
        self._reqs[rid] = r
        try:
            # Into the engine now, not when the request's task first runs (see
            # `Engine.generate`): the replacement a Preempt names takes the slot the
            # victim just left at the very next step boundary.
            r.stream = self.engine.generate(item)
        except Exception as exc:  # noqa: BLE001 - PromptTooLong, EngineDead: its error chunk
            r.queue.put_nowait(exc)
        r.task = asyncio.create_task(self._serve(r), name=f"req-{rid}")

    # --- cancel, heartbeat ---------------------------------------------------------

    async def _on_cancel(self, msg: Msg) -> None:
        try:
            cancel = decode_cancel(msg.data)
        except ProtocolError as exc:
            self.log.warning("bad_cancel", error=exc.message)
            return
        r = self._reqs.get(cancel.request_id)
        if r is None or r.cancelled:
            return
        as_tenant = self.subjects.cancel_tenant(msg.subject)  # None: a service's cancel
        if as_tenant is not None and as_tenant != r.item.request.tenant:
            self.log.warning("cancel_refused", request_id=cancel.request_id, as_tenant=as_tenant)
            return
        self.log.info("cancel", request_id=cancel.request_id, reason=cancel.reason,
                      traceparent=r.item.traceparent or None)
        r.cancelled = True
        # The client lost chunks and resumes elsewhere: the continuation's usage record
        # will cover the whole request, so this attempt bills nothing.
        r.unbilled = cancel.reason == GAP_CANCEL_REASON
        r.signal()
        try:
            await self.engine.abort(cancel.request_id)
        except Exception as exc:  # noqa: BLE001
            self.log.warning("abort_failed", request_id=cancel.request_id, error=repr(exc))

    async def _on_preempt(self, msg: Msg) -> None:
        """The dispatcher frees one of our slots for a tenant below its fair share."""
        try:
            order = decode_preempt(msg.data)
        except ProtocolError as exc:
            self.log.warning("bad_preempt", error=exc.message)
            return
        if order.worker_id != self.worker_id:
            return  # not ours
        if not self._epochs.admit(order.epoch):
            self.log.warning("stale_epoch_preempt", epoch=order.epoch)
            if order.replacement is not None:
                await self._refuse_stale(order.replacement)
            return
        if order.replacement is not None:
            # The request the slot is freed for goes into the engine first, the victim's
            # abort after it. An engine fills a freed slot at its next step boundary
            # from its waiting queue (ordered by engine priority, the replacement
            # first); were the abort first, a step could start between the two and
            # give the slot to work prefetched earlier, and the replacement would wait
            # for some other request to end. Taken even if the victim ended first:
            # the dispatcher counts it ours, and that end freed a slot too.
            await self._accept(order.replacement)
        r = self._reqs.get(order.request_id)
        if r is not None and not r.stopping:  # else ending anyway: its Finished says so
            r.preempted = True
            r.signal()
            # Free the engine slot here, not from the request's own task: a slot
            # released a few loop turns late (behind a step's worth of token flushes)
            # misses the next step boundary and costs the replacement a whole step.
            # The flag is set first, so the task ignores the stream's "abort" end and
            # hands back the tokens its client has (`_hand_back_preempted`).
            try:
                await self.engine.abort(order.request_id)
            except Exception as exc:  # noqa: BLE001 - its task aborts again on the way out
                self.log.warning("abort_failed", request_id=order.request_id, error=repr(exc))

    async def _heartbeat(self, timeout_s: float | None = None) -> None:
        """Report load and work, as a request: the dispatcher's acknowledgement is the
        worker's lease (`gpu_worker.lease`); "unknown" means fence now."""
        try:
            load = self.engine.load()
        except EngineDead as exc:
            self._engine_died(str(exc))
            return
        self.metrics.observe(load, self)
        live = [r for r in self._reqs.values() if not r.fenced]
        hb = Heartbeat(
            worker_id=self.worker_id,
            pool=self.s.pool,
            load=load,
            in_flight_ids=[r.request_id for r in live],
            started_ids=[r.request_id for r in live if r.started],
            draining=self._draining,
            interval_ms=self.s.heartbeat_ms,
            ts_ms=now_ms(),
            incarnation=self.incarnation,
        )
        sent_s = mono_s()
        try:
            assert self._nc is not None
            if timeout_s is None:
                timeout_s = min(2.0, max(0.2, self.s.heartbeat_ms / 1000))
            msg = await self._nc.request(self.subjects.events(self.s.pool), encode(hb),
                                         timeout=timeout_s)
            ack = decode_heartbeat_ack(msg.data)
        except Exception as exc:  # noqa: BLE001 - no dispatcher, a blip: the lease runs on
            self.log.debug("heartbeat_unacked", error=repr(exc))
            ack = None
        if ack is not None and hb.incarnation == self.incarnation:
            if not ack.known:
                await self._fence("declared lost by the dispatcher")
                return
            self._lease.renew(sent_s, ack.worker_timeout_ms)
        if self._reqs and self._lease.should_abandon(mono_s()):
            await self._fence("no acknowledged heartbeat for too long")

    async def _fence(self, why: str) -> None:
        """Stop all work without publishing anything for it (the dispatcher handed it
        elsewhere, or will), and rejoin as a new incarnation."""
        fenced = [r for r in self._reqs.values() if not r.fenced]
        old, self.incarnation = self.incarnation, new_incarnation()
        self._lease.revoke()
        self.num_fenced += 1
        self.log.warning("worker_fenced", reason=why, old_incarnation=old,
                         incarnation=self.incarnation, num_aborted=len(fenced))
        for r in fenced:
            r.fenced = True
            r.signal()
            with contextlib.suppress(Exception):
                await self.engine.abort(r.request_id)
        self._slot_event.set()

    async def _heartbeat_loop(self) -> None:
        # A periodic timer is the one place a plain sleep is right.
        while not self._closing:
            await self._heartbeat()
            await asyncio.sleep(self.s.heartbeat_ms / 1000)


async def serve(settings: WorkerSettings, stop: asyncio.Event) -> int:
    from gpu_worker.engines import make_engine

    try:
        engine = make_engine(settings)
        worker = Worker(settings, engine)
        worker.metrics.serve_http()  # --metrics-port 0: nothing
        return await worker.run(stop)
    except Exception as exc:  # noqa: BLE001 - startup failures exit non-zero, logged
        log.exception("worker_failed", error=repr(exc), worker_id=settings.worker_id)
        return EXIT_FAILED
