"""What the pure core tells the dispatcher shell to do: a tagged union of actions.

The core decides; the shell executes every action in one place
(`dispatcher.service.Dispatcher._apply`). Each action names the `QueuedRequest` it is
about; the shell finds the JetStream message and the reply subject through the
request's opaque `payload`.

Message settlement, in one table (DESIGN.md section 4):

| action | JetStream message | when |
|---|---|---|
| `Hold` | keep un-acked, touch with in_progress | admitted (queued) or deferred |
| `Ack` | ack: never redeliver | started, or finished/failed (never replay) |
| `Term` | term: never redeliver | refused, expired, shed, cancelled while queued |
| `Nak` | nak: redeliver now | shutdown: queued work goes back to JetStream |
| `Defer` | nak with a delay: redeliver later | a redelivery during the restart grace |

`CheckStarted` settles nothing: it asks the shell whether a worker already acked the
request's message (a WorkQueue stream deletes it then), the one record of "started"
that survives lost events and broker restarts; the shell answers with
`PoolCore.on_start_checked`.

Actions are immutable: `frozen`, or, for the two made for every request (`Hold`,
`Ack`), `Final` fields that mypy (and mypyc, which compiles this module for
`fairlane simulate --compiled`) refuses to assign outside `__init__`. Those two write
their `__init__`: mypyc compiles a written one to C, a dataclass's generated one stays
interpreted (~15x slower to call for a frozen one, which sets each field through
`object.__setattr__`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from dispatcher.scheduler.types import Dispatch, QueuedRequest
from fairlane.errors import ErrorCode


@dataclass(slots=True, init=False)
class Hold:
    """Keep the request's message un-acked: it is queued (or waits for the restart
    grace to end) and must come back to another dispatcher if this one dies."""

    request: Final[QueuedRequest]

    def __init__(self, request: QueuedRequest) -> None:
        self.request = request


@dataclass(slots=True, init=False)
class Ack:
    request: Final[QueuedRequest]
    reason: Final[str]  # started | finished | worker_lost | reconciled

    def __init__(self, request: QueuedRequest, reason: str) -> None:
        self.request, self.reason = request, reason


@dataclass(slots=True, frozen=True)
class Term:
    request: QueuedRequest
    reason: str  # the error code that ended it


@dataclass(slots=True, frozen=True)
class Nak:
    request: QueuedRequest


@dataclass(slots=True, frozen=True)
class Defer:
    """Hand the message back to JetStream for redelivery after `delay_ms`: a request
    redelivered during the restart grace. Not held, so a crash during the grace does
    not park it for another ``ack_wait`` (a crash loop would otherwise stack them)."""

    request: QueuedRequest
    delay_ms: float


@dataclass(slots=True, frozen=True)
class CheckStarted:
    """Did a worker start this request (ack its JetStream message) although no Started
    event says so? Answer with `PoolCore.on_start_checked(request_id, started, now)`."""

    request: QueuedRequest
    reason: str  # worker_lost | reconciled


@dataclass(slots=True, frozen=True)
class Preempt:
    """Tell `worker_id` to stop `request` and hand back its continuation: the slot it
    frees goes to `for_request`, a waiting request below its tenant's fair share —
    `dispatch`: sent with the order, to start there at once (None: held for the next
    free slot of any worker)."""

    request: QueuedRequest
    worker_id: str
    for_request: QueuedRequest
    dispatch: Dispatch | None = None


@dataclass(slots=True, frozen=True)
class SendError:
    """Tell the client, on the request's reply subject, why it ended."""

    request: QueuedRequest
    code: ErrorCode
    message: str
    retry_after_ms: int | None = None


@dataclass(slots=True, frozen=True)
class Requeued:
    """Back in its tenant's queue (front of its class): serve waiting pulls again."""

    request: QueuedRequest
    reason: str  # handed_back | worker_lost | reconciled | preempted


@dataclass(slots=True, frozen=True)
class Adopted:
    """A request a worker already runs (reported after this dispatcher restarted):
    in flight, never dispatched again."""

    request: QueuedRequest
    worker_id: str


@dataclass(slots=True, frozen=True)
class Released:
    """Queued work held back during the restart grace may now be served."""

    num_requests: int


Action = (Hold | Ack | Term | Nak | Defer | CheckStarted | Preempt | SendError | Requeued
          | Adopted | Released)


def refuse(req: QueuedRequest, code: ErrorCode, message: str,
           retry_after_ms: int | None = None) -> list[Action]:
    """The two actions that end a queued or refused request: tell the client, term it."""
    return [SendError(req, code, message, retry_after_ms), Term(req, code.value)]
