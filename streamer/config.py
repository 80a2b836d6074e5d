"""Streamer settings: every field is a ``--flag`` and a ``FAIRLANE_*`` env var."""

from __future__ import annotations

from typing import Annotated

import msgspec

from fairlane.gctune import YOUNG_OBJECTS
from fairlane.logs import LogLevel
from fairlane.settings import PositiveFloat, PositiveInt
from fairlane.streams import StreamSettings


class StreamerSettings(StreamSettings, kw_only=True):
    nats_url: str = "nats://127.0.0.1:4222"  # NATS server URL
    prefix: str = "fl"  # subject/stream prefix of the deployment
    host: str = "127.0.0.1"  # HTTP/websocket listen address (0.0.0.0 in a container)
    port: int = 8080  # HTTP/websocket listen port
    # Rate limiter's Redis. Empty: no Redis at all, the limiter runs on local
    # (per-process) buckets only.
    redis_url: str = "redis://127.0.0.1:6379/0"
    tenants_file: str = ""  # empty: default_tenants() (no keys: every key is refused)
    tenants_reload_s: float = 2.0  # how often the tenants file is checked for edits
    # Dev only: requests without an Authorization header run as this tenant. Empty (the
    # default) means every request must carry a known API key.
    anonymous_tenant: str = ""
    pool: str = "default"  # the model used when a websocket request names none
    owner: str = ""  # inbox owner id; empty = random per process
    max_body_bytes: PositiveInt = 1 << 20  # HTTP request bodies and websocket frames
    # Per request: chunks the relay may buffer for it before the consumer is "slow".
    max_buffered_chunks: PositiveInt = 1024
    # Per websocket connection: outgoing frames queued before the client is "slow".
    ws_send_buffer: PositiveInt = 1024
    ws_max_requests: PositiveInt = 64  # concurrent requests on one websocket
    # Compressing one tiny token frame at a time costs more CPU and latency than it saves.
    ws_per_message_deflate: bool = False
    ws_close_timeout_s: float = 5.0  # how long a slow client may take to get its close frame
    default_max_tokens: PositiveInt = 256  # when a request names none
    usage_settler: bool = True  # run the FL_USAGE -> rate limiter settler in this process
    # Bounds the tenant label's values on /metrics (streamer.metrics): beyond this, tenants
    # are counted as tenant="_other".
    metrics_max_tenants: Annotated[int, msgspec.Meta(ge=0)] = 1000  # most tenants with a /metrics label of their own
    metrics_tenant_idle_s: PositiveFloat = 600.0  # a tenant idle this long loses its /metrics series
    settler_durable: str = "ratelimit-settler"  # the settler's durable consumer name
    # Net new objects between young garbage collections, and what start-up left alive
    # frozen (fairlane.gctune; 0 keeps Python's own 700 and nothing frozen): a full
    # collection walking the imports stopped every stream for tens of ms.
    gc_young_objects: Annotated[int, msgspec.Meta(ge=0)] = YOUNG_OBJECTS
    log_level: LogLevel = "info"  # least severe log level written
    log_json: bool = True  # JSON log lines (else human-readable)
