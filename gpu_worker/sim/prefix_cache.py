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

Why not an OrderedDict: eviction runs on most of a busy engine's allocations, and an
OrderedDict's oldest entry costs an iterator and a hash of the (salt, request id)
key on every call (and each step of an OrderedDict iterator hashes again). Here the
oldest entry is the head of a deque of mutable entries; the key is hashed once when
an entry is put and once when it leaves. An entry replaced or taken stays in the
deque, emptied, until it reaches the head or a compaction drops it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable


class _Entry:
    """One sequence's cached prefix: `num_blocks` > 0 while it is the key's live entry,
    0 once evicted, taken or replaced (then only the deque still holds it)."""

    __slots__ = ("key", "num_blocks")

    def __init__(self, key: Hashable, num_blocks: int) -> None:
        self.key = key
        self.num_blocks = num_blocks


class PrefixCache:
    """Cached-but-free KV blocks per sequence key, evicted least recently cached first."""

    def __init__(self) -> None:
        self._live: dict[Hashable, _Entry] = {}  # key -> its live entry
        self._order: deque[_Entry] = deque()  # oldest first; may hold emptied entries
        self.num_blocks = 0  # blocks held over all entries (all of them free)
        self.num_evicted_blocks = 0

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._live

    def blocks(self, key: Hashable) -> int:
        """How many blocks `key` has cached (0 if none); does not touch recency."""
        e = self._live.get(key)
        return e.num_blocks if e is not None else 0

    def put(self, key: Hashable, num_blocks: int) -> None:
        """Cache the first `num_blocks` blocks of a sequence that just freed them.

        Replaces an older entry of the same key (those blocks are simply free now).
        """
        self._drop(key)
        if num_blocks > 0:
            e = self._live[key] = _Entry(key, num_blocks)
            self._order.append(e)
            self.num_blocks += num_blocks
            # Emptied entries wait for the head; without evictions they would pile up.
            if len(self._order) > 2 * len(self._live) + 64:
                self._order = deque(x for x in self._order if x.num_blocks)

    def take(self, key: Hashable, max_blocks: int) -> int:
        """Remove `key`'s entry and return how many of its blocks (at most
        `max_blocks`) the caller reuses. Blocks beyond that are just free now: they
        hold tokens past the prefix being resumed, or a divergent continuation."""
        return min(self._drop(key), max(0, max_blocks))

    def _drop(self, key: Hashable) -> int:
        """Forget `key`'s live entry (its deque slot is emptied); its block count."""
        e = self._live.pop(key, None)
        if e is None:
            return 0
        cached = e.num_blocks
        e.num_blocks = 0
        self.num_blocks -= cached
        return cached

    def evict(self, num_blocks: int) -> int:
        """Drop up to `num_blocks` cached blocks so that an allocation can use them;
        returns how many were dropped."""
        evicted = 0
        order = self._order
        while evicted < num_blocks and order:
            e = order[0]
            held = e.num_blocks
            drop = min(held, num_blocks - evicted)
            if drop == held:  # the whole entry (or an emptied one) goes
                order.popleft()
                if held:
                    del self._live[e.key]
                    e.num_blocks = 0
            else:
                e.num_blocks = held - drop  # tail blocks go first; a prefix stays
            evicted += drop
        self.num_blocks -= evicted
        self.num_evicted_blocks += evicted
        return evicted
