"""Fleet-level preemption for fairness, decided in the pure core (DESIGN.md section 5b).

With LLM-length outputs every slot of a busy pool is held for seconds, so a tenant that
becomes active behind a flood waits for slots to turn over however fair the queue order
is, and vLLM preempts only for KV, never for fairness. So the core decides, and the
worker aborts the victim and reports what it generated (`Scheduler.preempted`), which
requeues it as a continuation charged only for new work.

- **When** (all must hold): preemption is enabled for the pool and its policy measures
  fair shares (`fifo` does not: it never preempts); no worker has room (the caller says
  how many pulled slots wait for work); a tenant short of its fair share by a whole
  slot, and owed service by the policy's own accounts (its DRR turn, VTC's lowest
  counter: `Policy.fair_shares`), has a queued request within its quotas that has
  waited `quiet_preempt_after_ms` (default 0) if the tenant is quiet — its running +
  queued requests fit in its share: fair queueing promises it no wait — or, for a
  backlogged tenant, that has been short for `preempt_after_ms` (2,000) on every
  decision: its head waits behind its own queue anyway, and turnover usually makes up
  the shortfall first (preempting for it then only burns recompute); fewer
  than `max_per_s` orders in the last
  second. So preemption never serves a tenant more than its policy would: it only
  stops that service from waiting for a slot to turn over.
- **Whom**: lowest tier first. A higher tier reclaims what a lower one borrowed — down
  to that tier's floor (in slots), and only while the tier selector ranks the waiting
  tier ahead of it (a lower tier that aging or its floor puts first is not robbed);
  never a higher tier for a lower one. Within the waiter's own tier, the tenant
  furthest above its share by the policy's own measure (`Policy.fair_shares`), and
  only if the policy calls the move fair (no tenant is preempted for itself, nor one
  that is not above its share). Then that tenant's request that generated least —
  proxy: fewest earlier preemptions, then the most recent start. Never a continuation
  that ran less than `min_run_ms` since it restarted (hysteresis: a slot is not handed
  back and forth; a first run is fair game at once), nor one preempted
  `max_per_request` times already (so every request ends), nor one not yet started or
  whose worker is unknown.
- **Who gets the slot**: the waiting request the order names. The core *holds* the
  next free slot for it (`Scheduler.select` serves held requests first). The policy
  alone would not guarantee it: the victim's continuation is at the front of its own
  tenant's queue and the policy picks tenants by its accounts (a DRR deficit, a VTC
  counter), which may well favour the victim's tenant next.

One order per waiting request and at most one outstanding per (tier, tenant), so no
slot is taken unless a waiting request gets it. O(tenants running or queued in the
contested tiers) per decision, plus the victim tenant's requests (the core indexes its
requests in flight by tier and tenant, `dispatcher.scheduler.running`); how often
decisions are made is bounded by `Preemptor`'s rules.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from dispatcher.scheduler.base import FairShares, Standing
from dispatcher.scheduler.cost import CostModel
from dispatcher.scheduler.types import InFlight, PreemptionOrder, QueuedRequest
from fairlane.poolconfig import PreemptionConfig

if TYPE_CHECKING:
    from dispatcher.scheduler.core import Scheduler

WINDOW_MS = 1_000.0  # the rate cap's window: at most max_per_s orders in any 1 s
_EPS = 1e-9
_MIN_COST = 1e-6  # a continuation is never free: a zero cost would never end a DRR turn

WorkerOf = Callable[[str], str | None]
Eligible = Callable[[str, int], bool]


def continuation_cost(model: CostModel, req: QueuedRequest) -> float:
    """What a continuation is charged: the whole request's estimate (expecting at least
    one more token) less what its earlier runs paid — the work left, nothing more."""
    whole = dataclasses.replace(req, payload=None, expected_output_tokens=max(
        req.expected_output_tokens, req.num_generated_tokens + 1))
    return max(model.estimate(whole) - req.paid_cost, _MIN_COST)


class _NeverPreempts(Exception):
    """The policy has no measure of fair shares (fifo)."""


class Preemptor:
    """Preemption state of one pool: orders in flight, held slots, rate cap, counters.

    The shell may ask as often as it likes (it does on every serving pass while work
    waits and no slot is free). A decision weighs every tenant running or queued in the
    tiers it contests, O(those tenants), so two rules bound what asking costs:

    - a decision that found nothing is not recomputed for `recheck_ms`, unless a new
      waiter may be owed a slot (`poke`);
    - a decision that weighed more than `spacing_from` tenants is followed by none for
      `spacing_ms_per_tenant` per tenant weighed, orders or not, pokes or not. Weighing
      a tenant costs ~2 us interpreted, so decisions then take about a tenth of the
      dispatcher's time however many tenants compete. Why: in an overloaded pool of
      1,000 workers x 32 slots and 100,000 tenants (`bench/bench_simulate_scale.py`'s
      mix at 110% load, simulated) a decision weighed ~26,000 tenants in ~52 ms
      (~99 ms before the core indexed its running requests), 516 of them in 30 s: 0.9
      of a core (1.7 before). Spaced, 27 decisions there (~0.5 s apart), and
      TTFT p50 and p99 within 1% of unspaced for enterprise and pro, 4% for free
      (40 simulated s, compiled, against the parent commit): 32,000 slots turn over
      ~7,000 times a second, so waiting for turnover is short anyway. Pools weighing
      no more than `spacing_from` tenants are not spaced.
    """

    recheck_ms = 20.0
    spacing_from = 2_000
    spacing_ms_per_tenant = 0.02

    def __init__(self) -> None:
        self.pending: dict[str, str] = {}  # victim id -> waiter id: ordered, not yet ended
        self.held: dict[str, QueuedRequest] = {}  # waiter id -> waiter: next free slot is its
        self._order_times_ms: deque[float] = deque()  # orders within the last window
        self.num_orders = 0
        self._idle_until_ms = float("-inf")  # the last decision found nothing to do
        self._spaced_until_ms = float("-inf")  # the last decision weighed many tenants
        self.num_decisions = self.num_weighed = 0  # decisions made, tenants they weighed
        # Per tier that decision weighed: its fair-share level (slots per unit of weight;
        # inf with slots to spare), for `poke` to tell a new waiter who cannot be owed.
        self._levels: dict[str, float] = {}
        # (tier, tenant) -> its requests preempted (reported by workers), for metrics.
        self.preempted: Counter[tuple[str, str]] = Counter()
        # (worker, tier, tenant) -> queued continuations preempted on that worker.
        self._homed: dict[tuple[str, str, str], list[QueuedRequest]] = {}
        # (view, tier index, tenant) -> since when it has been short of its share by a
        # whole slot, every decision since seeing it so (a backlogged tenant's clock).
        self.short_since: dict[tuple[str, int, str], float] = {}

    # --- hooks the core calls --------------------------------------------------------------

    def next_held(self, queued: Mapping[str, QueuedRequest], eligible: Eligible) -> QueuedRequest | None:
        """The first held request still queued and within its quotas. Holds that went
        stale (dispatched anyway, cancelled, expired, quota filled since) are dropped:
        that slot then goes by the policy."""
        for rid in list(self.held):
            req = self.held[rid]
            if queued.get(rid) is req and eligible(req.tenant, req.kv_tokens):
                return req
            del self.held[rid]
        return None

    # --- continuations go home: resumed where the prefix cache holds their tokens ----------

    def on_preempted(self, req: QueuedRequest, worker_id: str | None) -> None:
        """`req` was preempted on `worker_id` and is queued again as a continuation."""
        self.preempted[(req.tier, req.tenant)] += 1
        if worker_id is not None:
            self.home(req, worker_id)

    def forget(self, tenants: Iterable[str], tiers: Iterable[str]) -> None:
        """These tenants were idle for the scheduler's idle period: their counts go."""
        if self.preempted:
            tiers = list(tiers)
            for tenant in tenants:
                for tier in tiers:
                    self.preempted.pop((tier, tenant), None)

    def home(self, req: QueuedRequest, worker_id: str) -> None:
        req.home_worker = worker_id
        self._homed.setdefault((worker_id, req.tier, req.tenant), []).append(req)

    def unhome(self, req: QueuedRequest) -> None:
        """`req` left the queue (dispatched, cancelled, expired, shed)."""
        if req.home_worker is None:
            return
        key = (req.home_worker, req.tier, req.tenant)
        homed = self._homed.get(key)
        if homed is not None and req in homed:
            homed.remove(req)
            if not homed:
                del self._homed[key]

    def at_home(self, picked: QueuedRequest, worker_id: str | None) -> QueuedRequest | None:
        """The policy picked `picked` for `worker_id`: a continuation of the same tenant
        and tier preempted on that worker, to go instead (its prefix cache still holds
        that one's tokens; the picked one's are elsewhere, or nowhere). The tenant gets
        the same turn either way."""
        if worker_id is None or picked.home_worker in (None, worker_id):
            return None
        homed = self._homed.get((worker_id, picked.tier, picked.tenant))
        return homed[0] if homed else None

    def poke(self, tier: str | None = None, weight: float = 1.0) -> None:
        """A tenant with nothing queued (in `tier`, of `weight`) has a request: decide
        anew, unless the last decision found nothing and this waiter cannot change that.

        It could only if it were short of its share by a whole slot. Its share is at
        most weight x the tier's level at that decision (a new demand never raises a
        water-filled level), so below one slot it is not owed one now either; any other
        change since is the `recheck_ms` timer's, as without this request. Why: in an
        overloaded tier with more tenants than slots, each arriving tenant made a whole
        decision (O(tenants)) that could find nothing (1,000,000 one-request tenants on
        3,200 full slots: 97% of the simulated pool's time, 34 ms a decision)."""
        level = self._levels.get(tier) if tier is not None else None
        if level is not None and weight * level < 1.0 - _EPS:
            return
        self._idle_until_ms = float("-inf")

    def on_left(self, request_id: str) -> None:
        """The request left in flight (finished, requeued, preempted, lost)."""
        self.pending.pop(request_id, None)

    # --- the decision ------------------------------------------------------------------------

    def decide(self, core: Scheduler, now_ms: float, num_free_slots: int,
               worker_of: WorkerOf) -> list[PreemptionOrder]:
        cfg = core.config.preemption
        if not cfg.enabled or num_free_slots > 0 or not core.num_queued:
            self.short_since.clear()  # a slot is free: nobody is kept short by a full fleet
            return []
        times = self._order_times_ms
        while times and times[0] <= now_ms - WINDOW_MS:
            times.popleft()
        if (len(times) >= cfg.max_per_s or now_ms < self._idle_until_ms
                or now_ms < self._spaced_until_ms):
            return []
        decision = _Decision(core, self, cfg, now_ms, worker_of)
        orders: list[PreemptionOrder] = []
        while len(times) < cfg.max_per_s:
            try:
                order = decision.next_order()
            except _NeverPreempts:
                break
            if order is None:
                break
            times.append(now_ms)
            self.num_orders += 1
            self.pending[order.request_id] = order.for_request.request_id
            self.held[order.for_request.request_id] = order.for_request
            orders.append(order)
        if not orders:
            self._idle_until_ms = now_ms + self.recheck_ms
            self._levels = decision.levels
        self.num_decisions += 1
        self.num_weighed += decision.weighed
        if decision.weighed > self.spacing_from:
            self._spaced_until_ms = now_ms + decision.weighed * self.spacing_ms_per_tenant
        return orders


class _Decision:
    """One decision's view: running counts per tier and tenant as they will be once
    the orders so far are carried out (victims gone, held waiters running)."""

    def __init__(self, core: Scheduler, pre: Preemptor, cfg: PreemptionConfig, now_ms: float,
                 worker_of: WorkerOf) -> None:
        self.core, self.cfg, self.now_ms, self.worker_of = core, cfg, now_ms, worker_of
        self.short_since = pre.short_since
        self.tiers = core.tiers
        self.running: dict[int, Counter[str]] = {}
        self.busy: set[tuple[int, str]] = set()  # (tier, tenant) with a slot held already
        self.pending = pending = pre.pending
        self.started_by = now_ms - cfg.min_run_ms  # hysteresis, for continuations
        # Counts per tenant from the core's index (O(tenants running), not O(requests)),
        # less the victims already ordered: their slots are promised to held waiters.
        self.weighed = 0  # tenants counted and weighed: what the decision cost
        for i, by_tenant in core.running.tiers():
            if by_tenant:
                self.running[i] = Counter({t: len(m) for t, m in by_tenant.items()})
                self.weighed += len(by_tenant)
        for rid in pending:
            req = core.in_flight_request(rid)
            if req is not None:
                self.running[self.tiers.index(req.tier)][req.tenant] -= 1
        for rid, w in list(pre.held.items()):
            if core.queued_request(rid) is not w:
                del pre.held[rid]
                continue
            i = self.tiers.index(w.tier)
            self._run(i)[w.tenant] += 1
            self.busy.add((i, w.tenant))
        self.total = sum(sum(c.values()) for c in self.running.values())
        self.order = self.tiers.order(now_ms)  # backlogged tiers, as the selector tries them
        self.levels: dict[str, float] = {}  # tier -> the highest level of its views

    def _run(self, i: int) -> Counter[str]:
        run = self.running.get(i)
        if run is None:
            run = self.running[i] = Counter()
        return run

    def _shares(self, i: int, extra_slots: int = 0) -> FairShares:
        run = self._run(i)
        name, num_slots = self.tiers.tiers[i].name, sum(run.values()) + extra_slots
        view = self.core.policy.fair_shares(name, run, num_slots)
        if view is None:
            raise _NeverPreempts
        self.weighed += len(view.standings)
        # The water-filled level: shares are min(demand, weight x level), so the
        # highest share per weight is the level, unless slots are left over (demands
        # and slots are whole, so a leftover is a whole slot; the sum of thousands of
        # fractional shares may miss num_slots by rounding, never by a half).
        level, shared = 0.0, 0.0
        for s in view.standings.values():
            level, shared = max(level, s.share / s.weight), shared + s.share
        if shared < num_slots - 0.5:
            level = math.inf
        self.levels[name] = max(self.levels.get(name, 0.0), level)
        return view

    def next_order(self) -> PreemptionOrder | None:
        for i in range(len(self.tiers.tiers)):  # waiting tiers, highest first
            if self.tiers.num_queued[i]:
                order = self._reclaim(i) or self._within_tier(i)
                if order is not None:
                    return order
        return None

    # --- from a lower tier ---------------------------------------------------------------------

    def _borrowed(self, j: int, i: int) -> bool:
        """Tier j (below i) holds slots beyond its floor that tier i may reclaim now."""
        n = sum(self._run(j).values())
        if n == 0 or n - 1 < self.tiers.tiers[j].floor_share * self.total - _EPS:
            return False
        # The selector serves tier j first (under its floor, or aged past i): not robbed.
        return j not in self.order or self.order.index(j) > self.order.index(i)

    def _reclaim(self, i: int) -> PreemptionOrder | None:
        for j in range(len(self.tiers.tiers) - 1, i, -1):  # lowest tier first
            if not self._borrowed(j, i):
                continue
            # Who in tier i gets the reclaimed slot: the one furthest below its share of
            # every slot not held by a higher tier (tier i may claim them all; floors
            # are `_borrowed`'s to keep), so a tenant whose demand fits is quiet.
            higher = sum(sum(self._run(k).values()) for k in range(i))
            waiters = self._waiters(i, self._shares(
                i, extra_slots=max(1, self.total - higher - sum(self._run(i).values()))),
                "reclaim")
            if not waiters:
                return None
            lower = self._shares(j).standings.values()
            for v in sorted(lower, key=lambda s: (-s.excess, s.tenant)):
                order = self._take(j, v.tenant, i, waiters[0])
                if order is not None:
                    return order
        return None

    # --- within the waiter's tier ------------------------------------------------------------

    def _within_tier(self, i: int) -> PreemptionOrder | None:
        view = self._shares(i)
        waiters = self._waiters(i, view, "tier")
        if not waiters:
            return None
        over = sorted((s for s in view.standings.values() if s.excess > _EPS),
                      key=lambda s: (-s.excess, s.tenant))
        for w in waiters:
            for v in over:
                if view.may_move(v, w):
                    order = self._take(i, v.tenant, i, w)
                    if order is not None:
                        return order
        return None

    def _waiters(self, i: int, view: FairShares, kind: str) -> list[Standing]:
        """Tenants of tier i short of their share by a whole slot whose head may claim
        one now, most under first (then the longest waiting). A quiet tenant's head
        waits `quiet_preempt_after_ms`; a backlogged tenant must have been short for
        `preempt_after_ms` (its head waits behind its own queue, so its wait says
        nothing; being short that long says turnover is not making up the shortfall)."""
        out = []
        short = self.short_since
        for key in [k for k in short if k[0] == kind and k[1] == i
                    and k[2] not in view.standings]:
            del short[key]  # no demand in this tier any more
        for s in view.standings.values():
            key = (kind, i, s.tenant)
            if not s.short:
                short.pop(key, None)
                continue
            since = short.setdefault(key, self.now_ms)
            head = s.head
            if s.quiet:
                waited_ms, after_ms = self.now_ms - head.enqueued_ms if head else 0.0, \
                    self.cfg.quiet_preempt_after_ms
            else:
                waited_ms, after_ms = self.now_ms - since, self.cfg.preempt_after_ms
            if (head is None or not view.owed(s) or (i, s.tenant) in self.busy
                    or waited_ms < after_ms
                    or not self.core.within_quota(s.tenant, head.kv_tokens)):
                continue
            out.append(s)
        out.sort(key=lambda s: (s.excess, s.head.enqueued_ms if s.head else 0.0, s.tenant))
        return out

    def _take(self, j: int, tenant: str, i: int, waiter: Standing) -> PreemptionOrder | None:
        """Order the preemption of `tenant`'s (tier j) best victim for `waiter` (tier i)."""
        best: tuple[tuple[bool, int, float, int], InFlight, str] | None = None
        # A waiter that is itself a continuation goes where its prefix cache is.
        home = waiter.head.home_worker if waiter.head is not None else None
        cfg, pending, started_by = self.cfg, self.pending, self.started_by
        for rid, f in self.core.running.tier(j).get(tenant, {}).items():
            req = f.request
            # Never one already ordered (its slot is promised), not yet started, out of
            # preemptions, or a continuation within its hysteresis. A first run is
            # not guarded: it has no slot history to ping-pong, and protecting it made
            # a quiet tenant wait up to min_run_ms whenever a batch had just turned
            # over at once (measured: bench/preemption_vllm.py, B's first probes after
            # A's 16 equal-length requests ended together waited ~0.9 s). A fresh
            # start is also the cheapest victim: it has generated least.
            if (rid in pending or f.started_ms is None
                    or req.num_preemptions >= cfg.max_per_request
                    or (req.num_preemptions and f.started_ms > started_by)):
                continue
            worker = self.worker_of(rid)
            if worker is None:
                continue
            key = (home is not None and worker != home, req.num_preemptions,
                   -f.started_ms, -req.seq)
            if best is None or key < best[0]:
                best = (key, f, worker)
        if best is None or waiter.head is None:
            return None
        _, f, worker = best
        self._run(j)[tenant] -= 1
        self._run(i)[waiter.tenant] += 1
        self.busy.add((i, waiter.tenant))
        return PreemptionOrder(f.request, worker, waiter.head)
