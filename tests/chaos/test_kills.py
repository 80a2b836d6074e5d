"""kill -9 under load, with every part a real process on a real nats-server.

- The dispatcher dies mid-load and is restarted: every accepted request completes,
  and each is generated exactly once (one `Started` per request id).
- A worker dies mid-generation: its started requests resume on another worker from
  the tokens their clients have (one unbroken stream, output equal to an undisturbed
  run); without a resume budget they end with a retryable `worker_lost`. Requests it
  had not started run on another worker.
"""

from __future__ import annotations

import asyncio
import collections

import pytest

from fairlane.protocol import ErrorCode, Started, decode_event
from fairlane.subjects import Subjects
from producer.client import FairlaneClient, RequestError
from tests.helpers import spec, wait_until
from tests.procs import Procs, kill9

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(180)]


@pytest.fixture
def procs(tmp_path):
    p = Procs(tmp_path)
    yield p
    p.close()


def _dispatcher(procs: Procs, url: str, prefix: str, name: str = "dispatcher"):
    return procs.spawn(name, "-m", "dispatcher", "--nats-url", url, "--prefix", prefix,
                       "--pool", "p", "--ack-wait-s", "3", "--worker-timeout-ms", "1500",
                       "--housekeeping-ms", "50")


def _worker(procs: Procs, url: str, prefix: str, name: str, time_scale: float):
    return procs.spawn(name, "-m", "gpu_worker", "--nats-url", url, "--prefix", prefix,
                       "--pool", "p", "--worker-id", name, "--time-scale", str(time_scale),
                       "--max-num-seqs", "8", "--heartbeat-ms", "200")


async def _count_started(nc, subjects: Subjects) -> collections.Counter:
    started: collections.Counter = collections.Counter()

    async def on_event(msg) -> None:
        ev = decode_event(msg.data)
        if isinstance(ev, Started) and not ev.resumed:  # a continuation is not a rerun
            started[ev.request_id] += 1

    await nc.subscribe(subjects.events("p"), cb=on_event)
    return started


async def test_dispatcher_kill9_under_load_every_request_completes_exactly_once(
        nats_server, nc, uid, procs):
    subjects = Subjects(f"t{uid}")
    url = nats_server.url
    started = await _count_started(nc, subjects)
    dispatcher = _dispatcher(procs, url, subjects.prefix)
    for i in range(2):
        _worker(procs, url, subjects.prefix, f"w{i}-{uid}", time_scale=0.3)
    client = FairlaneClient(nc, prefix=subjects.prefix)
    await client.start()
    num_requests = 120
    # tier given explicitly: submitting must work while no dispatcher is up.
    streams = [await client.submit(spec(tenant=f"t{i % 4}", pool="p", tier="standard",
                                        prompt="hello", max_tokens=12, expected_output_tokens=12))
               for i in range(num_requests)]
    collectors = [asyncio.create_task(s.collect()) for s in streams]
    await wait_until(lambda: sum(c.done() for c in collectors) >= 20, 60)
    kill9(dispatcher)  # mid-load: requests queued, dispatched-not-started and running
    await asyncio.sleep(0.5)
    _dispatcher(procs, url, subjects.prefix, "dispatcher-2")
    results = await asyncio.wait_for(asyncio.gather(*collectors, return_exceptions=True), 120)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert errors == []
    assert all(r.usage.completion_tokens == 12 for r in results)
    await nc.flush()
    assert set(started) == {s.request_id for s in streams}
    assert [rid for rid, n in started.items() if n != 1] == []  # generated exactly once
    await client.close()


async def _kill_worker_mid_stream(nats_server, nc, uid, procs, *, max_resumes: int,
                                  seed_base: int):
    """12 long requests on a worker killed mid-stream; a rescue worker takes over.
    Returns (streams, results, ids started on the doomed worker, client)."""
    subjects = Subjects(f"t{uid}")
    url = nats_server.url
    started = await _count_started(nc, subjects)
    _dispatcher(procs, url, subjects.prefix)
    doomed = _worker(procs, url, subjects.prefix, f"doomed-{uid}", time_scale=1.0)
    client = FairlaneClient(nc, prefix=subjects.prefix, max_resumes=max_resumes)
    await client.start()
    await wait_until(lambda: client.nc.is_connected, 5)
    # 8 slots + 4 prefetch on the doomed worker; long outputs so they are mid-stream.
    # A fixed seed per request fixes the simulator's tokens (as greedy sampling would).
    streams = [await client.submit(spec(tenant="acme", pool="p", tier="standard", prompt="x",
                                        max_tokens=400, expected_output_tokens=400,
                                        seed=seed_base + i, return_token_ids=True))
               for i in range(12)]
    collectors = [asyncio.create_task(s.collect()) for s in streams]
    await wait_until(lambda: len(started) >= 8, 60)  # its batch is full and streaming
    on_doomed = set(started)
    kill9(doomed)
    _worker(procs, url, subjects.prefix, f"rescue-{uid}", time_scale=0.05)
    results = await asyncio.wait_for(asyncio.gather(*collectors, return_exceptions=True), 120)
    return streams, results, on_doomed, client


async def test_worker_kill9_started_streams_resume_elsewhere_unbroken(
        nats_server, nc, uid, procs):
    streams, results, on_doomed, client = await _kill_worker_mid_stream(
        nats_server, nc, uid, procs, max_resumes=2, seed_base=1000)
    assert [r for r in results if isinstance(r, BaseException)] == []  # 100% complete
    for stream, r in zip(streams, results, strict=True):
        assert r.usage.completion_tokens == 400 and len(r.token_ids) == 400
        assert stream.num_resumes == (1 if stream.request_id in on_doomed else 0)
    assert client.num_resumes == len(on_doomed) > 0
    # The resumed outputs equal an undisturbed run of the same requests.
    calm = [await client.submit(spec(tenant="acme", pool="p", tier="standard", prompt="x",
                                     max_tokens=400, expected_output_tokens=400,
                                     seed=1000 + i, return_token_ids=True)) for i in range(12)]
    undisturbed = await asyncio.wait_for(asyncio.gather(*(s.collect() for s in calm)), 120)
    assert [r.token_ids for r in results] == [r.token_ids for r in undisturbed]
    assert [r.text for r in results] == [r.text for r in undisturbed]
    await client.close()


async def test_worker_kill9_without_resume_budget_ends_with_worker_lost(
        nats_server, nc, uid, procs):
    streams, results, on_doomed, client = await _kill_worker_mid_stream(
        nats_server, nc, uid, procs, max_resumes=0, seed_base=0)
    by_id = {s.request_id: r for s, r in zip(streams, results, strict=True)}
    for rid, r in by_id.items():
        if rid in on_doomed:
            assert isinstance(r, RequestError), r
            assert r.error.code == ErrorCode.WORKER_LOST and r.error.retryable
        else:
            assert not isinstance(r, BaseException), r
            assert r.usage.completion_tokens == 400
    assert len(on_doomed) < len(streams)  # some were waiting, and ran elsewhere
    await client.close()
