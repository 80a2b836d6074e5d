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
"""

from __future__ import annotations

import heapq
import itertools

from dispatcher.scheduler.base import Eligible, TenantBook, TenantState
from dispatcher.scheduler.cost import CostModel, make_cost_model
from dispatcher.scheduler.types import ActualUsage, QueuedRequest
from fairlane.poolconfig import SchedulerConfig

_Entry = tuple[float, int, int, TenantState]  # (counter, unique, version, state)


class VtcPolicy:
    name = "vtc"

    def __init__(self, config: SchedulerConfig, cost_model: CostModel | None = None) -> None:
        self.config = config
        self.cost_model = cost_model or make_cost_model(config)
        self._book = TenantBook(config)
        self._heaps: dict[str, list[_Entry]] = {}
        self._last: dict[str, float] = {}  # per tier: counter of the tenant served last
        self._unique = itertools.count()

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
        heapq.heappush(heap, (self._counter(st), next(self._unique), st.version, st))

    def _deactivate(self, st: TenantState) -> None:
        st.version += 1
        st.active = False

    def _min_counter(self, tier: str) -> float | None:
        heap = self._heaps.get(tier)
        while heap:
            _, _, version, st = heap[0]
            if version == st.version and st.active:
                return self._counter(st)
            heapq.heappop(heap)
        return None

    def lift(self, st: TenantState) -> None:
        """Counter lift on arrival of a newly backlogged tenant."""
        floor = self._min_counter(st.tier)
        if floor is None:
            floor = self._last.get(st.tier, 0.0)
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
        if st is not None:
            st.queue.remove(req)

    # --- selection ---------------------------------------------------------------------

    def pop(self, tier: str, eligible: Eligible, now_ms: float) -> QueuedRequest | None:
        heap = self._heaps.get(tier)
        while heap:
            _, _, version, st = heap[0]
            if version != st.version or not st.active:
                heapq.heappop(heap)
                continue
            head = st.queue.peek()
            heapq.heappop(heap)
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
        floor = self._min_counter(st.tier)
        if floor is None:
            floor = self._last.get(st.tier, 0.0)
        if self._counter(st) <= floor:
            self._book.states.pop((st.tier, st.tenant), None)

    def on_release(self, tenant: str, now_ms: float) -> None:
        for st in self._book.unpark(tenant):
            if not st.active:
                self._heap_push(st)

    # --- accounting --------------------------------------------------------------------

    def update_config(self, config: SchedulerConfig) -> None:
        self.config = config
        self._book.update_config(config)

    def charge(self, req: QueuedRequest, now_ms: float) -> float:
        cost = self.cost_model.estimate(req)
        st = self._book.state(req)
        st.credit -= cost / st.weight
        self._last[st.tier] = self._counter(st)
        if st.queue and not st.active and not st.parked:
            self._heap_push(st)
        return cost

    def refund(self, req: QueuedRequest, now_ms: float) -> float:
        st = self._book.state(req)
        st.credit += req.est_cost / st.weight
        if st.active:
            self._heap_push(st)
        return req.est_cost

    def true_up(self, req: QueuedRequest, usage: ActualUsage, now_ms: float) -> float:
        delta = self.cost_model.actual(req, usage) - req.est_cost
        st = self._book.state(req)
        st.credit -= delta / st.weight
        if st.active:
            self._heap_push(st)  # re-key: its counter changed
        return delta

    # --- inspection --------------------------------------------------------------------

    def counter(self, tier: str, tenant: str) -> float:
        st = self._book.states.get((tier, tenant))
        return self._counter(st) if st else 0.0
