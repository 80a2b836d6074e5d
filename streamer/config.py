"""Streamer settings: every field is a ``--flag`` and a ``FAIRLANE_*`` env var."""

from __future__ import annotations

import msgspec


class StreamerSettings(msgspec.Struct, kw_only=True):
    nats_url: str = "nats://127.0.0.1:4222"
    prefix: str = "fl"  # subject/stream prefix of the deployment
    host: str = "127.0.0.1"
    port: int = 8080
    redis_url: str = "redis://127.0.0.1:6379/0"
    # Empty: no Redis at all, the limiter runs on local (per-process) buckets only.
    tenants_file: str = ""  # empty: default_tenants() (no keys: every key is refused)
    tenants_reload_s: float = 2.0  # how often the tenants file is checked for edits
    # Dev only: requests without an Authorization header run as this tenant. Empty (the
    # default) means every request must carry a known API key.
    anonymous_tenant: str = ""
    pool: str = "default"  # the model used when a websocket request names none
    owner: str = ""  # inbox owner id; empty = random per process
    max_body_bytes: int = 1 << 20  # HTTP request bodies and websocket frames
    # Per request: chunks the relay may buffer for it before the consumer is "slow".
    max_buffered_chunks: int = 1024
    # Per websocket connection: outgoing frames queued before the client is "slow".
    ws_send_buffer: int = 1024
    ws_max_requests: int = 64  # concurrent requests on one websocket
    # Compressing one tiny token frame at a time costs more CPU and latency than it saves.
    ws_per_message_deflate: bool = False
    ws_close_timeout_s: float = 5.0  # how long a slow client may take to get its close frame
    default_max_tokens: int = 256  # when a request names none
    usage_settler: bool = True  # run the FL_USAGE -> rate limiter settler in this process
    settler_durable: str = "ratelimit-settler"
    log_level: str = "info"
    log_json: bool = True
