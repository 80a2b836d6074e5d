"""The pool's stats snapshot (`fairlane.protocol.PoolStats`). Pure: no I/O, time passed in.

`StatsTracker` is the `PoolCore`'s observer: it sees each dispatch, Started event,
preemption and refusal as the core decides it and keeps only what a snapshot needs,
over a sliding window (`window_ms`, 60 s). `snapshot()` combines that with the
scheduler's own state into a `PoolStats`; `dispatcher.stats_publisher` publishes it.

What each figure means (the admin dashboard shows them under these names):

- **share** of a tier: its fraction of the pool's recently dispatched cost, the
  exponentially decayed window (`share_window_ms`, 10 s) the tier floors are held to
  (`TierSelector.shares`). Cost is the pool's cost model (requests, tokens or
  KV-seconds), estimated at dispatch and trued up at finish.
- **share** of a tenant: its tier's share × the tenant's fraction of its tier's recent
  cost (the same decay, sampled at each snapshot), so a tier's tenants add up to it.
- **fair share** of a tenant: what weighted fair queueing promises it now, its weight
  over the summed weights of its tier's *active* tenants (requests queued or in
  flight), times its tier's share. Within a tier, capacity is split by weight; across
  tiers it goes by rank, floors and aging, not by weight, so a tier's reference is
  its floor. An idle tenant claims nothing (fair share 0) while its share decays. A
  quota-capped tenant (`max_concurrent`) may sit below its fair share by its own
  limit; a tenant whose demand is smaller than its fair share leaves the rest to the
  others (both are fair).
- **queue wait**: fetched from JetStream → dispatched to a worker, at each dispatch (a
  requeued request counts from its first fetch, as the Prometheus histogram does).
- **TTFT**: fetched → the worker's Started event, which it sends with the first token:
  time to first token as the dispatcher sees it, without the client → edge →
  JetStream hop before it or the token's way back. Continuations (resumed after a
  preemption) are left out: their first token went out long before.
- **rejected**: refused by the core at admission (unknown tenant, wrong tier, queue
  full, throttled, overloaded) or dropped from its queue (expired, shed). What the
  dispatcher refuses before the core (malformed, over the pool's limits) is counted in
  `fairlane_dispatcher_rejected_total` only, which also counts by error code.
- **preempted**: running requests stopped to free a slot for a tenant below its share.

Which tenants get a row: those recently active (requests queued or in flight, or an
event in the window: a dispatch, a rejection, a preemption), at most `max_tenants`,
ranked by queued + in flight, then share, then rejections; every tier always has one.
A snapshot costs one pass over the recently active tenants only (those admitted or
dispatched since the last one, active at it, or with an event in the window), not over
every tenant ever seen; the message is O(max_tenants + tiers) whatever their number. A
tenant idle for the whole window leaves the shares' sums (its decayed cost is then
under e^-6 of what it was, window 60 s over a 10 s decay).
(Measured here with 100,000 tenants all queued at once: ~0.2-0.5 s a snapshot, so
`dispatcher.stats_publisher` then stretches its interval to keep it under 1/10 of the
event loop.)
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left
from collections import Counter

from dispatcher.scheduler.actions import Action, Hold, SendError
from dispatcher.scheduler.pool import PoolCore, PoolObserver
from dispatcher.scheduler.types import QueuedRequest
from fairlane.errors import ErrorCode
from fairlane.poolconfig import MAX_UNKNOWN_CACHED, SchedulerConfig
from fairlane.protocol import PoolStats, TenantStats, TierStats

WINDOW_MS = 60_000.0
MAX_TENANTS = 200
REJECTION_CODES = frozenset({
    ErrorCode.UNKNOWN_TENANT, ErrorCode.INVALID_REQUEST, ErrorCode.QUEUE_FULL,
    ErrorCode.THROTTLED, ErrorCode.OVERLOADED, ErrorCode.EXPIRED,
})
_NEGLIGIBLE = 1e-6  # of the pool's recent cost: a tenant's decayed cost below it is dropped


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of sorted `values` (q in (0, 1])."""
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


class _Samples:
    """The latest (time, value) samples, at most about `max_len`, in time order."""

    __slots__ = ("items", "max_len")

    def __init__(self, max_len: int) -> None:
        self.items: list[tuple[float, float]] = []
        self.max_len = max_len

    def add(self, now_ms: float, value: float) -> None:
        self.items.append((now_ms, value))
        if len(self.items) > 2 * self.max_len:  # amortised: trimmed in halves
            del self.items[: -self.max_len]

    def prune(self, horizon_ms: float) -> None:
        i = bisect_left(self.items, horizon_ms, key=lambda s: s[0])
        if i:
            del self.items[:i]

    def p50_p99(self) -> tuple[float | None, float | None]:
        if not self.items:
            return None, None
        values = sorted(v for _, v in self.items[-self.max_len:])
        return round(percentile(values, 0.50), 1), round(percentile(values, 0.99), 1)


class _Events:
    """Event counts in one-second buckets, for a total over the window."""

    __slots__ = ("buckets", "total")

    def __init__(self) -> None:
        self.buckets: list[list[float]] = []  # [second, count]
        self.total = 0

    def add(self, now_ms: float, n: int = 1) -> None:
        sec = now_ms // 1000
        if self.buckets and self.buckets[-1][0] == sec:
            self.buckets[-1][1] += n
        else:
            self.buckets.append([sec, n])
        self.total += n

    def prune(self, horizon_ms: float) -> None:
        n = 0
        while n < len(self.buckets) and (self.buckets[n][0] + 1) * 1000 <= horizon_ms:
            self.total -= int(self.buckets[n][1])
            n += 1
        if n:
            del self.buckets[:n]


class _Recent:
    """What happened to one tier or tenant within the window."""

    __slots__ = ("tier", "waits", "ttfts", "rejected", "preempted")

    def __init__(self, tier: str, max_samples: int) -> None:
        self.tier = tier  # a tenant's tier, as its latest request said
        self.waits = _Samples(max_samples)
        self.ttfts = _Samples(max_samples)
        self.rejected = _Events()
        self.preempted = _Events()

    def prune(self, horizon_ms: float) -> bool:
        """Forget what is older than the window; True if nothing is left."""
        for s in (self.waits, self.ttfts, self.rejected, self.preempted):
            s.prune(horizon_ms)
        return not (self.waits.items or self.ttfts.items or self.rejected.total
                    or self.preempted.total)

    def fill(self, row: TierStats | TenantStats) -> None:
        row.queue_wait_p50_ms, row.queue_wait_p99_ms = self.waits.p50_p99()
        row.ttft_p50_ms, row.ttft_p99_ms = self.ttfts.p50_p99()
        row.num_rejected, row.num_preempted = self.rejected.total, self.preempted.total


class StatsTracker(PoolObserver):
    """Watches one pool's core (`PoolCore.observer`) and makes its snapshots."""

    def __init__(self, *, window_ms: float = WINDOW_MS, max_tenants: int = MAX_TENANTS,
                 tier_samples: int = 4096, tenant_samples: int = 256) -> None:
        self.window_ms = window_ms
        self.max_tenants = max_tenants
        self._tier_samples, self._tenant_samples = tier_samples, tenant_samples
        self._tiers: dict[str, _Recent] = {}
        self._tenants: dict[str, _Recent] = {}
        # Recent dispatched cost per tenant: the scheduler's cumulative (trued-up)
        # figure, differenced (from `TenantLoad.sampled_cost`) and decayed at each
        # snapshot.
        self._recent: dict[str, float] = {}
        self._sampled_ms: float | None = None
        self._config: SchedulerConfig | None = None  # _configs is of this one
        self._configs: dict[str, tuple[str, float]] = {}
        self._touched: set[str] = set()  # tenants admitted since the last snapshot
        self._active: set[str] = set()  # tenants queued or in flight at the last snapshot

    # --- the observer: decisions as the core makes them ------------------------------

    def _rows(self, req: QueuedRequest) -> tuple[_Recent, _Recent]:
        tier = self._tiers.get(req.tier)
        if tier is None:
            tier = self._tiers[req.tier] = _Recent(req.tier, self._tier_samples)
        tenant = self._tenants.get(req.tenant)
        if tenant is None:
            tenant = self._tenants[req.tenant] = _Recent(req.tier, self._tenant_samples)
        tenant.tier = req.tier
        return tier, tenant

    def dispatched(self, req: QueuedRequest, now_ms: float) -> None:
        self._touched.add(req.tenant)
        for r in self._rows(req):
            r.waits.add(now_ms, now_ms - req.arrival_ms)

    def started(self, req: QueuedRequest, now_ms: float) -> None:
        if req.num_preemptions:
            return
        for r in self._rows(req):
            r.ttfts.add(now_ms, now_ms - req.arrival_ms)

    def preempted(self, req: QueuedRequest, now_ms: float) -> None:
        for r in self._rows(req):
            r.preempted.add(now_ms)

    def ended(self, actions: list[Action], now_ms: float) -> None:
        for a in actions:
            if isinstance(a, Hold):  # admitted: its tenant is active now
                self._touched.add(a.request.tenant)
            elif isinstance(a, SendError) and a.code in REJECTION_CODES:
                for r in self._rows(a.request):
                    r.rejected.add(now_ms)

    # --- the snapshot ------------------------------------------------------------------

    def _prune(self, now_ms: float) -> None:
        horizon = now_ms - self.window_ms
        for rows in (self._tiers, self._tenants):
            for key in [k for k, r in rows.items() if r.prune(horizon)]:
                del rows[key]

    def _decay(self, now_ms: float, tau_ms: float) -> None:
        last, self._sampled_ms = self._sampled_ms, now_ms
        if last is None or now_ms <= last:
            return
        f = math.exp(-(now_ms - last) / max(tau_ms, 1.0))
        floor = _NEGLIGIBLE * sum(self._recent.values()) * f
        self._recent = {t: c * f for t, c in self._recent.items() if c * f > floor}

    def _config_of(self, cfg: SchedulerConfig, tenant: str) -> tuple[str, float]:
        """(tier, weight) of a tenant by the pool's config, cached until it changes
        (or the cache is full: tenants leave it as they leave the snapshot's rows)."""
        if cfg is not self._config or len(self._configs) >= MAX_UNKNOWN_CACHED:
            self._config, self._configs = cfg, {}
        out = self._configs.get(tenant)
        if out is None:
            tcfg = cfg.tenant(tenant)
            out = self._configs[tenant] = ((tcfg.tier, tcfg.weight) if tcfg
                                           else (cfg.default_tenant.tier, 1.0))
        return out

    def snapshot(self, core: PoolCore, now_ms: float, *, pool: str, ts_ms: int = 0,
                 epoch: int = 0) -> PoolStats:
        """The pool's `PoolStats` now (`now_ms` on the core's clock)."""
        sched = core.scheduler
        cfg = sched.config
        self._prune(now_ms)
        self._decay(now_ms, cfg.share_window_ms)
        tier_share = sched.tier_shares(now_ms)
        loads = sched.tenant_loads()
        # Only tenants that can have a row: admitted or in an event since the last
        # snapshot, active at it, or with recent cost or events (not all ever seen).
        names = self._touched | self._active | self._recent.keys() | self._tenants.keys()
        self._touched, self._active = set(), set()
        per_tier: dict[str, list[float]] = {}  # [active weight, recent cost, num active]
        found: list[tuple] = []
        for tenant in names:
            load = loads.get(tenant)
            recent = self._recent.get(tenant, 0.0)
            n = 0
            if load is not None:
                n = load.num_queued + load.num_in_flight
                cost, last = load.dispatched_cost, load.sampled_cost
                if cost != last:
                    recent = self._recent[tenant] = max(recent + cost - last, 0.0)
                    load.sampled_cost = cost
            seen = self._tenants.get(tenant)
            if not (n or seen):  # idle, and no event in the window: its rest of share
                self._recent.pop(tenant, None)  # is left out (e^-6 of it at most)
                self._configs.pop(tenant, None)
                continue
            tier, weight = self._config_of(cfg, tenant)
            if seen is not None:
                tier = seen.tier
            agg = per_tier.get(tier) or per_tier.setdefault(tier, [0.0, 0.0, 0])
            agg[1] += recent
            if n:
                agg[0] += weight
                agg[2] += 1
                self._active.add(tenant)
            found.append((n, recent, tenant, tier, weight, load, seen))
        # A tenant's share: its part of its tier's recent cost, of the tier's share.
        per_cost = {t: tier_share.get(t, 0.0) / a[1] if a[1] > 0 else 0.0
                    for t, a in per_tier.items()}
        shown = heapq.nlargest(self.max_tenants, found, key=lambda f: (
            f[0], f[1] * per_cost[f[3]], f[6].rejected.total if f[6] else 0, f[2]))
        tenants = []
        for n, recent, tenant, tier, weight, load, seen in shown:
            row = TenantStats(tenant=tenant, tier=tier, weight=weight,
                              share=round(recent * per_cost[tier], 4),
                              num_queued=load.num_queued if load else 0,
                              num_in_flight=load.num_in_flight if load else 0)
            if n:
                row.fair_share = round(tier_share.get(tier, 0.0) * weight / per_tier[tier][0], 4)
            if seen is not None:
                seen.fill(row)
            tenants.append(row)
        in_flight = Counter(f.request.tier for _, f in sched.in_flight_entries())
        queued = sched.tier_queue_depths()
        tiers = []
        for t in sched.tiers.tiers:
            row = TierStats(tier=t.name, floor_share=t.floor_share,
                            share=round(tier_share.get(t.name, 0.0), 4),
                            num_queued=queued.get(t.name, 0), num_in_flight=in_flight[t.name],
                            num_tenants_active=int(per_tier.get(t.name, (0, 0, 0))[2]))
            if (seen := self._tiers.get(t.name)) is not None:
                seen.fill(row)
            tiers.append(row)
        return PoolStats(
            pool=pool, ts_ms=ts_ms, epoch=epoch, policy=cfg.policy, cost_model=cfg.cost_model,
            window_ms=int(self.window_ms), share_window_ms=int(cfg.share_window_ms),
            num_queued=sched.num_queued, num_in_flight=sched.num_in_flight,
            num_workers=len(core.workers.workers), num_tenants_active=len(self._active),
            num_tenants_omitted=len(found) - len(shown),
            tiers=tiers, tenants=tenants,
        )

