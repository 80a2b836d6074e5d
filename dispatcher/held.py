"""JetStream messages the dispatcher holds un-acked while their requests wait.

Holding is what makes queued work durable: if the dispatcher dies, JetStream
redelivers every held message after ``ack_wait``. While alive, the dispatcher touches
each one with ``in_progress`` before ``ack_wait`` runs out — oldest first and only as
they near it, so holding 100k messages costs a few publishes per second. `settle` is
the one place acks are decided.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass

import structlog
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from dispatcher import metrics
from dispatcher.scheduler.types import ActualUsage, Dispatch
from fairlane import otel
from fairlane.protocol import Finished, InferenceRequest, WorkItem
from fairlane.runtime import mono_ms

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class Held:
    """A request's JetStream message, held un-acked until the request starts."""

    msg: Msg
    request: InferenceRequest
    touched_ms: float  # last delivery or in_progress, monotonic
    settled: bool = False
    # Its message's ``traceparent`` header ("": none), for its WorkItem and log lines.
    traceparent: str = ""

    @property
    def ids(self) -> dict[str, str]:
        """``request_id`` (and ``traceparent``, if any): keys for its log lines."""
        if self.traceparent:
            return {"request_id": self.request.request_id, "traceparent": self.traceparent}
        return {"request_id": self.request.request_id}


class HeldMessages:
    def __init__(self, ack_wait_s: float) -> None:
        self.ack_wait_ms = ack_wait_s * 1000
        self._held: dict[str, Held] = {}
        # (touched_ms, request id) in touch order; stale entries are skipped lazily.
        self._touch_order: deque[tuple[float, str]] = deque()

    def __len__(self) -> int:
        return len(self._held)

    def get(self, request_id: str) -> Held | None:
        return self._held.get(request_id)

    def hold(self, held: Held) -> None:
        self._held[held.request.request_id] = held
        self._touch_order.append((held.touched_ms, held.request.request_id))
        # The decoded request has everything; acks only need the message's reply
        # subject. Dropping the raw body and headers shrinks what 100k held cost.
        held.msg.data, held.msg.headers = b"", None

    def redelivered(self, held: Held, msg: Msg, now_ms: float) -> None:
        """JetStream delivered a held request again: keep the newest handle."""
        held.msg, held.touched_ms = msg, now_ms
        self._touch_order.append((now_ms, held.request.request_id))

    async def keep_alive(self, now_ms: float) -> None:
        """Touch held messages before ack_wait runs out, oldest first, only as needed."""
        horizon = now_ms - self.ack_wait_ms / 2
        while self._touch_order and self._touch_order[0][0] <= horizon:
            touched, rid = self._touch_order.popleft()
            held = self._held.get(rid)
            if held is None or held.settled or held.touched_ms != touched:
                continue  # settled, or touched again since (a newer entry exists)
            with contextlib.suppress(Exception):
                await held.msg.in_progress()
            held.touched_ms = now_ms
            self._touch_order.append((now_ms, rid))

    async def was_acked(self, js, stream: str, held: Held, attempts: int = 5) -> bool:
        """Whether the request's message left the WorkQueue stream, i.e. a worker acked
        it at its first token (we ack only requests we end, and ask only about ones we
        have not). If JetStream cannot be asked, say started: a retryable error to the
        client beats generating the request a second time."""
        try:
            seq = held.msg.metadata.sequence.stream
        except Exception:  # not a JetStream message (tests feeding the shell directly)
            return False
        delay_s = 0.2
        for attempt in range(1, attempts + 1):
            try:
                await js.get_msg(stream, seq)
                return False
            except NotFoundError:
                return True
            except Exception as exc:
                log.warning("start_check_failed", request_id=held.request.request_id,
                            attempt=attempt, error=repr(exc))
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, 2.0)
        return True

    async def settle(self, held: Held, action: str, delay_s: float | None = None) -> None:
        """ack: started or finished (never replay). term: refused, expired, cancelled.
        nak: hand back to JetStream for redelivery now (shutdown), or after `delay_s`
        (a redelivery deferred during the restart grace)."""
        if held.settled:
            return
        held.settled = True
        self._held.pop(held.request.request_id, None)
        try:
            if action == "ack":
                await held.msg.ack()
            elif action == "term":
                await held.msg.term()
            else:
                await held.msg.nak(delay=delay_s)
        except Exception as exc:
            log.warning("settle_failed", request_id=held.request.request_id, action=action,
                        error=str(exc))


def work_item(d: Dispatch, now: float, epoch_ms: int) -> WorkItem:
    """The `WorkItem` for one dispatch (a pull's batch, or a preemption's replacement)."""
    held: Held = d.request.payload
    queue_ms = int(now - d.request.arrival_ms)
    metrics.dispatched(d.request, queue_ms / 1000, d.cost)
    if otel.enabled():
        _trace_queue_wait(d, held)
    return WorkItem(
        request=held.request, engine_priority=d.engine_priority,
        dispatched_ms=epoch_ms, queue_ms=queue_ms, cache_salt=held.request.tenant,
        # A continuation's message was acked when it first started.
        ack_subject=None if held.settled else (held.msg.reply or None),
        traceparent=held.traceparent,
    )


def _trace_queue_wait(d: Dispatch, held: Held) -> None:
    """The request's wait in this dispatcher (ingest to dispatch) as a span of its trace;
    its start is the wall time now less the wait on the monotonic clock."""
    q, end_ns = d.request, time.time_ns()
    wait_ns = int((mono_ms() - q.arrival_ms) * 1_000_000)
    otel.record_span("fairlane.queue_wait", held.traceparent or None,
                     start_ns=end_ns - wait_ns, end_ns=end_ns,
                     attributes={"fairlane.request_id": q.request_id, "fairlane.tenant": q.tenant,
                                 "fairlane.tier": q.tier, "fairlane.pool": held.request.pool,
                                 "fairlane.attempt": q.attempt, "fairlane.cost": d.cost,
                                 "fairlane.engine_priority": d.engine_priority,
                                 "fairlane.estimated_prompt_tokens": q.prompt_tokens})


def usage_of(ev: Finished) -> ActualUsage | None:
    """What a `Finished` event says the request cost (None: no usage reported)."""
    u = ev.usage
    if u is None:
        return None
    return ActualUsage(u.prompt_tokens, u.completion_tokens, u.kv_token_seconds, u.e2e_ms)
