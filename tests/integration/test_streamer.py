"""The streamer against a real nats-server + Redis, with a fake fleet behind it.

The app runs under uvicorn on a free 127.0.0.1 port; clients are the official
`openai` SDK, `websockets` and `httpx`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass

import httpx
import openai
import pytest
import websockets
from openai import AsyncOpenAI
from structlog.testing import capture_logs

from fairlane.subjects import Subjects
from fairlane.tenants import hash_api_key
from streamer.app import create_app
from streamer.config import StreamerSettings
from streamer.schema import CLOSE_SLOW_CONSUMER
from streamer.testing import FakeFleet, serve_app

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

KEY_A = "sk-test-alpha"
KEY_B = "sk-test-beta"
KEY_LIMITED = "sk-test-limited"


def tenants_yaml() -> str:
    return f"""
tiers:
  - {{name: paid}}
  - {{name: free}}
pools:
  default: {{}}
  small: {{max_tokens: 50}}
tenants:
  alpha: {{tier: paid, api_keys: ["{hash_api_key(KEY_A)}"]}}
  beta: {{tier: free, api_keys: ["{hash_api_key(KEY_B)}"], pools: [default]}}
  limited: {{tier: free, requests_per_min: 2, api_keys: ["{hash_api_key(KEY_LIMITED)}"]}}
admin: {{api_keys: ["{hash_api_key("sk-test-admin")}"]}}
"""


@dataclass
class Stack:
    url: str
    fleet: FakeFleet
    settings: StreamerSettings

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://") + "/v1/stream"

    def openai(self, key: str = KEY_A) -> AsyncOpenAI:
        return AsyncOpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=20)

    def ws(self, key: str = KEY_A, **kw):
        return websockets.connect(self.ws_url, additional_headers={"Authorization": f"Bearer {key}"},
                                  **kw)


@contextlib.asynccontextmanager
async def make_stack(nats_server, redis_server, nc, uid, tmp_path, **overrides):
    path = tmp_path / "tenants.yaml"
    path.write_text(tenants_yaml())
    prefix = f"t{uid}"
    settings = StreamerSettings(
        nats_url=nats_server.url, prefix=prefix, redis_url=redis_server.url,
        tenants_file=str(path), settler_durable=f"settler{uid}", **overrides,
    )
    async with FakeFleet(nc, Subjects(prefix)) as fleet:
        async with serve_app(create_app(settings), ws_max_size=settings.max_body_bytes) as url:
            yield Stack(url, fleet, settings)


@pytest.fixture
async def stack(nats_server, redis_server, nc, uid, tmp_path):
    async with make_stack(nats_server, redis_server, nc, uid, tmp_path) as s:
        yield s


async def recv_json(ws, timeout_s: float = 10.0) -> dict:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout_s))


async def collect_ws(ws, cid: str, frames: dict[str, list[dict]] | None = None) -> list[dict]:
    """Read frames until `cid` ends (frames for other ids are kept in `frames`)."""
    frames = frames if frames is not None else {}
    while True:
        f = await recv_json(ws)
        frames.setdefault(f["id"], []).append(f)
        if f["id"] == cid and f["type"] in ("end", "error"):
            return frames[cid]


# --- OpenAI SDK ------------------------------------------------------------------------


async def test_openai_sdk_chat_non_streaming(stack):
    client = stack.openai()
    resp = await client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "n=5 size=3"}], max_tokens=20)
    assert resp.choices[0].message.content == "xxx" * 5
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 5
    assert resp.id.startswith("chatcmpl-")
    req = stack.fleet.requests[-1]
    assert req.tenant == "alpha" and req.tier == "paid" and req.pool == "default"
    assert req.sampling.max_tokens == 20


async def test_openai_sdk_completions_non_streaming_and_token_prompt(stack):
    client = stack.openai()
    resp = await client.completions.create(model="default", prompt="n=3", max_tokens=8)
    assert resp.choices[0].text == "xxxx" * 3
    resp = await client.completions.create(model="default", prompt=[1, 2, 3], max_tokens=4)
    assert resp.choices[0].text == "xxxx" * 4
    assert stack.fleet.requests[-1].prompt_token_ids == [1, 2, 3]


async def test_openai_sdk_streaming(stack):
    client = stack.openai()
    stream = await client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "n=7 size=2"}], max_tokens=50,
        stream=True, stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            finish = choice.finish_reason or finish
    assert "".join(pieces) == "xx" * 7
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 7

    stream = await client.completions.create(model="default", prompt="n=4", max_tokens=9,
                                             stream=True)
    text = "".join([c.choices[0].text async for c in stream if c.choices])
    assert text == "xxxx" * 4


async def test_openai_sdk_errors(stack):
    with pytest.raises(openai.AuthenticationError) as e:
        await stack.openai("sk-nope").chat.completions.create(
            model="default", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 401 and e.value.code == "unauthorized"
    client = stack.openai()
    with pytest.raises(openai.NotFoundError) as e:
        await client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    assert e.value.code == "model_not_found" and "gpt-9" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "hi"}], temperature=3.5)
    assert e.value.code == "invalid_request" and e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as e:  # over the pool's max_tokens
        await client.completions.create(model="small", prompt="hi", max_tokens=51)
    assert "max_tokens" in e.value.message
    with pytest.raises(openai.NotFoundError):  # beta may not use pool "small"
        await stack.openai(KEY_B).completions.create(model="small", prompt="hi")
    # an error after the stream started arrives as an SSE error event
    stream = await client.completions.create(model="default", prompt="fail=worker_lost",
                                             stream=True)
    with pytest.raises(openai.APIError) as e:
        async for _ in stream:
            pass
    assert "worker_lost" in str(e.value.body) or "fake fleet failure" in e.value.message


async def test_models_list(stack):
    models = await stack.openai().models.list()
    assert sorted(m.id for m in models.data) == ["default", "small"]
    # beta may use only "default": it neither sees nor retrieves "small"
    models = await stack.openai(KEY_B).models.list()
    assert [m.id for m in models.data] == ["default"]


async def test_model_retrieve_and_404_in_openai_shape(stack):
    model = await stack.openai().models.retrieve("small")
    assert (model.id, model.object, model.owned_by) == ("small", "model", "fairlane")
    with pytest.raises(openai.NotFoundError) as e:
        await stack.openai(KEY_B).models.retrieve("small")
    assert e.value.code == "model_not_found"
    async with httpx.AsyncClient(base_url=stack.url, timeout=10) as http:
        auth = {"Authorization": f"Bearer {KEY_A}"}
        for missing in ("gpt-9", "org/model"):
            r = await http.get(f"/v1/models/{missing}", headers=auth)
            assert r.status_code == 404
            assert r.json() == {"error": {
                "message": f"the model {missing!r} does not exist",
                "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}
        assert (await http.get("/v1/models/default")).status_code == 401


async def test_unknown_fields_are_ignored_with_a_header_and_a_warning(stack):
    body = {"model": "default", "prompt": "n=2", "max_tokens": 4, "bogus": 1,
            "metadata": {"k": "v"}}
    auth = {"Authorization": f"Bearer {KEY_A}"}
    async with httpx.AsyncClient(base_url=stack.url, timeout=10) as http:
        with capture_logs() as logs:
            r = await http.post("/v1/completions", json=body, headers=auth)
            again = await http.post("/v1/completions", json=body, headers=auth)
            plain = await http.post("/v1/completions", headers=auth,
                                    json={"model": "default", "prompt": "n=1"})
            sse = await http.post("/v1/completions", json={**body, "stream": True},
                                  headers=auth)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "xxxx" * 2
    assert r.headers["x-fairlane-ignored-fields"] == "bogus,metadata"
    assert again.headers["x-fairlane-ignored-fields"] == "bogus,metadata"
    assert "x-fairlane-ignored-fields" not in plain.headers
    assert sse.status_code == 200 and sse.headers["x-fairlane-ignored-fields"] == "bogus,metadata"
    assert sse.text.endswith("data: [DONE]\n\n")
    warned = [e for e in logs if e["event"] == "ignored_request_fields"]
    # once per tenant, endpoint and set of fields: a client that always sends them
    # does not flood the log
    assert [(e["tenant"], e["endpoint"], e["fields"], e["log_level"]) for e in warned] == [
        ("alpha", "completions", ["bogus", "metadata"], "warning")]


async def test_rate_limit_429_with_retry_after(stack):
    async with httpx.AsyncClient(base_url=stack.url, timeout=10) as http:
        body = {"model": "default", "prompt": "n=1", "max_tokens": 1}
        headers = {"Authorization": f"Bearer {KEY_LIMITED}"}
        codes = [(await http.post("/v1/completions", json=body, headers=headers)) for _ in range(3)]
    assert [r.status_code for r in codes] == [200, 200, 429]
    r = codes[2]
    assert int(r.headers["retry-after"]) >= 1
    err = r.json()["error"]
    assert err["code"] == "rate_limited" and err["type"] == "rate_limit_error"
    assert set(err) == {"message", "type", "param", "code"}


async def test_bad_http_input_is_4xx_with_clear_message(stack):
    auth = {"Authorization": f"Bearer {KEY_A}"}
    async with httpx.AsyncClient(base_url=stack.url, timeout=10) as http:
        cases = [
            (b"{not json", 400, "not valid JSON"),
            (b"", 400, "empty"),
            (b"[]", 400, "invalid request"),
            (json.dumps({"model": "default", "prompt": "x", "tools": [{"type": "function"}]}
                        ).encode(), 400, "tools"),
            (json.dumps({"model": "default", "prompt": "x", "presence_penalty": 1}).encode(),
             400, "presence_penalty is not supported (only 0 is accepted)"),
            (json.dumps({"model": "default", "prompt": "x", "max_tokens": 0}).encode(), 400, "max_tokens"),
            (json.dumps({"model": "default", "prompt": "x", "n": 2}).encode(), 400, "n"),
            (json.dumps({"model": "default", "prompt": "   "}).encode(), 400, "empty"),
            (json.dumps({"model": "nope", "prompt": "x"}).encode(), 404, "nope"),
            (json.dumps({"prompt": "x"}).encode(), 400, "model"),
            (b'{"model": "default", "prompt": "' + b"a" * (2 << 20) + b'"}', 413, "larger"),
        ]
        for body, status, needle in cases:
            r = await http.post("/v1/completions", content=body, headers=auth)
            assert r.status_code == status, (body[:60], r.text)
            err = r.json()["error"]
            assert needle in err["message"] or needle == err["param"], (needle, err)
        r = await http.post("/v1/completions", json={"model": "default", "prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = await http.post("/v1/completions", json={"model": "default", "prompt": "x"},
                            headers={"Authorization": "Basic abc"})
        assert r.status_code == 401
        r = await http.get("/v1/nothing-here")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        r = await http.get("/v1/completions")
        assert r.status_code == 405


async def test_ops_endpoints(stack):
    async with httpx.AsyncClient(base_url=stack.url, timeout=10) as http:
        assert (await http.get("/healthz")).json() == {"status": "ok"}
        r = await http.get("/readyz")
        assert r.status_code == 200 and r.json()["checks"] == {"nats": True, "streams": True}
        await http.post("/v1/completions", json={"model": "default", "prompt": "n=2"},
                        headers={"Authorization": f"Bearer {KEY_A}"})
        text = (await http.get("/metrics", headers={"Authorization": "Bearer sk-test-admin"})).text
    assert 'fairlane_streamer_requests_total{endpoint="completions",outcome="accepted",tenant="alpha"}' in text


# --- websocket -------------------------------------------------------------------------


async def test_websocket_concurrent_requests(stack):
    async with stack.ws() as ws:
        await ws.send(json.dumps({"type": "request", "id": "a", "prompt": "n=20 size=1 delay_ms=2"}))
        await ws.send(json.dumps({"type": "request", "id": "b", "messages": [
            {"role": "user", "content": "n=10 size=2 delay_ms=3"}], "return_token_ids": True}))
        frames: dict[str, list[dict]] = {}
        await collect_ws(ws, "a", frames)
        if not frames.get("b") or frames["b"][-1]["type"] != "end":
            await collect_ws(ws, "b", frames)
    for cid, n, size in (("a", 20, 1), ("b", 10, 2)):
        fs = frames[cid]
        assert fs[0]["type"] == "accepted" and fs[0]["request_id"]
        tokens = [f for f in fs if f["type"] == "token"]
        assert [t["seq"] for t in tokens] == list(range(n))
        assert "".join(t["text"] for t in tokens) == "x" * size * n
        assert fs[-1] == {"type": "end", "id": cid, "finish_reason": "length",
                          "usage": {"prompt_tokens": fs[-1]["usage"]["prompt_tokens"],
                                    "completion_tokens": n,
                                    "total_tokens": fs[-1]["usage"]["total_tokens"]}}
    assert frames["b"][1]["token_ids"] == [0]


async def test_websocket_unauthorized_handshake(stack):
    with pytest.raises(websockets.InvalidStatus) as e:
        async with stack.ws("sk-wrong"):
            pass
    assert e.value.response.status_code == 401


async def test_websocket_cancel_frame_cancels_upstream(stack):
    async with stack.ws() as ws:
        await ws.send(json.dumps({"type": "request", "id": "h", "prompt": "hold"}))
        accepted = await recv_json(ws)
        assert accepted["type"] == "accepted"
        assert (await recv_json(ws))["type"] == "token"
        await ws.send(json.dumps({"type": "cancel", "id": "h"}))
        end = await recv_json(ws)
        assert end == {"type": "end", "id": "h", "finish_reason": "cancelled", "usage": None}
        c = await stack.fleet.wait_cancelled(accepted["request_id"])
        assert c.reason == "client_cancel" and c.tenant == "alpha"


async def test_websocket_disconnect_cancels_upstream(stack):
    async with stack.ws() as ws:
        await ws.send(json.dumps({"type": "request", "id": "h1", "prompt": "hold"}))
        await ws.send(json.dumps({"type": "request", "id": "h2", "prompt": "hold"}))
        ids = set()
        while len(ids) < 2:
            f = await recv_json(ws)
            if f["type"] == "accepted":
                ids.add(f["request_id"])
    for rid in ids:
        c = await stack.fleet.wait_cancelled(rid)
        assert c.reason == "client_gone"


async def test_sse_disconnect_cancels_upstream(stack):
    async with httpx.AsyncClient(base_url=stack.url, timeout=10) as http:
        async with http.stream("POST", "/v1/chat/completions", headers={
                "Authorization": f"Bearer {KEY_A}"}, json={
                "model": "default", "stream": True,
                "messages": [{"role": "user", "content": "hold"}]}) as r:
            assert r.status_code == 200
            lines = r.aiter_lines()
            got = 0
            async for line in lines:
                if line.startswith("data: ") and '"x' in line:
                    got += 1
                    break
            assert got
    rid = stack.fleet.requests[-1].request_id
    c = await stack.fleet.wait_cancelled(rid)
    assert c.reason == "client_gone"


async def test_non_streaming_disconnect_cancels_upstream(stack):
    async with httpx.AsyncClient(base_url=stack.url, timeout=0.5) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/v1/completions", json={"model": "default", "prompt": "hold"},
                            headers={"Authorization": f"Bearer {KEY_A}"})
    rid = stack.fleet.requests[-1].request_id
    c = await stack.fleet.wait_cancelled(rid)
    assert c.reason == "client_gone"


async def test_slow_websocket_client_is_disconnected_and_others_unaffected(
    nats_server, redis_server, nc, uid, tmp_path
):
    async with make_stack(nats_server, redis_server, nc, uid, tmp_path,
                          ws_send_buffer=64, ws_close_timeout_s=20) as stack:
        # The slow client: tiny receive queue and it does not read at all for a while,
        # so the server's socket buffer fills and its send queue overflows.
        slow = await stack.ws(max_queue=1).__aenter__()
        fast = await stack.ws().__aenter__()
        try:
            await slow.send(json.dumps({"type": "request", "id": "s",
                                        "prompt": "n=20000 size=1000"}))
            await asyncio.sleep(0.2)
            t0 = time.monotonic()
            await fast.send(json.dumps({"type": "request", "id": "f",
                                        "prompt": "n=200 size=8 delay_ms=2"}))
            fs = await collect_ws(fast, "f")
            fast_s = time.monotonic() - t0
            tokens = [f for f in fs if f["type"] == "token"]
            assert [t["seq"] for t in tokens] == list(range(200))
            assert fs[-1]["type"] == "end"
            assert fast_s < 5.0, fast_s  # ~0.4 s of fleet delay; not held up by `s`

            # The slow socket: everything it gets ends in close code 4008, and its
            # request was cancelled upstream.
            slow_rid = next(r.request_id for r in stack.fleet.requests
                            if (r.prompt or "").startswith("n=20000"))
            c = await stack.fleet.wait_cancelled(slow_rid, timeout_s=10)
            assert c.reason == "slow_consumer"
            with pytest.raises(websockets.ConnectionClosed) as e:
                while True:
                    await asyncio.wait_for(slow.recv(), 20)
            assert e.value.rcvd is not None
            assert e.value.rcvd.code == CLOSE_SLOW_CONSUMER
            assert "slow consumer" in e.value.rcvd.reason
            # the fast socket is still usable
            await fast.send(json.dumps({"type": "request", "id": "f2", "prompt": "n=3"}))
            assert (await collect_ws(fast, "f2"))[-1]["type"] == "end"
        finally:
            await fast.close()
            await slow.close()


async def test_slow_sse_client_gets_error_event_and_upstream_cancel(
    nats_server, redis_server, nc, uid, tmp_path
):
    async with make_stack(nats_server, redis_server, nc, uid, tmp_path,
                          max_buffered_chunks=32) as stack:
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
            async with http.stream("POST", "/v1/completions", headers={
                    "Authorization": f"Bearer {KEY_A}"}, json={
                    "model": "default", "stream": True, "prompt": "n=20000 size=1000"}) as r:
                assert r.status_code == 200
                for _ in range(200):
                    if stack.fleet.requests:
                        break
                    await asyncio.sleep(0.02)
                rid = stack.fleet.requests[-1].request_id
                # not reading: the socket fills, the relay's bounded buffer overflows
                c = await stack.fleet.wait_cancelled(rid, timeout_s=20)
                assert c.reason == "slow_consumer"
                last = None
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        last = line
        assert last is not None and "[DONE]" not in last
        err = json.loads(last[len("data: "):])["error"]
        assert err["code"] == "slow_consumer"


async def test_streamer_fails_open_when_redis_is_down(
    nats_server, redis_server, nc, uid, tmp_path
):
    from prometheus_client import REGISTRY

    from tests.integration.test_ratelimit import stop_redis

    def degraded() -> float:
        return REGISTRY.get_sample_value("fairlane_ratelimit_degraded") or 0.0

    async with make_stack(nats_server, redis_server, nc, uid, tmp_path) as stack:
        client = stack.openai(KEY_LIMITED)
        body = {"model": "default", "prompt": "n=1", "max_tokens": 1}
        await client.completions.create(**body)
        await asyncio.to_thread(stop_redis, redis_server)
        try:
            # Redis gone: still served (fail open), limited only locally and approximately
            resp = await client.completions.create(**body)
            assert resp.choices[0].text == "xxxx"
            assert degraded() == 1
            async with httpx.AsyncClient(base_url=stack.url, timeout=10) as http:
                assert (await http.get("/readyz")).json()["ratelimit_degraded"] is True
        finally:
            await asyncio.to_thread(redis_server.start)
        await asyncio.sleep(1.1)  # the limiter retries Redis after retry_interval_s
        # Redis is back (empty after the restart): admitted by Redis again
        await client.completions.create(**body)
        assert degraded() == 0


async def test_what_start_up_made_is_frozen(nats_server, redis_server, nc, uid, tmp_path,
                                            monkeypatch):
    """Under `tuned_gc` (`python -m streamer`), once its lifespan has connected, the
    streamer freezes what is alive (`fairlane.gctune.refreeze`): no later collection
    walks its connections, tenants table and routes again."""
    import gc

    from fairlane import gctune
    from streamer import app as streamer_app

    seen: list[tuple[int, int]] = []

    def spy() -> None:
        before = gc.get_freeze_count()
        gctune.refreeze()
        seen.append((before, gc.get_freeze_count()))

    monkeypatch.setattr(streamer_app, "refreeze", spy)
    with gctune.tuned_gc(50_000):
        async with make_stack(nats_server, redis_server, nc, uid, tmp_path) as s:
            async with httpx.AsyncClient() as http:
                assert (await http.get(s.url + "/healthz")).status_code == 200
    [(before, after)] = seen
    assert after > before
