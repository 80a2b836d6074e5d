"""Which waiting pull gets how much of the queued work: spread evenly, in order. Pure.

When several requests are queued at once (a fetch brought in a few, or work piled up
while every slot was busy) and several workers' pulls wait, the work is handed out as
evenly as the pulls' room allows, first over the free slots (work that starts at
once), then over the prefetch room (work that waits in an engine's queue).

Handing the first pull all it can take instead puts two or three admissions on one
engine while another's slots stay free: their prefills run in the same step, each
waiting for the others', and the engine's running sequences stall for that longer
step. In `bench/fidelity.py`'s steady scenario (4 workers, ~25 requests/s), requests
that reached the dispatcher within ~1.5 ms of each other went to the same worker 40
times in a minute, and those pairs were nearly all of the TTFT tail: the `batch`
class's p99 was 57 ms, 41 ms without them.

The policy's order of picks is untouched: only which pull each pick goes to. The
shells (`dispatcher.matching`, `fleetsim.fleet`) keep each waiting pull as a
`PullShare` (their own pull records extend it) and call `spread` once per stage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from dispatcher.scheduler.pool import PoolCore
    from dispatcher.scheduler.types import Dispatch

P = TypeVar("P")

# take(pull, n) -> how many it got (<= n), or NOTHING_ELIGIBLE: a pull with no work yet
# got none, so no pull will (what is queued cannot go now: quota-blocked tenants).
NOTHING_ELIGIBLE = -1


@dataclass(eq=False, slots=True, init=False)
class PullShare:
    """A waiting pull's room (`fairlane.protocol.PullRequest`) and what the serving
    pass has given it so far. (`__init__` written out: compiled by mypyc for the fleet
    simulator, which makes one per pull.)"""

    max_items: int
    free_slots: int  # of max_items, how many would start at once
    free_kv_tokens: int  # 0: the worker gave no KV figure (unbounded)
    given: list[Dispatch]
    kv_given: int

    def __init__(self, max_items: int, free_slots: int, free_kv_tokens: int) -> None:
        self.max_items, self.free_slots, self.free_kv_tokens = max_items, free_slots, free_kv_tokens
        self.given, self.kv_given = [], 0

    def room_now(self) -> int:  # free slots not yet given work in this pass
        return min(self.free_slots, self.max_items) - len(self.given)

    def room(self) -> int:
        return self.max_items - len(self.given)

    def take(self, core: PoolCore, worker_id: str, n: int, now_ms: float,
             incarnation: str = "") -> int:
        """Up to `n` more picks for this pull (`spread`'s take): within what is left of
        its KV budget, even the first if it already has some (`must_fit`)."""
        kv = self.free_kv_tokens - self.kv_given if self.free_kv_tokens > 0 else None
        got = core.select(worker_id, n, now_ms, kv, incarnation, must_fit=bool(self.given))
        if not got:
            return NOTHING_ELIGIBLE if not self.given and core.is_alive(
                worker_id, incarnation) else 0
        self.given += got
        for d in got:
            self.kv_given += d.request.kv_tokens
        return len(got)


def water_fill(num_items: int, rooms: list[int]) -> list[int]:
    """`num_items` shared over `rooms` as evenly as they allow: every share is
    min(room, level) or one less, the one-more shares going to the first in order;
    the shares add up to min(num_items, sum(rooms))."""
    n = min(num_items, sum(rooms))
    if n <= 0:
        return [0] * len(rooms)
    # The lowest level L with sum(min(room, L)) >= n, by bisection (rooms are small).
    lo, hi = 0, max(rooms)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if sum(min(r, mid) for r in rooms) >= n:
            hi = mid
        else:
            lo = mid
    shares = [min(r, hi - 1) for r in rooms]  # below the level: everyone's share
    extra = n - sum(shares)
    for i, r in enumerate(rooms):  # one more each, in order, where room allows
        if extra <= 0:
            break
        if r >= hi:
            shares[i] += 1
            extra -= 1
    return shares


def spread(pulls: Iterable[P], num_queued: Callable[[], int], take: Callable[[P, int], int],
           room: Callable[[P], int]) -> bool:
    """Hand queued work to `pulls` (in their order) as evenly as `room(pull)` allows.

    First one each, in order: the common case (less work queued than pulls waiting)
    costs one `take` per item and looks no further than the pulls it serves. Work left
    after that is water-filled over the pulls that took their one and have room left,
    again until nothing is queued or no pull can take more (a pull that got less than
    its share is full: its KV budget, or nothing it may take). Returns False when
    `take` said nothing queued is eligible (the caller's other stages need not try)."""
    open_: list[P] = []
    for p in pulls:
        if not num_queued():
            return True
        if room(p) <= 0:
            continue
        got = take(p, 1)
        if got == NOTHING_ELIGIBLE:
            return False
        if got == 1 and room(p) > 0:
            open_.append(p)
    while open_ and num_queued():
        shares = water_fill(num_queued(), [room(p) for p in open_])
        still_open, progressed = [], False
        for p, share in zip(open_, shares, strict=True):
            if share <= 0:
                still_open.append(p)
                continue
            got = take(p, share)
            progressed = progressed or got > 0
            if got == share and room(p) > 0:
                still_open.append(p)
            if not num_queued():
                return True
        if not progressed:
            break
        open_ = still_open
    return True
