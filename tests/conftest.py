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
    await conn.drain()
