"""The silence watchdog asks about a client's silent streams in batches: a burst of
queued requests is one status round trip per tick, not one per stream (a real
nats-server and dispatcher, no worker, so every request stays queued and silent)."""

from __future__ import annotations

import asyncio

import pytest

from dispatcher.config import DispatcherSettings
from dispatcher.service import Dispatcher
from fairlane.poolconfig import SchedulerConfig
from fairlane.protocol import RequestStatus, decode_status_request, encode
from fairlane.subjects import Subjects
from producer.client import FairlaneClient
from tests.helpers import spec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

NUM_STREAMS = 120


async def test_silent_streams_are_asked_about_in_one_batch_and_kept_open(nats_server, nc, uid):
    subjects = Subjects(f"t{uid}")
    dispatcher = Dispatcher(
        DispatcherSettings(nats_url=nats_server.url, prefix=subjects.prefix, pool="p"),
        SchedulerConfig(policy="drr"))
    await dispatcher.start()
    asks: list[int] = []  # ids per status request seen on the wire

    async def on_ask(msg) -> None:
        ask = decode_status_request(msg.data)
        asks.append(len(ask.request_ids) or 1)

    await nc.subscribe(subjects.status("p"), cb=on_ask)
    client = FairlaneClient(nc, prefix=subjects.prefix, silence_s=0.4, max_silence_s=1.5)
    await client.start()
    try:
        streams = [await client.submit(spec(tenant=f"t{i % 2}", pool="p", prompt="hi"))
                   for i in range(NUM_STREAMS)]
        await asyncio.sleep(3.0)  # twice max_silence_s without a chunk: the point here
        assert all(not s.is_done and s.failure is None for s in streams)
        # Every stream asked about, by at most one request per tenant and 0.2 s tick
        # (one per stream would be ~NUM_STREAMS per tick).
        assert sum(asks) >= NUM_STREAMS
        assert len(asks) <= 2 * 16, asks
        assert max(asks) <= NUM_STREAMS // 2 and sum(asks) / len(asks) >= 10, asks
        statuses = await client.request_statuses("p", [s.request_id for s in streams[:3]],
                                                 streams[0].tenant)
        assert [statuses[s.request_id].state for s in streams[:3]] == ["queued"] * 3
    finally:
        await client.close()
        await dispatcher.stop()


async def test_a_dispatcher_without_batches_is_asked_one_by_one(nc, uid):
    """A dispatcher that predates batches answers the first id only: the rest are
    asked one at a time, so an upgrade of producers before dispatchers loses nothing."""
    subjects = Subjects(f"t{uid}")

    async def old_dispatcher(msg) -> None:
        ask = decode_status_request(msg.data)  # request_ids ignored, as an old one does
        await nc.publish(msg.reply, encode(RequestStatus(request_id=ask.request_id,
                                                         state="running")))

    await nc.subscribe(subjects.status("p"), cb=old_dispatcher)
    client = FairlaneClient(nc, prefix=subjects.prefix)
    statuses = await client.request_statuses("p", ["a", "b", "c"], "acme")
    assert {rid: st.state for rid, st in statuses.items()} == {
        "a": "running", "b": "running", "c": "running"}
