"""Per-request state of the worker: coalescing buffer, chunk numbering, usage.

Pure bookkeeping (no NATS, no awaits): `gpu_worker.serving` feeds it engine deltas
and publishes what it builds. Times are monotonic seconds, passed in or read here.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fairlane.protocol import Continuation, ErrorInfo, TokenChunk, Usage, WorkItem
from fairlane.runtime import now_ms
from gpu_worker.engine import GenerationDelta

WAKE = object()  # control signal on a request's queue: look at its flags


def mono_s() -> float:
    return time.monotonic()


@dataclass(eq=False)
class InFlight:
    """One accepted request, from pull to its last chunk."""

    item: WorkItem
    accepted_s: float = field(default_factory=mono_s)
    # engine deltas, exceptions and WAKE signals, consumed by the request's task
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    task: asyncio.Task | None = None
    # The engine's stream of deltas, made when the request is accepted (`Worker._accept`)
    # so an engine that admits on `generate()` has it before its next step boundary.
    stream: AsyncIterator[GenerationDelta] | None = None
    started: bool = False  # first token produced (Started published)
    first_token_s: float = 0.0
    last: GenerationDelta | None = None  # latest delta: carries the accounting
    next_seq: int = 0
    # coalescing buffer
    buf_text: list[str] = field(default_factory=list)
    buf_token_ids: list[int] = field(default_factory=list)
    buf_num_tokens: int = 0
    # Coalescing limits how often a request publishes; it is not a window every token
    # waits out: a token goes out at once unless this request sent a chunk less than
    # coalesce_ms ago, and then waits, with those that follow, until coalesce_ms after
    # it. (A window from the first buffered token held every token of an engine stepping
    # slower than coalesce_ms for the whole window, for nothing to coalesce with.)
    last_flush_s: float = -math.inf  # when the latest chunk was taken (mono_s)
    # control flags, set from outside the request's task, then WAKE is queued
    cancelled: bool = False
    requeue_reason: str | None = None
    fail: ErrorInfo | None = None
    # The worker fenced itself (its incarnation was declared lost): the request ends
    # here without publishing anything more; the dispatcher already handed it on.
    fenced: bool = False
    # The dispatcher preempted it to free the slot for a tenant below its fair share:
    # flush what was generated, abort, hand back a `Continuation`.
    preempted: bool = False
    unbilled: bool = False  # cancelled by a client that resumes it: publish no usage
    # Every output token id of the request (earlier runs included): a preemption
    # hands them back, so the continuation re-prefills exactly what the client has.
    generated_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        resume = self.item.request.resume
        if resume is not None:
            # A continuation: the client already has chunks 0 .. next_seq - 1.
            self.next_seq = resume.next_seq
            self.generated_ids = list(resume.generated_token_ids)

    @property
    def request_id(self) -> str:
        return self.item.request.request_id

    @property
    def stopping(self) -> bool:
        return (self.fail is not None or self.cancelled or self.requeue_reason is not None
                or self.fenced or self.preempted)

    def signal(self) -> None:
        self.queue.put_nowait(WAKE)

    def add(self, delta: GenerationDelta, now_s: float) -> bool:
        """Buffer a delta's tokens. True if this is the request's first token."""
        self.last = delta
        if not (delta.token_ids or delta.text):
            return False
        first = not self.started
        if first:
            self.started = True
            self.first_token_s = now_s
        self.buf_text.append(delta.text)
        self.buf_token_ids.extend(delta.token_ids)
        self.generated_ids.extend(delta.token_ids)
        self.buf_num_tokens += max(1, len(delta.token_ids))
        return first

    def continuation(self) -> Continuation:
        """Where this request stands, for a continuation elsewhere (flush first)."""
        resume = self.item.request.resume
        return Continuation(generated_token_ids=list(self.generated_ids), next_seq=self.next_seq,
                            num_preemptions=(resume.num_preemptions if resume else 0) + 1)

    def take_chunk(
        self,
        *,
        finish_reason: str | None = None,
        usage: Usage | None = None,
        error: ErrorInfo | None = None,
        now_s: float | None = None,
    ) -> TokenChunk:
        """Empty the buffer into the next chunk (seq numbers from 0, no gaps)."""
        req = self.item.request
        self.last_flush_s = mono_s() if now_s is None else now_s
        chunk = TokenChunk(
            request_id=req.request_id,
            seq=self.next_seq,
            text="".join(self.buf_text),
            token_ids=list(self.buf_token_ids)
            if req.return_token_ids and self.buf_token_ids
            else None,
            num_tokens=self.buf_num_tokens,
            finish_reason=finish_reason,
            usage=usage,
            error=error,
            attempt=req.attempt,
        )
        self.next_seq += 1
        self.buf_text.clear()
        self.buf_token_ids.clear()
        self.buf_num_tokens = 0
        return chunk

    def flush_due_s(self, coalesce_s: float) -> float:
        """When the buffered tokens go out: now if the last chunk is coalesce_s old."""
        return self.last_flush_s + coalesce_s

    def usage(self, worker_id: str, finish_reason: str, now_s: float | None = None) -> Usage:
        req = self.item.request
        d = self.last or GenerationDelta()
        now_s = mono_s() if now_s is None else now_s
        return Usage(
            request_id=req.request_id,
            tenant=req.tenant,
            pool=req.pool,
            tier=req.tier,
            worker_id=worker_id,
            prompt_tokens=d.num_prompt_tokens,
            completion_tokens=d.num_output_tokens,
            cached_prompt_tokens=d.num_cached_prompt_tokens,
            queue_ms=self.item.queue_ms,
            # Measured from the moment this worker accepted the item (its dispatch as
            # seen here), on the monotonic clock: no cross-host clock skew.
            ttft_ms=(self.first_token_s - self.accepted_s) * 1000 if self.started else 0.0,
            e2e_ms=(now_s - self.accepted_s) * 1000,
            kv_token_seconds=d.kv_token_seconds,
            num_recomputed_tokens=d.num_recomputed_tokens,
            finish_reason=finish_reason,
            ts_ms=now_ms(),
            attempt=req.attempt,
        )
