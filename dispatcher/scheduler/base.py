"""The `Policy` strategy interface and the per-tenant bookkeeping fair policies share.

A policy decides *which queued request of a tier goes next*; the `Scheduler` core owns
admission, tiers, in-flight state and quotas. `eligible(tenant, kv_tokens)` tells the
policy whether a tenant is within its quotas right now: an ineligible tenant is
*parked* (skipped, never dropped) and comes back when `on_release` says one of its
requests left the engine — the only event that can make it eligible again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from dispatcher.scheduler.cost import CostModel
from dispatcher.scheduler.tenant_queue import TenantQueue
from dispatcher.scheduler.types import ActualUsage, QueuedRequest
from fairlane.poolconfig import SchedulerConfig

Eligible = Callable[[str, int], bool]


class Policy(Protocol):
    name: str
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
    def update_config(self, config: SchedulerConfig) -> None:
        """Hot reload: new weights, quantum and tenants apply from the next decision on.
        Policy-specific state (rings, heaps, credits) is kept."""
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

    def state(self, req: QueuedRequest) -> TenantState:
        key = (req.tier, req.tenant)
        st = self.states.get(key)
        if st is None:
            tcfg = self.config.tenant(req.tenant)
            st = self.states[key] = TenantState(
                req.tenant, req.tier, tcfg.weight if tcfg else 1.0
            )
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
            tcfg = config.tenant(st.tenant)
            st.weight = max(tcfg.weight if tcfg else 1.0, 1e-9)

    def forget_if_idle(self, st: TenantState) -> None:
        """Drop the state of an idle tenant that owes nothing (bounded memory under
        tenant churn). A tenant in debt is kept: its debt must survive."""
        if not st.queue and not st.active and not st.parked and st.credit >= 0:
            self.states.pop((st.tier, st.tenant), None)
