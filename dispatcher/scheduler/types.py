"""Plain data the pure scheduler core works on. No I/O, no clocks: time is passed in.

All times here are milliseconds on the *caller's* clock (the dispatcher passes a
monotonic clock; tests pass whatever they like). Deadlines are converted to that
clock by the shell before a request enters the core.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from fairlane.protocol import ErrorCode


@dataclass(slots=True)
class QueuedRequest:
    request_id: str
    tenant: str
    tier: str
    prompt_tokens: int
    max_output_tokens: int
    expected_output_tokens: int
    priority: int = 0  # higher first, within the tenant
    arrival_ms: float = 0.0
    deadline_ms: float | None = None  # on the caller's clock
    ttft_budget_ms: float | None = None
    # Set by the core:
    seq: int = 0  # arrival order, for stable ordering
    est_cost: float = 0.0  # cost charged at dispatch (trued up on finish)
    est_kv_tokens: int = 0  # KV tokens charged against max_kv_tokens while in flight
    requeued: bool = False  # goes to the front of its priority class
    attempt: int = 0  # the client's attempt number for this request id
    # Opaque to the core: the shell's handle (JetStream message, decoded request).
    payload: Any = field(default=None, repr=False, compare=False)

    @property
    def kv_tokens(self) -> int:
        return self.prompt_tokens + self.max_output_tokens


class Verdict(enum.Enum):
    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"  # already known (queued or in flight): not enqueued twice
    REJECTED = "rejected"


@dataclass(slots=True, frozen=True)
class Admission:
    verdict: Verdict
    code: ErrorCode | None = None
    message: str = ""
    retry_after_ms: int | None = None

    @property
    def accepted(self) -> bool:
        return self.verdict is Verdict.ACCEPTED


ACCEPTED = Admission(Verdict.ACCEPTED)
DUPLICATE = Admission(Verdict.DUPLICATE)


@dataclass(slots=True, frozen=True)
class Dispatch:
    """One scheduling decision: this request goes to the pulling worker."""

    request: QueuedRequest
    engine_priority: int  # vLLM convention: lower runs first; derived from the tier
    cost: float


@dataclass(slots=True, frozen=True)
class ActualUsage:
    """What a finished request really consumed, for the cost true-up."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    kv_token_seconds: float = 0.0
    e2e_ms: float = 0.0
