"""Weighted Deficit Round Robin across the backlogged tenants of each tier.

Per tier, a ring (deque) of *active* tenants: backlogged and not quota-blocked. The
tenant at the head of the ring is taking its turn: at the start of a turn it is granted
`quantum × weight`; it sends its head request while the request's estimated cost fits
its deficit; when it does not fit, the turn ends and the tenant rotates to the tail.

Cost per decision is O(1) in the number of tenants:
- a tenant whose queue emptied leaves the ring the next time it is visited (O(1));
- a quota-blocked tenant is *parked* out of the ring when its turn comes (O(1)) and
  re-enters at the tail when one of its requests is released (`on_release`), keeping
  its deficit — it is skipped, not dropped, and it does not lose its turn for good;
- visits that only grant a quantum are amortised against the cost they let through:
  with `quantum × weight` ≥ the typical request cost, a visit sends at least one
  request. (A tenant in debt needs debt / (quantum × weight) turns to pay it back;
  those visits are amortised against the cost that created the debt.)

Departures from textbook DRR, deliberately:
- a tenant whose queue empties forfeits positive deficit (as in DRR) but *keeps debt*
  (a negative deficit from a true-up): nobody gains share by under-declaring;
- parking a blocked tenant does not reset its deficit.
"""

from __future__ import annotations

from collections import deque

from dispatcher.scheduler.base import Eligible, TenantBook, TenantState
from dispatcher.scheduler.cost import CostModel, make_cost_model
from dispatcher.scheduler.types import ActualUsage, QueuedRequest
from fairlane.poolconfig import SchedulerConfig

_EPS = 1e-9


class DrrPolicy:
    name = "drr"

    def __init__(self, config: SchedulerConfig, cost_model: CostModel | None = None) -> None:
        self.config = config
        self.cost_model = cost_model or make_cost_model(config)
        if not config.quantum > 0:
            raise ValueError(f"drr needs a positive quantum, got {config.quantum!r}")
        self.quantum = config.quantum
        self._book = TenantBook(config)
        self._rings: dict[str, deque[TenantState]] = {}
        self.num_visits = 0  # ring visits, for the benchmark's amortised-cost check

    # --- queueing ----------------------------------------------------------------------

    def _activate(self, st: TenantState) -> None:
        if not st.active:
            st.active = True
            st.parked = False
            st.in_turn = False
            ring = self._rings.get(st.tier)
            if ring is None:
                ring = self._rings[st.tier] = deque()
            ring.append(st)

    def push(self, req: QueuedRequest, now_ms: float) -> None:
        st = self._book.state(req)
        st.queue.push(req)
        # A parked tenant stays parked unless the new request became its head (a
        # smaller head may fit its KV quota); otherwise only a release can unblock it.
        if not st.parked or st.queue.peek() is req:
            self._activate(st)

    def push_front(self, req: QueuedRequest, now_ms: float) -> None:
        st = self._book.state(req)
        st.queue.push_front(req)
        self._activate(st)

    def remove(self, req: QueuedRequest) -> None:
        st = self._book.states.get((req.tier, req.tenant))
        if st is not None:
            st.queue.remove(req)  # an emptied tenant leaves the ring at its next visit

    # --- selection ---------------------------------------------------------------------

    def pop(self, tier: str, eligible: Eligible, now_ms: float) -> QueuedRequest | None:
        ring = self._rings.get(tier)
        if not ring:
            return None
        estimate = self.cost_model.estimate
        while ring:
            self.num_visits += 1
            st = ring[0]
            head = st.queue.peek()
            if head is None:
                ring.popleft()
                st.active = st.in_turn = False
                if st.credit > 0:
                    st.credit = 0.0  # idle: unused credit is forfeit, debt is not
                self._book.forget_if_idle(st)
                continue
            if not eligible(st.tenant, head.kv_tokens):
                ring.popleft()
                st.active = st.in_turn = False
                # Leaving the ring forfeits unused credit, as going idle does: kept, it
                # would stack with the fresh quantum granted on return, and a tenant
                # cycling through its quota would win more turns than its weight.
                if st.credit > 0:
                    st.credit = 0.0
                self._book.park(st)
                continue
            if not st.in_turn:
                st.in_turn = True
                st.credit += self.quantum * st.weight
            if estimate(head) <= st.credit + _EPS:
                return st.queue.pop()
            st.in_turn = False
            ring.rotate(-1)
        return None

    def on_release(self, tenant: str, now_ms: float) -> None:
        for st in self._book.unpark(tenant):
            self._activate(st)

    # --- accounting --------------------------------------------------------------------

    def update_config(self, config: SchedulerConfig) -> None:
        if not config.quantum > 0:
            raise ValueError(f"drr needs a positive quantum, got {config.quantum!r}")
        self.config = config
        self.quantum = config.quantum
        self._book.update_config(config)

    def charge(self, req: QueuedRequest, now_ms: float) -> float:
        cost = self.cost_model.estimate(req)
        self._book.state(req).credit -= cost
        return cost

    def refund(self, req: QueuedRequest, now_ms: float) -> float:
        self._book.state(req).credit += req.est_cost
        return req.est_cost

    def true_up(self, req: QueuedRequest, usage: ActualUsage, now_ms: float) -> float:
        delta = self.cost_model.actual(req, usage) - req.est_cost
        st = self._book.state(req)
        st.credit -= delta
        if st.credit > 0 and not st.active and not st.parked:
            st.credit = 0.0  # idle tenants carry debt, never credit
        return delta

    # --- inspection --------------------------------------------------------------------

    def deficit(self, tier: str, tenant: str) -> float:
        st = self._book.states.get((tier, tenant))
        return st.credit if st else 0.0

    def num_active(self, tier: str) -> int:
        return len(self._rings.get(tier, ()))
