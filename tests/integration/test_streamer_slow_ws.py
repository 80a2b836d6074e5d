"""A websocket client that stops reading gets the documented 4008 close (never 1006),
however long it pauses, and nothing hangs."""

from __future__ import annotations

import asyncio
import json

import pytest
import websockets

from streamer.schema import CLOSE_SLOW_CONSUMER
from tests.integration.test_streamer import make_stack

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


@pytest.mark.parametrize("pause_s", [7.0, 30.0])
async def test_client_that_stops_reading_sees_4008_when_it_reads_again(
    nats_server, redis_server, nc, uid, tmp_path, pause_s
):
    # A small send buffer and a short close timeout: both pauses outlast the timeout,
    # the case where the close frame used to be lost behind unread data (1006).
    async with make_stack(nats_server, redis_server, nc, uid, tmp_path,
                          ws_send_buffer=16, ws_close_timeout_s=2) as stack:
        slow = await stack.ws(max_queue=1).__aenter__()
        try:
            await slow.send(json.dumps({"type": "request", "id": "s",
                                        "prompt": "n=20000 size=1000"}))
            rid = None
            async with asyncio.timeout(10):
                while rid is None:
                    rid = next((r.request_id for r in stack.fleet.requests
                                if (r.prompt or "").startswith("n=20000")), None)
                    await asyncio.sleep(0.05)  # noqa: ASYNC110 - fake fleet state
            c = await stack.fleet.wait_cancelled(rid, timeout_s=10)
            assert c.reason == "slow_consumer"
            await asyncio.sleep(pause_s - 0.0)  # the client is not reading
            with pytest.raises(websockets.ConnectionClosed) as e:
                async with asyncio.timeout(20):
                    while True:
                        await slow.recv()
            assert e.value.rcvd is not None, "closed without a close frame (1006)"
            assert e.value.rcvd.code == CLOSE_SLOW_CONSUMER
        finally:
            await slow.close()
