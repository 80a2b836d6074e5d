"""Virtual Token Counter (Sheng et al., OSDI 2024, "Fairness in Serving LLMs").

Each tenant has a virtual counter of the (weighted) cost it received; the backlogged
tenant with the smallest counter goes next. *Counter lift*: a tenant that becomes
backlogged has its counter lifted to the smallest counter among the tier's backlogged
tenants (or, if none, to the counter of the tenant served last), so an idle tenant
cannot bank service and then monopolise the engine. Lifting only ever raises a counter,
so debt from a true-up survives.

Per tier, a min-heap of active tenants keyed by counter, with lazy invalidation by a
version number: O(log n) per decision. Quota-blocked tenants are parked exactly as in
DRR and come back on `on_release`.

Memory follows the active tenants: an idle tenant whose counter is at or below the
tier's floor would be lifted to the floor on return, so its state can go. When the
scheduler reports a tenant idle (`forget_idle`), its state goes if so; if not (it was
served more than the others since: debt, in effect), it waits in a per-tier heap of
idle states keyed by counter and goes when the floor passes its counter, which each
pass checks from the heap's top: O(states forgotten), never a scan.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from heapq import heappop, heappush  # by name: compiled, heapq.x is a lookup per call
from typing import ClassVar

from dispatcher.scheduler.base import (
    Eligible,
    SlotShares,
    Standing,
    TenantBook,
    TenantState,
    estimate_cost,
)
from dispatcher.scheduler.cost import CostModel, make_cost_model
from dispatcher.scheduler.types import ActualUsage, QueuedRequest
from fairlane.poolconfig import SchedulerConfig

_Entry = tuple[float, int, int, TenantState]  # (counter, unique, version, state)


class VtcPolicy:
    name: ClassVar[str] = "vtc"

    def __init__(self, config: SchedulerConfig, cost_model: CostModel | None = None) -> None:
        self.config = config
        self.cost_model = cost_model or make_cost_model(config)
        self._book = TenantBook(config)
        self._heaps: dict[str, list[_Entry]] = {}
        self._last: dict[str, float] = {}  # per tier: counter of the tenant served last
        self._unique = itertools.count()
        self._idle: dict[str, list[_Entry]] = {}  # per tier: idle states above the floor

    @staticmethod
    def _counter(st: TenantState) -> float:
        return -st.credit  # the counter is service received: credit's negation

    def _heap_push(self, st: TenantState) -> None:
        st.version += 1
        st.active = True
        st.parked = False
        heap = self._heaps.get(st.tier)
        if heap is None:
            heap = self._heaps[st.tier] = []
        heappush(heap, (self._counter(st), next(self._unique), st.version, st))

    def _deactivate(self, st: TenantState) -> None:
        st.version += 1
        st.active = False

    def _min_counter(self, tier: str) -> float | None:
        heap = self._heaps.get(tier)
        while heap:
            _, _, version, st = heap[0]
            if version == st.version and st.active:
                return self._counter(st)
            heappop(heap)
        return None

    def _floor(self, tier: str) -> float:
        """What a newly backlogged tenant of `tier` is lifted to."""
        floor = self._min_counter(tier)
        return self._last.get(tier, 0.0) if floor is None else floor

    def lift(self, st: TenantState) -> None:
        """Counter lift on arrival of a newly backlogged tenant."""
        floor = self._floor(st.tier)
        if self._counter(st) < floor:
            st.credit = -floor

    # --- queueing ----------------------------------------------------------------------

    def push(self, req: QueuedRequest, now_ms: float) -> None:
        st = self._book.state(req)
        newly_backlogged = not st.queue
        st.queue.push(req)
        if newly_backlogged and not st.active:
            self.lift(st)
        if not st.active and (not st.parked or st.queue.peek() is req):
            self._heap_push(st)

    def push_front(self, req: QueuedRequest, now_ms: float) -> None:
        st = self._book.state(req)
        st.queue.push_front(req)
        if not st.active:
            self._heap_push(st)  # no lift: it was backlogged (or just served)

    def remove(self, req: QueuedRequest) -> None:
        st = self._book.states.get((req.tier, req.tenant))
        if st is None:
            return
        blocked_head = st.parked and st.queue.peek() is req
        st.queue.remove(req)
        # As DRR's `remove`: the next head of a parked tenant may fit its quota.
        if blocked_head and st.queue and not st.active:
            self._heap_push(st)

    def take(self, req: QueuedRequest, now_ms: float) -> None:
        self.remove(req)  # `charge` raises its counter and re-keys it

    # --- selection ---------------------------------------------------------------------

    def pop(self, tier: str, eligible: Eligible, now_ms: float) -> QueuedRequest | None:
        heap = self._heaps.get(tier)
        while heap:
            _, _, version, st = heap[0]
            if version != st.version or not st.active:
                heappop(heap)
                continue
            head = st.queue.peek()
            heappop(heap)
            self._deactivate(st)
            if head is None:
                self._forget(st)
                continue
            if not eligible(st.tenant, head.kv_tokens):
                self._book.park(st)
                continue
            return st.queue.pop()  # `charge` (or `push_front`) puts it back in the heap
        return None

    def _forget(self, st: TenantState) -> None:
        # An idle tenant at or below the tier's floor would be lifted to the floor on
        # return anyway, so its state can go; one above the floor keeps its debt.
        if self._counter(st) <= self._floor(st.tier):
            self._book.states.pop((st.tier, st.tenant), None)

    def on_release(self, tenant: str, now_ms: float) -> None:
        for st in self._book.unpark(tenant):
            if not st.active:
                self._heap_push(st)

    def forget_idle(self, tenants: Iterable[str], now_ms: float) -> None:
        for tenant in tenants:
            for st in self._book.idle_states(tenant):
                heap = self._idle.setdefault(st.tier, [])
                heappush(heap, (self._counter(st), next(self._unique), st.version, st))
        states = self._book.states
        for tier, heap in self._idle.items():
            floor = self._floor(tier)
            while heap and heap[0][0] <= floor:
                _, _, version, st = heappop(heap)
                if (version != st.version or st.active or st.parked or st.queue
                        or states.get((st.tier, st.tenant)) is not st):
                    continue  # back since (the scheduler reports it again when idle)
                counter = self._counter(st)
                if counter <= floor:
                    del states[(st.tier, st.tenant)]
                else:  # its counter rose since it was indexed: index it anew
                    heappush(heap, (counter, next(self._unique), version, st))

    # --- accounting --------------------------------------------------------------------

    def update_config(self, config: SchedulerConfig) -> None:
        self.config = config
        self._book.update_config(config)

    def charge(self, req: QueuedRequest, now_ms: float) -> float:
        cost = estimate_cost(self.cost_model, req)
        st = self._book.state(req)
        # No other tenant of the tier backlogged (an out-of-turn charge counts as
        # contended): what it overpaid is not given back (see `DrrPolicy.true_up`).
        req.charged_alone = not st.active and self._min_counter(st.tier) is None
        st.credit -= cost / st.weight
        self._last[st.tier] = self._counter(st)
        if st.active or (st.queue and not st.parked):
            # Back into the heap; an active state (charged out of turn: adopted, or a
            # slot preemption freed for it) is re-keyed, its entry being stale.
            self._heap_push(st)
        return cost

    def refund(self, req: QueuedRequest, now_ms: float) -> float:
        if req.charged_alone:
            return req.est_cost
        st = self._book.state(req)
        st.credit += req.est_cost / st.weight
        if st.active:
            self._heap_push(st)
        return req.est_cost

    def true_up(self, req: QueuedRequest, usage: ActualUsage, now_ms: float) -> float:
        # A continuation's earlier runs were charged `paid_cost`: the total is trued up.
        delta = self.cost_model.actual(req, usage) - req.est_cost - req.paid_cost
        if delta <= 0 and req.charged_alone:
            return delta  # overpaid from a counter nobody contended: not given back
        st = self._book.state(req)
        st.credit -= delta / st.weight
        if st.active:
            self._heap_push(st)  # re-key: its counter changed
        return delta

    def fair_shares(self, tier: str, running: Mapping[str, int], num_slots: int) -> SlotShares:
        """VTC's measure: the counters decide who is owed — a waiter must be VTC's next
        pick (its counter the lowest backlogged one: counter lift puts a newly active
        tenant exactly there) and at or below its victim's counter. Counters are charged
        at dispatch, so they cannot see how many slots a tenant holds right now: whether
        the waiter is short and the victim above is the weighted slot share, as for DRR
        (`SlotShares`). All must agree, so preemption serves no one VTC would not serve
        next, and the counters stay as close as VTC keeps them."""
        counters = {st.tenant: self._counter(st) for (t, _), st in self._book.states.items()
                    if t == tier}
        return _CounterGatedShares(self._book.standings(tier, running, num_slots), counters,
                                   self._min_counter(tier))

    # --- inspection --------------------------------------------------------------------

    def counter(self, tier: str, tenant: str) -> float:
        st = self._book.states.get((tier, tenant))
        return self._counter(st) if st else 0.0


class _CounterGatedShares(SlotShares):
    def __init__(self, standings: dict[str, Standing], counters: dict[str, float],
                 lowest: float | None) -> None:
        super().__init__(standings)
        self.counters, self.lowest = counters, lowest

    def owed(self, waiter: Standing) -> bool:
        mine = self.counters.get(waiter.tenant)
        return (mine is not None and self.lowest is not None and mine <= self.lowest + 1e-9
                and super().owed(waiter))

    def may_move(self, victim: Standing, waiter: Standing) -> bool:
        # A victim whose state was forgotten (its counter at or below the tier's floor)
        # is never preempted by the counters' measure.
        mine = self.counters.get(waiter.tenant)
        theirs = self.counters.get(victim.tenant)
        return (mine is not None and theirs is not None and mine <= theirs + 1e-9
                and super().may_move(victim, waiter))
