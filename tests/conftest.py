"""Shared fixtures: real nats-server and redis-server, one each per test session.

Tests isolate themselves by name (a unique pool / tenant / subject prefix per test)
rather than by restarting servers, which keeps the suite fast.
"""

from __future__ import annotations

import uuid

import nats
import pytest

from fairlane.embedded import NatsServer, RedisServer


@pytest.fixture(scope="session")
def nats_server():
    server = NatsServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_server():
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture
def uid() -> str:
    """A short unique id for naming per-test pools, tenants and prefixes."""
    return uuid.uuid4().hex[:10]


@pytest.fixture
async def nc(nats_server):
    conn = await nats.connect(nats_server.url)
    yield conn
    # close(), not drain(): a drain waits for a broker round trip per subscription and
    # for every queued message to be handled (up to nats-py's 30 s drain_timeout, then
    # a flush). Twice in full test runs a streamer test's teardown hung here past its 60 s
    # limit, a DrainTimeoutError in its log. A test awaits what it needs before it
    # ends; its teardown owes the broker nothing.
    await conn.close()


TIERS = ("unit", "integration", "vllm", "e2e", "chaos")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects anything
def pytest_collection_modifyitems(config, items):
    """Every test belongs to a tier. scripts/test.sh runs the tiers by marker, so a test
    without one would be deselected by every tier and never run, silently."""
    untiered = [i.nodeid for i in items if not any(i.get_closest_marker(t) for t in TIERS)]
    if untiered:
        raise pytest.UsageError(
            f"tests without a tier marker ({' | '.join(TIERS)}): {', '.join(untiered[:10])}"
        )
