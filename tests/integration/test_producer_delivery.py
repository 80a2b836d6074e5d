"""The producer's delivery guarantees against a real nats-server, dispatcher and sim
worker: close() cancels upstream, a silent stream ends with `stream_lost`, a retry
with the same request id after a retryable failure is served to the end, and a first
connect to no server is an error, not a wait for ever."""

from __future__ import annotations

import asyncio

import nats
import pytest

from dispatcher.config import DispatcherSettings
from dispatcher.service import Dispatcher
from fairlane.poolconfig import SchedulerConfig
from fairlane.protocol import (
    ErrorCode,
    ErrorInfo,
    Finished,
    TokenChunk,
    decode_event,
    encode,
)
from fairlane.subjects import Subjects
from producer.client import FairlaneClient, RequestError
from tests.helpers import in_process_fleet, spec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture
async def fleet(nats_server, nc, uid):
    async with in_process_fleet(nats_server.url, nc, uid, time_scale=1.0) as f:
        yield f


async def _finished_events(nc, subjects: Subjects) -> tuple[dict[str, Finished], asyncio.Event]:
    finished: dict[str, Finished] = {}
    changed = asyncio.Event()

    async def on_evt(msg) -> None:
        try:
            evt = decode_event(msg.data)
        except Exception:  # noqa: BLE001 - other event kinds / versions: not ours
            return
        if isinstance(evt, Finished):
            finished[evt.request_id] = evt
            changed.set()

    await nc.subscribe(subjects.events("p"), cb=on_evt)
    return finished, changed


async def _wait_for(changed: asyncio.Event, pred, timeout_s: float) -> None:
    async with asyncio.timeout(timeout_s):
        while not pred():
            changed.clear()
            await changed.wait()


async def test_close_cancels_every_open_request_upstream(fleet, nc):
    client, subjects = fleet
    finished, changed = await _finished_events(nc, subjects)
    streams = [await client.submit(spec(tenant="acme", pool="p", prompt="hi",
                                        max_tokens=4000, expected_output_tokens=4000))
               for _ in range(4)]
    # Every one is running on the worker. Keep the iterators: a dropped one finalises
    # and forgets its stream.
    iters = [s.__aiter__() for s in streams]
    for it in iters:
        await asyncio.wait_for(it.__anext__(), 15)
    ids = {s.request_id for s in streams}
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await client.close()
    await _wait_for(changed, lambda: ids <= finished.keys(), 5)
    assert loop.time() - t0 < 1.5
    assert all(finished[i].usage is None or finished[i].usage.completion_tokens < 4000
               for i in ids)


async def test_a_reader_that_stops_early_cancels_its_request_upstream(fleet, nc):
    # A `break` out of the stream (or an exception in the reader's loop) means nobody
    # reads the rest: the worker stops generating it, and the usage bills only what
    # was generated until then.
    client, subjects = fleet
    finished, changed = await _finished_events(nc, subjects)
    stream = await client.submit(spec(tenant="acme", pool="p", prompt="hi",
                                      max_tokens=4000, expected_output_tokens=4000))
    async for _chunk in stream:
        break
    await _wait_for(changed, lambda: stream.request_id in finished, 5)
    fin = finished[stream.request_id]
    assert fin.error is not None and fin.error.code is ErrorCode.CANCELLED
    assert fin.usage is None or fin.usage.completion_tokens < 4000
    assert client.num_open_streams == 0


async def test_silent_stream_with_no_dispatcher_ends_with_stream_lost(nc, uid):
    subjects = Subjects(f"t{uid}")
    client = FairlaneClient(nc, prefix=subjects.prefix, silence_s=0.2, max_silence_s=1.0)
    await client.start()
    try:
        stream = await client.submit(spec(tenant="acme", pool="nobody", tier="standard",
                                          prompt="hi", max_tokens=4))
        with pytest.raises(RequestError) as err:
            await asyncio.wait_for(stream.collect(), 10)
        assert err.value.code is ErrorCode.STREAM_LOST and err.value.retryable
        assert client.num_open_streams == 0
    finally:
        await client.close()


async def test_no_tier_and_no_dispatcher_is_refused_promptly_as_overloaded(nc, uid):
    # The tier comes from the pool's dispatcher; with none answering the submit is
    # refused (retryable) after a brief re-ask, never left waiting.
    subjects = Subjects(f"t{uid}")
    client = FairlaneClient(nc, prefix=subjects.prefix)
    await client.start()
    try:
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(RequestError) as err:
            await client.submit(spec(tenant="acme", pool="nobody", prompt="hi", max_tokens=4))
        assert err.value.code is ErrorCode.OVERLOADED and err.value.retryable
        assert "no dispatcher answers for pool 'nobody'" in err.value.message
        assert asyncio.get_running_loop().time() - t0 < 2.0
        assert client.num_open_streams == 0
    finally:
        await client.close()


async def test_retry_with_same_id_after_worker_lost_is_served(fleet, nc):
    client, subjects = fleet
    # The caller's own retry (migration, which resumes by itself, is turned off here:
    # the worker_lost below is injected while the real worker still streams).
    client.max_resumes = 0
    finished, changed = await _finished_events(nc, subjects)
    first = await client.submit(spec(tenant="acme", pool="p", prompt="hi", max_tokens=20,
                                     expected_output_tokens=20))
    rid = first.request_id
    it = first.__aiter__()
    await asyncio.wait_for(it.__anext__(), 15)
    # The dispatcher's verdict when a started request's worker is gone.
    lost = TokenChunk(request_id=rid, seq=10_000,
                      error=ErrorInfo.of(ErrorCode.WORKER_LOST, "worker gone (test)"))
    await nc.publish(f"{client.inbox}.{rid}", encode(lost))
    with pytest.raises(RequestError) as err:
        await asyncio.wait_for(it.__anext__(), 10)
    assert err.value.code is ErrorCode.WORKER_LOST
    await _wait_for(changed, lambda: rid in finished, 15)  # attempt 0 is over
    again = await client.submit(spec(tenant="acme", pool="p", prompt="hi", max_tokens=20,
                                     expected_output_tokens=20, request_id=rid))
    assert again.attempt == 1
    done = await asyncio.wait_for(again.collect(), 20)
    assert done.finish_reason == "length" and done.usage.completion_tokens == 20


async def test_a_long_queued_stream_is_vouched_for_by_the_dispatcher(nats_server, nc, uid):
    """No worker: the request waits in the dispatcher far past the client's silence
    bound; the dispatcher's status answer ("queued") keeps the stream open."""
    subjects = Subjects(f"t{uid}")
    dispatcher = Dispatcher(
        DispatcherSettings(nats_url=nats_server.url, prefix=subjects.prefix, pool="p"),
        SchedulerConfig(policy="drr"),
    )
    await dispatcher.start()
    client = FairlaneClient(nc, prefix=subjects.prefix, silence_s=0.2, max_silence_s=1.0)
    await client.start()
    try:
        stream = await client.submit(spec(tenant="acme", pool="p", tier="standard", prompt="hi"))
        await asyncio.sleep(2.5)  # 2.5x max_silence_s without a chunk: the point here
        assert not stream.is_done and stream.failure is None
        status = await client.request_status("p", stream.request_id, "acme")
        assert status is not None and status.state == "queued"
    finally:
        await client.close()
        await dispatcher.stop()


async def test_resubmitting_a_finished_request_id_is_answered_not_generated_twice(fleet, nc):
    client, subjects = fleet
    started: list[str] = []

    async def on_evt(msg) -> None:
        try:
            evt = decode_event(msg.data)
        except Exception:  # noqa: BLE001 - other event kinds: not ours
            return
        if type(evt).__name__ == "Started":
            started.append(evt.request_id)

    await nc.subscribe(subjects.events("p"), cb=on_evt)
    first = await client.submit(spec(tenant="acme", pool="p", tier="standard", prompt="hi",
                                     max_tokens=4, request_id="same-id-1"))
    assert (await asyncio.wait_for(first.collect(), 20)).finish_reason == "length"
    with pytest.raises(RequestError) as err:
        again = await client.submit(spec(tenant="acme", pool="p", tier="standard",
                                         prompt="hi", max_tokens=4, request_id="same-id-1"))
        await asyncio.wait_for(again.collect(), 20)
    assert err.value.code is ErrorCode.DUPLICATE and "finished" in err.value.message
    await nc.flush()
    assert started.count("same-id-1") == 1


async def _served_once_as_attempt_0(client: FairlaneClient):
    """Submit an 8-token request; it must complete in full as its first attempt."""
    stream = await client.submit(spec(tenant="acme", pool="p", prompt="hi", max_tokens=8,
                                      expected_output_tokens=8))
    done = await asyncio.wait_for(stream.collect(), 20)
    assert done.usage is not None and done.usage.completion_tokens == 8
    assert stream.attempt == 0 and stream.num_resumes == 0
    return stream


async def test_duplicate_of_our_own_resend_attaches_not_a_second_attempt(fleet, nc):
    """A publish whose PubAck is lost (a stream-leader election, a node cut off) is
    sent again with the same message id; when the first copy was stored, JetStream
    answers the second as a duplicate. That copy is the client's own: the submit
    attaches to it, even while no dispatcher knows the request yet, instead of failing
    with `duplicate` or publishing a second attempt that would run beside it (the
    partition chaos run found both)."""
    client, subjects = fleet
    real_publish = client.js.publish
    calls: list[dict] = []

    async def publish_losing_first_ack(subject, payload, **kw):
        calls.append(kw.get("headers") or {})
        ack = await real_publish(subject, payload, **kw)
        if len(calls) == 1:
            raise nats.errors.TimeoutError  # stored, but the PubAck never came
        return ack

    client.js.publish = publish_losing_first_ack
    stream = await _served_once_as_attempt_0(client)
    # Both sends carried attempt 0's message id; nothing was published as attempt 1.
    assert [h["Nats-Msg-Id"] for h in calls] == [stream.request_id] * 2


async def test_duplicate_of_our_copy_flushed_behind_our_back_attaches(fleet, nc):
    """The copy JetStream kept may be ours without guard_publish having sent it twice:
    nats-py flushes a publish buffered while its node was cut off once it has failed
    over, and the wait for that publish's PubAck then ends in a re-send. The status of
    the stored copy names its reply subject: ours, so the submit attaches."""
    client, subjects = fleet
    real_publish = client.js.publish

    async def publish_after_an_early_copy(subject, payload, **kw):
        # The same message, stored first (as the late flush would store it).
        await nc.publish(subject, payload, headers=kw.get("headers"))
        await nc.flush()
        return await real_publish(subject, payload, **kw)

    client.js.publish = publish_after_an_early_copy
    await _served_once_as_attempt_0(client)


async def test_connecting_to_no_server_is_an_error_within_its_wait_not_a_wait_for_ever():
    """Once connected the client reconnects for ever, but a wrong URL or a server that
    is down answers the first connect with ConnectionError (nats-py alone would retry
    it without end)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(ConnectionError, match=r"nats://127\.0\.0\.1:1 within 1\.5 s"):
        await FairlaneClient.connect("nats://127.0.0.1:1", connect_wait_s=1.5)
    assert loop.time() - t0 < 10


async def test_connect_wait_none_still_connects_to_a_live_server(nats_server):
    client = await FairlaneClient.connect(nats_server.url, connect_wait_s=None)
    try:
        assert client.nc.is_connected
    finally:
        await client.close()
