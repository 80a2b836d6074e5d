"""Standby dispatchers: one leader per pool by a NATS KV lease; epochs fence batches."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest

from dispatcher.config import DispatcherSettings
from dispatcher.service import Dispatcher
from fairlane.poolconfig import SchedulerConfig
from fairlane.protocol import PullRequest, decode_work_batch, encode
from fairlane.subjects import Subjects
from producer.client import FairlaneClient
from tests.helpers import spec, wait_until
from tests.integration.test_dispatcher import ScriptedWorker

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def _dispatcher(url: str, subjects: Subjects, worker_timeout_ms: int = 600) -> Dispatcher:
    settings = DispatcherSettings(
        nats_url=url, prefix=subjects.prefix, pool="p", worker_timeout_ms=worker_timeout_ms,
        housekeeping_ms=50, max_tokens=512, ack_wait_s=5, leader_lease_ttl_s=1.5)
    return Dispatcher(settings, SchedulerConfig(policy="fifo"))


@pytest.fixture(params=[600, 3_500], ids=["short-timeout", "default-timeout"])
async def pair(nats_server, nc, uid, request):
    # With the default worker timeout (3.5 s) a restart grace would hold the handed-back
    # requests past the 2 s target: a graceful predecessor must need no grace.
    subjects = Subjects(f"t{uid}")
    leader = _dispatcher(nats_server.url, subjects, request.param)
    await asyncio.wait_for(leader.start(), 10)
    standby = _dispatcher(nats_server.url, subjects, request.param)
    standby_start = asyncio.create_task(standby.start())
    client = FairlaneClient(nc, prefix=subjects.prefix)
    await client.start()
    yield leader, standby, standby_start, client, subjects
    await client.close()
    standby_start.cancel()
    for d in (leader, standby):
        if not d._stopping:
            await d.stop()
        elif d.lease is not None:
            await d.lease.stop()


async def test_only_the_leader_dispatches_and_stamps_its_epoch(pair, nc):
    leader, standby, standby_start, client, subjects = pair
    await asyncio.sleep(2)  # several standby polls: it must stay standby
    assert not standby_start.done() and not standby.ready.is_set()
    assert leader.epoch > 0 and standby.epoch == 0
    w = await ScriptedWorker(nc, subjects, "p", "w1").start()
    streams = [await client.submit(spec(tenant="acme", pool="p", prompt=f"x{i}", max_tokens=2))
               for i in range(3)]
    await wait_until(lambda: leader.scheduler.num_queued == 3, 5)  # one batch holds all
    pull = PullRequest(worker_id="w1", pool="p", max_items=8, wait_ms=1000)
    reply = await nc.request(subjects.work("p"), encode(pull), timeout=4)
    batch = decode_work_batch(reply.data)
    assert {i.request.request_id for i in batch.items} == {s.request_id for s in streams}
    assert batch.epoch == leader.epoch
    assert standby.scheduler.num_in_flight == 0  # the standby holds nothing
    w.die()


async def test_graceful_stop_hands_over_within_2s(pair, nc):
    leader, standby, standby_start, client, subjects = pair
    old_epoch = leader.epoch
    streams = [await client.submit(spec(tenant="acme", pool="p", prompt=f"x{i}", max_tokens=2))
               for i in range(5)]

    await wait_until(lambda: leader.scheduler.num_queued == 5, 5)
    t0 = time.monotonic()
    await leader.stop()  # releases the lease and naks its queued messages
    await asyncio.wait_for(standby_start, 2)
    assert standby.epoch > old_epoch
    w = await ScriptedWorker(nc, subjects, "p", "w2").start()
    got: set[str] = set()
    while len(got) < 5 and time.monotonic() - t0 < 2:
        try:
            got |= {i.request.request_id for i in await w.pull(max_items=8, wait_ms=300)}
        except nats.errors.NoRespondersError:
            # As the real worker does (gpu_worker.service: a routine, debug-level retry):
            # a pull can find no responders right after the takeover even though the
            # standby flushed its subscriptions before `ready` (seen once in ~20 CI runs;
            # cause not proven). The 2 s bound below still holds for the whole handover.
            await asyncio.sleep(0.02)
    assert got == {s.request_id for s in streams}
    assert time.monotonic() - t0 < 2.5
    w.die()


async def test_a_fenced_leader_answers_no_pulls(pair, nc):
    leader, standby, standby_start, client, subjects = pair
    await client.submit(spec(tenant="acme", pool="p", prompt="x", max_tokens=2))
    await asyncio.sleep(0.3)
    leader.lease.machine.written_ms = -1e12  # as if its renewals stopped reaching NATS
    pull = PullRequest(worker_id="w3", pool="p", max_items=8, wait_ms=300)
    with pytest.raises(TimeoutError):
        await nc.request(subjects.work("p"), encode(pull), timeout=1)


async def test_a_fenced_leader_never_leads_again(nats_server, nc, uid):
    # Alone in its pool: once fenced, nothing competes for the key, and before the fix
    # its lease loop re-took it when it expired and the dispatcher served batches
    # stamped epoch 0 that every worker refused and handed back, for ever. Now the
    # lease resigns, and a fresh dispatcher takes over with a newer epoch.
    subjects = Subjects(f"t{uid}")
    fenced = _dispatcher(nats_server.url, subjects)
    await asyncio.wait_for(fenced.start(), 10)
    first_epoch = fenced.epoch
    fenced.lease.machine.written_ms = -1e12  # as if its renewals stopped reaching NATS
    await asyncio.wait_for(fenced.lease_lost.wait(), 5)
    assert fenced.epoch == 0
    await asyncio.wait_for(asyncio.shield(fenced.lease._task), 5)  # stopped competing
    await fenced.stop()  # as `__main__` does before it rejoins with a fresh dispatcher
    assert not fenced.lease.leading()
    successor = _dispatcher(nats_server.url, subjects)
    try:
        await asyncio.wait_for(successor.start(), 10)  # the key lapses: it leads
        assert successor.epoch > first_epoch
        await FairlaneClient(nc, prefix=subjects.prefix).submit(
            spec(tenant="acme", pool="p", prompt="x", max_tokens=2))
        pull = PullRequest(worker_id="w9", pool="p", max_items=8, wait_ms=2_000)
        batch = decode_work_batch((await nc.request(subjects.work("p"), encode(pull),
                                                    timeout=5)).data)
        assert batch.items and batch.epoch == successor.epoch
    finally:
        await successor.stop()


async def test_a_renewal_that_landed_after_its_timeout_keeps_the_lease(nats_server, nc, uid):
    # A slow broker: the leader's renewal times out on its side but the server applied
    # it, so the revision the leader holds is stale and its next compare-and-set fails.
    # The key still holds the leader's own value, so it is still the leader: it renews
    # from the key's revision instead of fencing itself and failing over for nothing.
    subjects = Subjects(f"t{uid}")
    leader = _dispatcher(nats_server.url, subjects)
    await asyncio.wait_for(leader.start(), 10)
    try:
        lease = leader.lease
        kv = await nc.jetstream().key_value(f"{subjects.prefix}_leader")
        landed = await kv.update("p", lease.holder.encode(), last=lease.machine.revision)
        await wait_until(lambda: lease.machine.revision > landed, 5)  # renewed past it
        assert not leader.lease_lost.is_set() and lease.leading()
        assert leader.epoch == lease.machine.epoch
    finally:
        await leader.stop()


async def test_a_lease_check_that_gets_no_answer_does_not_fence_the_leader(nats_server, nc,
                                                                           uid):
    # The renewal's compare-and-set fails on a stale revision and the check of whose
    # value the key holds then times out (a slow broker): that is no answer about the
    # key, so the leader keeps trying until its fence deadline instead of giving up a
    # lease it still holds.
    subjects = Subjects(f"t{uid}")
    leader = _dispatcher(nats_server.url, subjects)
    await asyncio.wait_for(leader.start(), 10)
    try:
        lease = leader.lease
        real_get, unanswered = lease._kv.get, []

        async def slow_get(key, *args, **kwargs):
            if not unanswered:
                unanswered.append(key)
                raise TimeoutError  # what asyncio.wait_for raises for a slow reply
            return await real_get(key, *args, **kwargs)

        lease._kv.get = slow_get
        kv = await nc.jetstream().key_value(f"{subjects.prefix}_leader")
        landed = await kv.update("p", lease.holder.encode(), last=lease.machine.revision)
        await wait_until(lambda: lease.machine.revision > landed, 5)  # renewed past it
        assert unanswered == ["p"]
        assert not leader.lease_lost.is_set() and lease.leading()
    finally:
        await leader.stop()
