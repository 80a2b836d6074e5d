"""`fairlane.otel`: off (and harmless) unless the extra is installed AND OTEL_* asks;
when on, spans parent on the request's ``traceparent``. (The whole fleet exporting to
an OTLP collector: tests/integration/test_otel_traces.py.)"""

from __future__ import annotations

import sys

import pytest

from fairlane import otel

pytestmark = pytest.mark.unit

TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
OTEL_VARS = ("OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
             "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


@pytest.fixture
def clean_env(monkeypatch):
    for name in OTEL_VARS:
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch
    otel.shutdown()  # whatever a test turned on is off for the next


@pytest.mark.parametrize("env,want", [
    ({}, False),  # the extra installed is not enough: nobody said where to send
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, True),
    ({"OTEL_TRACES_EXPORTER": "console"}, True),
    ({"OTEL_TRACES_EXPORTER": "otlp,console"}, True),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, False),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, False),
])
def test_tracing_is_wanted_only_when_otel_vars_ask(env, want):
    assert otel.wanted(env) is want


def test_off_by_default_every_call_is_a_no_op(clean_env):
    assert otel.setup("streamer") is False and not otel.enabled()
    span = otel.start_span("x", TP, server=True, attributes={"a": 1})
    assert span is None
    otel.add_event(span, "first_token")
    otel.set_attributes(span, {"a": 1})
    otel.mark_error(span, "no")
    otel.end_span(span, error="no")
    otel.record_span("y", TP, start_ns=1)
    assert otel.traceparent_of(span, TP) == TP  # the trace travels unchanged
    otel.shutdown()


def test_asked_for_without_the_extra_warns_and_stays_off(clean_env):
    from structlog.testing import capture_logs

    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    clean_env.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # "not installed"
    with capture_logs() as logs:
        assert otel.setup("dispatcher") is False
    assert not otel.enabled() and otel.start_span("x", TP) is None
    assert [e["event"] for e in logs] == ["otel_unavailable"]
    assert "fairlane[otel]" in logs[0]["hint"]


def test_spans_parent_on_the_traceparent_and_carry_attributes(clean_env):
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind, StatusCode

    mem = InMemorySpanExporter()
    assert otel.setup("streamer", exporter=mem) and otel.enabled()
    edge = otel.start_span("POST /v1/completions", TP, server=True,
                           attributes={"fairlane.tenant": "acme", "skipped": None})
    downstream = otel.traceparent_of(edge, TP)
    assert downstream.startswith("00-0af7651916cd43dd8448eb211c80319c-")
    assert downstream != TP and downstream.endswith("-01")
    otel.record_span("fairlane.queue_wait", downstream, start_ns=1_000, end_ns=2_000)
    gen = otel.start_span("fairlane.generate", downstream)
    otel.add_event(gen, "first_token")
    otel.end_span(gen, error="engine_error: boom",
                  attributes=otel.usage_attributes(5, None))
    otel.end_span(edge, attributes={"http.response.status_code": 200})
    root = otel.start_span("fresh", None)  # no traceparent: a trace of its own
    otel.end_span(root)
    otel.shutdown()  # flushes
    assert not otel.enabled()
    spans = {s.name: s for s in mem.get_finished_spans()}
    e, q, g = spans["POST /v1/completions"], spans["fairlane.queue_wait"], spans["fairlane.generate"]
    assert e.kind == SpanKind.SERVER and e.parent.span_id == 0xb7ad6b7169203331
    assert e.parent.is_remote and dict(e.attributes) == {
        "fairlane.tenant": "acme", "http.response.status_code": 200}
    assert e.resource.attributes["service.name"] == "fairlane-streamer"
    for child in (q, g):
        assert child.context.trace_id == 0x0af7651916cd43dd8448eb211c80319c
        assert child.parent.span_id == e.context.span_id and child.kind == SpanKind.INTERNAL
    assert (q.start_time, q.end_time) == (1_000, 2_000)
    assert [ev.name for ev in g.events] == ["first_token"]
    assert g.status.status_code == StatusCode.ERROR
    assert dict(g.attributes) == {"gen_ai.usage.input_tokens": 5}
    assert spans["fresh"].parent is None
    assert spans["fresh"].context.trace_id != e.context.trace_id


def test_an_unsampled_client_trace_stays_unsampled(clean_env):
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    mem = InMemorySpanExporter()
    otel.setup("streamer", exporter=mem)
    unsampled = TP[:-2] + "00"
    edge = otel.start_span("POST /v1/completions", unsampled, server=True)
    downstream = otel.traceparent_of(edge, unsampled)
    assert downstream.endswith("-00") and downstream[3:35] == TP[3:35]
    otel.record_span("fairlane.queue_wait", downstream, start_ns=1)
    otel.end_span(edge)
    otel.shutdown()
    assert mem.get_finished_spans() == ()
