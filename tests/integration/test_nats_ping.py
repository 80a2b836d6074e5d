"""A process whose NATS server goes silent fails over to another server in seconds.

A node cut off by a network partition (or frozen) resets no connection: without pings
nats-py would wait its default 2 minutes before noticing, and the process (a producer
re-sending a publish, a worker, a dispatcher) would sit on the dead node for the whole
cut (BENCHMARKS.md section 8). Every fairlane connection is made with
`fairlane.natsconn.connect_options`, which sets the ping interval and the pings allowed
without a pong; this test freezes the server a connection is on (SIGSTOP: the socket
stays open and silent, as in a partition) and requires the connection to move to the
other server within the bound those settings promise.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import nats
import pytest

from fairlane.embedded import NatsServer
from fairlane.natsconn import (
    DEFAULT_MAX_OUTSTANDING_PINGS,
    DEFAULT_PING_INTERVAL_S,
    NatsConnSettings,
    connect_options,
)
from producer.client import FairlaneClient

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

PING_S = 0.5
MAX_PINGS = 2
# What every process gets unless told otherwise: the third unanswered ping fails over.
DEFAULT_DETECT_S = (DEFAULT_MAX_OUTSTANDING_PINGS + 1) * DEFAULT_PING_INTERVAL_S
# After noticing, nats-py may first try the frozen server again (a connect that times
# out after nats-py's 2 s) before the live one.
RECONNECT_S = 2.0 + 2.0


class _Settings(NatsConnSettings, kw_only=True):
    nats_url: str = ""


@contextlib.contextmanager
def _frozen(server: NatsServer):
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)


async def _moves_off(nc, frozen: NatsServer, moved: asyncio.Event, detect_s: float) -> float:
    """Seconds from freezing `frozen` until `nc` is reconnected elsewhere."""
    loop = asyncio.get_running_loop()
    with _frozen(frozen):
        t0 = loop.time()
        await asyncio.wait_for(moved.wait(), timeout=detect_s + RECONNECT_S + 5.0)
        took_s = loop.time() - t0
    assert nc.connected_url is not None and nc.connected_url.port != frozen.port
    return took_s


def test_defaults_notice_a_dead_node_in_seconds() -> None:
    opts = connect_options(_Settings())
    assert (opts["ping_interval"], opts["max_outstanding_pings"]) == (
        DEFAULT_PING_INTERVAL_S,
        DEFAULT_MAX_OUTSTANDING_PINGS,
    )
    # Inside a stream leader's election (4-9 s), far below nats-py's 2 minutes.
    assert 2.0 <= DEFAULT_DETECT_S <= 8.0


async def test_service_connection_fails_over_from_a_silent_server() -> None:
    with NatsServer() as a, NatsServer() as b:
        s = _Settings(
            nats_url=f"{a.url},{b.url}",
            nats_ping_interval_s=PING_S,
            nats_max_outstanding_pings=MAX_PINGS,
        )
        moved = asyncio.Event()

        async def reconnected() -> None:
            moved.set()

        nc = await nats.connect(
            **connect_options(s),
            dont_randomize=True,
            reconnected_cb=reconnected,
            reconnect_time_wait=0.1,
            max_reconnect_attempts=-1,
        )
        try:
            assert nc.connected_url.port == a.port
            took_s = await _moves_off(nc, a, moved, (MAX_PINGS + 1) * PING_S)
            assert took_s <= (MAX_PINGS + 1) * PING_S + RECONNECT_S, took_s
            # The new server carries traffic.
            sub = await nc.subscribe("ping.test")
            await nc.publish("ping.test", b"x")
            msg = await sub.next_msg(timeout=2)
            assert msg.data == b"x"
        finally:
            await nc.close()


async def test_producer_library_connects_with_the_ping_settings(nats_server) -> None:
    """The producer library's own connection (`FairlaneClient.connect`, defaults
    untouched) carries the same settings, so a client on a dead node moves too."""
    client = await FairlaneClient.connect(nats_server.url)
    try:
        assert client.nc.options["ping_interval"] == DEFAULT_PING_INTERVAL_S
        assert client.nc.options["max_outstanding_pings"] == DEFAULT_MAX_OUTSTANDING_PINGS
    finally:
        await client.close()
