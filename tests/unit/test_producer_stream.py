"""A stream drops late chunks of an attempt it has left (pure: no NATS).

A worker cut off by a network partition can deliver its last chunks after the heal,
when the client has already resumed the request elsewhere as the next attempt: those
chunks (stamped with their attempt by the worker) must not mix into the new attempt's
stream, while chunks that carry no attempt (older senders, the dispatcher's error
chunks) are taken as before."""

from __future__ import annotations

import asyncio

import pytest

from fairlane.errors import ErrorCode
from fairlane.protocol import InferenceRequest, TokenChunk, WorkItem
from gpu_worker.inflight import InFlight
from producer.stream import RequestError, RequestStream
from tests.helpers import request

pytestmark = [pytest.mark.unit]


def _stream(attempt: int) -> RequestStream:
    return RequestStream("r1", "acme", "p", None, asyncio.Queue(), attempt=attempt)


def _queued(s: RequestStream) -> list[TokenChunk]:
    out = []
    while not s._queue.empty():
        out.append(s._queue.get_nowait())
    return out


async def test_chunks_of_an_earlier_attempt_are_dropped() -> None:
    s = _stream(attempt=1)
    s._offer(TokenChunk(request_id="r1", seq=84, text="old", attempt=0))
    s._offer(TokenChunk(request_id="r1", seq=84, text="new", attempt=1))
    assert [c.text for c in _queued(s)] == ["new"]
    assert s.num_stale_chunks == 1


async def test_unstamped_and_later_chunks_are_taken() -> None:
    s = _stream(attempt=1)
    s._offer(TokenChunk(request_id="r1", seq=0, text="a"))  # a sender that does not say
    s._offer(TokenChunk(request_id="r1", seq=1, text="b", attempt=2))
    assert [c.text for c in _queued(s)] == ["a", "b"] and s.num_stale_chunks == 0


async def test_worker_stamps_the_attempt_it_serves() -> None:
    req: InferenceRequest = request(request_id="r1", tenant="acme", tier="paid", pool="p", prompt="hi",
                                   max_tokens=4, reply_to="fl.inbox.o.acme.r1")
    req.attempt = 3
    r = InFlight(WorkItem(request=req))  # (an event loop runs: InFlight makes a queue)
    r.buf_text.append("x")
    r.buf_num_tokens = 1
    assert r.take_chunk().attempt == 3


class _Client:
    """What a stream asks of its client around a gap; the continuation's publish is
    refused (no stream leader answered within the failover window)."""

    def __init__(self) -> None:
        self.cancels: list[str] = []
        self.retry_next: set[str] = set()

    async def cancel(self, request_id, pool, tenant, reason) -> None:
        self.cancels.append(reason)

    async def _await_attempt_end(self, stream) -> None:
        return None

    async def _resume(self, stream, error) -> bool:
        stream.failure = error
        return False

    def _note_end(self, stream) -> None:
        if stream.failure is not None and stream.failure.retryable:
            self.retry_next.add(stream.request_id)

    def _forget(self, request_id) -> None:
        return None


async def test_a_gap_whose_resume_is_refused_fails_retryably() -> None:
    """A gap in the token stream cancels the attempt and resumes from the tokens read;
    when the fleet does not take the continuation, the caller gets a retryable
    `stream_lost` (a retry runs the next attempt), not `internal`."""
    client = _Client()
    s = RequestStream("r1", "acme", "p", client, asyncio.Queue(), attempt=0)
    s._request = request(request_id="r1", tenant="acme", tier="paid", pool="p", prompt="hi",
                         max_tokens=8, reply_to="fl.inbox.o.acme.r1")
    s._resumes_left = 2
    s._offer(TokenChunk(request_id="r1", seq=0, text="a", num_tokens=1, token_ids=[7],
                        attempt=0))
    s._offer(TokenChunk(request_id="r1", seq=2, text="c", num_tokens=1, token_ids=[9],
                        attempt=0))
    with pytest.raises(RequestError) as err:
        async for _ in s:
            pass
    assert err.value.code is ErrorCode.STREAM_LOST and err.value.retryable
    assert client.cancels and "r1" in client.retry_next
