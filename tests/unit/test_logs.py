"""`fairlane.logs`: one JSON line per event for structlog and stdlib loggers alike; and
the W3C ``traceparent`` / request-id helpers of `fairlane.trace`."""

from __future__ import annotations

import json
import logging
import sys
import warnings

import pytest
import structlog

from fairlane.logs import configure_logging
from fairlane.trace import (
    new_traceparent,
    parse_traceparent,
    trace_id_of,
    traceparent_or_new,
    valid_request_id,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

KEYS = {"event", "level", "timestamp", "logger"}


@pytest.fixture
def restore_logging():
    """configure_logging changes process-wide state: put it all back after the test."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    config = structlog.get_config()
    hook = sys.excepthook
    # uvicorn configures its loggers when a test runs it with its default log config
    # (a process's main() does not): start from a logger tree as a process has it.
    uv = [logging.getLogger(n) for n in ("uvicorn", "uvicorn.error")]
    uv_state = [(lg.handlers[:], lg.level, lg.propagate) for lg in uv]
    for lg in uv:
        lg.handlers[:], lg.propagate = [], True
        lg.setLevel(logging.NOTSET)  # (setLevel: also clears the loggers' level caches)
    yield
    for lg, (h, lvl, prop) in zip(uv, uv_state, strict=True):
        lg.handlers[:], lg.propagate = h, prop
        lg.setLevel(lvl)
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.captureWarnings(False)
    structlog.configure(**config)
    structlog.contextvars.clear_contextvars()
    sys.excepthook = hook


def _lines(err: str) -> list[dict]:
    return [json.loads(line) for line in err.splitlines() if line.strip()]


def test_stdlib_and_structlog_lines_are_one_json_object_each(restore_logging, capsys):
    configure_logging("info", json=True)
    structlog.contextvars.bind_contextvars(request_id="r-1")
    logging.getLogger("uvicorn.error").info("Started server process [%d]", 42)
    logging.getLogger("nats.aio.client").debug("below the level: not written")
    structlog.get_logger("dispatcher.service").info("request_settled", reason="x")
    try:
        raise ZeroDivisionError("boom")
    except ZeroDivisionError:
        logging.getLogger("asyncio").exception("Task exception was never retrieved")
        structlog.get_logger("gpu_worker.service").exception("worker_failed")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("careful", UserWarning, stacklevel=1)
    err = capsys.readouterr().err
    lines = _lines(err)  # every line parses: nothing else was written
    assert len(err.splitlines()) == len(lines) == 5, err
    for line in lines:
        assert KEYS <= set(line), line
        assert line["request_id"] == "r-1"  # the structlog context, on stdlib lines too
        assert line["timestamp"].endswith("Z")
    uv, settled, stdlib_exc, struct_exc, warned = lines
    assert (uv["logger"], uv["level"], uv["event"]) == (
        "uvicorn.error", "info", "Started server process [42]")
    assert (settled["logger"], settled["reason"]) == ("dispatcher.service", "x")
    for exc_line, logger in ((stdlib_exc, "asyncio"), (struct_exc, "gpu_worker.service")):
        assert exc_line["level"] == "error" and exc_line["logger"] == logger
        # The traceback: one string field of the one line.
        assert isinstance(exc_line["exception"], str)
        assert exc_line["exception"].startswith("Traceback (most recent call last):")
        assert "ZeroDivisionError: boom" in exc_line["exception"]
    assert warned["logger"] == "py.warnings" and "UserWarning: careful" in warned["event"]


def test_configuring_again_replaces_the_handler(restore_logging, capsys):
    configure_logging("info", json=True)
    configure_logging("warning", json=True)
    logging.getLogger("x").info("filtered")
    logging.getLogger("x").warning("once")
    lines = _lines(capsys.readouterr().err)
    assert [ln["event"] for ln in lines] == ["once"]


def test_console_mode_stays_human_readable(restore_logging, capsys):
    configure_logging("info", json=False)
    logging.getLogger("uvicorn.error").info("Application startup complete.")
    structlog.get_logger("streamer.app").info("streamer_started", prefix="fl")
    try:
        raise ValueError("bad")
    except ValueError:
        logging.getLogger("asyncio").exception("failed")
    err = capsys.readouterr().err
    assert "Application startup complete." in err and "[uvicorn.error]" in err
    assert "streamer_started" in err and "prefix=fl" in err
    assert "ValueError: bad" in err
    assert not err.lstrip().startswith("{")


def test_uncaught_exception_is_one_json_line(restore_logging, capsys):
    configure_logging("info", json=True)
    try:
        raise RuntimeError("crash")
    except RuntimeError:
        sys.excepthook(*sys.exc_info())
    (line,) = _lines(capsys.readouterr().err)
    assert line["level"] == "critical" and line["event"] == "uncaught_exception"
    assert "RuntimeError: crash" in line["exception"]


VALID = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.mark.parametrize("value,expected", [
    (VALID, VALID),
    (VALID.encode(), VALID),
    (" " + VALID + " ", VALID),
    # A later version: its version-00 prefix, passed on as version 00.
    ("01" + VALID[2:] + "-extra", "00" + VALID[2:]),
    ("01" + VALID[2:], "00" + VALID[2:]),
    (None, None),
    ("", None),
    ("garbage", None),
    (VALID + "-extra", None),  # version 00 has exactly four fields
    ("ff" + VALID[2:], None),  # version ff is invalid
    (VALID.upper(), None),  # lower-case hex only
    ("00-" + "0" * 32 + "-b7ad6b7169203331-01", None),  # all-zero trace id
    ("00-0af7651916cd43dd8448eb211c80319c-" + "0" * 16 + "-01", None),  # all-zero parent
    ("00-0af7651916cd43dd8448eb211c80319-b7ad6b7169203331-01", None),  # short trace id
    ("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-1", None),
    (VALID + "\n", VALID),
    (b"\xff\xfe", None),
    ("0" * 600, None),
])
def test_parse_traceparent(value, expected):
    assert parse_traceparent(value) == expected


def test_new_traceparent_is_valid_and_fresh():
    seen = {new_traceparent() for _ in range(100)}
    assert len(seen) == 100
    for tp in seen:
        assert parse_traceparent(tp) == tp and tp.endswith("-00")
    assert new_traceparent(sampled=True).endswith("-01")
    assert traceparent_or_new(VALID) == VALID
    fresh = traceparent_or_new("nonsense")
    assert parse_traceparent(fresh) == fresh
    assert trace_id_of(VALID) == "0af7651916cd43dd8448eb211c80319c"


@pytest.mark.parametrize("value,ok", [
    ("abc-DEF_123", True), ("a" * 128, True), ("a" * 129, False), ("", False),
    (None, False), ("a b", False), ("a.b", False), ("abc\n", False),
])
def test_valid_request_id(value, ok):
    assert valid_request_id(value) is ok
