"""Prometheus metrics of the dispatcher (DESIGN.md section 7b), prefix ``fairlane_dispatcher_``.

Gauges are refreshed from the scheduler on each housekeeping pass rather than on every
decision, so the hot path only touches counters and histograms.

What is counted where: per tier, queue wait, TTFT, resume latency, share and queue
depth; per tenant, queue depth and requests in flight (gauges), dispatched cost and
preemptions (by tier), rejections (by reason: the error code), and queue wait and TTFT
(``tenant_queue_wait_seconds`` / ``tenant_ttft_seconds``, coarser buckets). Queue wait
runs from the fetch from JetStream to the dispatch; TTFT from that fetch to the
worker's Started event, which it sends with the first token: every entry path
(producer library, HTTP, websocket) alike, the edge -> JetStream hop before it and the
token's way back left out. Continuations (after a preemption) are not a first token:
``resume_seconds`` times them. ``event_loop_lag_seconds`` says whether the dispatcher's
one core keeps up with its pool (`fairlane.looplag`).

Per-tenant series follow the scheduler's live tenants, not every tenant ever seen: each
pass sets the gauges of the tenants whose load changed since the last one, and removes
every per-tenant series of the tenants the scheduler forgot, idle for
``--tenant-idle-s`` (`dispatcher.scheduler.loads`). A pass costs O(tenants changed +
forgotten + tiers), and ``/metrics`` stays as long as the active set. A tenant that
comes back after that starts its counters from 0 again (Prometheus reads it as a
counter reset).

The active set itself is bounded too: at most ``--metrics-max-tenants`` tenants have
label values of their own at once (``TENANTS``, the `fairlane.metrics_labels` bound the
workers and the streamer use); beyond it, tenants are counted under
``tenant="_other"``, whose gauges hold the sum of theirs. A tenant keeps its label
while the scheduler holds it; one it never held (refused at ingest only) loses its
series after ``--tenant-idle-s`` without a request. Rejected requests whose tenant
cannot be told (an unparseable subject) count under ``tenant="_unknown"``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable

from prometheus_client import Counter, Gauge, Histogram

from dispatcher.scheduler.actions import Ack, Action
from dispatcher.scheduler.loads import TenantChanges
from dispatcher.scheduler.types import QueuedRequest, TenantLoad
from fairlane.looplag import LAG_BUCKETS, LAG_HELP
from fairlane.metrics_labels import OTHER_TENANT, UNKNOWN_TENANT, TenantLabels, fixed_child

# Tenant label values (see the module docstring); `configure` sets the bound.
TENANTS = TenantLabels(max_tenants=1000, idle_s=600.0)

INGESTED = Counter("fairlane_dispatcher_ingested_total", "Request messages fetched from JetStream")
REJECTED = Counter("fairlane_dispatcher_rejected_total",
                   "Requests refused or dropped, by tenant and reason (the error code)",
                   ["tenant", "reason"])
DISPATCHED_COST = Counter(
    "fairlane_dispatcher_dispatched_cost_total", "Cost units dispatched (estimate at dispatch)",
    ["tenant", "tier"],
)
# One core serves the whole pool: this says when it stops keeping up (fairlane.looplag).
LOOP_LAG = Histogram("fairlane_dispatcher_event_loop_lag_seconds", LAG_HELP, buckets=LAG_BUCKETS)
QUEUE_WAIT = Histogram(
    "fairlane_dispatcher_queue_wait_seconds", "Time from ingest to dispatch", ["tier"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
TENANT_QUEUE_WAIT = Histogram(
    "fairlane_dispatcher_tenant_queue_wait_seconds", "Time from ingest to dispatch, per tenant",
    ["tenant"], buckets=(0.01, 0.05, 0.25, 1, 5, 30, 300),
)
TTFT = Histogram(
    "fairlane_dispatcher_ttft_seconds",
    "Time from ingest to the worker's first token (its Started event); continuations "
    "excluded", ["tier"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
TENANT_TTFT = Histogram(
    "fairlane_dispatcher_tenant_ttft_seconds",
    "Time from ingest to the worker's first token, per tenant; continuations excluded",
    ["tenant"], buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, 60),
)
PREEMPTIONS = Counter(
    "fairlane_dispatcher_preemptions_total",
    "Running requests preempted to free a slot for a tenant below its fair share",
    ["tenant", "tier"],
)
# What preemption's decisions cost (`dispatcher.scheduler.preempt`: each weighs the
# tenants with demand in the tiers it contests; above 2,000 weighed they space out).
PREEMPTION_DECISIONS = Counter(
    "fairlane_dispatcher_preemption_decisions_total",
    "Preemption decisions made (each weighs the tenants with demand in the waiting tiers)",
)
PREEMPTION_TENANTS_WEIGHED = Counter(
    "fairlane_dispatcher_preemption_tenants_weighed_total",
    "Tenants weighed by preemption decisions (their cost: O(tenants weighed))",
)
# Each preemptor's counts at its last pass (a new scheduler after a takeover, or a
# second dispatcher in the same process, counts from its own 0).
_decisions_seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
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
METRIC_TENANTS = Gauge("fairlane_dispatcher_metric_tenants",
                       "Tenants with a label value of their own on this dispatcher's series "
                       "(at most --metrics-max-tenants; the rest count as _other)")

# The tenants the gauges count under "_other" (the bound was full when their load
# changed), with the (queued, in flight) each adds to its sums.
_overflow: dict[str, tuple[int, int]] = {}
_overflow_sum = [0, 0]


def configure(max_tenants: int, idle_s: float) -> None:
    """The tenant bound: ``--metrics-max-tenants``, and ``--tenant-idle-s`` for tenants
    the scheduler does not hold."""
    TENANTS.max_tenants, TENANTS.idle_s = max_tenants, idle_s


# --- what the shell records as it happens ---------------------------------------------


def rejected(tenant: str | None, reason: str) -> None:
    """A request refused (at ingest or by the core) or dropped from its queue."""
    TENANTS.child(REJECTED, tenant or UNKNOWN_TENANT, reason).inc()


def dispatched(req: QueuedRequest, queue_s: float, cost: float) -> None:
    fixed_child(QUEUE_WAIT, req.tier).observe(queue_s)
    TENANTS.child(TENANT_QUEUE_WAIT, req.tenant).observe(queue_s)
    TENANTS.child(DISPATCHED_COST, req.tenant, req.tier).inc(cost)


def started(actions: list[Action], preempted_at_ms: float | None, now_ms: float) -> None:
    """A worker's Started event, as the core took it (`PoolCore.on_started`'s actions;
    `preempted_at_ms`: when the request was handed back preempted, for a continuation)."""
    req = next((a.request for a in actions if isinstance(a, Ack) and a.reason == "started"),
               None)
    if req is None:  # a repeat, or from a worker the core does not know
        return
    if preempted_at_ms is not None:
        fixed_child(RESUME_LATENCY, req.tier).observe((now_ms - preempted_at_ms) / 1000)
    elif not req.num_preemptions:
        ttft_s = max(0.0, now_ms - req.arrival_ms) / 1000
        fixed_child(TTFT, req.tier).observe(ttft_s)
        TENANTS.child(TENANT_TTFT, req.tenant).observe(ttft_s)


def preempted(tenant: str, tier: str) -> None:
    TENANTS.child(PREEMPTIONS, tenant, tier).inc()


# --- each housekeeping pass -------------------------------------------------------------


def observe_scheduler(scheduler, now_ms: float, changes: TenantChanges) -> None:
    """Refresh gauges from what the last housekeeping tick found (`PoolCore.tenant_changes`)
    and the scheduler's per-tier figures."""
    TENANTS.keep = scheduler.tenant_loads().__contains__  # held tenants keep their label
    overflowed = False
    for tenant, load in changes.changed.items():
        overflowed |= _set_tenant_load(tenant, load)
    depths = scheduler.tier_queue_depths()
    if changes.forgotten:
        overflowed |= remove_tenants(changes.forgotten, depths.keys())
    if overflowed:
        QUEUE_DEPTH.labels(OTHER_TENANT).set(_overflow_sum[0])
        IN_FLIGHT.labels(OTHER_TENANT).set(_overflow_sum[1])
    TENANTS.expire()
    METRIC_TENANTS.set(len(TENANTS))
    for tier, share in scheduler.tier_shares(now_ms).items():
        TIER_SHARE.labels(tier=tier).set(share)
    for tier, depth in depths.items():
        TIER_QUEUE_DEPTH.labels(tier=tier).set(depth)
    pre = scheduler.preemptor
    decisions, weighed = _decisions_seen.get(pre, (0, 0))
    PREEMPTION_DECISIONS.inc(pre.num_decisions - decisions)
    PREEMPTION_TENANTS_WEIGHED.inc(pre.num_weighed - weighed)
    _decisions_seen[pre] = pre.num_decisions, pre.num_weighed


def _set_tenant_load(tenant: str, load: TenantLoad) -> bool:
    """Set `tenant`'s gauges, or its part of ``_other``'s; True if ``_other``'s changed."""
    label = TENANTS.label(tenant)
    old = _overflow.pop(tenant, None)
    if old is not None:
        _overflow_sum[0] -= old[0]
        _overflow_sum[1] -= old[1]
    if label == OTHER_TENANT:
        _overflow[tenant] = (load.num_queued, load.num_in_flight)
        _overflow_sum[0] += load.num_queued
        _overflow_sum[1] += load.num_in_flight
        return True
    for metric, value in ((QUEUE_DEPTH, load.num_queued), (IN_FLIGHT, load.num_in_flight)):
        TENANTS.track(label, metric, (label,))
        metric.labels(label).set(value)
    return old is not None


def remove_tenants(tenants: Iterable[str], tiers: Iterable[str]) -> bool:
    """Remove every per-tenant series of these tenants, in any of `tiers`; True if one
    of them was counted under ``_other`` (its gauges' sums changed)."""
    tiers = list(tiers)
    overflowed = False
    for tenant in tenants:
        TENANTS.forget(tenant)  # every series recorded through it
        old = _overflow.pop(tenant, None)
        if old is not None:
            _overflow_sum[0] -= old[0]
            _overflow_sum[1] -= old[1]
            overflowed = True
        # And any recorded directly, not through TENANTS.
        for metric in (QUEUE_DEPTH, IN_FLIGHT, TENANT_QUEUE_WAIT, TENANT_TTFT):
            _remove(metric, tenant)
        for tier in tiers:
            _remove(DISPATCHED_COST, tenant, tier)
            _remove(PREEMPTIONS, tenant, tier)
    return overflowed


def _remove(metric, *labelvalues: str) -> None:
    with contextlib.suppress(KeyError):  # absent: older prometheus_client raise
        metric.remove(*labelvalues)
