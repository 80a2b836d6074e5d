"""Prometheus metrics of the dispatcher (per-tenant labels; DESIGN.md section 7).

Gauges are refreshed from the scheduler on each housekeeping pass rather than on every
decision, so the hot path only touches counters.

Per-tenant series follow the scheduler's live tenants, not every tenant ever seen: each
pass sets the gauges of the tenants whose load changed since the last one, and removes
every per-tenant series (gauges, ``dispatched_cost_total``, ``preemptions_total``) of
the tenants the scheduler forgot, idle for ``--tenant-idle-s``
(`dispatcher.scheduler.loads`). A pass costs O(tenants changed + forgotten + tiers),
and ``/metrics`` stays as long as the active set. A tenant that comes back after that
starts its counters from 0 again (Prometheus reads it as a counter reset).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

from prometheus_client import Counter, Gauge, Histogram

from dispatcher.scheduler.loads import TenantChanges

INGESTED = Counter("fairlane_dispatcher_ingested_total", "Request messages fetched from JetStream")
REJECTED = Counter("fairlane_dispatcher_rejected_total", "Requests refused or dropped", ["reason"])
DISPATCHED_COST = Counter(
    "fairlane_dispatcher_dispatched_cost_total", "Cost units dispatched (estimate at dispatch)",
    ["tenant", "tier"],
)
QUEUE_WAIT = Histogram(
    "fairlane_dispatcher_queue_wait_seconds", "Time from ingest to dispatch", ["tier"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
PREEMPTIONS = Counter(
    "fairlane_dispatcher_preemptions_total",
    "Running requests preempted to free a slot for a tenant below its fair share",
    ["tier", "tenant"],
)
RECOMPUTED_TOKENS = Counter(
    "fairlane_dispatcher_recomputed_tokens_total",
    "Prefill tokens recomputed for continuations (preemption, migration), not cached",
    ["tier"],
)
RESUME_LATENCY = Histogram(
    "fairlane_dispatcher_resume_seconds",
    "From a preempted request handed back to its continuation's first token", ["tier"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
QUEUE_DEPTH = Gauge("fairlane_dispatcher_queue_depth", "Requests queued", ["tenant"])
IN_FLIGHT = Gauge("fairlane_dispatcher_in_flight", "Requests dispatched, not finished", ["tenant"])
TIER_SHARE = Gauge(
    "fairlane_dispatcher_tier_share", "Share of recently dispatched cost per tier (what floors hold)",
    ["tier"],
)
TIER_QUEUE_DEPTH = Gauge("fairlane_dispatcher_tier_queue_depth", "Requests queued per tier", ["tier"])


def observe_scheduler(scheduler, now_ms: float, changes: TenantChanges) -> None:
    """Refresh gauges from what the last housekeeping tick found (`PoolCore.tenant_changes`)
    and the scheduler's per-tier figures."""
    for tenant, load in changes.changed.items():
        QUEUE_DEPTH.labels(tenant).set(load.num_queued)
        IN_FLIGHT.labels(tenant).set(load.num_in_flight)
    depths = scheduler.tier_queue_depths()
    if changes.forgotten:
        remove_tenants(changes.forgotten, depths.keys())
    for tier, share in scheduler.tier_shares(now_ms).items():
        TIER_SHARE.labels(tier=tier).set(share)
    for tier, depth in depths.items():
        TIER_QUEUE_DEPTH.labels(tier=tier).set(depth)


def remove_tenants(tenants: Iterable[str], tiers: Iterable[str]) -> None:
    """Remove every per-tenant series of these tenants, in any of `tiers`."""
    tiers = list(tiers)
    for tenant in tenants:
        for metric in (QUEUE_DEPTH, IN_FLIGHT):
            _remove(metric, tenant)
        for tier in tiers:
            _remove(DISPATCHED_COST, tenant, tier)
            _remove(PREEMPTIONS, tier, tenant)


def _remove(metric, *labelvalues: str) -> None:
    with contextlib.suppress(KeyError):  # absent: older prometheus_client raise
        metric.remove(*labelvalues)
