"""The `Policy` strategy interface and the per-tenant bookkeeping fair policies share.

A policy decides *which queued request of a tier goes next*; the `Scheduler` core owns
admission, tiers, in-flight state and quotas. `eligible(tenant, kv_tokens)` tells the
policy whether a tenant is within its quotas right now: an ineligible tenant is
*parked* (skipped, never dropped) and comes back when `on_release` says one of its
requests left the engine — the only event that can make it eligible again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import ClassVar, Protocol

from dispatcher.scheduler.cost import CostModel
from dispatcher.scheduler.tenant_queue import TenantQueue
from dispatcher.scheduler.types import ActualUsage, QueuedRequest
from fairlane.poolconfig import SchedulerConfig

Eligible = Callable[[str, int], bool]
_EPS = 1e-9


def estimate_cost(model: CostModel, req: QueuedRequest) -> float:
    """What running `req` now is expected to cost: the whole request, or for a
    continuation (preempted before) only the work left, so its tenant pays for new work
    only (`Scheduler.preempted` settles the earlier runs and sets `resume_cost`)."""
    return req.resume_cost if req.num_preemptions else model.estimate(req)


# --- fair shares, for preemption (`dispatcher.scheduler.preempt`) ---------------------


@dataclass(slots=True)
class Standing:
    """One tenant of one tier against its fair share of the slots that tier holds."""

    tenant: str
    weight: float
    num_running: int
    head: QueuedRequest | None  # its next queued request, if any
    share: float = 0.0  # fair share of the tier's slots (fractional)
    excess: float = 0.0  # (num_running - share) / weight: > 0 above its share, < 0 below
    demand: float = 0.0  # slots it would use now: running + queued (capped by its quota)

    @property
    def short(self) -> bool:
        """Short of its share by a whole slot: one more running would not exceed it."""
        return self.num_running + 1 <= self.share + _EPS

    @property
    def quiet(self) -> bool:
        """Its whole demand fits in its fair share: a tenant that, served as fair
        queueing promises, would wait for nobody (its queue is only the requests that
        arrived while every slot was held). A backlogged tenant's head waits behind its
        own queue however slots are shared."""
        return self.demand <= self.share + _EPS


class FairShares(Protocol):
    """A policy's own measure of who is above and below its fair share in one tier."""

    standings: dict[str, Standing]

    def owed(self, waiter: Standing) -> bool:
        """Whether `waiter` is short of its share by a whole slot (may claim one)."""
        ...

    def may_move(self, victim: Standing, waiter: Standing) -> bool:
        """Whether taking one slot from `victim` for `waiter`'s head is fair by this
        policy's measure (and does not simply invert the two: no thrashing)."""
        ...


def water_fill(demands: Mapping[str, tuple[float, float]], num_slots: float) -> dict[str, float]:
    """Weighted max-min shares of `num_slots`: `demands` maps a tenant to (weight,
    demand); none gets more than it demands, the rest is split in proportion to weight."""
    out: dict[str, float] = {}
    left = float(num_slots)
    total_weight = sum(w for w, _ in demands.values())
    for name, (w, d) in sorted(demands.items(), key=lambda kv: kv[1][1] / kv[1][0]):
        give = min(float(d), left * w / total_weight) if total_weight > 0 else 0.0
        out[name] = give
        left -= give
        total_weight -= w
    return out


class SlotShares:
    """The slot measure both fair policies start from: the weighted max-min
    (water-filling) share of the tier's slots among its tenants with demand (running +
    queued, capped by `max_concurrent`), against what each runs now. Fair turns in
    proportion to weight converge to it as slots turn over; preemption gets there
    without waiting for the turnover. Each policy adds its own accounts (DRR's turns,
    VTC's counters), so preemption never serves a tenant the policy would not.

    A move (one slot from victim to waiter) is allowed when the waiter is short of
    its share by a whole slot (running + 1 <= share) and the victim is above its share
    (running > share). Why whole slots: a fractional share is DRR's to honour by
    time-sharing slots as they turn over — a tenant owed 0.8 of a slot runs on none
    part of the time, and preempting it in then would hand it more than its weight,
    every time (its debt would grow without bound). No thrashing: after a move the
    waiter is not above its share and the victim not short by a whole slot, so the move
    is never undone, and each move lowers the sum of whole-slot shortfalls by one, so
    with demand fixed the moves end — with every tenant at floor(share) or more.
    """

    def __init__(self, standings: dict[str, Standing]) -> None:
        self.standings = standings

    def owed(self, waiter: Standing) -> bool:
        return waiter.short

    def may_move(self, victim: Standing, waiter: Standing) -> bool:
        return victim.tenant != waiter.tenant and victim.excess > _EPS and self.owed(waiter)


class Policy(Protocol):
    name: ClassVar[str]
    cost_model: CostModel

    def push(self, req: QueuedRequest, now_ms: float) -> None: ...
    def push_front(self, req: QueuedRequest, now_ms: float) -> None:
        """Back to the front of its priority class (requeue, or a pick not taken)."""
        ...
    def pop(self, tier: str, eligible: Eligible, now_ms: float) -> QueuedRequest | None:
        """The next request of `tier`, or None if it has none that is eligible now.
        The core follows every pop with either `charge` or `push_front`."""
        ...
    def remove(self, req: QueuedRequest) -> None: ...
    def take(self, req: QueuedRequest, now_ms: float) -> None:
        """Remove queued `req` to dispatch it out of the policy's own order, in the
        turn its tenant would get next (a slot preemption freed for it); `charge`
        follows. Only for a request `fair_shares` called owed."""
        ...
    def charge(self, req: QueuedRequest, now_ms: float) -> float:
        """Cost charged when `req` is dispatched (returned for metrics)."""
        ...
    def refund(self, req: QueuedRequest, now_ms: float) -> float:
        """Undo `charge` for a request that went back to the queue; returns the amount."""
        ...
    def true_up(self, req: QueuedRequest, usage: ActualUsage, now_ms: float) -> float:
        """Correct the charge to the actual usage; returns actual - estimate."""
        ...
    def on_release(self, tenant: str, now_ms: float) -> None:
        """One of `tenant`'s in-flight requests left: parked queues may be eligible again."""
        ...
    def forget_idle(self, tenants: Iterable[str], now_ms: float) -> None:
        """These tenants had nothing queued or in flight for the scheduler's idle period:
        drop the state they owe nothing on (memory follows the active tenants, not every
        tenant ever seen). A debt is kept until it is repaid: nobody gains share by
        under-declaring and then waiting."""
        ...
    def update_config(self, config: SchedulerConfig) -> None:
        """Hot reload: new weights, quantum and tenants apply from the next decision on.
        Policy-specific state (rings, heaps, credits) is kept."""
        ...
    def fair_shares(self, tier: str, running: Mapping[str, int], num_slots: int) -> FairShares | None:
        """Who in `tier` is above or below its fair share of `num_slots`, by this
        policy's own measure, given each tenant's `running` requests in the tier (for
        preemption). None: this policy never preempts."""
        ...


class TenantState:
    """One tenant's line within one tier, plus its fairness account.

    `credit` is the DRR deficit (cost the tenant may still send) or, for VTC, minus its
    virtual counter; either way a negative value is *debt* and survives the queue
    emptying, so under-declared requests are paid back later.
    """

    __slots__ = ("tenant", "tier", "weight", "queue", "credit", "active", "parked",
                 "in_turn", "version", "listed")

    def __init__(self, tenant: str, tier: str, weight: float) -> None:
        self.tenant = tenant
        self.tier = tier
        self.weight = max(weight, 1e-9)
        self.queue = TenantQueue()
        self.credit = 0.0
        self.active = False  # in the policy's selection structure (ring / heap)
        self.parked = False  # quota-blocked: out of the structure until a release
        self.in_turn = False  # DRR: this turn's quantum already granted
        self.version = 0  # VTC: invalidates stale heap entries
        self.listed = False  # on the book's parked list for its tenant


class TenantBook:
    """Tenant states keyed by (tier, tenant), and the parked lists per tenant."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.states: dict[tuple[str, str], TenantState] = {}
        self.parked: dict[str, list[TenantState]] = {}
        self.tiers: set[str] = set()  # every tier a state was made for (few)

    def state(self, req: QueuedRequest) -> TenantState:
        key = (req.tier, req.tenant)
        st = self.states.get(key)
        if st is None:
            self.tiers.add(req.tier)
            st = self.states[key] = TenantState(req.tenant, req.tier,
                                                self.config.weight(req.tenant))
        return st

    def park(self, st: TenantState) -> None:
        st.parked = True
        if not st.listed:
            st.listed = True
            self.parked.setdefault(st.tenant, []).append(st)

    def unpark(self, tenant: str) -> list[TenantState]:
        """The tenant's parked states that still have work (to re-activate)."""
        out = self.parked.pop(tenant, None)
        if not out:
            return []
        woken = []
        for st in out:
            st.listed = False
            if st.parked:
                st.parked = False
                if st.queue:
                    woken.append(st)
        return woken

    def update_config(self, config: SchedulerConfig) -> None:
        """New weights apply to every known tenant state; credits and queues stay."""
        self.config = config
        for st in self.states.values():
            st.weight = max(config.weight(st.tenant), 1e-9)

    def standings(self, tier: str, running: Mapping[str, int], num_slots: int) -> dict[str, Standing]:
        """Every tenant of `tier` with demand, against its water-filled slot share.
        O(tenant states) per call: preemption decisions are rare, not per dispatch."""
        out: dict[str, Standing] = {}
        demands: dict[str, tuple[float, float]] = {}
        queued: dict[str, TenantState] = {st.tenant: st for (t, _), st in self.states.items()
                                           if t == tier and st.queue}
        for tenant in sorted({*queued, *(t for t, n in running.items() if n > 0)}):
            st = queued.get(tenant)
            tcfg = self.config.tenant(tenant)
            weight = st.weight if st else max(tcfg.weight if tcfg else 1.0, 1e-9)
            n = running.get(tenant, 0)
            demand = n + (len(st.queue) if st else 0)
            cap = tcfg.max_concurrent if tcfg else None
            if cap is not None:
                demand = max(min(demand, cap), n)  # quota-blocked work claims no share
            demands[tenant] = (weight, demand)
            out[tenant] = Standing(tenant, weight, n, st.queue.peek() if st else None,
                                   demand=demand)
        for tenant, share in water_fill(demands, num_slots).items():
            s = out[tenant]
            s.share = share
            s.excess = (s.num_running - share) / s.weight
        return out

    def idle_states(self, tenant: str) -> list[TenantState]:
        """The tenant's states with nothing queued, neither active nor parked (one per
        tier it used: O(tiers))."""
        found = (self.states.get((tier, tenant)) for tier in self.tiers)
        return [st for st in found
                if st is not None and not st.queue and not st.active and not st.parked]

    def forget_if_idle(self, st: TenantState) -> None:
        """Drop the state of an idle tenant that owes nothing (bounded memory under
        tenant churn). A tenant in debt is kept: its debt must survive."""
        if not st.queue and not st.active and not st.parked and st.credit >= 0:
            self.states.pop((st.tier, st.tenant), None)
