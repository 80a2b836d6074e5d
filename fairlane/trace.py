"""W3C Trace Context (``traceparent``) and request-id helpers shared by every process.

A request's ``traceparent`` is decided once, at the edge (the client's if valid, else a
fresh one), and travels unchanged: in the NATS headers of its JetStream publish, then
in its `WorkItem` to the worker, which logs it with the request's lines. Without
OpenTelemetry (`fairlane.otel`, an optional extra) fairlane makes no spans of its own,
so it never changes the parent id; a tracing backend joins the client's trace to
fairlane's log lines by the trace id. With it, the edge's server span becomes the
parent the fleet carries (same trace id), so the fleet's spans hang under it.

Format (version 00): ``00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>``, lower
case, ids not all zeros. A later version is accepted by its version-00 prefix (as the
spec asks) and passed on as version 00; anything else is ignored, never an error.
"""

from __future__ import annotations

import re
import secrets

TRACEPARENT_HEADER = "traceparent"
REQUEST_ID_HEADER = "X-Request-Id"

_TRACEPARENT_RE = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?", re.S)
_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")


def parse_traceparent(value: str | bytes | None) -> str | None:
    """The version-00 form of a valid ``traceparent``, else None."""
    if value is None:
        return None
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    if len(value) > 512:  # a header, not a payload
        return None
    m = _TRACEPARENT_RE.fullmatch(value.strip())
    if m is None:
        return None
    version, trace_id, parent_id, flags, rest = m.groups()
    if version == "ff" or (version == "00" and rest is not None):
        return None
    if trace_id == "0" * 32 or parent_id == "0" * 16:
        return None
    return f"00-{trace_id}-{parent_id}-{flags}"


def new_traceparent(sampled: bool = False) -> str:
    """A fresh trace: random trace and parent ids; not sampled unless asked."""
    trace_id = secrets.token_hex(16)
    parent_id = secrets.token_hex(8)
    # All-zero ids are invalid; vanishingly rare, but then draw again.
    if trace_id == "0" * 32 or parent_id == "0" * 16:
        return new_traceparent(sampled)
    return f"00-{trace_id}-{parent_id}-{'01' if sampled else '00'}"


def traceparent_or_new(value: str | bytes | None) -> str:
    """`value` if it is a valid ``traceparent`` (as version 00), else a fresh one."""
    return parse_traceparent(value) or new_traceparent()


def trace_id_of(traceparent: str) -> str:
    """The 32-hex trace id of a valid ``traceparent``."""
    return traceparent[3:35]


def valid_request_id(value: str | None) -> bool:
    """Whether `value` has the shape of a fairlane request id (``[A-Za-z0-9_-]{1,128}``)."""
    return value is not None and _REQUEST_ID_RE.fullmatch(value) is not None
