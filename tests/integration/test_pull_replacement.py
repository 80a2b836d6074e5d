"""A freed slot is offered at once, not after the worker's pull has waited its time out.

Real nats-server, the real dispatcher, two real workers (simulator engines). Each
worker has one slot and one prefetch place, so while its request runs its next pull
has prefetch room only. The dispatcher hands queued work to pulls with a free slot
first, and to prefetch room only after: a request given to prefetch room waits inside
that engine until its running request ends. So a worker whose slot frees while its
full pull waits must say so (`gpu_worker.pulling`), or the next request may be queued
behind a long generation on the other worker while this one idles.
"""

from __future__ import annotations

import asyncio

import pytest

from dispatcher.config import DispatcherSettings
from dispatcher.service import Dispatcher
from fairlane.poolconfig import PreemptionConfig, SchedulerConfig
from fairlane.subjects import Subjects
from gpu_worker.config import WorkerSettings
from gpu_worker.engines import make_engine
from gpu_worker.service import Worker
from producer.client import FairlaneClient
from tests.helpers import spec, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


async def test_the_next_request_goes_to_the_slot_that_freed(nats_server, nc, uid):
    subjects = Subjects(f"t{uid}")
    # No preemption: the point is where the request is placed, not what frees a slot.
    dispatcher = Dispatcher(
        DispatcherSettings(nats_url=nats_server.url, prefix=subjects.prefix, pool="p",
                           housekeeping_ms=50),
        SchedulerConfig(policy="fifo", preemption=PreemptionConfig(enabled=False)))
    await dispatcher.start()
    stop = asyncio.Event()
    workers, tasks = [], []
    for i in range(2):
        # A 20-s pull wait: without the replacement, the full pull would still be
        # waiting when the quiet request arrives (with the default 1 s, for a window).
        ws = WorkerSettings(nats_url=nats_server.url, prefix=subjects.prefix, pool="p",
                            worker_id=f"w{i}-{uid}", time_scale=0.5, max_num_seqs=1,
                            prefetch_seqs=1, heartbeat_ms=200, pull_wait_ms=20_000,
                            drain_timeout_s=1.0)
        workers.append(Worker(ws, make_engine(ws)))
        tasks.append(asyncio.create_task(workers[-1].run(stop)))
    client = FairlaneClient(nc, prefix=subjects.prefix)
    await client.start()
    try:
        await wait_until(lambda: len(dispatcher._pulls) == 2, 20)  # both idle, pulling
        long = await client.submit(spec(tenant="flood", pool="p", prompt="x" * 64,
                                        max_tokens=2_000, expected_output_tokens=2_000))
        short = await client.submit(spec(tenant="flood", pool="p", prompt="hi",
                                         max_tokens=4, expected_output_tokens=4))
        long_done = asyncio.create_task(long.collect())
        short_done = await asyncio.wait_for(short.collect(), 20)
        freed = short_done.usage.worker_id
        # The worker that ran the short request offers its slot again at once.
        await wait_until(lambda: any(p.free_slots and p.pull.worker_id == freed
                                     for p in dispatcher._pulls), 5)
        quiet = await client.submit(spec(tenant="quiet", pool="p", prompt="hi",
                                         max_tokens=4, expected_output_tokens=4))
        quiet_done = await asyncio.wait_for(quiet.collect(), 20)
        assert quiet_done.usage.worker_id == freed  # not behind the long request
        assert not long_done.done()  # which is still generating
        assert sum(w.num_pulls_replaced for w in workers) >= 1
        long_done.cancel()
    finally:
        await client.close()
        stop.set()
        await dispatcher.stop()  # answers the waiting pulls: the drains need not wait
        await asyncio.wait_for(asyncio.gather(*tasks), 40)
