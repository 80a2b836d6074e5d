"""Prometheus metrics of the streamer (DESIGN.md section 7b), prefix ``fairlane_streamer_``,
on the process's default registry (served at ``/metrics`` behind an admin key).

The streamer sees only its own entry paths, HTTP (OpenAI API) and websocket; clients
of the producer library talk to NATS directly. So its request and token counters are
the edge's view: what a tenant was metered, every entry path included, is the workers'
``fairlane_worker_*_tokens_total`` (from the ``FL_USAGE`` records), and the fleet-wide
TTFT and queue wait per tier and tenant are the dispatcher's.

``requests_total{tenant,endpoint,outcome}`` counts every inference request the edge
answered: ``accepted``, or refused with the error code as the outcome, whichever step
refused it: an invalid or missing API key (``unauthorized``, tenant ``_unknown``), a
body or frame that fails validation (``invalid_request``, ``body_too_large``), an
unknown model, the tenant's rate limit (``rate_limited``), the fleet's answer
(``queue_full``, ``throttled``, ...) or the fleet being unreachable (``unavailable``).

Tenant label values are bounded (``TENANTS``, `fairlane.metrics_labels`): at most
``--metrics-max-tenants`` tenants have series of their own, a tenant without a request
for ``--metrics-tenant-idle-s`` loses them (checked as others come and at each scrape),
and the rest are counted as ``tenant="_other"``.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from fairlane.looplag import LAG_BUCKETS, LAG_HELP
from fairlane.metrics_labels import UNKNOWN_TENANT, TenantLabels

TENANTS = TenantLabels(max_tenants=1000, idle_s=600.0)  # `configure` sets the bound

REQUESTS = Counter(
    "fairlane_streamer_requests_total",
    "Inference requests at the HTTP and websocket edge by tenant, endpoint and outcome "
    "(accepted, or the error code that refused it: unauthorized, invalid_request, "
    "rate_limited, queue_full, ...)",
    ["tenant", "endpoint", "outcome"],
)
TOKENS = Counter(
    "fairlane_streamer_tokens_relayed_total",
    "Completion tokens relayed to the streamer's HTTP and websocket clients (producer-"
    "library clients read NATS directly: fairlane_worker_completion_tokens_total counts "
    "every entry path)", ["tenant"],
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
# Every stream the edge relays shares one loop (fairlane.looplag).
LOOP_LAG = Histogram("fairlane_streamer_event_loop_lag_seconds", LAG_HELP, buckets=LAG_BUCKETS)


def configure(max_tenants: int, idle_s: float) -> None:
    """The tenant bound: ``--metrics-max-tenants`` and ``--metrics-tenant-idle-s``."""
    TENANTS.max_tenants, TENANTS.idle_s = max_tenants, idle_s


def tenant_child(metric: Any, tenant: str | None, *rest: str) -> Any:
    """`metric`'s child for `tenant` (None: not known, ``_unknown``) and `rest`."""
    TENANTS.expire()  # O(tenants gone): nothing to do, most times
    return TENANTS.child(metric, tenant or UNKNOWN_TENANT, *rest)


def request(tenant: str | None, endpoint: str, outcome: str) -> None:
    """An inference request answered: ``accepted``, or the error code refusing it."""
    tenant_child(REQUESTS, tenant, endpoint, outcome).inc()


def expire() -> None:
    """Before a scrape: tenants idle for the idle period lose their series."""
    TENANTS.expire()
