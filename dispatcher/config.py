"""Dispatcher settings: flags and FAIRLANE_* env vars (see fairlane.settings)."""

from __future__ import annotations

import msgspec


class DispatcherSettings(msgspec.Struct, kw_only=True):
    nats_url: str = "nats://127.0.0.1:4222"
    prefix: str = "fl"
    pool: str = "default"
    # Tenants/tiers/pool policy; empty = built-in defaults (one tier, drr, anyone).
    tenants_file: str = ""
    # Overrides the pool's policy from the tenants file (fifo | drr | vtc).
    policy: str = ""
    # JetStream: a held message is redelivered to another dispatcher after ack_wait_s
    # of silence, so this is the failover delay after a dispatcher crash.
    ack_wait_s: float = 30.0
    # Must cover every message the dispatcher holds (queued + dispatched-not-started);
    # JetStream's default of 1,000 silently starves fetches once reached.
    max_held_messages: int = 200_000
    fetch_batch: int = 256
    # A worker silent for this long is dead: unstarted work is requeued, started work
    # gets a retryable worker_lost error.
    worker_timeout_ms: int = 3_500
    housekeeping_ms: int = 200
    stop_timeout_s: float = 10.0  # bound on a graceful stop (NATS may be gone)
    max_tokens: int = 4096
    max_prompt_chars: int = 200_000
    metrics_port: int = 0  # 0 = no /metrics endpoint
    metrics_host: str = "127.0.0.1"  # 0.0.0.0 in a container, for Prometheus
    log_level: str = "info"
    log_json: bool = True
