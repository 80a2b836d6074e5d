"""The tier selector: which tier's backlog is served next.

Tiers are ordered, highest first (`config.tiers`). For each decision the selector
returns the backlogged tiers in the order to try them (the core tries the next when a
tier has nothing eligible, so a quota-blocked tier never idles a slot):

1. **Floors** — a backlogged tier whose share of recently dispatched cost is under its
   `floor_share` goes first (the most starved, relative to its floor, first). Floors
   are soft: a tier with no backlog is never tried, so its idle floor is borrowed by
   the others, and the share is measured over an exponentially decayed window
   (`share_window_ms`), so a tier cannot bank floor while idle.
2. **Rank with aging** — otherwise the highest tier wins, except that a backlogged
   tier rises one level for every `aging_ms` it has waited since it was last served
   (score = level − waited / aging_ms, lowest first). A waiting lower tier therefore
   overtakes busy higher tiers after (level gap × aging_ms) and never starves.
   `aging_ms = 0` turns aging off for that tier (then only its floor protects it).

O(number of tiers) per decision; tiers are few.
"""

from __future__ import annotations

import math

from fairlane.poolconfig import SchedulerConfig, TierConfig


class TierSelector:
    def __init__(self, config: SchedulerConfig) -> None:
        self.tiers: list[TierConfig] = list(config.tiers) or [TierConfig("standard")]
        self._index = {t.name: i for i, t in enumerate(self.tiers)}
        self._tau_ms = max(config.share_window_ms, 1.0)
        n = len(self.tiers)
        self.num_queued = [0] * n
        self.queued_cost = [0.0] * n
        self.dispatched_cost = [0.0] * n  # cumulative, for metrics
        self._recent = [0.0] * n  # decayed dispatched cost, for floors
        self._decayed_at_ms: float | None = None
        self._waiting_since: list[float | None] = [None] * n

    def index(self, tier: str) -> int:
        """Index of a tier; a tier not configured joins at the bottom, with defaults."""
        i = self._index.get(tier)
        if i is None:
            i = self._index[tier] = len(self.tiers)
            self.tiers.append(TierConfig(tier))
            self.num_queued.append(0)
            self.queued_cost.append(0.0)
            self.dispatched_cost.append(0.0)
            self._recent.append(0.0)
            self._waiting_since.append(None)
        return i

    def engine_priority(self, i: int) -> int:
        return self.tiers[i].engine_priority

    # --- events ------------------------------------------------------------------------

    def on_queued(self, i: int, cost: float, now_ms: float) -> None:
        if self.num_queued[i] == 0:
            self._waiting_since[i] = now_ms
        self.num_queued[i] += 1
        self.queued_cost[i] += cost

    def on_unqueued(self, i: int, cost: float) -> None:
        self.num_queued[i] -= 1
        if self.num_queued[i] <= 0:
            self.num_queued[i] = 0
            self.queued_cost[i] = 0.0  # no float drift survives an empty tier
            self._waiting_since[i] = None
        else:
            self.queued_cost[i] -= cost

    def _decay(self, now_ms: float) -> None:
        last = self._decayed_at_ms
        if last is not None and now_ms > last:
            f = math.exp(-(now_ms - last) / self._tau_ms)
            self._recent = [c * f for c in self._recent]
        if last is None or now_ms > last:
            self._decayed_at_ms = now_ms

    def add_cost(self, i: int, cost: float, now_ms: float) -> None:
        """Dispatched cost (negative for a refund; a true-up's difference)."""
        self._decay(now_ms)
        self._recent[i] = max(self._recent[i] + cost, 0.0)
        self.dispatched_cost[i] += cost

    def on_served(self, i: int, now_ms: float) -> None:
        if self.num_queued[i] > 0:
            self._waiting_since[i] = now_ms

    # --- selection ---------------------------------------------------------------------

    def order(self, now_ms: float) -> list[int]:
        """Backlogged tiers, in the order to try them for the next dispatch."""
        backlogged = [i for i, n in enumerate(self.num_queued) if n > 0]
        if len(backlogged) <= 1:
            return backlogged
        self._decay(now_ms)
        total = sum(self._recent)
        under: list[tuple[float, int]] = []
        rest: list[tuple[float, int]] = []
        for i in backlogged:
            tier = self.tiers[i]
            if tier.floor_share > 0:
                share = self._recent[i] / total if total > 0 else 0.0
                if share < tier.floor_share:
                    under.append((share / tier.floor_share, i))
                    continue
            score = float(i)
            since = self._waiting_since[i]
            if tier.aging_ms > 0 and since is not None:
                score -= (now_ms - since) / tier.aging_ms
            rest.append((score, i))
        under.sort()
        rest.sort()
        return [i for _, i in under] + [i for _, i in rest]

    def shares(self, now_ms: float) -> dict[str, float]:
        """Each tier's share of recently dispatched cost (the quantity floors bound)."""
        self._decay(now_ms)
        total = sum(self._recent)
        return {t.name: (self._recent[i] / total if total > 0 else 0.0)
                for i, t in enumerate(self.tiers)}
