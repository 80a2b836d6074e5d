"""Optional OpenTelemetry spans: off, and free, unless the ``otel`` extra is installed
AND an operator turns tracing on with the standard ``OTEL_*`` variables.

Turning it on (each process reads its own environment; `fairlane up` passes it on):

- ``pip install 'fairlane[otel]'`` (the OpenTelemetry SDK and its OTLP/HTTP exporter);
- ``OTEL_EXPORTER_OTLP_ENDPOINT=http://collector:4318`` (or
  ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``), or ``OTEL_TRACES_EXPORTER=otlp|console``.
  Installing the extra alone does not export (the SDK's default target,
  localhost:4318, is rarely there): a process traces only when told where to.
  ``OTEL_TRACES_EXPORTER=none`` or ``OTEL_SDK_DISABLED=true`` turns it off again.

Everything else is the SDK's own: ``OTEL_SERVICE_NAME`` (default
``fairlane-<process>``), ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER`` (default
parent-based always-on: a client's unsampled ``traceparent`` stays unsampled),
``OTEL_EXPORTER_OTLP_HEADERS`` / ``_TIMEOUT`` / ``_COMPRESSION``, ``OTEL_BSP_*``.
Only OTLP over HTTP/protobuf ships in the extra; ``..._PROTOCOL=grpc`` works when
``opentelemetry-exporter-otlp-proto-grpc`` is installed too.

Spans, all in the request's trace (the ``traceparent`` fairlane already carries,
`fairlane.trace`): the streamer's ``POST /v1/...`` server span (a child of the
client's span when it sent one) and, as its children, the dispatcher's
``fairlane.queue_wait`` (ingest to dispatch) and the worker's ``fairlane.generate``
(accept to finish, a ``first_token`` event). With tracing on, the edge sends its own
span's context downstream in place of the client's; off, the ``traceparent`` travels
unchanged. One span per request per hop, none per token; ending one hands it to the
SDK's batch processor (a queue and a thread), so the event loop never exports.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from typing import Any

import structlog

from fairlane.trace import parse_traceparent

log = structlog.get_logger(__name__)

AttrValue = str | int | float | bool
_tracer: Any = None  # an SDK Tracer once `setup` turned tracing on; None: every call no-ops
_provider: Any = None


def wanted(env: Mapping[str, str] | None = None) -> bool:
    """Whether the environment asks for traces (whether or not the extra is installed)."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = _exporter_names(env)
    if exporters is not None:
        return bool(exporters)
    return bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def _exporter_names(env: Mapping[str, str]) -> list[str] | None:
    """``OTEL_TRACES_EXPORTER`` as a list ([] for "none"); None when unset."""
    value = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not value:
        return None
    return [n for n in (p.strip() for p in value.split(",")) if n and n != "none"]


def enabled() -> bool:
    return _tracer is not None


def setup(service: str, exporter: Any = None) -> bool:
    """Turn tracing on for this process if the environment asks and the extra is
    installed (True: on). Call once, from ``main()``, after logging is configured.
    `exporter`: a span exporter to use instead of the environment's (tests)."""
    global _tracer, _provider
    if _tracer is not None:
        return True
    if exporter is None and not wanted():
        return False
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        log.warning("otel_unavailable", error=str(exc),
                    hint="OTEL_* asks for traces: pip install 'fairlane[otel]'")
        return False
    exporters = [exporter] if exporter is not None else _exporters()
    if not exporters:
        return False
    resource = Resource.create()
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": f"fairlane-{service}"}))
    # Shut down by `shutdown` (bounded), not by the SDK's atexit hook (which is not).
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    for e in exporters:
        provider.add_span_processor(BatchSpanProcessor(e))
    _provider, _tracer = provider, provider.get_tracer(f"fairlane.{service}")
    log.info("otel_tracing_on", service=resource.attributes.get("service.name"),
             exporters=[type(e).__name__ for e in exporters])
    return True


def _exporters() -> list[Any]:
    out = []
    for name in _exporter_names(os.environ) or ["otlp"]:
        if name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            out.append(ConsoleSpanExporter())
        elif name == "otlp":
            protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf")
            try:
                if protocol.strip() == "grpc":
                    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                        OTLPSpanExporter,
                    )
                else:
                    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                        OTLPSpanExporter,
                    )
            except ImportError as exc:
                log.warning("otel_exporter_unavailable", protocol=protocol, error=str(exc))
                continue
            out.append(OTLPSpanExporter())
        else:
            log.warning("otel_exporter_unknown", exporter=name, known="otlp, console, none")
    return out


def shutdown(timeout_s: float = 5.0) -> None:
    """Export what is buffered and stop; waits at most `timeout_s` (an unreachable
    collector would otherwise hold a stopping process for the exporter's retries)."""
    global _tracer, _provider
    provider, _provider, _tracer = _provider, None, None
    if provider is None:
        return

    def _shutdown() -> None:
        try:
            provider.shutdown()
        except Exception as exc:  # noqa: BLE001 - never fail a process's exit over traces
            log.warning("otel_shutdown_failed", error=repr(exc))

    t = threading.Thread(target=_shutdown, name="otel-shutdown", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        log.warning("otel_shutdown_timed_out", timeout_s=timeout_s)


def _parent(traceparent: str | None) -> Any:
    """An OpenTelemetry context whose current span is the remote `traceparent`
    (None: no parent, the span starts a trace)."""
    tp = parse_traceparent(traceparent) if traceparent else None
    if tp is None:
        return None
    from opentelemetry import trace

    _, trace_id, span_id, flags = tp.split("-")
    ctx = trace.SpanContext(int(trace_id, 16), int(span_id, 16), is_remote=True,
                            trace_flags=trace.TraceFlags(int(flags, 16)))
    return trace.set_span_in_context(trace.NonRecordingSpan(ctx))


def start_span(name: str, traceparent: str | None, *, server: bool = False,
               start_ns: int | None = None,
               attributes: Mapping[str, AttrValue | None] | None = None) -> Any:
    """A started span, child of `traceparent` (None: a new trace); None when off."""
    if _tracer is None:
        return None
    from opentelemetry.trace import SpanKind

    try:
        return _tracer.start_span(
            name, context=_parent(traceparent),
            kind=SpanKind.SERVER if server else SpanKind.INTERNAL,
            attributes=_clean(attributes), start_time=start_ns)
    except Exception as exc:  # noqa: BLE001 - tracing never fails a request
        log.warning("otel_span_failed", span=name, error=repr(exc))
        return None


def traceparent_of(span: Any, fallback: str | None) -> str | None:
    """The W3C ``traceparent`` naming `span` as the parent (`fallback`: no span)."""
    if span is None:
        return fallback
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return fallback
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def set_attributes(span: Any, attributes: Mapping[str, AttrValue | None]) -> None:
    if span is not None:
        span.set_attributes(_clean(attributes))


def add_event(span: Any, name: str, attributes: Mapping[str, AttrValue | None] | None = None
              ) -> None:
    if span is not None:
        span.add_event(name, _clean(attributes))


def mark_error(span: Any, description: str) -> None:
    """Mark `span` failed (it is ended elsewhere)."""
    if span is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, description))


def end_span(span: Any, *, error: str | None = None, end_ns: int | None = None,
             attributes: Mapping[str, AttrValue | None] | None = None) -> None:
    """End `span` (no-op for None); `error`: mark it failed, with that description."""
    if span is None:
        return
    try:
        if attributes:
            span.set_attributes(_clean(attributes))
        if error is not None:
            mark_error(span, error)
        span.end(end_time=end_ns)
    except Exception as exc:  # noqa: BLE001
        log.warning("otel_span_failed", error=repr(exc))


def record_span(name: str, traceparent: str | None, *, start_ns: int,
                end_ns: int | None = None,
                attributes: Mapping[str, AttrValue | None] | None = None) -> None:
    """A span already over (e.g. a wait measured by its two ends); no-op when off."""
    if _tracer is not None:
        end_span(start_span(name, traceparent, start_ns=start_ns, attributes=attributes),
                 end_ns=end_ns if end_ns is not None else time.time_ns())


def usage_attributes(prompt_tokens: int | None, completion_tokens: int | None
                     ) -> dict[str, AttrValue | None]:
    """Token counts under OpenTelemetry's GenAI names."""
    return {"gen_ai.usage.input_tokens": prompt_tokens,
            "gen_ai.usage.output_tokens": completion_tokens}


def _clean(attributes: Mapping[str, AttrValue | None] | None) -> dict[str, AttrValue]:
    return {k: v for k, v in (attributes or {}).items() if v is not None}
