"""Plain data the pure scheduler core works on. No I/O, no clocks: time is passed in.

All times here are milliseconds on the *caller's* clock (the dispatcher passes a
monotonic clock; tests pass whatever they like). Deadlines are converted to that
clock by the shell before a request enters the core.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Final

from fairlane.protocol import ErrorCode


@dataclass(slots=True, init=False)
class QueuedRequest:
    # One per request: `__init__` written, as the records below (why: see there).
    request_id: str
    tenant: str
    tier: str
    prompt_tokens: int
    max_output_tokens: int
    expected_output_tokens: int
    priority: int  # higher first, within the tenant
    arrival_ms: float
    deadline_ms: float | None  # on the caller's clock
    ttft_budget_ms: float | None
    # Set by the core:
    seq: int  # arrival order, for stable ordering
    est_cost: float  # cost charged at dispatch (trued up on finish)
    est_kv_tokens: int  # KV tokens charged against max_kv_tokens while in flight
    requeued: bool  # goes to the front of its priority class
    attempt: int  # the client's attempt number for this request id
    # Preemption (DESIGN.md 5b), set by the core:
    enqueued_ms: float  # when it last entered the queue (preempt_after_ms counts from it)
    num_preemptions: int  # times it was preempted: a continuation when > 0
    num_generated_tokens: int  # output tokens its earlier runs generated, all of them
    paid_cost: float  # what its earlier runs were charged, settled to the work they did
    resume_cost: float  # a continuation's estimated cost: the work left, nothing more
    home_worker: str | None  # a continuation: the worker whose prefix cache has it
    # Its last charge was made while no other tenant of its tier waited (a quantum or a
    # counter nobody else contended): its refunds do not come back as credit (drr, vtc).
    charged_alone: bool
    # Opaque to the core: the shell's handle (JetStream message, decoded request).
    payload: Any = field(repr=False, compare=False)

    def __init__(self, request_id: str, tenant: str, tier: str, prompt_tokens: int,
                 max_output_tokens: int, expected_output_tokens: int, priority: int = 0,
                 arrival_ms: float = 0.0, deadline_ms: float | None = None,
                 ttft_budget_ms: float | None = None, seq: int = 0, est_cost: float = 0.0,
                 est_kv_tokens: int = 0, requeued: bool = False, attempt: int = 0,
                 enqueued_ms: float = 0.0, num_preemptions: int = 0,
                 num_generated_tokens: int = 0, paid_cost: float = 0.0,
                 resume_cost: float = 0.0, home_worker: str | None = None,
                 charged_alone: bool = False, payload: Any = None) -> None:
        self.request_id, self.tenant, self.tier = request_id, tenant, tier
        self.prompt_tokens, self.max_output_tokens = prompt_tokens, max_output_tokens
        self.expected_output_tokens, self.priority = expected_output_tokens, priority
        self.arrival_ms, self.deadline_ms, self.ttft_budget_ms = arrival_ms, deadline_ms, ttft_budget_ms
        self.seq, self.est_cost, self.est_kv_tokens = seq, est_cost, est_kv_tokens
        self.requeued, self.attempt, self.enqueued_ms = requeued, attempt, enqueued_ms
        self.num_preemptions, self.num_generated_tokens = num_preemptions, num_generated_tokens
        self.paid_cost, self.resume_cost, self.home_worker = paid_cost, resume_cost, home_worker
        self.charged_alone, self.payload = charged_alone, payload

    @property
    def kv_tokens(self) -> int:
        return self.prompt_tokens + self.max_output_tokens


@dataclass(slots=True)
class TenantLoad:
    """Per-tenant live counters (quotas and metrics)."""

    num_queued: int = 0
    num_in_flight: int = 0
    kv_tokens_in_flight: int = 0
    dispatched_cost: float = 0.0  # cumulative, trued up to actual usage
    queued_cost: float = 0.0  # estimated cost of the requests waiting
    # `dispatched_cost` when the stats snapshot last sampled it (`dispatcher.stats`):
    # kept here, it goes when the load is forgotten, and a fresh load starts from 0.
    sampled_cost: float = 0.0


# The records made for every request (InFlight, Dispatch, ActualUsage) write their
# `__init__`: mypyc compiles a written one (`fairlane simulate --compiled`), a
# dataclass's generated one stays interpreted. Immutable ones have `Final` fields
# (mypy and mypyc refuse to assign them outside `__init__`) instead of `frozen`,
# whose `__init__` sets each field through `object.__setattr__`, ~15x slower.


@dataclass(slots=True, init=False)
class InFlight:
    """A dispatched request, as the core tracks it until it ends or goes back."""

    request: QueuedRequest
    tier_index: int
    started: bool
    started_ms: float | None  # when this run started (min_run_ms counts from it)

    def __init__(self, request: QueuedRequest, tier_index: int, started: bool = False,
                 started_ms: float | None = None) -> None:
        self.request, self.tier_index = request, tier_index
        self.started, self.started_ms = started, started_ms


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


@dataclass(slots=True, init=False)
class Dispatch:
    """One scheduling decision: this request goes to the pulling worker."""

    request: Final[QueuedRequest]
    engine_priority: Final[int]  # vLLM convention: lower runs first; from the tier
    cost: Final[float]

    def __init__(self, request: QueuedRequest, engine_priority: int, cost: float) -> None:
        self.request, self.engine_priority, self.cost = request, engine_priority, cost


@dataclass(slots=True, init=False)
class ActualUsage:
    """What a finished request really consumed, for the cost true-up."""

    prompt_tokens: Final[int]
    completion_tokens: Final[int]
    kv_token_seconds: Final[float]
    e2e_ms: Final[float]

    def __init__(self, prompt_tokens: int = 0, completion_tokens: int = 0,
                 kv_token_seconds: float = 0.0, e2e_ms: float = 0.0) -> None:
        self.prompt_tokens, self.completion_tokens = prompt_tokens, completion_tokens
        self.kv_token_seconds, self.e2e_ms = kv_token_seconds, e2e_ms


@dataclass(slots=True, frozen=True)
class PreemptionOrder:
    """Preempt `request` on `worker_id`: the slot it frees goes to `for_request`.

    The shell sends the order to the worker, which aborts the request and reports the
    tokens it generated (`Scheduler.preempted`); until then the core holds the next free
    slot for `for_request` (a request that was dispatched anyway is simply not held).
    """

    request: QueuedRequest  # the victim, running
    worker_id: str
    for_request: QueuedRequest  # the waiting request below its tenant's fair share

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def for_tenant(self) -> str:
        return self.for_request.tenant
