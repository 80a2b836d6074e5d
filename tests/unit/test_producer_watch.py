"""The producer's pure delivery decisions: silent streams, duplicate publishes."""

from __future__ import annotations

import pytest

from fairlane.errors import ErrorCode, ErrorInfo
from fairlane.protocol import RequestStatus
from producer.watch import Action, dedupe_key, duplicate_action, silence_action

pytestmark = pytest.mark.unit


def st(state: str, attempt: int = 0, error: ErrorInfo | None = None) -> RequestStatus:
    return RequestStatus(request_id="r1", state=state, attempt=attempt, error=error)


def test_dedupe_key_bare_id_for_first_attempt_then_suffixed() -> None:
    assert dedupe_key("r1", 0) == "r1"
    assert dedupe_key("r1", 2) == "r1.2"


@pytest.mark.parametrize("state", ["queued", "running"])
def test_silence_vouched_keeps_waiting(state: str) -> None:
    assert silence_action(st(state), 100.0, 30.0) == (Action.WAIT, None)


def test_silence_ended_with_error_fails_with_that_error() -> None:
    err = ErrorInfo.of(ErrorCode.WORKER_LOST, "gone")
    assert silence_action(st("ended", error=err), 3.0, 30.0) == (Action.FAIL, err)


@pytest.mark.parametrize("state", ["ended", "unknown", "some_future_state"])
def test_silence_ended_cleanly_or_unknown_is_stream_lost(state: str) -> None:
    action, err = silence_action(st(state), 3.0, 30.0)
    assert action is Action.FAIL and err is not None
    assert err.code is ErrorCode.STREAM_LOST and err.retryable


def test_silence_unknown_before_any_chunk_is_waited_out_as_jetstream_redelivers() -> None:
    # The message may sit un-acked at a dead dispatcher until ack_wait: a new attempt
    # now would run beside it.
    assert silence_action(st("unknown"), 45.0, 30.0, started=False) == (Action.ASK_AGAIN, None)
    action, err = silence_action(st("unknown"), 60.0, 30.0, started=False)
    assert action is Action.FAIL and err.code is ErrorCode.STREAM_LOST


@pytest.mark.parametrize("earlier", [
    st("ended"), st("ended", error=ErrorInfo.of(ErrorCode.CANCELLED, "gap")), st("running")])
def test_silence_status_of_an_earlier_attempt_waits_for_the_current_one(earlier) -> None:
    """A resumed stream (attempt 1) whose dispatcher still answers for attempt 0 (it has
    not ingested attempt 1 yet): never the current attempt's end, never a new attempt."""
    assert silence_action(earlier, 3.0, 30.0, started=False, attempt=1) == (
        Action.ASK_AGAIN, None)
    action, error = silence_action(earlier, 61.0, 30.0, started=False, attempt=1)
    assert action is Action.FAIL and error.code == ErrorCode.STREAM_LOST
    assert silence_action(earlier, 3.0, 30.0, started=False, attempt=0)[0] in (
        Action.FAIL, Action.WAIT)


def test_silence_no_answer_asks_again_until_max_silence() -> None:
    assert silence_action(None, 29.9, 30.0) == (Action.ASK_AGAIN, None)
    action, err = silence_action(None, 30.0, 30.0)
    assert action is Action.FAIL and err is not None and err.code is ErrorCode.STREAM_LOST


@pytest.mark.parametrize("state", ["queued", "running"])
def test_duplicate_of_our_live_request_attaches(state: str) -> None:
    assert duplicate_action(st(state), 0, ours=True) == (Action.ATTACH, None)


@pytest.mark.parametrize("state", ["queued", "running"])
def test_duplicate_of_another_clients_live_request_fails_with_status(state: str) -> None:
    action, err = duplicate_action(st(state, attempt=1), 1, ours=False)
    assert action is Action.FAIL and err is not None
    assert err.code is ErrorCode.DUPLICATE and state in err.message


@pytest.mark.parametrize("ours", [True, False])
def test_duplicate_of_an_unknown_or_retryably_failed_request_republishes(ours: bool) -> None:
    assert duplicate_action(st("unknown"), 0, ours=ours) == (Action.REPUBLISH, None)
    lost = ErrorInfo.of(ErrorCode.WORKER_LOST, "gone")
    assert duplicate_action(st("ended", error=lost), 0, ours=ours) == (Action.REPUBLISH, None)


@pytest.mark.parametrize("ours", [True, False])
@pytest.mark.parametrize("error", [None, ErrorInfo.of(ErrorCode.INVALID_REQUEST, "bad")])
def test_duplicate_of_a_finished_request_is_answered_never_run_twice(ours, error) -> None:
    action, err = duplicate_action(st("ended", error=error), 0, ours=ours)
    assert action is Action.FAIL and err.code is ErrorCode.DUPLICATE
    assert "finished" in err.message or "invalid_request" in err.message


def test_duplicate_live_older_attempt_republishes() -> None:
    # The dispatcher still runs attempt 0 but we publish attempt 1 (deduped): not ours.
    assert duplicate_action(st("running", attempt=0), 1, ours=True) == (Action.REPUBLISH, None)


def test_duplicate_no_answer_attaches_only_if_ours() -> None:
    assert duplicate_action(None, 0, ours=True) == (Action.ATTACH, None)
    action, err = duplicate_action(None, 0, ours=False)
    assert action is Action.FAIL and err is not None and err.code is ErrorCode.DUPLICATE
