"""The worker's span of one request (`fairlane.otel`): ``fairlane.generate`` from accept
to the request's end, a child of the request's trace, with a ``first_token`` event.
Everything here is a no-op while tracing is off; nothing runs per token."""

from __future__ import annotations

from typing import Any

from fairlane import otel
from gpu_worker.engine import GenerationDelta
from gpu_worker.inflight import InFlight


def generation_span(r: InFlight, worker_id: str) -> Any:
    """The request's span, started now (None: tracing is off)."""
    if not otel.enabled():
        return None
    item, req = r.item, r.item.request
    return otel.start_span("fairlane.generate", item.traceparent or None, attributes={
        "fairlane.request_id": req.request_id, "fairlane.tenant": req.tenant,
        "fairlane.tier": req.tier, "fairlane.pool": req.pool, "fairlane.attempt": req.attempt,
        "fairlane.worker_id": worker_id, "fairlane.engine_priority": item.engine_priority,
        "fairlane.queue_ms": item.queue_ms, "fairlane.resumed": req.resume is not None,
        "gen_ai.request.max_tokens": req.sampling.max_tokens,
    })


def first_token(span: Any) -> None:
    otel.add_event(span, "first_token")


def end_generation(span: Any, r: InFlight, outcome: object) -> None:
    """End the span with how the request ended and what it used."""
    if span is None:
        return
    error = None
    if r.fenced:
        reason = "fenced"
    elif r.fail is not None:
        reason, error = "error", f"{r.fail.code.value}: {r.fail.message}"
    elif r.preempted and not isinstance(outcome, GenerationDelta | BaseException):
        reason = "preempted"
    elif r.requeue_reason is not None and not r.started:
        reason = "requeued"
    elif r.cancelled:
        reason = "cancelled"
    elif isinstance(outcome, BaseException):
        reason, error = "error", repr(outcome)
    elif isinstance(outcome, GenerationDelta) and outcome.finish_reason is not None:
        reason = outcome.finish_reason
    else:
        reason = "unknown"
    d = r.last or GenerationDelta()
    otel.end_span(span, error=error, attributes={
        "fairlane.finish_reason": reason,
        **otel.usage_attributes(d.num_prompt_tokens, d.num_output_tokens),
        "fairlane.cached_prompt_tokens": d.num_cached_prompt_tokens,
        "fairlane.num_chunks": r.next_seq,
    })
