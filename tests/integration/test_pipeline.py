"""The walking skeleton end to end, in one process: producer -> real nats-server ->
dispatcher -> gpu_worker (SimEngine) -> tokens back on the reply subject."""

from __future__ import annotations

import asyncio
import collections
import gc
import os
import types
import uuid
from pathlib import Path

import msgspec
import pytest

from fairlane.protocol import ChatMessage, decode_chunk, decode_usage, encode
from tests.helpers import in_process_fleet, request, spec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture
async def fleet(nats_server, nc, uid):
    async with in_process_fleet(nats_server.url, nc, uid, time_scale=0.05) as f:
        yield f


async def test_request_round_trip_tokens_in_order_with_usage_metered(fleet, nc):
    client, subjects = fleet
    stream = await client.submit(spec(tenant="acme", pool="p", prompt="hello world",
                                      max_tokens=40, expected_output_tokens=40,
                                      return_token_ids=True))
    seqs, texts = [], []
    last = None
    async for chunk in stream:
        seqs.append(chunk.seq)
        texts.append(chunk.text)
        last = chunk
    assert seqs == list(range(len(seqs)))
    assert last.finish_reason == "length"
    usage = last.usage
    assert usage.completion_tokens == 40 and usage.prompt_tokens > 0
    assert sum(len(c) for c in texts) > 0
    # The metering record lands in the usage stream, keyed by request id.
    js = nc.jetstream()
    sub = await js.subscribe(subjects.usage("acme"), stream=subjects.usage_stream,
                             ordered_consumer=True)
    msg = await sub.next_msg(timeout=5)
    record = decode_usage(msg.data)
    assert record.request_id == stream.request_id and record.completion_tokens == 40
    assert msg.headers["Nats-Msg-Id"] == stream.request_id
    await sub.unsubscribe()


async def test_many_concurrent_requests_all_complete(fleet):
    client, _ = fleet
    streams = [await client.submit(spec(tenant=f"t{i % 3}", pool="p", prompt="hi", max_tokens=8,
                                        expected_output_tokens=8)) for i in range(30)]
    done = await asyncio.gather(*(s.collect() for s in streams))
    assert all(d.finish_reason == "length" and d.usage.completion_tokens == 8 for d in done)


async def test_same_request_id_published_twice_generates_once(fleet, nc):
    client, subjects = fleet
    rid = uuid.uuid4().hex
    req = request(request_id=rid, tenant="acme", pool="p", tier="standard",
                  reply_to=f"{client.inbox}.{rid}", prompt="hi", max_tokens=5,
                  expected_output_tokens=5)
    started = []

    async def on_event(msg) -> None:
        if b'"started"' in msg.data and rid.encode() in msg.data:
            started.append(msg)

    await nc.subscribe(subjects.events("p"), cb=on_event)
    stream = await client.submit_request(req)
    await nc.jetstream().publish(subjects.request("p", "standard", "acme"), encode(req),
                                 headers={"Nats-Msg-Id": rid})
    assert (await stream.collect()).usage.completion_tokens == 5
    await nc.flush()
    assert len(started) == 1


async def test_request_from_a_newer_producer_with_unknown_fields_is_served(fleet, nc):
    """Rolling upgrade: a producer one version ahead adds fields this dispatcher and
    worker do not know (top level and nested); they ignore them and serve it."""
    client, subjects = fleet
    rid = uuid.uuid4().hex
    reply = f"{client.inbox}.{rid}"
    req = request(request_id=rid, tenant="acme", pool="p", tier="standard", reply_to=reply,
                  messages=[ChatMessage(role="user", content="hi")], max_tokens=6,
                  expected_output_tokens=6)
    body = msgspec.json.decode(encode(req))
    body["logprobs"] = 5
    body["sampling"]["min_p"] = 0.05
    body["messages"][0]["name"] = "alice"
    sub = await nc.subscribe(reply)
    await nc.jetstream().publish(subjects.request("p", "standard", "acme"),
                                 msgspec.json.encode(body), headers={"Nats-Msg-Id": rid})
    chunks = []
    while not (chunks and chunks[-1].is_last):
        chunks.append(decode_chunk((await sub.next_msg(timeout=10)).data))
    await sub.unsubscribe()
    assert chunks[-1].error is None, chunks[-1].error
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 6


PACKAGES = ("dispatcher", "gpu_worker", "producer", "fairlane", "streamer")
REPO_PACKAGES = tuple(str(Path(__file__).resolve().parents[2] / p) + os.sep for p in PACKAGES)


def _fairlanes(obj: object) -> bool:
    """An object of fairlane's own code: an instance of one of its classes, or a frame,
    coroutine or function of its modules."""
    if isinstance(obj, types.FrameType | types.CoroutineType | types.FunctionType):
        code = obj.f_code if isinstance(obj, types.FrameType) else (
            obj.cr_code if isinstance(obj, types.CoroutineType) else obj.__code__)
        return code.co_filename.startswith(REPO_PACKAGES)
    return type(obj).__module__.partition(".")[0] in PACKAGES


async def test_finished_requests_leave_no_cyclic_garbage_of_their_own(fleet):
    """The dispatcher collects young objects only every 50,000 net allocations
    (`fairlane.gctune`): that bounds memory only because a finished request leaves
    nothing that only the cycle collector can free. The whole path runs in this process
    (producer, dispatcher, worker). What the collector does find comes with time, not
    requests (~100 objects a second, none of fairlane's: nats-py's timeouts and their
    tracebacks), so what is counted is fairlane's own objects among it."""
    client, _ = fleet

    async def one(i: int) -> None:
        stream = await client.submit(spec(tenant=f"t{i % 20}", pool="p", prompt="hi",
                                          max_tokens=8))
        async for _chunk in stream:
            pass

    await asyncio.gather(*(one(i) for i in range(100)))  # warm: first-use objects
    gc.collect()
    gc.disable()
    try:
        num_requests = 0
        for _ in range(4):
            await asyncio.gather(*(one(i) for i in range(100)))
            num_requests += 100
        gc.set_debug(gc.DEBUG_SAVEALL)  # keep what it finds, to look at
        gc.collect()
    finally:
        gc.set_debug(0)
        gc.enable()
    found, gc.garbage[:] = list(gc.garbage), []
    ours = [o for o in found if _fairlanes(o)]
    assert len(ours) < num_requests // 10, (
        f"{len(ours)} of fairlane's objects among {len(found)} cyclic garbage after "
        f"{num_requests} requests: {collections.Counter(type(o).__qualname__ for o in ours)}")
