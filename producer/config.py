"""Producer CLI settings: flags and FAIRLANE_* env vars."""

from __future__ import annotations

import msgspec


class ProducerSettings(msgspec.Struct, kw_only=True):
    nats_url: str = "nats://127.0.0.1:4222"
    prefix: str = "fl"
    tenant: str = "acme"
    pool: str = "default"
    tier: str = ""  # empty: the tenant's tier, asked of the pool's dispatcher
    prompt: str = "Hello, fairlane"
    max_tokens: int = 64
    temperature: float = 1.0
    priority: int = 0
    seed: int | None = None
    ttft_budget_ms: int | None = None
    deadline_s: float | None = None  # relative: now + deadline_s
    count: int = 1  # >1: load mode (progress bar + latency summary)
    concurrency: int = 8
    timeout_s: float = 120.0  # per request, load mode
    json_summary: bool = False  # print the load summary as one JSON line
    # Rate limits: the tenant's requests/min and tokens/min from the tenants file,
    # enforced in Redis (the same limiter as the HTTP edge). Empty: not limited here.
    redis_url: str = ""
    tenants_file: str = ""
    log_level: str = "warning"
