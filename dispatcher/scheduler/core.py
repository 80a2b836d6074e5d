"""The pure scheduler core: synchronous, no I/O, no clock reads (time is passed in).

The dispatcher shell calls it; tests, the simulator and benchmarks drive it directly.
Stages, in fixed order (DESIGN.md section 5):

1. admission (`submit`): tenant known, per-tenant queue cap, total cap, throttling on
   the predicted wait (`dispatcher.scheduler.throttle`);
2. tier selector (`dispatcher.scheduler.tiers`): floors, then rank with aging;
3. the policy across the tier's tenants (`drr`, `vtc`, or `fifo`);
4. within a tenant, its heap (`dispatcher.scheduler.tenant_queue`).

This module owns the bookkeeping every policy shares: what is queued, what is in
flight, per-tenant quotas, deadlines, shedding, and the counters metrics read.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable
from heapq import heapify, heappop, heappush  # by name: compiled, heapq.x is a lookup per call

from dispatcher.scheduler.actions import SendError
from dispatcher.scheduler.cost import make_cost_model
from dispatcher.scheduler.loads import TenantChanges, TenantLoad, TenantLoads
from dispatcher.scheduler.policies import Eligible, Policy, make_policy
from dispatcher.scheduler.preempt import Preemptor, WorkerOf, continuation_cost
from dispatcher.scheduler.running import RunningIndex
from dispatcher.scheduler.tenant_queue import shed_victims
from dispatcher.scheduler.throttle import RateMeter, predict_wait_ms, retry_after_ms
from dispatcher.scheduler.tiers import TierSelector
from dispatcher.scheduler.types import (
    ACCEPTED,
    DUPLICATE,
    ActualUsage,
    Admission,
    Dispatch,
    InFlight,
    PreemptionOrder,
    QueuedRequest,
    Verdict,
)
from fairlane.poolconfig import SchedulerConfig, TenantConfig
from fairlane.protocol import ErrorCode

_DEFAULT_RETRY_MS = 1_000
ENGINE_PRIORITY_SPAN = 1_000  # engine priorities per tier (see _dispatch)


class Scheduler:
    """Queue + in-flight bookkeeping around a tier selector and a selection `Policy`."""

    def __init__(self, config: SchedulerConfig, policy: Policy | None = None) -> None:
        self.config = config
        self.policy = policy or make_policy(config)
        self.cost_model = getattr(self.policy, "cost_model", None) or make_cost_model(config)
        self.tiers = TierSelector(config)
        self.rate = RateMeter(config.throttle_window_ms) if config.throttle_window_ms > 0 else None
        self._queued: dict[str, QueuedRequest] = {}
        self._in_flight: dict[str, InFlight] = {}
        self.running = RunningIndex()  # the same per tier and tenant (read-only outside)
        self._loads = TenantLoads()  # per tenant, forgotten when idle (`sweep_tenants`)
        self._next_seq = 0
        # Throttling's inputs, O(1) to keep: queued per (tier, tenant), backlogged weight.
        self._tt_queued: dict[tuple[int, str], int] = {}
        self._tier_weight: dict[int, float] = {}
        self._deadlines: list[tuple[float, int, QueuedRequest]] = []
        self._deadline_seq = itertools.count()
        self.rejections: Counter[ErrorCode] = Counter()  # by reason, at admission
        self.drops: Counter[ErrorCode] = Counter()  # queued work removed (expired, shed)
        self.num_dispatched = 0
        self.preemptor = Preemptor()  # fleet-level preemption (DESIGN.md 5b)
        # `within_quota` bound once: every pick hands it to the policy, and compiled
        # (`fairlane simulate --compiled`) `self.within_quota` is a new object each time.
        self._eligible: Eligible = self.within_quota

    # --- queries -----------------------------------------------------------------------

    @property
    def num_queued(self) -> int:
        return len(self._queued)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def is_known(self, request_id: str) -> bool:
        return request_id in self._queued or request_id in self._in_flight

    def is_queued(self, request_id: str) -> bool:
        return request_id in self._queued

    def is_started(self, request_id: str) -> bool:
        f = self._in_flight.get(request_id)
        return f is not None and f.started

    def queued(self) -> Iterable[QueuedRequest]:
        return self._queued.values()

    def queued_request(self, request_id: str) -> QueuedRequest | None:
        return self._queued.get(request_id)

    def in_flight_request(self, request_id: str) -> QueuedRequest | None:
        f = self._in_flight.get(request_id)
        return f.request if f else None

    def in_flight_ids(self) -> Iterable[str]:
        return self._in_flight.keys()

    def in_flight_entries(self) -> Iterable[tuple[str, InFlight]]:
        return self._in_flight.items()

    def tenant_loads(self) -> dict[str, TenantLoad]:
        return self._loads.loads

    def sweep_tenants(self, now_ms: float, idle_ms: float) -> TenantChanges:
        """Forget tenants idle for `idle_ms` and the policy state they owe nothing on."""
        changes = self._loads.sweep(now_ms, idle_ms)
        self.config.forget_unknown(changes.forgotten)
        self.policy.forget_idle(changes.forgotten, now_ms)
        self.preemptor.forget(changes.forgotten, [t.name for t in self.tiers.tiers])
        return changes

    def tenant_config(self, tenant: str) -> TenantConfig | None:
        return self.config.tenant(tenant)

    def tier_shares(self, now_ms: float) -> dict[str, float]:
        """Each tier's share of recently dispatched cost (what floors are held to)."""
        return self.tiers.shares(now_ms)

    def tier_dispatched_cost(self) -> dict[str, float]:
        return {t.name: self.tiers.dispatched_cost[i] for i, t in enumerate(self.tiers.tiers)}

    def tier_queue_depths(self) -> dict[str, int]:
        return {t.name: self.tiers.num_queued[i] for i, t in enumerate(self.tiers.tiers)}

    def service_rate_per_ms(self, now_ms: float) -> float | None:
        """Measured dispatched cost per ms over the throttle window (None: unmeasured)."""
        return self.rate.rate_per_ms(now_ms) if self.rate else None

    def predicted_wait_ms(self, tenant: str, tier: str, now_ms: float) -> float | None:
        """How long a new request of `tenant` would wait now (None: unknown)."""
        i = self.tiers.index(tier)
        weight = self.config.weight(tenant)
        load = self._loads.get(tenant)
        backlogged = self._tt_queued.get((i, tenant), 0) > 0
        return predict_wait_ms(
            rate_per_ms=self.service_rate_per_ms(now_ms),
            tenant_queued_cost=load.queued_cost if load else 0.0,
            weight=weight,
            tier_weight=self._tier_weight.get(i, 0.0) + (0.0 if backlogged else weight),
            ahead_cost=sum(self.tiers.queued_cost[: i + 1]),
        )

    # --- admission ---------------------------------------------------------------------

    def _reject(self, code: ErrorCode, message: str, retry_ms: int | None = None) -> Admission:
        self.rejections[code] += 1
        return Admission(Verdict.REJECTED, code, message, retry_after_ms=retry_ms)

    def submit(self, req: QueuedRequest, now_ms: float) -> Admission:
        """Admit `req` to its tenant's queue, or say why not."""
        if self.is_known(req.request_id):
            return DUPLICATE
        tcfg = self.config.tenant(req.tenant)
        if tcfg is None:
            return self._reject(ErrorCode.UNKNOWN_TENANT, f"unknown tenant {req.tenant!r}")
        load = self._loads.touch(req.tenant)
        if tcfg.max_queued is not None and load.num_queued >= tcfg.max_queued:
            return self._reject(
                ErrorCode.QUEUE_FULL,
                f"tenant {req.tenant!r} has {load.num_queued} requests queued "
                f"(max_queued={tcfg.max_queued})", _DEFAULT_RETRY_MS)
        if len(self._queued) >= self.config.max_queued_total:
            return self._reject(ErrorCode.OVERLOADED, "dispatcher queue is full",
                                self._drain_retry_ms(now_ms))
        budget_ms = self._budget_ms(req, now_ms)
        if budget_ms is not None and load.queued_cost > 0:
            wait_ms = self.predicted_wait_ms(req.tenant, req.tier, now_ms)
            if wait_ms is not None and wait_ms > budget_ms:
                return self._reject(
                    ErrorCode.THROTTLED,
                    f"predicted queue wait {wait_ms:.0f} ms exceeds the request's "
                    f"budget of {max(budget_ms, 0):.0f} ms", retry_after_ms(wait_ms - budget_ms))
        req.arrival_ms = now_ms if req.arrival_ms == 0 else req.arrival_ms
        req.seq = self._next_seq
        self._next_seq += 1
        req.est_cost = self.cost_model.estimate(req)
        self._enqueue(req, now_ms)
        self.policy.push(req, now_ms)
        return ACCEPTED

    @staticmethod
    def _budget_ms(req: QueuedRequest, now_ms: float) -> float | None:
        budget = req.ttft_budget_ms
        if req.deadline_ms is not None:
            left = req.deadline_ms - now_ms
            budget = left if budget is None else min(budget, left)
        return budget

    def _drain_retry_ms(self, now_ms: float) -> int:
        rate = self.service_rate_per_ms(now_ms)
        if rate is None:
            return _DEFAULT_RETRY_MS
        return retry_after_ms(sum(self.tiers.queued_cost) / rate)

    def _enqueue(self, req: QueuedRequest, now_ms: float) -> None:
        self._queued[req.request_id] = req
        req.enqueued_ms = now_ms
        load = self._loads.touch(req.tenant)
        load.num_queued += 1
        load.queued_cost += req.est_cost
        i = self.tiers.index(req.tier)
        self.tiers.on_queued(i, req.est_cost, now_ms)
        key = (i, req.tenant)
        n = self._tt_queued.get(key, 0)
        if n == 0:
            self._tier_weight[i] = self._tier_weight.get(i, 0.0) + self.config.weight(req.tenant)
        self._tt_queued[key] = n + 1
        if req.deadline_ms is not None:
            heappush(self._deadlines, (req.deadline_ms, next(self._deadline_seq), req))

    def _unqueue(self, req: QueuedRequest) -> None:
        """Bookkeeping for a request leaving the queue (already out of `_queued`)."""
        self.preemptor.unhome(req)
        load = self._loads.touch(req.tenant)
        load.num_queued -= 1
        load.queued_cost = load.queued_cost - req.est_cost if load.num_queued else 0.0
        i = self.tiers.index(req.tier)
        self.tiers.on_unqueued(i, req.est_cost)
        key = (i, req.tenant)
        n = self._tt_queued.pop(key, 1) - 1
        if n > 0:
            self._tt_queued[key] = n
        else:
            w = self._tier_weight.get(i, 0.0) - self.config.weight(req.tenant)
            self._tier_weight[i] = max(w, 0.0)

    # --- selection ---------------------------------------------------------------------

    def within_quota(self, tenant: str, kv_tokens: int) -> bool:
        tcfg = self.config.tenant(tenant)
        if tcfg is None:
            return True
        load = self._loads.get(tenant)
        if load is None:
            return tcfg.max_concurrent is None or tcfg.max_concurrent > 0
        if tcfg.max_concurrent is not None and load.num_in_flight >= tcfg.max_concurrent:
            return False
        return not (
            tcfg.max_kv_tokens is not None
            and load.num_in_flight > 0  # one request always fits, or it would wait forever
            and load.kv_tokens_in_flight + kv_tokens > tcfg.max_kv_tokens
        )

    def _pick(self, now_ms: float) -> QueuedRequest | None:
        # Try tiers in the selector's order; a tier whose tenants are all quota-blocked
        # yields nothing and the next one is tried (work conservation).
        for i in self.tiers.order(now_ms):
            req = self.policy.pop(self.tiers.tiers[i].name, self._eligible, now_ms)
            if req is not None:
                return req
        return None

    def select(self, max_items: int, now_ms: float, free_kv_tokens: int | None = None,
               worker_id: str | None = None, must_fit: bool = False) -> list[Dispatch]:
        """Up to `max_items` requests for one pulling worker (`worker_id`), their KV needs
        within `free_kv_tokens` bar the first pick's (a lone request must progress), or
        all of them if `must_fit` (a pull served again in a pass: what it has left)."""
        out: list[Dispatch] = []
        kv_budget = free_kv_tokens
        while len(out) < max_items and self._queued:
            # A slot freed by preemption (or any slot, if that comes first) goes to the
            # waiting request it was taken for, not by the policy (`preempt`).
            held = self.preemptor.next_held(self._queued, self._eligible) \
                if self.preemptor.held else None
            req = held or self._pick(now_ms)
            if req is None:
                break
            if held is None and (home := self.preemptor.at_home(req, worker_id)) is not None:
                self.policy.push_front(req, now_ms)
                self.policy.take(home, now_ms)
                req = home
            if kv_budget is not None and (out or must_fit) and req.kv_tokens > kv_budget:
                if held is None:
                    self.policy.push_front(req, now_ms)
                break
            if held is not None:
                del self.preemptor.held[held.request_id]
                self.policy.take(held, now_ms)
            if kv_budget is not None:
                kv_budget -= req.kv_tokens
            out.append(self._dispatch(req, now_ms, held=held is not None))
        return out

    def _dispatch(self, req: QueuedRequest, now_ms: float, held: bool = False) -> Dispatch:
        del self._queued[req.request_id]
        self._unqueue(req)
        cost = self.policy.charge(req, now_ms)
        req.est_cost = cost
        req.est_kv_tokens = req.kv_tokens
        load = self._loads.touch(req.tenant)
        # Engine priority = tier priority x 1000 + the tenant's requests in flight: the
        # engine's waiting queue serves lighter tenants first (a small tenant does not
        # queue behind a flood's prefetched work); vLLM evicts the heaviest's first under
        # KV pressure. A held request (a preemption freed its slot) goes first in its
        # tier, or work prefetched for lighter tenants takes the slot (the victim's own).
        bump = 0 if held else min(load.num_in_flight, ENGINE_PRIORITY_SPAN - 1)
        load.num_in_flight += 1
        load.kv_tokens_in_flight += req.est_kv_tokens
        load.dispatched_cost += cost
        i = self.tiers.index(req.tier)
        self.tiers.add_cost(i, cost, now_ms)
        self.tiers.on_served(i, now_ms)
        if self.rate is not None:
            self.rate.add(now_ms, cost)
        self.num_dispatched += 1
        f = self._in_flight[req.request_id] = InFlight(req, i)
        self.running.add(f)
        return Dispatch(req, self.tiers.engine_priority(i) * ENGINE_PRIORITY_SPAN + bump, cost)

    def adopt(self, request_id: str, now_ms: float) -> QueuedRequest | None:
        """A queued request turns out to be running already (a worker reports it after
        this dispatcher restarted and JetStream redelivered the request): move it to
        in flight, charged as a dispatch, so it is never dispatched a second time."""
        req = self._queued.get(request_id)
        if req is None:
            return None
        self.policy.remove(req)
        self._dispatch(req, now_ms)
        return req

    # --- configuration -----------------------------------------------------------------

    def update_config(self, config: SchedulerConfig) -> None:
        """Hot reload of tenants, weights, quotas and limits (tenants file edits).

        Tiers, the policy and the cost model shape the scheduler's structures and the
        dispatcher's consumers, so changing them needs a restart: ValueError.
        """
        old = self.config
        if ([t.name for t in config.tiers] != [t.name for t in old.tiers]
                or config.policy != old.policy or config.cost_model != old.cost_model):
            raise ValueError("tiers, policy and cost_model change only with a restart")
        self.config = config
        self.tiers.tiers = list(config.tiers)
        self.policy.update_config(config)
        # Throttling's per-tier backlogged weight, recomputed with the new weights.
        self._tier_weight = {}
        for (i, tenant), n in self._tt_queued.items():
            if n > 0:
                self._tier_weight[i] = self._tier_weight.get(i, 0.0) + config.weight(tenant)

    # --- lifecycle ---------------------------------------------------------------------

    def on_started(self, request_id: str, now_ms: float) -> bool:
        f = self._in_flight.get(request_id)
        if f is None:
            return False
        if not f.started:
            f.started, f.started_ms = True, now_ms
        return True

    def _release(self, request_id: str, now_ms: float) -> InFlight | None:
        f = self._in_flight.pop(request_id, None)
        if f is None:
            return None
        self.running.remove(f)
        load = self._loads.touch(f.request.tenant)
        load.num_in_flight -= 1
        load.kv_tokens_in_flight -= f.request.est_kv_tokens
        self.policy.on_release(f.request.tenant, now_ms)  # may un-park the tenant
        self.preemptor.on_left(request_id)
        return f

    def on_finished(self, request_id: str, usage: ActualUsage | None, now_ms: float) -> QueuedRequest | None:
        """Release the request's quota and true its cost up to what it really used."""
        f = self._release(request_id, now_ms)
        if f is None:
            return None
        req = f.request
        if usage is not None:
            if req.num_preemptions and usage.kv_token_seconds:
                # Measured KV-seconds cover the last run only (the counts are the whole
                # request's): the whole is trued up by its counts, as its runs were.
                usage = ActualUsage(usage.prompt_tokens, usage.completion_tokens)
            delta = self.policy.true_up(req, usage, now_ms)
            self._loads.touch(req.tenant).dispatched_cost += delta
            self.tiers.add_cost(f.tier_index, delta, now_ms)
        return req

    def requeue(self, request_id: str, now_ms: float) -> bool:
        """A dispatched request that never started goes back to the front of its
        priority class; its dispatch charge is refunded."""
        f = self._in_flight.get(request_id)
        if f is None or f.started:
            return False
        self._release(request_id, now_ms)
        req = f.request
        refund = self.policy.refund(req, now_ms)
        self._loads.touch(req.tenant).dispatched_cost -= refund
        self.tiers.add_cost(f.tier_index, -refund, now_ms)
        if self.rate is not None:
            self.rate.add(now_ms, -refund)
        self.num_dispatched -= 1
        req.requeued = True
        self._enqueue(req, now_ms)
        self.policy.push_front(req, now_ms)
        return True

    # --- preemption (DESIGN.md 5b; the decision is `dispatcher.scheduler.preempt`) ------

    def preemptions(self, now_ms: float, num_free_slots: int,
                    worker_of: WorkerOf) -> list[PreemptionOrder]:
        """Running requests to preempt now, each for a waiting request below its tenant's
        share, which holds the next free slot (`preempt`); [] while pulls wait for work."""
        return self.preemptor.decide(self, now_ms, num_free_slots, worker_of)

    def dispatch_held(self, request_id: str, now_ms: float) -> Dispatch | None:
        """Dispatch a held request now, with its preemption order (`PoolCore`)."""
        req = self.preemptor.held.pop(request_id, None)  # quota checked as it was held
        if req is None or self._queued.get(request_id) is not req:
            return None
        self.policy.take(req, now_ms)
        return self._dispatch(req, now_ms, held=True)

    def preempted(self, request_id: str, num_generated_tokens: int, now_ms: float,
                  worker_id: str | None = None) -> QueuedRequest | None:
        """The worker stopped `request_id` after `num_generated_tokens` output tokens
        (earlier runs included): its quota is released, this run is settled to the work
        it did, and it goes to the front of its tenant's queue as a continuation charged
        for the work left only. Returns it (the shell attaches the resume point)."""
        f = self._release(request_id, now_ms)
        if f is None:
            return None
        req = f.request
        done = max(num_generated_tokens, req.num_generated_tokens)
        req.requeued = True
        self.policy.push_front(req, now_ms)  # first: an idle tenant would forfeit the refund
        delta = self.policy.true_up(req, ActualUsage(req.prompt_tokens, done), now_ms)
        self._loads.touch(req.tenant).dispatched_cost += delta
        self.tiers.add_cost(f.tier_index, delta, now_ms)
        if self.rate is not None:
            self.rate.add(now_ms, delta)
        req.paid_cost += req.est_cost + delta
        req.num_generated_tokens = done
        req.num_preemptions += 1
        req.resume_cost = req.est_cost = continuation_cost(self.cost_model, req)
        self._enqueue(req, now_ms)
        self.preemptor.on_preempted(req, worker_id)
        return req

    def cancel(self, request_id: str) -> QueuedRequest | None:
        """Remove a queued request. Returns None if it is not queued (maybe running)."""
        req = self._queued.pop(request_id, None)
        if req is None:
            return None
        self.policy.remove(req)
        self._unqueue(req)
        return req

    # --- deadlines and overload --------------------------------------------------------

    def expire(self, now_ms: float) -> list[SendError]:
        """Drop queued requests whose deadline has passed: they never reach a GPU.
        A deadline heap makes this O(expired · log n), not a scan of the queue."""
        out: list[SendError] = []
        heap = self._deadlines
        while heap and heap[0][0] <= now_ms:
            deadline, _, req = heappop(heap)
            # Stale entries: dispatched, cancelled, or requeued (pushed again).
            if self._queued.get(req.request_id) is not req or req.deadline_ms != deadline:
                continue
            self.cancel(req.request_id)
            self.drops[ErrorCode.EXPIRED] += 1
            out.append(SendError(req, ErrorCode.EXPIRED, "deadline passed while queued"))
        if len(heap) > 1024 and len(heap) > 4 * len(self._queued):
            self._deadlines = [e for e in heap if self._queued.get(e[2].request_id) is e[2]]
            heapify(self._deadlines)
        return out

    def shed(self, now_ms: float, max_queued_total: int | None = None) -> list[SendError]:
        """Overload shedding: cut the queue to `max_queued_total` (default: the config's).

        Who goes: `shed_victims` (lowest tier, longest tenant queues, least urgent
        first). A fast, retryable `overloaded` beats a wait that blows the SLA anyway.
        """
        limit = self.config.max_queued_total if max_queued_total is None else max_queued_total
        excess = len(self._queued) - max(limit, 0)
        if excess <= 0:
            return []
        retry_ms = self._drain_retry_ms(now_ms)
        victims = shed_victims(self._queued.values(), self.tiers.index, excess)
        out = []
        for req in victims:
            self.cancel(req.request_id)
            self.drops[ErrorCode.OVERLOADED] += 1
            out.append(SendError(req, ErrorCode.OVERLOADED, "shed under overload", retry_ms))
        return out
