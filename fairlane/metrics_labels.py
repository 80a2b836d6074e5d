"""Bounded ``tenant`` label values for Prometheus series (DESIGN.md section 7b).

Every process labels some series by tenant: the dispatcher (queue depth, queue wait,
TTFT, rejections, ...), each worker (requests and metered tokens) and the streamer
(requests by outcome, tokens relayed). Without a bound, a fleet that sees 100,000
tenants would carry 100,000 label sets per series for ever and make every scrape
megabytes long. `TenantLabels` is the one bound they all use:

- a tenant gets a label value of its own while fewer than `max_tenants` have one;
- beyond that, it is counted under ``tenant="_other"`` (one series whatever the
  number of tenants), unless the least recently seen tenant has been idle for
  `idle_s`: that one gives its place (and its series) up;
- `expire` (each process calls it on its own housekeeping: worker heartbeat,
  dispatcher pass, streamer scrape) drops every tenant idle for `idle_s` with its
  series; `forget` drops one now (the dispatcher: a tenant its scheduler forgot);
- `keep` (optional): a tenant it says yes to is never given up for idleness, its
  clock restarts instead; the dispatcher keeps the tenants its scheduler still holds
  (something queued or in flight, or idle for less than ``--tenant-idle-s``).

A tenant whose series went starts its counters from 0 when it comes back (Prometheus
reads that as a counter reset); what it was billed stays in ``FL_USAGE``. Series
labelled ``_other`` or ``_unknown`` (a request whose tenant could not be told: no
valid API key, an unparseable subject) are never removed: two series in all.

O(1) per lookup, O(expired) per `expire`: the LRU order is an `OrderedDict`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

OTHER_TENANT = "_other"
UNKNOWN_TENANT = "_unknown"
_SHARED = frozenset({OTHER_TENANT, UNKNOWN_TENANT})  # label values no tenant owns

# Children of label sets that are never removed (a tier, a reason), by (metric, *labels).
_fixed_children: dict[tuple[Any, ...], Any] = {}


def fixed_child(metric: Any, *labels: str) -> Any:
    """`metric.labels(*labels)` looked up once, for a label set whose series is never
    removed: prometheus_client checks the labels on every call (~2 µs), too much on a
    hot path. Tenant-labelled series, which do go, use `TenantLabels.child`."""
    key = (metric, *labels)
    found = _fixed_children.get(key)
    if found is None:
        found = _fixed_children[key] = metric.labels(*labels)
    return found


class TenantLabels:
    """The tenant label values one process exposes: at most `max_tenants` of them."""

    def __init__(self, max_tenants: int, idle_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 keep: Callable[[str], bool] | None = None) -> None:
        self.max_tenants = max_tenants
        self.idle_s = idle_s
        self.keep = keep
        self._clock = clock
        self._last_seen: OrderedDict[str, float] = OrderedDict()
        # The label sets each tenant has on each metric, for removing them.
        self._series: dict[str, set[tuple[Any, tuple[str, ...]]]] = {}
        # Each series' child by (metric, *label values): a hot path (every dispatch,
        # first token, finished request) skips prometheus_client's label checks, ~2 µs
        # a lookup. A tenant's entries go with its series (`forget`).
        self._children: dict[tuple[Any, ...], Any] = {}

    def __len__(self) -> int:
        return len(self._last_seen)

    def __contains__(self, tenant: object) -> bool:
        return tenant in self._last_seen

    def label(self, tenant: str) -> str:
        """The label value to count `tenant` under now: its own, or ``_other``."""
        if tenant in _SHARED:
            return tenant
        now = self._clock()
        if tenant in self._last_seen:
            self._last_seen[tenant] = now
            self._last_seen.move_to_end(tenant)
            return tenant
        if len(self._last_seen) >= self.max_tenants:
            if not self._last_seen:  # max_tenants 0: no tenant labels at all
                return OTHER_TENANT
            oldest, seen = next(iter(self._last_seen.items()))
            if now - seen < self.idle_s:
                return OTHER_TENANT
            if self.keep is not None and self.keep(oldest):
                self._refresh(oldest, now)
                return OTHER_TENANT
            self.forget(oldest)
        self._last_seen[tenant] = now
        return tenant

    def track(self, label: str, metric: Any, labels: tuple[str, ...]) -> None:
        """Remember a label set of `label` (what `label` returned) on `metric`."""
        if label not in _SHARED:
            self._series.setdefault(label, set()).add((metric, labels))

    def child(self, metric: Any, tenant: str, *rest: str) -> Any:
        """`metric`'s child for `tenant` (its first label) and the other label values
        `rest`, in the metric's label order; tracked, so that `forget` removes it."""
        label = self.label(tenant)
        key = (metric, label, *rest)
        found = self._children.get(key)
        if found is None:
            labels = (label, *rest)
            self.track(label, metric, labels)
            found = self._children[key] = metric.labels(*labels)
        return found

    def expire(self) -> int:
        """Drop every tenant idle for `idle_s` (unless kept) and its series; returns
        how many went."""
        now = self._clock()
        cutoff = now - self.idle_s
        n = 0
        for _ in range(len(self._last_seen)):  # each at most once, kept ones included
            tenant, seen = next(iter(self._last_seen.items()))
            if seen > cutoff:
                break
            if self.keep is not None and self.keep(tenant):
                self._refresh(tenant, now)  # to the end; the loop goes on with the next
                continue
            self.forget(tenant)
            n += 1
        return n

    def forget(self, tenant: str) -> None:
        """Drop `tenant`'s label value and remove its series now."""
        self._last_seen.pop(tenant, None)
        for metric, labels in self._series.pop(tenant, ()):
            self._children.pop((metric, *labels), None)
            try:
                metric.remove(*labels)
            except KeyError:  # already removed
                pass

    def _refresh(self, tenant: str, now: float) -> None:
        self._last_seen[tenant] = now
        self._last_seen.move_to_end(tenant)
