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
- parking a blocked tenant does not reset its deficit;
- an overpayment (a true-up below the estimate, a preempted run) comes back as credit
  only if the charge was made while another tenant was in the ring: a lone tenant's
  quanta cost nobody anything (it gets one per visit).

Memory follows the active tenants: an idle tenant that owes nothing has no state (it
is dropped when its queue empties, or by `forget_idle` once the scheduler has seen it
idle for its idle period). A tenant in debt keeps its state, however long it stays
away, until its turns repay the debt: dropped only when settled.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
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

_EPS = 1e-9


class DrrPolicy:
    name: ClassVar[str] = "drr"

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
        if st is None:
            return
        blocked_head = st.parked and st.queue.peek() is req
        st.queue.remove(req)  # an emptied tenant leaves the ring at its next visit
        # A parked tenant whose blocked head left (cancelled, expired) may fit its KV
        # quota with the next one, as when a smaller head arrives (`push`); parked, it
        # would wait for a release that may never come. Still blocked: parked again.
        if blocked_head and st.queue:
            self._activate(st)

    def take(self, req: QueuedRequest, now_ms: float) -> None:
        # Its turn, taken before the ring reaches it: the quantum is granted now, and the
        # ring's visit continues this turn rather than granting another, so the tenant
        # still gets one quantum per round.
        st = self._book.state(req)
        st.queue.remove(req)
        if st.active and not st.in_turn:
            st.in_turn = True
            st.credit += self.quantum * st.weight

    # --- selection ---------------------------------------------------------------------

    def pop(self, tier: str, eligible: Eligible, now_ms: float) -> QueuedRequest | None:
        ring = self._rings.get(tier)
        if not ring:
            return None
        model = self.cost_model
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
            if estimate_cost(model, head) <= st.credit + _EPS:
                return st.queue.pop()
            st.in_turn = False
            ring.rotate(-1)
        return None

    def on_release(self, tenant: str, now_ms: float) -> None:
        for st in self._book.unpark(tenant):
            self._activate(st)

    def forget_idle(self, tenants: Iterable[str], now_ms: float) -> None:
        # Idle states usually went when their queue emptied (`pop`); what is left is
        # state made again by a later true-up or refund, and debt, which is kept.
        for tenant in tenants:
            for st in self._book.idle_states(tenant):
                self._book.forget_if_idle(st)

    # --- accounting --------------------------------------------------------------------

    def update_config(self, config: SchedulerConfig) -> None:
        if not config.quantum > 0:
            raise ValueError(f"drr needs a positive quantum, got {config.quantum!r}")
        self.config = config
        self.quantum = config.quantum
        self._book.update_config(config)

    def charge(self, req: QueuedRequest, now_ms: float) -> float:
        cost = estimate_cost(self.cost_model, req)
        st = self._book.state(req)
        st.credit -= cost
        ring = self._rings.get(st.tier)
        req.charged_alone = not ring or (len(ring) == 1 and ring[0] is st)
        return cost

    def refund(self, req: QueuedRequest, now_ms: float) -> float:
        if not req.charged_alone:  # paid from a quantum nobody contended: not owed back
            self._book.state(req).credit += req.est_cost
        return req.est_cost

    def true_up(self, req: QueuedRequest, usage: ActualUsage, now_ms: float) -> float:
        # A continuation's earlier runs were charged `paid_cost`: the total is trued up.
        delta = self.cost_model.actual(req, usage) - req.est_cost - req.paid_cost
        if delta <= 0 and (req.charged_alone or (req.tier, req.tenant) not in self._book.states):
            # Forgotten and idle: credit would be forfeit at once anyway. Charged alone
            # in its tier's ring: it was paid from quanta nobody else wanted (a lone
            # tenant gets one per visit), so the overpayment is not owed back: given
            # back, it would let the tenant run work it started on an idle fleet (a
            # preempted continuation, typically) on top of its share once others wait.
            return delta
        st = self._book.state(req)
        st.credit -= delta
        if st.credit > 0 and not st.active and not st.parked:
            st.credit = 0.0  # idle tenants carry debt, never credit
        self._book.forget_if_idle(st)  # owes nothing and idle: no state needed
        return delta

    def fair_shares(self, tier: str, running: Mapping[str, int], num_slots: int) -> SlotShares:
        """DRR's measure: the weighted max-min share of the tier's slots (`SlotShares`),
        the occupancy its weighted turns converge to, gated by its turns: a tenant is
        owed a slot only if its head fits the credit of its current or next turn
        (`take` then spends that turn). So preemption serves a tenant no more often
        than DRR would — it only stops the turn from waiting for a slot to turn over —
        and DRR's bound on weighted service holds; without the gate, a tenant whose
        requests are short (`requests` cost) would hold its slot share against DRR's
        request-count share by preempting at every turnover. A quiet tenant (demand
        within its share) may take its next turn early, once (see `owed`)."""
        return _TurnGatedShares(self._book.standings(tier, running, num_slots),
                                self._book, tier, self._rings.get(tier, deque()),
                                self.quantum, self.cost_model)

    # --- inspection --------------------------------------------------------------------

    def deficit(self, tier: str, tenant: str) -> float:
        st = self._book.states.get((tier, tenant))
        return st.credit if st else 0.0

    def num_active(self, tier: str) -> int:
        return len(self._rings.get(tier, ()))


class _TurnGatedShares(SlotShares):
    def __init__(self, standings: dict[str, Standing], book: TenantBook, tier: str,
                 ring: deque[TenantState], quantum: float, model: CostModel) -> None:
        super().__init__(standings)
        self._book, self._tier, self._ring = book, tier, ring
        self._quantum, self._model = quantum, model
        self._first: TenantState | None = None
        self._first_known = False  # `_first` is computed once per view

    def owed(self, waiter: Standing) -> bool:
        st = self._book.states.get((self._tier, waiter.tenant))
        if st is None or waiter.head is None or not st.active or not super().owed(waiter):
            return False
        if not any(o.queue for o in self._ring if o is not st):
            return True  # alone with work in its tier: DRR's next pick whatever its credit
        if not waiter.quiet:
            # A backlogged tenant: only in its turn (its head fits its credit, with the
            # quantum a new turn adds), and only if DRR would serve it first among the
            # tenants a freed slot could go to (those short of their share, in ring
            # order): preemption then takes turns in DRR's order, never ahead of it.
            return self._first_fit() is st
        # A quiet tenant (its whole demand fits in its share) may spend its next turn's
        # quantum early: with every slot held by a flood, DRR's round advances only as
        # slots turn over, and a tenant that asks for less than its share should not
        # wait for the round to come back. It goes at most one turn into debt, which
        # its next turn repays, so DRR's bound widens by one quantum at most.
        credit = st.credit + self._quantum * st.weight
        return estimate_cost(self._model, waiter.head) <= credit + _EPS

    def _first_fit(self) -> TenantState | None:
        """The first short tenant in ring order whose head fits its turn's credit (one
        ring walk per view: a decision asks for every waiter)."""
        if not self._first_known:
            self._first_known = True
            for st in self._ring:
                s = self.standings.get(st.tenant)
                head = st.queue.peek()
                if head is None or s is None or not s.short:
                    continue
                credit = st.credit + (0.0 if st.in_turn else self._quantum * st.weight)
                if estimate_cost(self._model, head) <= credit + _EPS:
                    self._first = st
                    break
        return self._first
