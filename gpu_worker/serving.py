"""One request's life on the worker, and what it publishes (DESIGN.md sections 4 and 6).

`RequestServing` is the part of `gpu_worker.service.Worker` that serves one accepted
request: a pump task moves engine deltas into the request's queue, and the request's
task streams coalesced `TokenChunk`s (``seq`` from 0) to the request's ``reply_to``,
publishes `Started` on the first token and `Finished` at the end, and sends the `Usage`
to JetStream with ``Nats-Msg-Id = request_id`` (idempotent metering). Pulling is
`gpu_worker.pulling`'s; cancel, heartbeats and drain stay in `gpu_worker.service`.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import msgspec
import structlog
from nats.aio.client import Client as NATS

from fairlane.protocol import (
    ErrorCode,
    ErrorInfo,
    Finished,
    Preempted,
    Requeue,
    Started,
    Usage,
    encode,
)
from fairlane.runtime import now_ms
from fairlane.subjects import Subjects
from gpu_worker.config import WorkerSettings
from gpu_worker.engine import Engine, EngineDead, EngineError, GenerationDelta
from gpu_worker.inflight import WAKE, InFlight, mono_s
from gpu_worker.lease import WorkerLease
from gpu_worker.metrics import WorkerMetrics
from gpu_worker.tracing import end_generation, first_token, generation_span

USAGE_PUBLISH_ATTEMPTS = 5
ACK_TIMEOUT_S = 1.0  # per attempt of the first-token JetStream ack


class RequestServing:
    """Mixin of `Worker`: serving one request and publishing its events and usage."""

    # Set by Worker.__init__ / Worker.run.
    s: WorkerSettings
    engine: Engine
    subjects: Subjects
    worker_id: str
    js: Any
    log: Any  # a bound structlog logger
    _nc: NATS | None
    _reqs: dict[str, InFlight]
    _background: set[asyncio.Task]
    _slot_event: asyncio.Event
    _lease: WorkerLease
    incarnation: str
    metrics: WorkerMetrics

    def _engine_died(self, reason: str) -> None:
        raise NotImplementedError

    # --- one request ----------------------------------------------------------------

    async def _pump(self, r: InFlight) -> None:
        """Engine deltas -> the request's queue (so the server side can time flushes)."""
        stream = r.stream
        if stream is None:
            return  # generate() raised at accept: the error is on the queue already
        try:
            closer = getattr(stream, "aclose", None)
            try:
                async for delta in stream:
                    r.queue.put_nowait(delta)
                    if delta.finish_reason is not None:
                        return
            finally:
                if closer is not None:
                    await closer()
            r.queue.put_nowait(EngineError("engine stream ended without a finish reason"))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure becomes an error chunk
            r.queue.put_nowait(exc)

    async def _serve(self, r: InFlight) -> None:
        rid = r.request_id
        # The request's own task (`Worker._accept`): every line it, its pump and its
        # usage publisher log carries its request id and trace context (DESIGN.md 7b).
        ids = {"request_id": rid}
        if r.item.traceparent:
            ids["traceparent"] = r.item.traceparent
        bound = structlog.contextvars.bind_contextvars(**ids)
        span = generation_span(r, self.worker_id)  # None unless tracing is on (fairlane.otel)
        pump = asyncio.create_task(self._pump(r), name=f"pump-{rid}")
        coalesce_s = self.s.coalesce_ms / 1000
        outcome: object = None
        # Wakes this task (WAKE) when held tokens are due: one timer per held chunk,
        # not a wait_for (a task and a timeout) per token.
        timer: asyncio.TimerHandle | None = None
        try:
            while True:
                if r.stopping:
                    # Flags win over anything still held or queued. (A fenced
                    # request's held token would otherwise be flushed in vain, at once,
                    # forever: _flush publishes nothing for it and never yields.)
                    break
                if r.buf_num_tokens:
                    left_s = r.flush_due_s(coalesce_s) - mono_s()
                    if left_s <= 0:
                        await self._flush(r)
                        continue
                    if timer is None:
                        timer = asyncio.get_running_loop().call_later(left_s, r.signal)
                elif timer is not None:
                    timer.cancel()
                    timer = None
                ev = await r.queue.get()
                if r.stopping:
                    break  # flags win over anything still queued
                if ev is WAKE:
                    continue
                if isinstance(ev, BaseException):
                    outcome = ev
                    break
                assert isinstance(ev, GenerationDelta)
                first = r.add(ev, mono_s())
                if first:
                    first_token(span)
                    if not await self._ack_started(r):
                        break  # fenced while waiting: nothing more goes out for it
                    await self._event(
                        Started(request_id=rid, worker_id=self.worker_id, ts_ms=now_ms(),
                                resumed=r.item.request.resume is not None), r
                    )
                    self._slot_event.set()  # it left the engine's queue
                if ev.finish_reason is not None:
                    outcome = ev
                    break
                # The first token goes out at once (it is the TTFT); a later one too,
                # unless this request sent a chunk less than coalesce_ms ago: then it
                # waits until coalesce_ms after that one (`InFlight.flush_due_s`).
                if r.buf_num_tokens and (
                    first or coalesce_s <= 0 or mono_s() >= r.flush_due_s(coalesce_s)
                ):
                    await self._flush(r)
        finally:
            if timer is not None:
                timer.cancel()
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pump  # closes the engine stream: the engine frees the sequence
            closer = getattr(r.stream, "aclose", None)
            if closer is not None:  # a pump cancelled before it ran never closed it
                with contextlib.suppress(Exception):
                    await closer()
        try:
            await self._finish(r, outcome)
        except Exception as exc:  # noqa: BLE001 - never let one request kill the worker
            self.log.error("finish_failed", request_id=rid, error=repr(exc))
        finally:
            end_generation(span, r, outcome)
            self._reqs.pop(rid, None)
            self._slot_event.set()
            structlog.contextvars.reset_contextvars(**bound)

    async def _ack_started(self, r: InFlight) -> bool:
        """Ack the request's JetStream message before its first token goes out, and
        wait for the server to confirm it: "acked" is the record of "started" that
        survives a dispatcher crash, lost events and a broker restart, so the
        dispatcher never requeues (generates twice) what a client has tokens of."""
        if not r.item.ack_subject:
            return True
        delay_s = 0.05
        while await self._may_publish(r):
            try:
                await self._nc.request(r.item.ack_subject, b"+ACK", timeout=ACK_TIMEOUT_S)
                return True
            except Exception as exc:  # noqa: BLE001 - a reconnect: retry within the lease
                self.log.warning("start_ack_failed", request_id=r.request_id, error=repr(exc))
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, 1.0)
        return False

    async def _may_publish(self, r: InFlight | None = None) -> bool:
        """Wait until the lease lets this worker publish for its work (DESIGN.md
        section 4); False if `r` was fenced meanwhile (publish nothing for it)."""
        while not self._lease.valid(mono_s()):
            if r is not None and r.fenced:
                return False
            await self._lease.wait_changed(0.25)
        return r is None or not r.fenced

    async def _finish(self, r: InFlight, outcome: object) -> None:
        rid = r.request_id
        if r.preempted and not r.fenced and r.fail is None and not isinstance(
                outcome, GenerationDelta | BaseException):
            await self._hand_back_preempted(r)
            return
        if r.fenced:
            with contextlib.suppress(Exception):
                await self.engine.abort(rid)
            self.log.info("request_fenced", request_id=rid)
            return
        if r.fail is not None:
            await self._end_with_error(r, r.fail)
            return
        if r.requeue_reason is not None and not r.started:
            with contextlib.suppress(Exception):
                await self.engine.abort(rid)
            await self._event(
                Requeue(request_id=rid, worker_id=self.worker_id, reason=r.requeue_reason), r
            )
            self.log.info("requeued", request_id=rid, reason=r.requeue_reason)
            return
        if r.cancelled:
            with contextlib.suppress(Exception):
                await self.engine.abort(rid)
            await self._end_with_error(
                r, ErrorInfo.of(ErrorCode.CANCELLED, "request cancelled"), finish_reason="abort"
            )
            return
        if isinstance(outcome, EngineDead):
            self._engine_died(str(outcome))
            await self._end_with_error(r, ErrorInfo.of(ErrorCode.ENGINE_ERROR, str(outcome)))
            return
        if isinstance(outcome, EngineError):
            await self._end_with_error(r, outcome.info())
            return
        if isinstance(outcome, BaseException):
            self.log.error("engine_request_failed", request_id=rid, error=repr(outcome))
            await self._end_with_error(
                r, ErrorInfo.of(ErrorCode.ENGINE_ERROR, f"engine error: {outcome!r}")
            )
            return
        assert isinstance(outcome, GenerationDelta) and outcome.finish_reason is not None
        if outcome.finish_reason == "abort":  # the engine dropped it without our cancel
            await self._end_with_error(
                r, ErrorInfo.of(ErrorCode.ENGINE_ERROR, "request aborted by the engine")
            )
            return
        usage = r.usage(self.worker_id, outcome.finish_reason)
        await self._flush(r, finish_reason=outcome.finish_reason, usage=usage)
        if not await self._event(
            Finished(request_id=rid, worker_id=self.worker_id, usage=usage, ts_ms=usage.ts_ms),
            r,
        ):
            return  # fenced: the dispatcher handed it elsewhere; never bill it here
        self._publish_usage(usage)
        self.log.info(
            "request_finished",
            request_id=rid,
            tenant=usage.tenant,
            finish_reason=usage.finish_reason,
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            ttft_ms=round(usage.ttft_ms, 2),
            e2e_ms=round(usage.e2e_ms, 2),
            kv_token_seconds=round(usage.kv_token_seconds, 3),
        )

    async def _hand_back_preempted(self, r: InFlight) -> None:
        """Stopped by the dispatcher's `Preempt`: the client gets every token generated
        so far, then the dispatcher gets the continuation (and the slot is free)."""
        with contextlib.suppress(Exception):
            await self.engine.abort(r.request_id)
        if r.buf_num_tokens:
            await self._flush(r)
        resume = r.continuation()
        if await self._event(Preempted(request_id=r.request_id, worker_id=self.worker_id,
                                       resume=resume, ts_ms=now_ms()), r):
            self.log.info("request_preempted", request_id=r.request_id,
                          num_generated_tokens=len(resume.generated_token_ids),
                          next_seq=resume.next_seq)

    async def _end_with_error(
        self, r: InFlight, error: ErrorInfo, finish_reason: str = "error"
    ) -> None:
        usage = r.usage(self.worker_id, finish_reason)
        await self._flush(r, error=error, usage=usage)
        if not await self._event(
            Finished(
                request_id=r.request_id,
                worker_id=self.worker_id,
                usage=usage,
                error=error,
                ts_ms=usage.ts_ms,
            ),
            r,
        ):
            return
        if usage.completion_tokens > 0 and not r.unbilled:
            self._publish_usage(usage)  # tokens were generated: the tenant is metered
        self.log.info(
            "request_failed",
            request_id=r.request_id,
            code=error.code.value,
            message=error.message,
            completion_tokens=usage.completion_tokens,
        )

    async def _flush(
        self,
        r: InFlight,
        *,
        finish_reason: str | None = None,
        usage: Usage | None = None,
        error: ErrorInfo | None = None,
    ) -> None:
        req = r.item.request
        if not await self._may_publish(r):
            return
        chunk = r.take_chunk(finish_reason=finish_reason, usage=usage, error=error)
        try:
            assert self._nc is not None
            await self._nc.publish(req.reply_to, encode(chunk))
        except Exception as exc:  # noqa: BLE001 - tokens are at-most-once by design
            self.log.warning("chunk_publish_failed", request_id=req.request_id, error=repr(exc))

    # --- events and usage ------------------------------------------------------------

    async def _event(self, evt: msgspec.Struct, r: InFlight | None = None) -> bool:
        """Publish a worker event for our work, within the lease. False: `r` was
        fenced while waiting, and nothing was published."""
        if not await self._may_publish(r):
            return False
        evt.incarnation = self.incarnation  # type: ignore[attr-defined]
        try:
            assert self._nc is not None
            await self._nc.publish(self.subjects.events(self.s.pool), encode(evt))
        except Exception as exc:  # noqa: BLE001
            self.log.warning("event_publish_failed", event=type(evt).__name__, error=repr(exc))
        self.metrics.on_event(evt, r)
        return True

    def _publish_usage(self, usage: Usage) -> None:
        self.metrics.on_usage(usage)
        t = asyncio.create_task(self._publish_usage_now(usage))
        self._background.add(t)
        t.add_done_callback(self._background.discard)

    async def _publish_usage_now(self, usage: Usage) -> None:
        subject = self.subjects.usage(usage.tenant)
        headers = {"Nats-Msg-Id": usage.request_id}  # one metering record per request
        delay_s = 0.1
        for attempt in range(1, USAGE_PUBLISH_ATTEMPTS + 1):
            try:
                await self.js.publish(subject, encode(usage), timeout=2.0, headers=headers)
                return
            except Exception as exc:  # noqa: BLE001 - retried, idempotent by msg id
                self.log.warning("usage_publish_failed", request_id=usage.request_id,
                                 attempt=attempt, error=repr(exc))
                await asyncio.sleep(delay_s)
                delay_s *= 2
        self.log.error("usage_lost", request_id=usage.request_id, tenant=usage.tenant)
