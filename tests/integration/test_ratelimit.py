"""The Redis rate limiter on a real redis-server, including Redis going away."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY

from fairlane.protocol import Usage, encode
from fairlane.ratelimit import RateLimiter, RateLimits, UsageSettler
from fairlane.streams import ensure_streams
from fairlane.subjects import Subjects

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture
async def limiter(redis_server, uid):
    lim = RateLimiter.from_url(redis_server.url, key_prefix=f"t{uid}", retry_interval_s=0.2)
    yield lim
    await lim.close()


def _usage(tenant: str, rid: str, prompt: int, completion: int, pool: str = "default") -> Usage:
    return Usage(request_id=rid, tenant=tenant, pool=pool, tier="standard",
                 prompt_tokens=prompt, completion_tokens=completion)


def stop_redis(server) -> None:
    """Take Redis down but keep its data dir, so `server.start()` brings it back on the
    same port (RedisServer.stop() would delete the dir)."""
    server.proc.terminate()
    server.proc.wait(timeout=10)


def _failopen_count() -> float:
    return REGISTRY.get_sample_value("fairlane_ratelimit_failopen_total", {"op": "admit"}) or 0.0


async def _bucket(lim: RateLimiter, tenant: str, klass: str = "default") -> dict:
    raw = await lim._redis.hgetall(lim._bucket_key(tenant, klass))
    return {k.decode(): float(v) for k, v in raw.items()}


async def test_requests_per_min(limiter, uid):
    lim = RateLimits(requests_per_min=3)
    got = [await limiter.admit("acme", lim, 0, f"r{i}") for i in range(4)]
    assert [d.allowed for d in got] == [True, True, True, False]
    assert not any(d.degraded for d in got)
    assert 0 < got[3].retry_after_ms <= 20_000
    # other tenants and other classes have their own buckets
    assert (await limiter.admit("other", lim, 0, "o1")).allowed
    assert (await limiter.admit("acme", lim, 0, "b1", klass="big")).allowed


async def test_reserve_then_settle_true_up(limiter):
    lim = RateLimits(tokens_per_min=1000)
    assert (await limiter.admit("t", lim, 600, "r1")).allowed
    d = await limiter.admit("t", lim, 600, "r2")
    assert not d.allowed and d.retry_after_ms > 0
    # r1 actually used 100 tokens: the 500 unused come back
    assert await limiter.settle(_usage("t", "r1", 40, 60)) is True
    assert (await limiter.admit("t", lim, 600, "r2")).allowed
    # settling r2 with more than reserved charges the overage as debt
    assert await limiter.settle(_usage("t", "r2", 100, 2000)) is True
    level = (await _bucket(limiter, "t"))["t"]
    assert level < 0  # in debt
    assert not (await limiter.admit("t", lim, 1, "r3")).allowed


async def test_settle_exactly_once_even_concurrently(limiter):
    lim = RateLimits(tokens_per_min=10_000)
    assert (await limiter.admit("t", lim, 5000, "r1")).allowed
    before = (await _bucket(limiter, "t"))["t"]
    results = await asyncio.gather(*(limiter.settle(_usage("t", "r1", 0, 100)) for _ in range(10)))
    assert results.count(True) == 1 and results.count(False) == 9
    after = (await _bucket(limiter, "t"))["t"]
    assert 4900 <= after - before <= 4910  # refunded 4900 once (+ a few ms of refill)


async def test_debt_is_capped(limiter):
    lim = RateLimits(tokens_per_min=1000)
    assert (await limiter.admit("t", lim, 10, "r1")).allowed
    await limiter.settle(_usage("t", "r1", 0, 10_000_000))
    level = (await _bucket(limiter, "t"))["t"]
    assert -1000 <= level <= -999  # max_debt_minutes=1 -> at most one minute's budget


async def test_refund_returns_request_and_tokens(limiter):
    lim = RateLimits(requests_per_min=1, tokens_per_min=1000)
    assert (await limiter.admit("t", lim, 900, "r1")).allowed
    assert not (await limiter.admit("t", lim, 900, "r2")).allowed
    assert await limiter.refund("t", "r1") is True
    assert (await limiter.admit("t", lim, 900, "r2")).allowed
    # a usage record arriving after the refund is not charged twice
    assert await limiter.settle(_usage("t", "r1", 10, 10)) is False


async def test_unlimited_never_touches_redis(uid):
    lim = RateLimiter.from_url("redis://127.0.0.1:1/0", key_prefix=f"t{uid}")
    d = await lim.admit("t", RateLimits(), 10**9, "r1")
    assert d.allowed and not d.degraded
    await lim.close()


async def test_fail_open_when_redis_stops_and_recover(redis_server, limiter):
    lim = RateLimits(requests_per_min=2)
    assert (await limiter.admit("t", lim, 0, "r1")).allowed
    failopen_before = _failopen_count()
    await asyncio.to_thread(stop_redis, redis_server)
    try:
        d1 = await limiter.admit("t", lim, 0, "r2")
        assert d1.allowed and d1.degraded  # fail open ...
        assert limiter.degraded
        d2 = await limiter.admit("t", lim, 0, "r3")
        d3 = await limiter.admit("t", lim, 0, "r4")
        # ... but still approximately limited, locally
        assert d2.allowed and not d3.allowed and d3.degraded
        assert _failopen_count() >= failopen_before + 3
        assert await limiter.settle(_usage("t", "r2", 1, 1)) is None  # Redis must see it later
    finally:
        await asyncio.to_thread(redis_server.start)
    await asyncio.sleep(0.3)  # past retry_interval_s
    d = await limiter.admit("t2", lim, 0, "r5")
    assert d.allowed and not d.degraded
    assert not limiter.degraded
    assert REGISTRY.get_sample_value("fairlane_ratelimit_degraded") == 0


async def test_restart_reloads_scripts(redis_server, limiter):
    lim = RateLimits(requests_per_min=100)
    assert (await limiter.admit("t", lim, 0, "r1")).allowed
    await asyncio.to_thread(redis_server.restart)  # fresh Redis: no scripts loaded
    d = None
    for _ in range(20):
        d = await limiter.admit("t", lim, 0, "r2")
        if not d.degraded:
            break
        await asyncio.sleep(0.1)
    assert d is not None and d.allowed and not d.degraded


async def test_usage_settler_exactly_once_and_survives_redis_outage(
    nc, redis_server, limiter, uid
):
    subjects = Subjects(f"t{uid}")
    js = nc.jetstream()
    await ensure_streams(js, subjects)
    settler = UsageSettler(js, subjects, limiter, durable=f"s{uid}", fetch_timeout_s=0.2,
                           nak_delay_s=0.2)
    await settler.start()
    try:
        lim = RateLimits(tokens_per_min=1000)
        assert (await limiter.admit("acme", lim, 800, "u1")).allowed
        # the same record twice under different msg ids: settled once
        for mid in ("a", "b"):
            await js.publish(subjects.usage("acme"), encode(_usage("acme", "u1", 50, 50)),
                             headers={"Nats-Msg-Id": f"u1-{mid}"})
        for _ in range(50):
            if settler.num_settled >= 2:
                break
            await asyncio.sleep(0.05)
        assert settler.num_settled == 2  # both acked ...
        level = (await _bucket(limiter, "acme"))["t"]
        assert 895 <= level <= 1000  # ... but the 700 unused came back only once
        # Redis down: records wait (nak) and are settled when it returns
        assert (await limiter.admit("acme", lim, 500, "u2")).allowed
        await asyncio.to_thread(stop_redis, redis_server)
        try:
            await js.publish(subjects.usage("acme"), encode(_usage("acme", "u2", 0, 10)),
                             headers={"Nats-Msg-Id": "u2"})
            await asyncio.sleep(0.5)
            assert settler.num_settled == 2
        finally:
            await asyncio.to_thread(redis_server.start)
        for _ in range(100):
            if settler.num_settled >= 3:
                break
            await asyncio.sleep(0.05)
        assert settler.num_settled == 3
    finally:
        await settler.stop()
