"""Websocket frames the streamer refuses: each gets an error frame naming its field, and
the socket stays usable (real nats-server + Redis, a fake fleet; `test_streamer`'s stack).
"""

from __future__ import annotations

import json

import pytest

from tests.integration.test_streamer import collect_ws, make_stack, recv_json

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture
async def stack(nats_server, redis_server, nc, uid, tmp_path):
    async with make_stack(nats_server, redis_server, nc, uid, tmp_path) as s:
        yield s


async def test_websocket_bad_frames_then_good(stack):
    async with stack.ws() as ws:
        await ws.send("{oops")
        f = await recv_json(ws)
        assert f["type"] == "error" and f["id"] is None and "JSON" in f["error"]["message"]

        async def refused(frame: dict) -> dict:
            await ws.send(json.dumps({"type": "request", **frame}))
            f = await recv_json(ws)
            assert f["type"] == "error" and f["id"] == frame["id"], f
            return f["error"]

        # fairlane's own protocol stays strict: an unknown field is named, not ignored;
        # each refusal names its field (param), as the HTTP edge's OpenAI errors do.
        e = await refused({"id": "x", "prompt": "hi", "tenant": "evil"})
        assert (e["message"], e["param"]) == ("invalid frame: unknown field 'tenant'", "tenant")
        e = await refused({"id": "y", "prompt": "hi", "top_p": 0})
        assert e["code"] == "invalid_request" and "top_p" in e["message"] and e["param"] == "top_p"
        e = await refused({"id": "z"})  # a rule across fields blames none of them
        assert "exactly one of" in e["message"] and e["param"] is None
        e = await refused({"id": "m", "prompt": "x", "model": "nope"})
        assert (e["code"], e["param"]) == ("model_not_found", "model")
        # A limit the pool sets, refused past the schema.
        e = await refused({"id": "big", "prompt": "x", "model": "small", "max_tokens": 51})
        assert (e["code"], e["param"]) == ("invalid_request", "max_tokens")
        await ws.send(json.dumps({"type": "launch", "id": "q"}))
        f = await recv_json(ws)
        assert f["type"] == "error"
        await ws.send(json.dumps({"type": "request", "id": "ok", "prompt": "n=2"}))
        fs = await collect_ws(ws, "ok")
        assert fs[-1]["type"] == "end"
    assert all(r.tenant == "alpha" for r in stack.fleet.requests)
