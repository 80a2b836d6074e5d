"""One request's token stream (`RequestStream`), its errors and its collected result.

Split from `producer.client` (which re-exports these names): the stream is fed by the
client's one inbox subscription and watched by its one silence watchdog.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fairlane.errors import FairlaneError
from fairlane.protocol import ErrorCode, ErrorInfo, TokenChunk, Usage

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

    async def _iterate(self) -> AsyncIterator[TokenChunk]:
        try:
            while not self._done:
                chunk = await self._queue.get()
                if chunk is None:
                    assert self.failure is not None
                    self._client._note_end(self)
                    raise RequestError.from_info(self.failure)
                if chunk.error is not None:  # terminal, accepted whatever its seq
                    self._done = True
                    self.failure = chunk.error
                    self._client._note_end(self)
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
