"""Logs and traces at the edge, against a real fleet (nats-server, dispatcher, simulated
worker): every HTTP answer carries ``X-Request-Id`` (for completions, the id the fleet
ran the request under), the streamer writes one access line per request, and a
``traceparent`` travels from the client through the JetStream message and the
dispatcher's `WorkItem` to the worker's log lines. The last test runs the streamer as
its own process and reads its stderr: every line one JSON object, uvicorn's too."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import structlog
import websockets
from structlog.testing import capture_logs

from fairlane.embedded import free_port
from fairlane.protocol import WorkItem, decode_work_batch
from fairlane.tenants import hash_api_key
from fairlane.trace import parse_traceparent
from streamer.app import create_app
from streamer.config import StreamerSettings
from streamer.testing import serve_app
from tests.helpers import in_process_fleet, wait_until
from tests.procs import Procs

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

KEY = "sk-observe"
AUTH = {"Authorization": f"Bearer {KEY}"}
TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
FLEET_ID = re.compile(r"^[0-9a-f]{32}$")  # producer.spec.new_request_id


def tenants_yaml() -> str:
    return f"pools: {{p: {{}}}}\ntenants: {{acme: {{api_keys: ['{hash_api_key(KEY)}']}}}}\n"


class LogWatch:
    """A structlog processor for `capture_logs`: records events (with the structlog
    context merged in) and lets a test await one, rather than sleep for it."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self._waiters: list[tuple[Callable[[dict], bool], asyncio.Future]] = []

    def __call__(self, logger: Any, method: str, event_dict: dict) -> dict:
        self.events.append(dict(event_dict))
        for pred, fut in list(self._waiters):
            if not fut.done() and pred(event_dict):
                fut.set_result(dict(event_dict))
        return event_dict

    def where(self, event: str, **fields: Any) -> list[dict]:
        return [e for e in self.events
                if e.get("event") == event and all(e.get(k) == v for k, v in fields.items())]

    async def wait(self, event: str, timeout_s: float = 15.0, **fields: Any) -> dict:
        found = self.where(event, **fields)
        if found:
            return found[0]
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((lambda e: e.get("event") == event and all(
            e.get(k) == v for k, v in fields.items()), fut))
        return await asyncio.wait_for(fut, timeout_s)


@contextlib.contextmanager
def watch_logs():
    watch = LogWatch()
    with capture_logs(processors=[structlog.contextvars.merge_contextvars, watch]):
        yield watch


class Wire:
    """Snoops the fleet's NATS traffic: request messages as published to JetStream
    (with their headers) and the `WorkItem`s dispatchers hand to workers (pull answers
    go to the worker's ``_INBOX``)."""

    def __init__(self) -> None:
        self.headers: dict[str, dict] = {}  # request id -> JetStream message headers
        self.items: dict[str, WorkItem] = {}
        self._item_waiters: dict[str, asyncio.Future] = {}
        self._subs: list[Any] = []

    async def start(self, nc: Any, prefix: str) -> Wire:
        self._subs.append(await nc.subscribe(f"{prefix}.req.>", cb=self._on_request))
        self._subs.append(await nc.subscribe("_INBOX.>", cb=self._on_inbox))
        await nc.flush()
        return self

    async def stop(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _on_request(self, msg: Any) -> None:
        body = json.loads(msg.data)
        self.headers[body["request_id"]] = dict(msg.headers or {})

    async def _on_inbox(self, msg: Any) -> None:
        try:
            batch = decode_work_batch(msg.data)
        except Exception:
            return  # another inbox reply (pool info, heartbeat acks, ...)
        for item in batch.items:
            rid = item.request.request_id
            self.items[rid] = item
            fut = self._item_waiters.get(rid)
            if fut is not None and not fut.done():
                fut.set_result(item)

    async def item(self, request_id: str, timeout_s: float = 15.0) -> WorkItem:
        if request_id in self.items:
            return self.items[request_id]
        fut = self._item_waiters.setdefault(request_id,
                                            asyncio.get_running_loop().create_future())
        return await asyncio.wait_for(fut, timeout_s)


@pytest.fixture
async def edge(nats_server, nc, uid, tmp_path):
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(tenants_yaml())
    async with in_process_fleet(nats_server.url, nc, uid, time_scale=0.05) as (client, subjects):
        wire = await Wire().start(nc, subjects.prefix)
        settings = StreamerSettings(nats_url=nats_server.url, prefix=subjects.prefix,
                                    redis_url="", tenants_file=str(tenants),
                                    usage_settler=False)
        try:
            async with serve_app(create_app(settings, client=client)) as url:
                yield url, wire
        finally:
            await wire.stop()


async def test_completion_runs_under_its_x_request_id_with_one_access_line(edge):
    url, wire = edge
    body = {"model": "p", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with watch_logs() as logs:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            r = await http.post("/v1/chat/completions", json=body,
                                headers={**AUTH, "traceparent": TP, "X-Request-Id": "mine-1"})
        assert r.status_code == 200, r.text
        rid = r.headers["x-request-id"]
        access = await logs.wait("http_request", request_id=rid)
    # The id the fleet used: the answer's, the worker's and the metering record's.
    assert FLEET_ID.match(rid) and r.json()["id"] == f"chatcmpl-{rid}"
    finished = logs.where("request_finished", request_id=rid)
    assert len(finished) == 1 and finished[0]["tenant"] == "acme"
    # Exactly one access line for the request, with what an operator needs.
    assert len(logs.where("http_request", request_id=rid)) == 1
    assert len(logs.where("http_request")) == 1
    assert access["method"] == "POST" and access["path"] == "/v1/chat/completions"
    assert access["status"] == 200 and access["tenant"] == "acme"
    assert access["duration_ms"] > 0 and access["client"].startswith("127.0.0.1:")
    assert access["traceparent"] == TP
    # A client's own id is recorded, not adopted (ids are the fleet-wide dedupe key).
    assert access["client_request_id"] == "mine-1"
    # The trace context went all the way: JetStream header, WorkItem, worker log line.
    assert wire.headers[rid]["traceparent"] == TP
    assert (await wire.item(rid)).traceparent == TP
    assert finished[0]["traceparent"] == TP


@pytest.mark.parametrize("method,path,kwargs,status,code", [
    ("POST", "/v1/completions", {"json": {"model": "p", "prompt": "hi"},
                                 "headers": {"Authorization": "Bearer sk-wrong"}},
     401, "unauthorized"),
    ("POST", "/v1/completions", {"content": b"{not json", "headers": AUTH}, 400,
     "invalid_request"),
    ("POST", "/v1/completions", {"json": {"model": "nope", "prompt": "hi"}, "headers": AUTH},
     404, "model_not_found"),
    ("GET", "/v1/nowhere", {}, 404, None),
    ("GET", "/v1/completions", {}, 405, None),
])
async def test_error_answers_carry_an_x_request_id(edge, method, path, kwargs, status, code):
    url, _ = edge
    with watch_logs() as logs:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            r = await http.request(method, path, **kwargs)
        rid = r.headers["x-request-id"]
        access = await logs.wait("http_request", request_id=rid)
    assert r.status_code == status and FLEET_ID.match(rid)
    assert "error" in r.json() and (code is None or r.json()["error"]["code"] == code)
    assert access["status"] == status and access["path"] == path
    assert len(logs.where("http_request")) == 1
    if status != 401 and path.startswith("/v1/completions") and method == "POST":
        assert access["tenant"] == "acme"
    if status == 401:
        assert "tenant" not in access


async def test_ops_routes_get_an_id_too(edge):
    url, _ = edge
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        a = await http.get("/healthz")
        b = await http.get("/v1/models", headers=AUTH)
    ids = {a.headers["x-request-id"], b.headers["x-request-id"]}
    assert len(ids) == 2 and all(FLEET_ID.match(i) for i in ids)


async def test_streamed_answer_keeps_streaming_and_logs_once_at_its_end(edge):
    url, wire = edge
    body = {"model": "p", "prompt": "hello", "max_tokens": 6, "seed": 2, "stream": True}
    with watch_logs() as logs:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            async with http.stream("POST", "/v1/completions", json=body,
                                   headers={**AUTH, "traceparent": TP}) as r:
                rid = r.headers["x-request-id"]
                assert r.headers["content-type"].startswith("text/event-stream")
                events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        access = await logs.wait("http_request", request_id=rid)
    assert events[-1] == "data: [DONE]" and len(events) >= 2
    assert json.loads(events[0][6:])["id"] == f"cmpl-{rid}"
    assert access["status"] == 200 and len(logs.where("http_request")) == 1
    assert (await wire.item(rid)).traceparent == TP


@pytest.mark.parametrize("sent", [None, "garbage", "00-" + "0" * 32 + "-b7ad6b7169203331-01",
                                  TP.upper()])
async def test_missing_or_invalid_traceparent_is_replaced_by_a_fresh_one(edge, sent):
    url, wire = edge
    headers = dict(AUTH) if sent is None else {**AUTH, "traceparent": sent}
    with watch_logs() as logs:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            r = await http.post("/v1/completions", headers=headers,
                                json={"model": "p", "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200, r.text  # never an error
        rid = r.headers["x-request-id"]
        access = await logs.wait("http_request", request_id=rid)
    got = (await wire.item(rid)).traceparent
    assert parse_traceparent(got) == got and got != sent and got.lower() != TP
    # One trace per request: what the edge logged is what reached the worker.
    assert access["traceparent"] == got == wire.headers[rid]["traceparent"]
    assert logs.where("request_finished", request_id=rid)[0]["traceparent"] == got


async def test_websocket_requests_join_the_upgrade_requests_trace(edge):
    url, wire = edge
    ws_url = url.replace("http://", "ws://") + "/v1/stream"
    with watch_logs() as logs:
        async with websockets.connect(ws_url, additional_headers={**AUTH, "traceparent": TP}
                                      ) as ws:
            socket_id = ws.response.headers["x-request-id"]
            rids = []
            for cid in ("a", "b"):
                await ws.send(json.dumps({"type": "request", "id": cid, "model": "p",
                                          "prompt": "hi", "max_tokens": 2}))
                frames = []
                while not frames or frames[-1]["type"] not in ("end", "error"):
                    frames.append(json.loads(await asyncio.wait_for(ws.recv(), 15)))
                assert frames[0]["type"] == "accepted", frames
                rids.append(frames[0]["request_id"])
        access = await logs.wait("http_request", request_id=socket_id)
    for rid in rids:
        assert (await wire.item(rid)).traceparent == TP
    assert access["websocket"] is True and access["status"] == 101
    assert access["tenant"] == "acme" and access["path"] == "/v1/stream"
    # Without one, each request on a socket gets a trace of its own.
    async with websockets.connect(ws_url, additional_headers=AUTH) as ws:
        await ws.send(json.dumps({"type": "request", "id": "c", "model": "p",
                                  "prompt": "hi", "max_tokens": 2}))
        accepted = json.loads(await asyncio.wait_for(ws.recv(), 15))
        tp = (await wire.item(accepted["request_id"])).traceparent
    assert parse_traceparent(tp) == tp and tp != TP


async def test_websocket_denial_carries_an_x_request_id(edge):
    url, _ = edge
    ws_url = url.replace("http://", "ws://") + "/v1/stream"
    with pytest.raises(websockets.InvalidStatus) as e:
        async with websockets.connect(ws_url, additional_headers={"Authorization": "Bearer x"}):
            pass
    assert e.value.response.status_code == 401
    assert FLEET_ID.match(e.value.response.headers["x-request-id"])


@pytest.fixture
def procs(tmp_path):
    p = Procs(tmp_path)
    yield p
    p.close()


async def test_streamer_process_writes_only_json_lines(nats_server, nc, uid, tmp_path, procs):
    """`python -m streamer` as users run it: its stderr, uvicorn's lines included, is
    one JSON object per line, with one access line per request."""
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(tenants_yaml())
    port = free_port()
    log_path = tmp_path / "streamer.log"  # Procs: <name>.log, stdout and stderr
    async with in_process_fleet(nats_server.url, nc, uid, time_scale=0.05) as (_, subjects):
        proc = procs.spawn("streamer", "-m", "streamer", env={
            "FAIRLANE_NATS_URL": nats_server.url, "FAIRLANE_PREFIX": subjects.prefix,
            "FAIRLANE_PORT": str(port), "FAIRLANE_TENANTS_FILE": str(tenants),
            "FAIRLANE_REDIS_URL": "", "FAIRLANE_USAGE_SETTLER": "false",
            "FAIRLANE_LOG_JSON": "true", "FAIRLANE_LOG_LEVEL": "info"})
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            async def ready() -> bool:
                assert proc.poll() is None, log_path.read_text()
                with contextlib.suppress(httpx.TransportError):
                    return (await http.get("/readyz")).status_code == 200
                return False

            # Another process's state: polled (helpers.wait_until).
            await wait_until(ready, timeout_s=30, interval_s=0.1)
            r = await http.post("/v1/completions", headers={**AUTH, "traceparent": TP},
                                json={"model": "p", "prompt": "hi", "max_tokens": 3})
            missing = await http.get("/nowhere")
        assert r.status_code == 200, r.text
        assert missing.status_code == 404
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 30) == 0
    text = log_path.read_text()
    lines = [json.loads(line) for line in text.splitlines()]  # each line parses
    assert lines, text
    for line in lines:
        assert {"event", "level", "timestamp", "logger"} <= set(line), line
    loggers = {line["logger"] for line in lines}
    assert "uvicorn.error" in loggers and "streamer.app" in loggers, loggers
    rid = r.headers["x-request-id"]
    (access,) = [ln for ln in lines if ln["event"] == "http_request" and
                 ln["request_id"] == rid]
    assert access["status"] == 200 and access["tenant"] == "acme"
    assert access["traceparent"] == TP
    (miss,) = [ln for ln in lines if ln["event"] == "http_request" and
               ln["request_id"] == missing.headers["x-request-id"]]
    assert miss["status"] == 404 and miss["path"] == "/nowhere"
    # Only our lines: uvicorn's own access log is off.
    assert not [ln for ln in lines if ln["logger"] == "uvicorn.access"]
    assert len([ln for ln in lines if ln["event"] == "http_request"
                and ln["path"] != "/readyz"]) == 2
