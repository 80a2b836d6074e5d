"""Logging configuration. Called from each process's main(), never at import.

One format for every library: structlog's own events and stdlib `logging` records
(uvicorn, nats-py's ``nats.aio.client``, asyncio, ``py.warnings``, ...) go through the
same processors and one stderr handler (`structlog.stdlib.ProcessorFormatter`). In
JSON mode every line is one JSON object with ``event``, ``level``, ``timestamp``
(ISO 8601, UTC) and ``logger``, plus the event's keys and the structlog context
(`structlog.contextvars`: e.g. ``request_id`` and ``traceparent`` on a worker's lines
about a request); a traceback is one string field, ``exception``.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal

import structlog

LogLevel = Literal["debug", "info", "warning", "error"]


class _FairlaneHandler(logging.StreamHandler):
    """The root handler `configure_logging` installs (and replaces when called again)."""


def configure_logging(level: str = "info", json: bool = True) -> None:
    lvl = getattr(logging, level.upper(), logging.INFO)
    # Before the renderer: the same for structlog events and foreign (stdlib) records.
    shared: list = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_logger_name,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer = (
        structlog.processors.JSONRenderer()
        if json
        # Plain tracebacks, never a pretty printer's dump of local variables (keys).
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty(),
                                           exception_formatter=structlog.dev.plain_traceback)
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, _strip_event],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            # JSON: the traceback as one string field. The console renderer prints
            # exceptions itself (readably, over several lines).
            *([structlog.processors.format_exc_info] if json else []),
            renderer,
        ],
    )
    handler = _FairlaneHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _FairlaneHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(lvl)
    logging.captureWarnings(True)  # warnings.warn(...) as log records, not bare lines
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=True,
    )
    if json:
        sys.excepthook = _log_uncaught


def _strip_event(logger, method: str, event_dict: dict) -> dict:
    """A foreign record's message without the trailing newline some add (warnings)."""
    event = event_dict.get("event")
    if isinstance(event, str):
        event_dict["event"] = event.rstrip()
    return event_dict


def _log_uncaught(exc_type, exc, tb) -> None:
    """An exception nothing caught ends the process as one JSON line too."""
    if issubclass(exc_type, KeyboardInterrupt):
        sys.__excepthook__(exc_type, exc, tb)
        return
    logging.getLogger("fairlane").critical("uncaught_exception", exc_info=(exc_type, exc, tb))
