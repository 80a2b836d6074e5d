"""Requests in flight per tier and tenant, for preemption. Pure, O(1) per change.

A preemption decision weighs how many requests each tenant runs in each tier, and
picks a victim among one tenant's requests. Counting them from the core's one dict of
in-flight requests cost O(requests in flight) per decision: at 1,000 workers x 32
slots, 32,000 entries walked in Python tens of times a second. The core keeps this
index beside that dict instead (`Scheduler._dispatch` adds, `_release` removes), so a
decision reads counts per tenant and walks only its victim tenant's requests.
"""

from __future__ import annotations

from collections.abc import ItemsView

from dispatcher.scheduler.types import InFlight


class RunningIndex:
    """tier index -> tenant -> request id -> its in-flight entry, in dispatch order;
    a tenant (and a tier) with nothing in flight has no entry."""

    __slots__ = ("_tiers",)

    def __init__(self) -> None:
        self._tiers: dict[int, dict[str, dict[str, InFlight]]] = {}

    def add(self, f: InFlight) -> None:
        by_tenant = self._tiers.get(f.tier_index)
        if by_tenant is None:
            by_tenant = self._tiers[f.tier_index] = {}
        req = f.request
        mine = by_tenant.get(req.tenant)
        if mine is None:
            by_tenant[req.tenant] = {req.request_id: f}
        else:
            mine[req.request_id] = f

    def remove(self, f: InFlight) -> None:
        by_tenant = self._tiers[f.tier_index]
        req = f.request
        mine = by_tenant[req.tenant]
        del mine[req.request_id]
        if not mine:
            del by_tenant[req.tenant]

    def tiers(self) -> ItemsView[int, dict[str, dict[str, InFlight]]]:
        """(tier index, its tenants with requests in flight), read-only; a tier with
        none left may still be listed, empty."""
        return self._tiers.items()

    def tier(self, tier_index: int) -> dict[str, dict[str, InFlight]]:
        """The tier's tenants with requests in flight (read-only)."""
        return self._tiers.get(tier_index) or {}
