"""One request's token stream (`RequestStream`), its errors and its collected result.

Split from `producer.client` (which re-exports these names): the stream is fed by the
client's one inbox subscription and watched by its one silence watchdog.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fairlane.errors import FairlaneError
from fairlane.protocol import (
    GAP_CANCEL_REASON,
    ErrorCode,
    ErrorInfo,
    InferenceRequest,
    TokenChunk,
    Usage,
)

if TYPE_CHECKING:
    from producer.client import FairlaneClient


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
    attempt: int = 0
    # Monotonic s of the last chunk (or the submit); the client's watchdog reads it.
    _last_chunk_s: float = 0.0
    # Monotonic s since which no chunk came and no dispatcher vouched (None: vouched).
    _unvouched_since_s: float | None = None
    # Its last chunk (finish or error) has arrived, read or not: nothing to watch for.
    _ended_upstream: bool = False
    # Migration (DESIGN.md section 5b): the request as published, the output token ids
    # read so far, and how many more times it may be resumed elsewhere after its
    # worker was lost. The library always asks for token ids (a continuation needs
    # them); `_wants_token_ids` says whether the caller sees them.
    _request: InferenceRequest | None = field(default=None, repr=False)
    _token_ids: list[int] = field(default_factory=list, repr=False)
    _num_tokens: int = 0
    _resumes_left: int = 0
    _resumed_at_seq: int = 0  # the current attempt's first seq (0 unless resumed)
    _wants_token_ids: bool = True
    num_resumes: int = 0
    num_stale_chunks: int = 0  # chunks of an earlier attempt, dropped
    # The W3C trace context its JetStream messages carry (each attempt the same).
    traceparent: str = ""

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
        if chunk.attempt is not None and chunk.attempt < self.attempt:
            # A late chunk of an attempt this stream already left (its worker was cut
            # off, then healed): the current attempt's stream is what the caller reads.
            self.num_stale_chunks += 1
            return
        self._last_chunk_s = asyncio.get_running_loop().time()
        self._unvouched_since_s = None
        if chunk.is_last:
            self._ended_upstream = True
        try:
            self._queue.put_nowait(chunk)
        except asyncio.QueueFull:
            self._fail(ErrorInfo.of(ErrorCode.SLOW_CONSUMER,
                                    "consumer fell too far behind the token stream"))
            self._client._spawn_cancel(self, "slow_consumer")

    def __aiter__(self) -> AsyncIterator[TokenChunk]:
        return self._iterate()

    def _resumable(self, error: ErrorInfo) -> bool:
        """A lost worker or stream, with every token id read so far known: the
        request can continue elsewhere from exactly what the caller has."""
        return (error.code in (ErrorCode.WORKER_LOST, ErrorCode.STREAM_LOST)
                and self._resumes_left > 0 and self._request is not None
                and len(self._token_ids) == self._num_tokens)

    async def _resume_after_gap(self, why: str) -> bool:
        """Chunks were lost on the way (our inbox subscription was re-establishing after
        a broker restart while the worker's buffered chunks went out): stop this
        attempt, unbilled, wait until the fleet has ended it, and continue from the
        tokens we have — instead of failing a request whose tokens were generated."""
        lost = ErrorInfo.of(ErrorCode.STREAM_LOST, why)
        if not self._resumable(lost):
            return False
        await self._client.cancel(self.request_id, self.pool, self.tenant, GAP_CANCEL_REASON)
        await self._client._await_attempt_end(self)
        return await self._try_resume(lost)

    async def _try_resume(self, error: ErrorInfo) -> bool:
        if not self._resumable(error):
            return False
        self._resumes_left -= 1
        return await self._client._resume(self, error)

    async def _iterate(self) -> AsyncIterator[TokenChunk]:
        try:
            while not self._done:
                chunk = await self._queue.get()
                if chunk is None:
                    assert self.failure is not None
                    if await self._try_resume(self.failure):
                        continue  # one unbroken stream: a pause, then the next seq
                    self._client._note_end(self)
                    raise RequestError.from_info(self.failure)
                if chunk.error is not None:  # terminal, accepted whatever its seq
                    if await self._try_resume(chunk.error):
                        continue
                    self._done = True
                    self.failure = chunk.error
                    self._client._note_end(self)
                    raise RequestError.from_info(chunk.error)
                if chunk.seq < self._next_seq:
                    continue  # duplicate delivery: drop
                if chunk.seq > self._next_seq:
                    gap = f"token stream gap: expected seq {self._next_seq}, got {chunk.seq}"
                    tried = self._resumable(ErrorInfo.of(ErrorCode.STREAM_LOST, gap))
                    if await self._resume_after_gap(gap):
                        continue
                    # Not resumable (budget spent) is an error of the stream; a resume
                    # the fleet did not take (no stream leader within the failover
                    # window) is retryable: the attempt was cancelled, a retry of the
                    # id runs the next one.
                    self.failure = (ErrorInfo.of(ErrorCode.STREAM_LOST,
                                                 f"{gap}; resuming it failed") if tried
                                    else ErrorInfo.of(ErrorCode.INTERNAL, gap))
                    await self.cancel(GAP_CANCEL_REASON)
                    self._client._note_end(self)
                    raise RequestError.from_info(self.failure)
                self._next_seq += 1
                self._num_tokens += chunk.num_tokens
                if chunk.token_ids:
                    self._token_ids.extend(chunk.token_ids)
                    if not self._wants_token_ids:
                        chunk.token_ids = None
                if chunk.finish_reason is not None:
                    self._done = True
                yield chunk
        finally:
            if not self._done and self.failure is None:
                # The caller stopped reading before the end (a `break`, an exception or
                # a cancel in its loop, the iterator closed or collected): nobody will
                # read the rest, so the fleet stops generating, and billing, it. One
                # loop turn later, so that a caller cancelling it itself (its own
                # reason, e.g. the websocket's client_cancel) goes first.
                with contextlib.suppress(RuntimeError):  # no loop left: nobody to tell
                    asyncio.get_running_loop().call_soon(self._abandoned)
            else:
                self._client._forget(self.request_id)

    def _abandoned(self) -> None:
        if not self._done and self.failure is None:
            self._done = True
            self._client._spawn_cancel(self, "client_gone")

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
