"""A stream drops late chunks of an attempt it has left (pure: no NATS).

A worker cut off by a network partition can deliver its last chunks after the heal,
when the client has already resumed the request elsewhere as the next attempt: those
chunks (stamped with their attempt by the worker) must not mix into the new attempt's
stream, while chunks that carry no attempt (older senders, the dispatcher's error
chunks) are taken as before."""

from __future__ import annotations

import asyncio

import pytest

from fairlane.protocol import InferenceRequest, TokenChunk, WorkItem
from gpu_worker.inflight import InFlight
from producer.stream import RequestStream
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
