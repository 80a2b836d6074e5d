"""Admission refusals answered by the real dispatcher, configured by a tenants file:
the client gets the error code (and a retry hint where the README promises one)."""

from __future__ import annotations

import asyncio

import pytest

from dispatcher.config import DispatcherSettings
from dispatcher.service import Dispatcher
from fairlane.protocol import ErrorCode
from fairlane.subjects import Subjects
from fairlane.tenants import TenantsWatcher
from producer.client import FairlaneClient, RequestError
from tests.helpers import spec, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

TENANTS = """
tiers:
  - {name: paid}
  - {name: free}
pools:
  p: {policy: drr, max_queued_total: 4}
tenants:
  acme: {tier: paid, max_queued: 2}
  globex: {tier: free}
"""


@pytest.fixture
async def env(nats_server, nc, uid, tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANTS)
    subjects = Subjects(f"t{uid}")
    settings = DispatcherSettings(nats_url=nats_server.url, prefix=subjects.prefix, pool="p",
                                  housekeeping_ms=20)
    dispatcher = Dispatcher(settings, tenants=TenantsWatcher(path))
    await dispatcher.start()
    client = FairlaneClient(nc, prefix=subjects.prefix)
    await client.start()
    yield dispatcher, client
    await client.close()
    await dispatcher.stop()


async def _refusal(stream) -> RequestError:
    with pytest.raises(RequestError) as err:
        await asyncio.wait_for(stream.collect(), 10)
    return err.value


async def test_queue_full_for_a_tenant_over_max_queued(env):
    dispatcher, client = env
    held = [await client.submit(spec(tenant="acme", pool="p", prompt="hi", max_tokens=4))
            for _ in range(2)]
    await wait_until(lambda: all(dispatcher.scheduler.is_queued(s.request_id) for s in held))
    try:
        third = await client.submit(spec(tenant="acme", pool="p", prompt="hi", max_tokens=4))
    except RequestError as exc:  # refused by the producer's own pre-check
        err = exc
    else:
        err = await _refusal(third)
    assert err.code is ErrorCode.QUEUE_FULL, (err.code, err.message)
    assert err.retry_after_ms is not None and err.retry_after_ms > 0


async def test_overloaded_sheds_lowest_tier_past_max_queued_total(env):
    dispatcher, client = env
    streams = [await client.submit(spec(tenant="globex", pool="p", prompt="hi", max_tokens=4))
               for _ in range(6)]
    errors = []
    for s in streams:
        try:
            await asyncio.wait_for(s.collect(), 3)
        except RequestError as exc:
            errors.append(exc)
        except TimeoutError:
            pass  # still queued: fine
    assert errors, "no request refused although 6 > max_queued_total 4"
    assert {e.code for e in errors} <= {ErrorCode.OVERLOADED, ErrorCode.QUEUE_FULL}
    assert ErrorCode.OVERLOADED in {e.code for e in errors}, [(e.code, e.message) for e in errors]
    assert all(e.retry_after_ms for e in errors)
