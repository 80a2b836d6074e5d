"""Nothing stranded: a request on a subject no dispatcher serves gets an explicit error
on its reply subject within seconds and leaves FL_REQUESTS (dispatcher/janitor.py)."""

from __future__ import annotations

import asyncio

import pytest

from dispatcher.config import DispatcherSettings
from dispatcher.service import Dispatcher
from fairlane.poolconfig import SchedulerConfig
from fairlane.protocol import ErrorCode, decode_chunk, encode
from fairlane.subjects import Subjects
from tests.helpers import request, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture
async def dispatcher(nats_server, uid):
    subjects = Subjects(f"t{uid}")
    d = Dispatcher(DispatcherSettings(
        nats_url=nats_server.url, prefix=subjects.prefix, pool="p", worker_timeout_ms=600,
        housekeeping_ms=50, ack_wait_s=5, janitor_every_s=0.2, stranded_after_s=1.5,
    ), SchedulerConfig(policy="drr"))
    await d.start()
    yield d, subjects
    await d.stop()


async def _publish_raw(nc, subjects: Subjects, pool: str, tier: str, rid: str):
    """As a client that bypassed the library would: JetStream accepts any subject."""
    reply = f"{subjects.prefix}.inbox.raw.{rid}"
    answers: asyncio.Queue = asyncio.Queue()

    async def on_chunk(msg) -> None:
        answers.put_nowait(decode_chunk(msg.data))

    await nc.subscribe(reply, cb=on_chunk)
    req = request(request_id=rid, tenant="acme", pool=pool, tier=tier, reply_to=reply,
                  prompt="hi")
    await nc.jetstream().publish(subjects.request(pool, tier, "acme"), encode(req))
    return answers


async def _subject_count(nc, subjects: Subjects, subject: str) -> int:
    info = await nc.jetstream().stream_info(subjects.requests_stream, subjects_filter=subject)
    return (info.state.subjects or {}).get(subject, 0)


async def test_unknown_tier_of_a_served_pool_is_answered_and_removed(dispatcher, nc):
    d, subjects = dispatcher
    answers = await _publish_raw(nc, subjects, "p", "platinum", "r-tier")
    chunk = await asyncio.wait_for(answers.get(), 5)
    assert chunk.request_id == "r-tier" and chunk.error.code == ErrorCode.INVALID_REQUEST
    assert "platinum" in chunk.error.message and "standard" in chunk.error.message

    async def gone() -> bool:
        return await _subject_count(nc, subjects, subjects.request("p", "platinum", "acme")) == 0

    await wait_until(gone, 5)
    assert answers.empty()  # answered once


async def test_pool_nobody_serves_is_answered_after_the_grace(dispatcher, nc):
    d, subjects = dispatcher
    answers = await _publish_raw(nc, subjects, "nosuchpool", "standard", "r-pool")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    chunk = await asyncio.wait_for(answers.get(), 10)
    assert chunk.error.code == ErrorCode.INVALID_REQUEST
    assert "nosuchpool" in chunk.error.message
    assert loop.time() - t0 < 5  # within seconds, not forever

    async def gone() -> bool:
        return await _subject_count(
            nc, subjects, subjects.request("nosuchpool", "standard", "acme")) == 0

    await wait_until(gone, 5)


async def test_a_served_pool_whose_leader_is_gone_keeps_its_requests(dispatcher, nc, nats_server):
    """Durability wins: a pool that was led keeps its queue while its dispatcher is down."""
    d, subjects = dispatcher
    other = Dispatcher(DispatcherSettings(
        nats_url=nats_server.url, prefix=subjects.prefix, pool="q", ack_wait_s=5,
        ), SchedulerConfig(policy="drr"))
    await other.start()
    await wait_until(lambda: "q" in d.janitor._led_pools, 5)
    await other.stop()
    answers = await _publish_raw(nc, subjects, "q", "standard", "r-wait")
    await asyncio.sleep(2.5)  # past stranded_after_s: still waiting for its dispatcher
    assert answers.empty()
    assert await _subject_count(nc, subjects, subjects.request("q", "standard", "acme")) == 1


async def test_republishing_a_queued_id_answers_or_attaches_and_leaves_the_stream(
        dispatcher, nc):
    """The same id published again (no Nats-Msg-Id, so JetStream keeps both) while the
    first is still queued: another reply subject is told `duplicate`; the same one
    attaches. The extra message is removed at once, not parked for ack_wait."""
    d, subjects = dispatcher
    first = await _publish_raw(nc, subjects, "p", "standard", "r-dup")
    await wait_until(lambda: d.scheduler.is_queued("r-dup"), 5)
    # Same body, same reply subject: attaches silently.
    req = request(request_id="r-dup", tenant="acme", pool="p", tier="standard",
                  reply_to=f"{subjects.prefix}.inbox.raw.r-dup", prompt="hi")
    await nc.jetstream().publish(subjects.request("p", "standard", "acme"), encode(req))
    # Another reply subject: an explicit answer.
    other = await _publish_raw(nc, subjects, "p", "standard", "r-dup-x")
    twin = request(request_id="r-dup", tenant="acme", pool="p", tier="standard",
                   reply_to=f"{subjects.prefix}.inbox.raw.r-dup-x", prompt="hi")
    await nc.jetstream().publish(subjects.request("p", "standard", "acme"), encode(twin))
    chunk = await asyncio.wait_for(other.get(), 5)
    assert chunk.request_id == "r-dup" and chunk.error.code == ErrorCode.DUPLICATE
    assert "queued" in chunk.error.message

    async def one_left() -> bool:  # r-dup itself, still queued; r-dup-x is its own id
        n = await _subject_count(nc, subjects, subjects.request("p", "standard", "acme"))
        return n == 2

    await wait_until(one_left, 5)
    assert first.empty()  # the original's stream was not touched
    assert d.scheduler.is_queued("r-dup")
