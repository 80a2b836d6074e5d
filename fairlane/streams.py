"""Idempotent provisioning of the JetStream streams (DESIGN.md sections 3 and 4).

Every process calls `ensure_streams` at start; the first creates the streams, later
ones find them and bring their config up to date. Safe to run concurrently.
"""

from __future__ import annotations

import msgspec
import structlog
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError

from fairlane.subjects import Subjects

log = structlog.get_logger(__name__)


class StreamSettings(msgspec.Struct, kw_only=True):
    # Per-tenant cap on queued requests (per subject fl.req.<pool>.<tier>.<tenant>):
    # a flooding tenant is refused by the broker itself once it has this many waiting.
    max_queued_per_tenant: int = 100_000
    duplicate_window_s: float = 120.0  # idempotent-submit window for Nats-Msg-Id
    usage_max_age_days: float = 30.0
    replicas: int = 1


def requests_config(subjects: Subjects, s: StreamSettings) -> StreamConfig:
    return StreamConfig(
        name=subjects.requests_stream,
        subjects=[subjects.requests_all()],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        duplicate_window=s.duplicate_window_s,
        max_msgs_per_subject=s.max_queued_per_tenant,
        discard=DiscardPolicy.NEW,
        discard_new_per_subject=True,
        num_replicas=s.replicas,
    )


def usage_config(subjects: Subjects, s: StreamSettings) -> StreamConfig:
    return StreamConfig(
        name=subjects.usage_stream,
        subjects=[subjects.usage_all()],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=s.usage_max_age_days * 86_400,
        duplicate_window=s.duplicate_window_s,  # one usage record per request id
        num_replicas=s.replicas,
    )


async def _ensure(js: JetStreamContext, config: StreamConfig) -> None:
    try:
        await js.stream_info(config.name)
    except NotFoundError:
        try:
            await js.add_stream(config)
            log.info("stream_created", stream=config.name)
            return
        except BadRequestError:
            # Lost a creation race with another process: fall through to update.
            pass
    await js.update_stream(config)


async def ensure_streams(
    js: JetStreamContext, subjects: Subjects, settings: StreamSettings | None = None
) -> None:
    s = settings or StreamSettings()
    await _ensure(js, requests_config(subjects, s))
    await _ensure(js, usage_config(subjects, s))
