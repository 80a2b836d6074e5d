"""The simulator's prefix cache: KV blocks that outlive the sequence that wrote them.

A SIMULATOR model of vLLM's automatic prefix caching, narrowed to what the fleet's
resumable generation needs (DESIGN.md section 5b). When a sequence leaves the
engine's batch (it finished, was aborted, its consumer went away, or the engine
preempted it for KV), its full KV blocks stay in the cache under its key
``(cache_salt, request_id)``. They count as FREE: any allocation may evict them, the
least recently cached entry first and, within an entry, its tail blocks first (as
vLLM frees a request's blocks in reverse order), so what survives is always a
prefix. A later run of the same request under the same salt takes whatever is left
and re-prefills only the rest.

Only whole sequences are keyed, never prompt contents: two different requests with
the same prompt do not share blocks here (vLLM would share them; the fleet's
fairness experiments do not depend on it).

Every operation is O(1), eviction amortised O(1) per entry; the cache holds at most
as many blocks (and entries) as the engine has KV blocks, because the engine only
puts blocks it just freed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class PrefixCache:
    """Cached-but-free KV blocks per sequence key, evicted least recently cached first."""

    def __init__(self) -> None:
        # key -> number of cached blocks (a prefix of that sequence); oldest first.
        self._entries: OrderedDict[Hashable, int] = OrderedDict()
        self.num_blocks = 0  # blocks held over all entries (all of them free)
        self.num_evicted_blocks = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def blocks(self, key: Hashable) -> int:
        """How many blocks `key` has cached (0 if none); does not touch recency."""
        return self._entries.get(key, 0)

    def put(self, key: Hashable, num_blocks: int) -> None:
        """Cache the first `num_blocks` blocks of a sequence that just freed them.

        Replaces an older entry of the same key (those blocks are simply free now).
        """
        self.num_blocks -= self._entries.pop(key, 0)
        if num_blocks > 0:
            self._entries[key] = num_blocks
            self.num_blocks += num_blocks

    def take(self, key: Hashable, max_blocks: int) -> int:
        """Remove `key`'s entry and return how many of its blocks (at most
        `max_blocks`) the caller reuses. Blocks beyond that are just free now: they
        hold tokens past the prefix being resumed, or a divergent continuation."""
        cached = self._entries.pop(key, 0)
        self.num_blocks -= cached
        return min(cached, max(0, max_blocks))

    def evict(self, num_blocks: int) -> int:
        """Drop up to `num_blocks` cached blocks so that an allocation can use them;
        returns how many were dropped."""
        evicted = 0
        while evicted < num_blocks and self._entries:
            key, held = next(iter(self._entries.items()))
            drop = min(held, num_blocks - evicted)
            if drop == held:
                del self._entries[key]
            else:
                self._entries[key] = held - drop  # tail blocks go first; a prefix stays
            evicted += drop
        self.num_blocks -= evicted
        self.num_evicted_blocks += evicted
        return evicted
