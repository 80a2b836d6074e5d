"""Per-tenant loads, kept while a tenant is active and for an idle period after. Pure.

The scheduler keeps a `TenantLoad` (queued, in flight, KV in flight, dispatched cost)
per tenant for its quotas and for metrics. A pool that sees 100,000 tenants must not
keep 100,000 of them for ever, nor have each housekeeping pass (and each metrics
refresh) walk them all. So:

- every change goes through `touch`, which marks the tenant *changed* (a set: O(1));
- `sweep` (one per housekeeping pass) looks at the changed tenants only: a tenant with
  nothing queued or in flight joins the *idle index* (an `OrderedDict` in order of
  becoming idle, so oldest first), a busy one leaves it; then it forgets the tenants
  idle for `idle_ms`, oldest first, stopping at the first that is not. A pass costs
  O(tenants changed + tenants forgotten), never O(tenants known);
- what it returns (`TenantChanges`) is what the dispatcher's metrics follow: gauges
  set for the changed tenants, label sets removed for the forgotten ones.

A forgotten tenant that comes back starts from a fresh load (its cumulative
`dispatched_cost` restarts at 0: a metrics counter, not an account; fairness accounts
live in the policy, which keeps a tenant's debt, see `Policy.forget_idle`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from dispatcher.scheduler.types import TenantLoad


@dataclass(slots=True)
class TenantChanges:
    """What one sweep found: tenants whose load changed since the previous sweep (with
    their load now), and tenants forgotten (idle for the idle period)."""

    changed: dict[str, TenantLoad] = field(default_factory=dict)
    forgotten: list[str] = field(default_factory=list)


class TenantLoads:
    """`TenantLoad` per tenant, with the changed set and the idle index (see module)."""

    __slots__ = ("loads", "_changed", "_idle")

    def __init__(self) -> None:
        self.loads: dict[str, TenantLoad] = {}
        self._changed: set[str] = set()  # always a subset of `loads`
        self._idle: OrderedDict[str, float] = OrderedDict()  # tenant -> idle since (ms)

    def __len__(self) -> int:
        return len(self.loads)

    def get(self, tenant: str) -> TenantLoad | None:
        """Its load, to read (not marked changed)."""
        return self.loads.get(tenant)

    def touch(self, tenant: str) -> TenantLoad:
        """Its load, created if need be, to change: marked changed for the next sweep."""
        load = self.loads.get(tenant)
        if load is None:
            load = self.loads[tenant] = TenantLoad()
        self._changed.add(tenant)
        return load

    def num_idle(self) -> int:
        return len(self._idle)

    def sweep(self, now_ms: float, idle_ms: float) -> TenantChanges:
        """Index the changed tenants by idleness, forget those idle for `idle_ms`."""
        out = TenantChanges()
        idle, loads = self._idle, self.loads
        for tenant in self._changed:
            load = out.changed[tenant] = loads[tenant]
            idle.pop(tenant, None)
            if not (load.num_queued or load.num_in_flight):
                idle[tenant] = now_ms  # idle from now on: to the end (the newest)
        self._changed = set()
        cutoff = now_ms - idle_ms
        while idle:
            tenant = next(iter(idle))
            if idle[tenant] > cutoff:
                break  # the rest became idle later
            del idle[tenant]
            del loads[tenant]
            out.forgotten.append(tenant)
        return out
