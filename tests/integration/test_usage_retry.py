"""The worker's usage record reaches FL_USAGE even if the first publishes fail
(gpu_worker/serving.py retries with backoff, idempotent by Nats-Msg-Id): the usage
stream is deleted while a request runs and recreated just after it finishes."""

from __future__ import annotations

import asyncio

import pytest

from dispatcher.config import DispatcherSettings
from dispatcher.service import Dispatcher
from fairlane.poolconfig import SchedulerConfig
from fairlane.protocol import decode_usage
from fairlane.subjects import Subjects
from producer.client import FairlaneClient
from tests.helpers import spec
from tests.procs import Procs

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


async def test_usage_published_after_usage_stream_comes_back(nats_server, nc, uid, tmp_path):
    subjects = Subjects(f"t{uid}")
    dispatcher = Dispatcher(DispatcherSettings(
        nats_url=nats_server.url, prefix=subjects.prefix, pool="p", housekeeping_ms=50),
        SchedulerConfig(policy="fifo"))
    await dispatcher.start()
    client = FairlaneClient(nc, prefix=subjects.prefix)
    await client.start()
    procs = Procs(tmp_path)
    js = nc.jetstream()
    try:
        procs.spawn("worker", "-m", "gpu_worker", "--nats-url", nats_server.url,
                    "--prefix", subjects.prefix, "--pool", "p", "--worker-id", "w1",
                    "--time-scale", "0.05", "--max-num-seqs", "8", "--heartbeat-ms", "200")
        warm = await client.submit(spec(tenant="acme", pool="p", prompt="hi", max_tokens=2))
        await asyncio.wait_for(warm.collect(), 40)  # the worker is up and serving
        config = (await js.stream_info(subjects.usage_stream)).config
        await js.delete_stream(subjects.usage_stream)
        stream = await client.submit(spec(tenant="acme", pool="p", prompt="hi", max_tokens=2))
        await asyncio.wait_for(stream.collect(), 20)
        await asyncio.sleep(0.3)  # the first publish attempts fail: no stream
        await js.add_stream(config)
        sub = await js.pull_subscribe(subjects.usage("acme"), durable=None,
                                      stream=subjects.usage_stream)
        seen: list[str] = []
        for _ in range(20):  # bounded: the retry schedule spans ~3 s
            try:
                msgs = await sub.fetch(10, timeout=0.5)
            except TimeoutError:
                continue
            seen += [decode_usage(m.data).request_id for m in msgs]
            if stream.request_id in seen:
                break
        assert seen.count(stream.request_id) == 1, seen
        # ...and it got there by a retry, not a lucky first attempt.
        log = (tmp_path / "worker.log").read_text()
        assert "usage_publish_failed" in log and stream.request_id in log
    finally:
        procs.close()
        await client.close()
        await dispatcher.stop()
