"""The worker's pull loop (`gpu_worker.pulling`) against a real nats-server, with the
simulator engine and the scripted dispatcher of `test_worker`: it asks only for the
room it has, offers a freed slot at once, and waits for (and retries) a dispatcher."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.msg import Msg

from fairlane.protocol import Heartbeat, HeartbeatAck, decode_event, encode
from fairlane.subjects import Subjects
from tests.helpers import wait_until
from tests.integration.test_worker import POOL, FakeDispatcher, work_item, worker_running

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


async def test_pulls_only_with_headroom(nats_server, uid, dispatcher):
    dispatcher.limit = 2 + 1
    subjects = dispatcher.subjects
    dispatcher.add(*(work_item(subjects, f"h{i}", out=5 + i % 7) for i in range(20)))
    async with worker_running(nats_server, uid, max_num_seqs=2, prefetch_seqs=1):
        await dispatcher.wait(lambda: all(dispatcher.finished(f"h{i}") for i in range(20)), 30)
    assert dispatcher.headroom_violations == []
    assert dispatcher.max_outstanding <= 3
    assert all(p.max_items <= 3 and p.worker_id == f"w{uid}" for p in dispatcher.pulls)
    assert all(p.free_kv_tokens > 0 for p in dispatcher.pulls)
    for i in range(20):
        assert dispatcher.chunks[f"h{i}"][-1].finish_reason == "stop"
    assert max(h.load.num_running for h in dispatcher.of(Heartbeat)) <= 2


async def test_a_slot_that_frees_while_a_full_pull_waits_is_advertised_at_once(
        nats_server, uid, dispatcher):
    """One slot and one prefetch: while its request runs, the worker's pull has no slot
    free (prefetch room only). When the request ends, the worker does not leave that
    slot hidden for the rest of the pull's wait: it sends a new pull with the free
    slot, and the old one is answered empty (as `dispatcher.matching` answers it).
    Until that answer is in, the old pull's one item counts as taken: the new one asks
    for 1."""
    subjects = dispatcher.subjects
    dispatcher.add(work_item(subjects, "s1", out=30))
    async with worker_running(nats_server, uid, max_num_seqs=1, prefetch_seqs=1,
                              pull_wait_ms=3_000) as (worker, *_):
        await dispatcher.wait(lambda: dispatcher.complete("s1"))
        await dispatcher.wait(lambda: dispatcher.num_replaced == 1)
        # (max_items, free_slots): while s1 ran, prefetch room only; then the slot.
        assert [(p.max_items, p.free_slots) for p in dispatcher.pulls] == [
            (2, 1), (1, 0), (1, 1)]
        assert worker.num_pulls_replaced == 1
        await wait_until(lambda: len(worker._pulls_out) == 1)  # the old one's answer is in
        dispatcher.add(work_item(subjects, "s2", out=3))  # the new pull takes it
        await dispatcher.wait(lambda: dispatcher.complete("s2"))
        # s2's end freed the slot again: the pull sent full while it ran is replaced.
        await dispatcher.wait(lambda: dispatcher.num_replaced == 2)
    assert worker.num_pulls_replaced == 2
    get = worker.metrics.registry.get_sample_value
    assert get("fairlane_worker_pulls_total", {"kind": "replacement"}) == 2
    assert get("fairlane_worker_pulls_total", {"kind": "new"}) == worker.num_pulls - 2
    assert get("fairlane_worker_pull_failures_total") == 0
    assert worker.num_pulls_failed == 0


async def test_pulls_that_find_no_dispatcher_are_counted_and_retried(nats_server, nc, uid):
    """Heartbeats acknowledged but nobody answering pulls (a dispatcher gone from the
    work subject): each pull fails at once (no responders), is counted
    (`fairlane_worker_pull_failures_total`) and retried with backoff; once a dispatcher
    answers, work flows."""
    subjects = Subjects(f"t{uid}")

    async def ack(msg: Msg) -> None:
        evt = decode_event(msg.data)
        if isinstance(evt, Heartbeat) and msg.reply:
            await msg.respond(encode(HeartbeatAck(known=True, worker_timeout_ms=3_500)))

    hb_sub = await nc.subscribe(subjects.events(POOL), cb=ack)
    async with worker_running(nats_server, uid) as (worker, *_):
        get = worker.metrics.registry.get_sample_value
        await wait_until(lambda: (get("fairlane_worker_pull_failures_total") or 0) >= 2, 10)
        assert worker.num_pulls_failed >= 2
        await hb_sub.unsubscribe()
        d = await FakeDispatcher(nc, subjects).start()
        try:
            d.add(work_item(subjects, "late", out=3))
            await d.wait(lambda: d.complete("late"))
        finally:
            await d.stop()


async def test_worker_waits_for_a_dispatcher(nats_server, nc, uid):
    """No dispatcher acknowledges its heartbeats: the worker takes no work it could not
    report on (no pulls), and starts pulling once one answers."""
    subjects = Subjects(f"t{uid}")
    async with worker_running(nats_server, uid) as (worker, *_):
        beats = 0
        unacked = asyncio.Event()

        async def on_heartbeat(_msg: Msg) -> None:
            nonlocal beats
            beats += 1
            if beats >= 3:
                unacked.set()

        hb_sub = await nc.subscribe(subjects.events(POOL), cb=on_heartbeat)
        await asyncio.wait_for(unacked.wait(), 10)  # heard, but nobody acknowledged
        await hb_sub.unsubscribe()
        assert worker.num_pulls == 0
        d = await FakeDispatcher(nc, subjects).start()
        try:
            d.add(work_item(subjects, "late", out=3))
            await d.wait(lambda: d.finished("late"))
            assert d.chunks["late"][-1].finish_reason == "stop"
        finally:
            await d.stop()
