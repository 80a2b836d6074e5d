"""Prometheus metrics of the streamer (per-tenant labels), on the default registry."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter(
    "fairlane_streamer_requests_total",
    "Requests at the edge by outcome (accepted, rate_limited, queue_full, ...)",
    ["tenant", "endpoint", "outcome"],
)
TOKENS = Counter(
    "fairlane_streamer_tokens_relayed_total", "Tokens relayed to clients", ["tenant"]
)
ACTIVE = Gauge("fairlane_streamer_active_streams", "Streams being relayed", ["endpoint"])
SLOW_CONSUMERS = Counter(
    "fairlane_streamer_slow_consumers_total",
    "Clients disconnected for not keeping up",
    ["tenant", "transport"],
)
CLIENT_GONE = Counter(
    "fairlane_streamer_client_disconnects_total",
    "Requests cancelled upstream because the client went away",
    ["tenant", "transport"],
)
TTFT = Histogram(
    "fairlane_streamer_ttft_seconds",
    "Time from admission to the first chunk, seen at the edge",
    ["tier"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
