"""Reconciliation (DESIGN §4): worker heartbeats list their in-flight ids; an id the
dispatcher gave a worker that the worker no longer reports (a lost reply or a lost
`Finished`) is requeued if unstarted or releases the tenant's quota if started.

The worker here is a protocol peer publishing real messages on fl.work / fl.evt."""

from __future__ import annotations

import asyncio

import pytest

from dispatcher.config import DispatcherSettings
from dispatcher.service import Dispatcher
from fairlane.protocol import Heartbeat, PullRequest, Started, decode_work_batch, encode
from fairlane.subjects import Subjects
from fairlane.tenants import TenantsWatcher
from producer.client import FairlaneClient
from tests.helpers import spec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

TENANTS = """
tiers:
  - {name: paid}
pools:
  p: {policy: drr}
tenants:
  acme: {tier: paid, max_concurrent: 1}
"""


@pytest.fixture
async def env(nats_server, nc, uid, tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANTS)
    subjects = Subjects(f"t{uid}")
    settings = DispatcherSettings(nats_url=nats_server.url, prefix=subjects.prefix, pool="p",
                                  housekeeping_ms=20, worker_timeout_ms=5000)
    dispatcher = Dispatcher(settings, tenants=TenantsWatcher(path))
    await dispatcher.start()
    client = FairlaneClient(nc, prefix=subjects.prefix)
    await client.start()
    yield subjects, client
    await client.close()
    await dispatcher.stop()


async def _beat(nc, subjects, ids) -> None:
    await nc.publish(subjects.events("p"), encode(Heartbeat(
        worker_id="w1", pool="p", in_flight_ids=sorted(ids), interval_ms=100)))
    await nc.flush()


async def _pull(nc, subjects, wait_ms: int = 1000) -> list[str]:
    pull = PullRequest(worker_id="w1", pool="p", max_items=8, wait_ms=wait_ms)
    reply = await nc.request(subjects.work("p"), encode(pull), timeout=wait_ms / 1000 + 3)
    return [i.request.request_id for i in decode_work_batch(reply.data).items]


async def _pull_until(nc, subjects, want: str, ids: set[str]) -> list[str]:
    """Heartbeat (listing `ids`) and pull, a bounded number of times, until `want` comes."""
    for _ in range(30):
        await _beat(nc, subjects, ids)
        got = await _pull(nc, subjects, wait_ms=300)
        if want in got:
            return got
    raise AssertionError(f"{want} never dispatched")


async def test_started_request_missing_from_heartbeats_releases_quota(env, nc):
    subjects, client = env
    await _beat(nc, subjects, [])
    a = await client.submit(spec(tenant="acme", pool="p", prompt="hi", max_tokens=4))
    assert await _pull_until(nc, subjects, a.request_id, set()) == [a.request_id]
    await nc.publish(subjects.events("p"), encode(Started(request_id=a.request_id,
                                                          worker_id="w1")))
    b = await client.submit(spec(tenant="acme", pool="p", prompt="hi", max_tokens=4))
    # While the worker reports A, max_concurrent 1 holds B back.
    await _beat(nc, subjects, [a.request_id])
    assert await _pull(nc, subjects, wait_ms=500) == []
    # A's Finished is lost: heartbeats stop listing it -> quota released -> B dispatched.
    assert await _pull_until(nc, subjects, b.request_id, set()) == [b.request_id]


async def test_unstarted_request_missing_from_heartbeats_is_requeued(env, nc):
    subjects, client = env
    await _beat(nc, subjects, [])
    a = await client.submit(spec(tenant="acme", pool="p", prompt="hi", max_tokens=4))
    assert await _pull_until(nc, subjects, a.request_id, set()) == [a.request_id]
    # The WorkBatch reply was "lost": the worker never reports A; it must come back.
    await asyncio.sleep(0)
    got = await _pull_until(nc, subjects, a.request_id, set())
    assert got == [a.request_id]
