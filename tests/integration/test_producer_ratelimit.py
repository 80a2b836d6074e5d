"""The producer library applies the same Redis rate limiter as the HTTP edge."""

from __future__ import annotations

import pytest

from fairlane.protocol import ErrorCode
from fairlane.ratelimit import RateLimiter, RateLimits
from fairlane.streams import StreamSettings, ensure_streams
from fairlane.subjects import Subjects
from producer.client import FairlaneClient, RequestError, RequestSpec, SamplingParams

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]


async def test_producer_refuses_over_the_limit_and_refunds_refused_publishes(
        nats_server, redis_server, nc, uid):
    limiter = RateLimiter.from_url(redis_server.url)
    client = FairlaneClient(nc, prefix=f"t{uid}", limiter=limiter)
    await client.start()
    limits = RateLimits(requests_per_min=2)
    tenant = f"acme{uid}"
    spec = RequestSpec(tenant=tenant, pool="p", tier="standard", prompt="hi",
                       sampling=SamplingParams(max_tokens=4))
    for _ in range(2):
        await client.submit(spec, rate_limits=limits)  # no dispatcher: JetStream queues them
    with pytest.raises(RequestError) as err:
        await client.submit(spec, rate_limits=limits)
    assert err.value.error.code == ErrorCode.RATE_LIMITED
    assert err.value.error.retryable and err.value.error.retry_after_ms > 0
    assert err.value.code == ErrorCode.RATE_LIMITED and err.value.retryable  # the same, flat
    # Other tenants and unlimited submissions are unaffected.
    other = RequestSpec(tenant=f"globex{uid}", pool="p", tier="standard", prompt="hi")
    await client.submit(other, rate_limits=limits)
    await client.submit(spec, rate_limits=None)
    await client.close()
    await limiter.close()


async def test_refused_publish_gives_the_reservation_back(nats_server, redis_server, nc, uid):
    limiter = RateLimiter.from_url(redis_server.url)
    subjects = Subjects(f"t{uid}")
    js = nc.jetstream()
    # A per-tenant queue cap of 1, so the broker refuses the second publish.
    await ensure_streams(js, subjects, StreamSettings(max_queued_per_tenant=1))
    client = FairlaneClient(nc, prefix=subjects.prefix, limiter=limiter)
    await client.start(provision_streams=False)
    limits = RateLimits(requests_per_min=2)
    spec = RequestSpec(tenant="acme", pool="p", tier="standard", prompt="hi")
    await client.submit(spec, rate_limits=limits)
    with pytest.raises(RequestError) as err:
        await client.submit(spec, rate_limits=limits)  # reserved, then refused by the broker
    assert err.value.error.code == ErrorCode.QUEUE_FULL
    await js.purge_stream(subjects.requests_stream)
    await client.submit(spec, rate_limits=limits)  # admitted: the refused one's came back
    with pytest.raises(RequestError) as err:
        await client.submit(spec, rate_limits=limits)
    assert err.value.error.code == ErrorCode.RATE_LIMITED
    await client.close()
    await limiter.close()
