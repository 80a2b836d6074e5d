"""Queued work is durable: dispatcher A holds queued requests (no worker), dies by
SIGKILL (no nak); dispatcher B on the same pool gets them after ack_wait and each is
dispatched exactly once."""

from __future__ import annotations

import asyncio
import collections

import pytest
from nats.errors import NoRespondersError

from fairlane.protocol import Heartbeat, PullRequest, decode_work_batch, encode
from fairlane.subjects import Subjects
from producer.client import FairlaneClient
from tests.helpers import spec, wait_until
from tests.procs import Procs, kill9

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


def _dispatcher(procs: Procs, url: str, prefix: str, name: str):
    return procs.spawn(name, "-m", "dispatcher", "--nats-url", url, "--prefix", prefix,
                       "--pool", "p", "--ack-wait-s", "1", "--leader-lease-ttl-s", "1",
                       "--housekeeping-ms", "50")


async def test_held_requests_come_back_to_the_next_dispatcher_once(nats_server, nc, uid,
                                                                    tmp_path):
    procs = Procs(tmp_path)
    subjects = Subjects(f"t{uid}")
    client = FairlaneClient(nc, prefix=subjects.prefix)
    try:
        a = _dispatcher(procs, nats_server.url, subjects.prefix, "dispA")
        await client.start()
        ids = []
        for _ in range(3):
            s = await client.submit(spec(tenant="acme", pool="p", tier="standard",
                                         prompt="hi", max_tokens=2))
            ids.append(s.request_id)
        js = nc.jetstream()

        async def held() -> bool:
            try:
                cons = await js.consumers_info(subjects.requests_stream)
            except Exception:
                return False
            return sum(c.num_ack_pending for c in cons) == 3

        await wait_until(held, 20, 0.05)
        kill9(a)
        _dispatcher(procs, nats_server.url, subjects.prefix, "dispB")
        got: collections.Counter = collections.Counter()
        for _ in range(80):  # bounded: ~40 s at most
            await nc.publish(subjects.events("p"), encode(Heartbeat(
                worker_id="w1", pool="p", in_flight_ids=sorted(got), interval_ms=100)))
            try:
                reply = await nc.request(subjects.work("p"), encode(PullRequest(
                    worker_id="w1", pool="p", max_items=8, wait_ms=300)), timeout=1.5)
            except (TimeoutError, NoRespondersError):
                await asyncio.sleep(0.2)  # B not up yet
                continue
            got.update(i.request.request_id for i in decode_work_batch(reply.data).items)
            if set(ids) <= set(got):
                break
        assert set(got) == set(ids), got
        assert all(n == 1 for n in got.values()), got
    finally:
        await client.close()
        procs.close()
