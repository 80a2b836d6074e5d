"""One tenant's waiting line: a heap ordered by (priority desc, deadline asc, arrival asc).

A requeued request (dispatched, never started) goes to the *front of its priority
class*: ahead of every request of the same priority, behind higher priorities.
Removal is lazy (cancel/expire mark an entry dead; it is skipped when it surfaces), so
every operation is O(log n); the heap is compacted when dead entries dominate.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable
from heapq import heapify, heappop, heappush  # by name: compiled, heapq.x is a lookup per call

from dispatcher.scheduler.types import QueuedRequest

# (-priority, front_rank, deadline, seq, unique, request): `unique` makes every key
# distinct, so tuples never compare requests.
_Entry = tuple[int, int, float, int, int, QueuedRequest]

_unique = itertools.count()


class TenantQueue:
    __slots__ = ("_heap", "_live", "_num_front")

    def __init__(self) -> None:
        self._heap: list[_Entry] = []
        self._live: dict[str, _Entry] = {}
        self._num_front = 0

    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def _push(self, req: QueuedRequest, front_rank: int) -> None:
        deadline = math.inf if req.deadline_ms is None else req.deadline_ms
        entry = (-req.priority, front_rank, deadline, req.seq, next(_unique), req)
        self._live[req.request_id] = entry
        heappush(self._heap, entry)

    def push(self, req: QueuedRequest) -> None:
        self._push(req, 0)

    def push_front(self, req: QueuedRequest) -> None:
        """Back to the front of its priority class, if it was requeued (the most
        recently requeued first); otherwise — a pick the core did not take — back to its
        natural place, which was the head."""
        if not req.requeued:
            self._push(req, 0)
            return
        self._num_front += 1
        self._push(req, -self._num_front)

    def remove(self, req: QueuedRequest) -> bool:
        entry = self._live.get(req.request_id)
        if entry is None or entry[5] is not req:
            return False
        del self._live[req.request_id]
        if len(self._heap) > 64 and len(self._heap) > 2 * len(self._live):
            self._heap = list(self._live.values())
            heapify(self._heap)
        return True

    def peek(self) -> QueuedRequest | None:
        heap, live = self._heap, self._live
        while heap:
            entry = heap[0]
            # Live if its request's current entry is this one: told by `unique`, not by
            # tuple identity, which compiled code (mypyc) does not keep.
            current = live.get(entry[5].request_id)
            if current is not None and current[4] == entry[4]:
                return entry[5]
            heappop(heap)
        return None

    def pop(self) -> QueuedRequest | None:
        req = self.peek()
        if req is not None:
            heappop(self._heap)
            del self._live[req.request_id]
        return req

    def requests(self) -> list[QueuedRequest]:
        """Live requests, best first (O(n log n): for shedding and inspection only)."""
        return [e[5] for e in sorted(self._live.values())]


def shed_victims(queued: Iterable[QueuedRequest], tier_index: Callable[[str], int],
                 num_victims: int) -> list[QueuedRequest]:
    """Which `num_victims` queued requests overload shedding drops: the lowest tier
    first; within a tier, the longest tenant queues are cut first (water-filling, so a
    flood pays for itself), each losing its least urgent requests (the end of the
    queue's order). O(queued · log) per call: it runs on overload, not per decision."""
    by_tier: dict[int, dict[str, list[QueuedRequest]]] = {}
    for req in queued:
        by_tier.setdefault(tier_index(req.tier), {}).setdefault(req.tenant, []).append(req)
    victims: list[QueuedRequest] = []
    for i in sorted(by_tier, reverse=True):  # lowest tier first
        if num_victims <= 0:
            break
        tenants = by_tier[i]
        for reqs in tenants.values():  # least urgent last: (priority, deadline, arrival)
            reqs.sort(key=lambda r: (-r.priority, r.deadline_ms is None,
                                     r.deadline_ms or 0.0, r.seq))
        longest = [(-len(reqs), name) for name, reqs in tenants.items()]
        heapify(longest)
        while num_victims > 0 and longest:
            neg, name = heappop(longest)
            victims.append(tenants[name].pop())
            num_victims -= 1
            if neg + 1 < 0:
                heappush(longest, (neg + 1, name))
    return victims
