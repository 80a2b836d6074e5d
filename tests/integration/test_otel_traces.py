"""OpenTelemetry spans across the fleet: dispatcher, simulated worker and streamer run
as their own processes, configured only by the standard OTEL_* variables, and export
over OTLP/HTTP to a tiny collector this test serves. One request's spans (the edge's
server span, the dispatcher's queue wait, the worker's generation) share the trace id
the client sent and hang under the edge's span; a client's unsampled trace exports
nothing; a websocket request gets a span of its own in the socket's trace."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import signal
from dataclasses import dataclass, field

import httpx
import pytest
import websockets
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from fairlane.embedded import free_port
from fairlane.subjects import Subjects
from fairlane.tenants import hash_api_key
from streamer.testing import serve_app
from tests.helpers import wait_until
from tests.procs import Procs

pytest.importorskip("opentelemetry.sdk")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

KEY = "sk-otel"
AUTH = {"Authorization": f"Bearer {KEY}"}
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
SERVER, INTERNAL = 2, 1  # Span.SpanKind in the OTLP protobuf
STATUS_ERROR = 2


@dataclass
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict
    events: list[str]
    status: int


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


@dataclass
class Collector:
    """An OTLP/HTTP trace receiver (``POST /v1/traces``, protobuf) that keeps every span
    and lets the test await the ones it expects."""

    spans: list[Span] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def traces(self, request: Request) -> Response:
        body = await request.body()
        if request.headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        export = ExportTraceServiceRequest.FromString(body)
        for rs in export.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    self.spans.append(Span(
                        service=resource.get("service.name", ""), name=s.name,
                        trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(), kind=s.kind,
                        start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        events=[e.name for e in s.events], status=s.status.code))
        self.changed.set()
        return Response(ExportTraceServiceResponse().SerializeToString(),
                        media_type="application/x-protobuf")

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/traces", self.traces, methods=["POST"])])

    def named(self, trace_id: str, name: str) -> list[Span]:
        return [s for s in self.spans if s.trace_id == trace_id and s.name == name]

    async def wait_for(self, trace_id: str, names: set[str], timeout_s: float = 30) -> dict:
        """The spans of `trace_id` once one of each of `names` has arrived."""
        async with asyncio.timeout(timeout_s):
            while True:
                got = {s.name: s for s in self.spans if s.trace_id == trace_id}
                if names <= set(got):
                    return got
                self.changed.clear()
                await self.changed.wait()


@pytest.fixture
def procs(tmp_path):
    p = Procs(tmp_path)
    yield p
    p.close()


async def test_one_trace_from_the_client_through_edge_dispatcher_and_worker(
        nats_server, uid, tmp_path, procs):
    collector = Collector()
    subjects = Subjects(f"t{uid}")
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(f"pools: {{p: {{}}}}\n"
                       f"tenants: {{acme: {{api_keys: ['{hash_api_key(KEY)}']}}}}\n")
    port = free_port()
    async with serve_app(collector.app()) as otlp:
        # Only the standard variables turn it on; a short batch delay exports quickly.
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp, "OTEL_BSP_SCHEDULE_DELAY": "50",
               "FAIRLANE_LOG_JSON": "true"}
        nats = ["--nats-url", nats_server.url, "--prefix", subjects.prefix, "--pool", "p"]
        fleet = [
            procs.spawn("dispatcher", "-m", "dispatcher", *nats, env=env),
            procs.spawn("worker", "-m", "gpu_worker", *nats, "--worker-id", f"w-{uid}",
                        "--time-scale", "0.05", "--heartbeat-ms", "200", env=env),
            procs.spawn("streamer", "-m", "streamer", env={
                **env, "FAIRLANE_NATS_URL": nats_server.url, "FAIRLANE_PREFIX": subjects.prefix,
                "FAIRLANE_PORT": str(port), "FAIRLANE_TENANTS_FILE": str(tenants),
                "FAIRLANE_POOL": "p", "FAIRLANE_REDIS_URL": "",
                "FAIRLANE_USAGE_SETTLER": "false"}),
        ]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            async def ready() -> bool:
                for p in fleet:
                    assert p.poll() is None, (tmp_path / "streamer.log").read_text()
                with contextlib.suppress(httpx.TransportError):
                    return (await http.get("/readyz")).status_code == 200
                return False

            await wait_until(ready, timeout_s=60, interval_s=0.1)  # other processes
            body = {"model": "p", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 3, "seed": 2}
            # First a client trace that is not sampled: nothing of it may be exported.
            unsampled = "5" * 32
            r0 = await http.post("/v1/chat/completions", json=body,
                                 headers={**AUTH, "traceparent": f"00-{unsampled}-{CLIENT_SPAN}-00"})
            r = await http.post("/v1/chat/completions", json=body,
                                headers={**AUTH, "traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"})
            assert (r0.status_code, r.status_code) == (200, 200), r.text
            got = await collector.wait_for(
                TRACE_ID, {"POST /v1/chat/completions", "fairlane.queue_wait", "fairlane.generate"})

            ws_trace = "6" * 32
            url = f"ws://127.0.0.1:{port}/v1/stream"
            async with websockets.connect(url, additional_headers={
                    **AUTH, "traceparent": f"00-{ws_trace}-{CLIENT_SPAN}-01"}) as ws:
                await ws.send(json.dumps({"type": "request", "id": "a", "prompt": "hi",
                                          "max_tokens": 2, "seed": 2}))
                frames = [json.loads(await asyncio.wait_for(ws.recv(), 20)) for _ in range(4)]
            assert frames[0]["type"] == "accepted" and frames[-1]["type"] == "end", frames
            ws_spans = await collector.wait_for(
                ws_trace, {"fairlane.ws_request", "fairlane.queue_wait", "fairlane.generate"})

        for p in fleet:  # a graceful stop flushes what is still buffered
            p.send_signal(signal.SIGTERM)
        for p in fleet:
            assert await asyncio.to_thread(p.wait, 30) == 0

    edge, queue, gen = (got["POST /v1/chat/completions"], got["fairlane.queue_wait"],
                        got["fairlane.generate"])
    # The edge's span is the client's span's child; the fleet's are the edge's.
    assert (edge.service, edge.kind, edge.parent_id) == ("fairlane-streamer", SERVER, CLIENT_SPAN)
    assert (queue.service, queue.kind, queue.parent_id) == (
        "fairlane-dispatcher", INTERNAL, edge.span_id)
    assert (gen.service, gen.kind, gen.parent_id) == ("fairlane-gpu_worker", INTERNAL, edge.span_id)
    rid = r.headers["x-request-id"]
    common = {"fairlane.request_id": rid, "fairlane.tenant": "acme", "fairlane.pool": "p"}
    for span in (edge, queue, gen):
        assert common.items() <= span.attributes.items(), (span.name, span.attributes)
        assert span.attributes["fairlane.tier"] == edge.attributes["fairlane.tier"]
        assert span.status != STATUS_ERROR
    assert edge.attributes["http.response.status_code"] == 200
    assert edge.attributes["http.request.method"] == "POST"
    usage = r.json()["usage"]
    for span in (edge, gen):
        assert span.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 3
        assert span.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert gen.events == ["first_token"] and gen.attributes["fairlane.finish_reason"] == "length"
    # In time: the wait starts inside the request, generation after the wait began.
    assert edge.start_ns <= queue.start_ns <= queue.end_ns <= edge.end_ns
    assert queue.start_ns <= gen.start_ns <= gen.end_ns <= edge.end_ns
    # The unsampled request's spans were ended before the sampled one's, so they would
    # have been exported by now: there are none.
    assert not [s for s in collector.spans if s.trace_id == unsampled]
    # A websocket request: its own server span, the socket's trace, the fleet's under it.
    w = ws_spans["fairlane.ws_request"]
    assert (w.kind, w.parent_id, w.attributes["fairlane.request_id"]) == (
        SERVER, CLIENT_SPAN, frames[0]["request_id"])
    assert w.attributes["gen_ai.usage.output_tokens"] == 2
    for name in ("fairlane.queue_wait", "fairlane.generate"):
        assert ws_spans[name].parent_id == w.span_id
