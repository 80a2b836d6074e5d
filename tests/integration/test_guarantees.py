"""README delivery guarantees exercised against a real nats-server.

- tokens are at-most-once, in order: duplicates dropped, a gap is an error, an error
  chunk is terminal whatever its seq (producer library, hand-made chunks on the real
  reply subject);
- queued work is durable and held past ack_wait without redelivery (real dispatcher).
"""

from __future__ import annotations

import asyncio

import pytest

from dispatcher.config import DispatcherSettings
from dispatcher.service import Dispatcher
from fairlane.poolconfig import SchedulerConfig
from fairlane.protocol import (
    ErrorCode,
    ErrorInfo,
    Finished,
    Heartbeat,
    PullRequest,
    Started,
    TokenChunk,
    Usage,
    decode_work_batch,
    encode,
)
from fairlane.subjects import Subjects
from producer.client import FairlaneClient, RequestError
from tests.helpers import spec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture
async def client(nc, uid):
    subjects = Subjects(f"t{uid}")
    c = FairlaneClient(nc, prefix=subjects.prefix)
    await c.start()
    yield c
    await c.close()


async def _submit(client: FairlaneClient):
    # No dispatcher serves pool "nobody": every chunk the stream sees is ours.
    return await client.submit(spec(tenant="acme", pool="nobody", tier="standard",
                                    prompt="hi", max_tokens=8))


async def _send(nc, client, stream, **fields) -> None:
    await nc.publish(f"{client.inbox}.{stream.request_id}",
                     encode(TokenChunk(request_id=stream.request_id, **fields)))
    await nc.flush()


async def test_duplicate_seq_is_dropped(nc, client):
    stream = await _submit(client)
    await _send(nc, client, stream, seq=0, text="a", num_tokens=1)
    await _send(nc, client, stream, seq=0, text="a", num_tokens=1)  # duplicate
    await _send(nc, client, stream, seq=1, text="b", num_tokens=1, finish_reason="stop")
    done = await asyncio.wait_for(stream.collect(), 10)
    assert done.text == "ab" and done.finish_reason == "stop"


async def test_seq_gap_fails_the_stream(nc, client):
    stream = await _submit(client)
    await _send(nc, client, stream, seq=0, text="a", num_tokens=1)
    await _send(nc, client, stream, seq=2, text="c", num_tokens=1)  # seq 1 lost
    with pytest.raises(RequestError) as err:
        await asyncio.wait_for(stream.collect(), 10)
    assert "gap" in err.value.message


@pytest.mark.parametrize("seq", [0, 1, 7])
async def test_error_chunk_is_terminal_whatever_its_seq(nc, client, seq):
    stream = await _submit(client)
    await _send(nc, client, stream, seq=0, text="a", num_tokens=1)
    await _send(nc, client, stream, seq=seq,
                error=ErrorInfo.of(ErrorCode.WORKER_LOST, "gone"))
    # Anything after a terminal error is ignored.
    await _send(nc, client, stream, seq=1, text="b", num_tokens=1, finish_reason="stop")
    with pytest.raises(RequestError) as err:
        await asyncio.wait_for(stream.collect(), 10)
    assert err.value.code is ErrorCode.WORKER_LOST


async def test_held_request_is_kept_alive_past_ack_wait_and_served_once(nats_server, nc, uid):
    """ack_wait 1 s, request held (no worker) for ~3.5 s: JetStream never redelivers it,
    and a worker that then appears gets it exactly once."""
    subjects = Subjects(f"t{uid}")
    settings = DispatcherSettings(
        nats_url=nats_server.url, prefix=subjects.prefix, pool="p", worker_timeout_ms=600,
        housekeeping_ms=50, max_tokens=512, ack_wait_s=1,
    )
    dispatcher = Dispatcher(settings, SchedulerConfig(policy="fifo"))
    await dispatcher.start()
    client = FairlaneClient(nc, prefix=subjects.prefix)
    await client.start()
    try:
        stream = await client.submit(spec(tenant="acme", pool="p", prompt="hi", max_tokens=1))
        await asyncio.sleep(3.5)  # the thing under test is the passage of time
        js = nc.jetstream()
        consumers = await js.consumers_info(subjects.requests_stream)
        assert consumers, "dispatcher created no consumer"
        assert all(c.num_redelivered == 0 for c in consumers), \
            [(c.name, c.num_redelivered) for c in consumers]
        assert sum(c.delivered.consumer_seq for c in consumers) == 1

        started: list[str] = []
        pull = PullRequest(worker_id="w1", pool="p", max_items=8, wait_ms=2000)
        await nc.publish(subjects.events("p"), encode(Heartbeat(
            worker_id="w1", pool="p", in_flight_ids=[], interval_ms=100)))
        reply = await nc.request(subjects.work("p"), encode(pull), timeout=5)
        items = decode_work_batch(reply.data).items
        assert [i.request.request_id for i in items] == [stream.request_id]
        item = items[0]
        rid = item.request.request_id
        await nc.publish(subjects.events("p"), encode(Started(request_id=rid, worker_id="w1")))
        started.append(rid)
        usage = Usage(request_id=rid, tenant="acme", pool="p", tier=item.request.tier,
                      completion_tokens=1)
        await nc.publish(item.request.reply_to, encode(TokenChunk(
            request_id=rid, seq=0, text="x", num_tokens=1, finish_reason="stop", usage=usage)))
        await nc.publish(subjects.events("p"), encode(Finished(
            request_id=rid, worker_id="w1", usage=usage)))
        done = await asyncio.wait_for(stream.collect(), 10)
        assert done.text == "x"
        # A second pull finds nothing more: it was served once.
        pull2 = PullRequest(worker_id="w1", pool="p", max_items=8, wait_ms=300)
        reply = await nc.request(subjects.work("p"), encode(pull2), timeout=5)
        assert decode_work_batch(reply.data).items == []
        assert started == [rid]
    finally:
        await client.close()
        await dispatcher.stop()
