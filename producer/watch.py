"""Pure decisions of the producer's delivery guarantees (DESIGN.md section 4).

Kept free of I/O so unit tests drive them directly; `producer.client` does the
asking (``fl.status.<pool>``) and acts on the answers.

- `silence_action`: what a stream silent for a while does with the dispatcher's
  status answer (None: nobody answered).
- `duplicate_action`: what a submit whose publish JetStream deduped does.
- `dedupe_key`: the `Nats-Msg-Id` of one attempt of a request.
"""

from __future__ import annotations

import enum

from fairlane.errors import ErrorCode, ErrorInfo
from fairlane.protocol import RequestState, RequestStatus

# The fleet's heartbeat is 1 s; three missed beats is "silent".
DEFAULT_SILENCE_S = 3.0
# Total silence with no dispatcher vouching for the request before giving up.
DEFAULT_MAX_SILENCE_S = 30.0
STATUS_TIMEOUT_S = 1.0


def dedupe_key(request_id: str, attempt: int) -> str:
    """JetStream's dedupe id: the bare id for the first attempt, `id.attempt` after."""
    return request_id if attempt == 0 else f"{request_id}.{attempt}"


class Action(enum.StrEnum):
    WAIT = "wait"  # the dispatcher vouches for it: restart the silence timer
    ASK_AGAIN = "ask_again"  # nobody answered: keep asking until max silence
    FAIL = "fail"  # end the stream with the returned error
    ATTACH = "attach"  # duplicate publish of a live request of ours: keep the stream
    REPUBLISH = "republish"  # duplicate publish of an ended request: attempt + 1


def silence_action(status: RequestStatus | None, silent_s: float, max_silence_s: float,
                   started: bool = True, attempt: int = 0) -> tuple[Action, ErrorInfo | None]:
    """What a stream with no chunk for `silent_s` does, given the status answer.

    `started`: a chunk of the request's current attempt has arrived. A request not yet
    started that a dispatcher does not know is still in JetStream (its publish was
    acked): a dispatcher that died with it delivered but un-acked gets it back after
    `ack_wait`, so "unknown" is waited out (up to twice `max_silence_s`, which covers
    the default 30 s ack_wait) instead of resumed as a new attempt — the old one would
    run too once it comes back to a dispatcher that never saw the new one end.

    `attempt`: the stream's current attempt. A status of an earlier attempt (a resumed
    stream whose new attempt the dispatcher has not ingested yet: its consumer was
    reconnecting after a NATS node died) says nothing of this one: it counts as
    "unknown", never as this attempt's end.
    """
    if status is not None and status.attempt < attempt:
        status = RequestStatus(request_id=status.request_id, state=RequestState.UNKNOWN,
                               attempt=status.attempt)
    if status is not None and status.state == RequestState.UNKNOWN and not started:
        if silent_s < 2 * max_silence_s:
            return Action.ASK_AGAIN, None
        return Action.FAIL, ErrorInfo.of(
            ErrorCode.STREAM_LOST,
            f"no dispatcher has seen the request for {silent_s:.0f} s")
    if status is None:
        if silent_s >= max_silence_s:
            return Action.FAIL, ErrorInfo.of(
                ErrorCode.STREAM_LOST,
                f"no tokens for {silent_s:.0f} s and no dispatcher vouches for the request")
        return Action.ASK_AGAIN, None
    state = status.state
    if state in (RequestState.QUEUED, RequestState.RUNNING):
        return Action.WAIT, None
    if state == RequestState.ENDED:
        if status.error is not None:
            return Action.FAIL, status.error
        return Action.FAIL, ErrorInfo.of(
            ErrorCode.STREAM_LOST, "the request ended but its last tokens were lost")
    # unknown (or a state newer than this client): nobody has it
    return Action.FAIL, ErrorInfo.of(
        ErrorCode.STREAM_LOST, f"the dispatcher does not know the request (state {state!r})")


def duplicate_action(status: RequestStatus | None, attempt: int,
                     ours: bool) -> tuple[Action, ErrorInfo | None]:
    """What a submit does when JetStream says its publish was a duplicate.

    `ours`: the earlier publish came from this client (its tokens reach our inbox).
    """
    if status is None:
        # Cannot tell: the dedupe says someone published it inside the window; if it
        # was us, its tokens will come to this inbox, and the silence watchdog bounds
        # the wait. If not, we cannot receive them.
        if ours:
            return Action.ATTACH, None
        return Action.FAIL, ErrorInfo.of(
            ErrorCode.DUPLICATE, "request id already submitted by another client; "
            "its status is unknown (no dispatcher answered)")
    if status.state in (RequestState.QUEUED, RequestState.RUNNING) and status.attempt >= attempt:
        if ours:
            return Action.ATTACH, None
        return Action.FAIL, ErrorInfo.of(
            ErrorCode.DUPLICATE, f"request id already submitted by another client: "
            f"state {status.state}, attempt {status.attempt}")
    if (status.state == RequestState.ENDED and status.attempt >= attempt
            and (status.error is None or not status.error.retryable)):
        # Finished (or failed for good) inside the dedupe window: answer, never run twice.
        how = (f"failed with {status.error.code}" if status.error is not None
               else "finished")
        return Action.FAIL, ErrorInfo.of(
            ErrorCode.DUPLICATE, f"request id already {how} (attempt {status.attempt}); "
            "use a new request id to generate again")
    # Ended with a retryable failure, or unknown: deduped but not live, run it anew.
    return Action.REPUBLISH, None
