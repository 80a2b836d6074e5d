"""Idempotent provisioning of the JetStream streams (DESIGN.md sections 3 and 4).

Every process calls `ensure_streams` at start: the first creates the streams, and a
later one changes an existing stream only in the settings it was explicitly given
(a field left at None keeps the stream's value). Otherwise a process started with
defaults would quietly undo what an operator set with the `nats` CLI or another
process's flags. Each change is logged. Safe to run concurrently.

A service (dispatcher, worker) may start before JetStream can answer: a cluster that
is still electing its meta leader, or a server too busy to reply within the API
timeout. Those errors pass, so a service waits them out (`patience_s`, logged at each
try) instead of exiting; a user's producer gives up at once and says why.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import nats.errors
import structlog
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError, ServiceUnavailableError

from fairlane.natsconn import NatsConnSettings
from fairlane.subjects import Subjects

log = structlog.get_logger(__name__)

_DAY_S = 86_400.0


class StreamSettings(NatsConnSettings, kw_only=True):
    """Stream settings, part of every process's settings (each field a flag and env var);
    the NATS connection's credentials and TLS come with them (`NatsConnSettings`).

    None = not asked for: a new stream gets the built-in default, an existing one keeps
    its value.
    """

    # Per-tenant cap on queued requests (max messages per subject
    # fl.req.<pool>.<tier>.<tenant>): the broker refuses a flooding tenant's excess.
    max_queued_per_tenant: int | None = None
    duplicate_window_s: float | None = None  # idempotent-submit window (Nats-Msg-Id)
    stream_replicas: int | None = None  # JetStream replicas of both streams (3 in a cluster)
    requests_max_age_s: float | None = None  # FL_REQUESTS: oldest request kept; 0 = no limit
    requests_max_bytes: int | None = None  # FL_REQUESTS: size cap in bytes; -1 = no limit
    usage_max_age_s: float | None = None  # FL_USAGE: how long records are kept (default 90 days)
    # FL_USAGE: size cap in bytes; -1 = no limit (the default: NATS reserves a stream's
    # whole byte cap on disk when the stream is created, see USAGE_MAX_MSGS)
    usage_max_bytes: int | None = None
    # FL_USAGE: most records kept, the oldest dropped first (default 20 million)
    usage_max_msgs: int | None = None


# Built-in values for a stream being created, where a setting is None.
_REQUESTS_DEFAULTS: dict[str, Any] = dict(
    max_msgs_per_subject=100_000, duplicate_window=120.0, num_replicas=1, max_age=0.0,
    max_bytes=-1)
# FL_USAGE is bounded by default, by age and by record count, dropping the oldest
# records first. 90 days: a monthly billing export still finds the whole previous month
# when it runs late. The count, not a byte cap, bounds its size because nats-server
# reserves a stream's `max_bytes` on disk up front: a 10 GiB cap refuses to create the
# stream on a laptop with less free space, and a test server with a stream per test
# prefix runs out after a handful. A record takes ~450 bytes in the store (measured;
# ~750 with 64-character ids), so 20 million are ~8.5 GiB (at most ~14 GiB). A busy
# fleet reaches the count first (at 100 requests/s in ~2.3 days): export more often
# than that (`fairlane usage` says when a period's records were already dropped).
USAGE_MAX_AGE_S = 90 * _DAY_S
USAGE_MAX_MSGS = 20_000_000
_USAGE_DEFAULTS: dict[str, Any] = dict(
    duplicate_window=120.0, num_replicas=1, max_age=USAGE_MAX_AGE_S, max_bytes=-1,
    max_msgs=USAGE_MAX_MSGS)


def _asked_requests(s: StreamSettings) -> dict[str, Any]:
    asked = dict(max_msgs_per_subject=s.max_queued_per_tenant,
                 duplicate_window=s.duplicate_window_s, num_replicas=s.stream_replicas,
                 max_age=s.requests_max_age_s, max_bytes=s.requests_max_bytes)
    return {k: v for k, v in asked.items() if v is not None}


def _asked_usage(s: StreamSettings) -> dict[str, Any]:
    asked = dict(duplicate_window=s.duplicate_window_s, num_replicas=s.stream_replicas,
                 max_age=s.usage_max_age_s, max_bytes=s.usage_max_bytes,
                 max_msgs=s.usage_max_msgs)
    return {k: v for k, v in asked.items() if v is not None}


def requests_config(subjects: Subjects, s: StreamSettings) -> StreamConfig:
    return StreamConfig(
        name=subjects.requests_stream,
        subjects=[subjects.requests_all()],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        discard=DiscardPolicy.NEW,
        discard_new_per_subject=True,
        **{**_REQUESTS_DEFAULTS, **_asked_requests(s)},
    )


def usage_config(subjects: Subjects, s: StreamSettings) -> StreamConfig:
    return StreamConfig(
        name=subjects.usage_stream,
        subjects=[subjects.usage_all()],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        # At a bound the oldest records go (the metering of new work never stops).
        discard=DiscardPolicy.OLD,
        # The duplicate window makes one usage record per request id.
        **{**_USAGE_DEFAULTS, **_asked_usage(s)},
    )


def _differs(current: Any, wanted: Any) -> bool:
    if isinstance(wanted, float) or isinstance(current, float):
        # nats-py reports durations as float seconds converted from nanoseconds.
        return abs(float(current or 0) - float(wanted)) > 1e-6
    return current != wanted


async def _ensure(js: JetStreamContext, config: StreamConfig, asked: dict[str, Any]) -> None:
    try:
        info = await js.stream_info(config.name)
    except NotFoundError:
        try:
            await js.add_stream(config)
            log.info("stream_created", stream=config.name)
            return
        except BadRequestError:  # lost a creation race with another process
            info = await js.stream_info(config.name)
    current = info.config
    changes = {k: [getattr(current, k), v] for k, v in asked.items()
               if _differs(getattr(current, k), v)}
    if not changes:
        return
    await js.update_stream(dataclasses.replace(current, **{k: v for k, (_, v) in changes.items()}))
    log.info("stream_updated", stream=config.name,
             changes={k: f"{old} -> {new}" for k, (old, new) in changes.items()})


# JetStream not answering yet (no reply within the API timeout, nobody serving its API,
# "temporarily unavailable"): worth another try. An answer (settings refused, say) is
# raised at once. A JetStream API subject the server denies this user looks like a
# timeout here, so a service without those permissions keeps retrying; each try's
# `jetstream_not_answering` then comes beside the server's permission error in its log.
TRANSIENT_ERRORS = (nats.errors.TimeoutError, nats.errors.NoRespondersError,
                    ServiceUnavailableError)
RETRY_FIRST_S, RETRY_MAX_S = 0.25, 5.0


async def ensure_streams(
    js: JetStreamContext, subjects: Subjects, settings: StreamSettings | None = None, *,
    patience_s: float = 0.0,
) -> None:
    """Create or adjust both streams. `patience_s`: for how long to retry while
    JetStream is not answering (`TRANSIENT_ERRORS`); `math.inf` for a service, whose
    start its stop signal still cancels. Then the last error is raised."""
    s = settings or StreamSettings()
    give_up_at = time.monotonic() + patience_s
    wait_s = RETRY_FIRST_S
    while True:
        try:
            await _ensure(js, requests_config(subjects, s), _asked_requests(s))
            await _ensure(js, usage_config(subjects, s), _asked_usage(s))
            return
        except TRANSIENT_ERRORS as exc:
            if time.monotonic() + wait_s > give_up_at:
                raise
            log.warning("jetstream_not_answering", error=repr(exc), retry_in_s=wait_s)
            await asyncio.sleep(wait_s)
            wait_s = min(2 * wait_s, RETRY_MAX_S)
