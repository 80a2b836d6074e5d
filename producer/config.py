"""Producer CLI settings: flags and FAIRLANE_* env vars."""

from __future__ import annotations

from fairlane.logs import LogLevel
from fairlane.settings import PositiveInt
from fairlane.streams import StreamSettings


class ProducerSettings(StreamSettings, kw_only=True):
    nats_url: str = "nats://127.0.0.1:4222"  # NATS server URL
    prefix: str = "fl"  # subject and stream prefix of the deployment
    tenant: str = "acme"  # the tenant the requests run as
    pool: str = "default"  # the model pool the requests go to
    tier: str = ""  # empty: the tenant's tier, asked of the pool's dispatcher
    prompt: str = "Hello, fairlane"  # the prompt of every request
    max_tokens: PositiveInt = 64  # output tokens per request, at most
    temperature: float = 1.0  # sampling temperature; 0 = greedy
    priority: int = 0  # within the tenant's own queue: higher goes first
    seed: int | None = None  # sampling seed; empty = random
    ttft_budget_ms: int | None = None  # refuse (throttled) if the first token would be later
    deadline_s: float | None = None  # relative: now + deadline_s
    count: PositiveInt = 1  # >1: load mode (progress bar + latency summary)
    concurrency: PositiveInt = 8  # requests in flight at once, load mode
    timeout_s: float = 120.0  # per request, load mode
    json_summary: bool = False  # print the load summary as one JSON line
    # Rate limits: the tenant's requests/min and tokens/min from the tenants file,
    # enforced in Redis (the same limiter as the HTTP edge). Empty: not limited here.
    redis_url: str = ""
    tenants_file: str = ""  # where the tenant's rate limits come from (with --redis-url)
    log_level: LogLevel = "warning"  # least severe log level written
