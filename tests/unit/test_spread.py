"""`dispatcher.scheduler.spread`: queued work over waiting pulls, evenly, in order."""

from __future__ import annotations

import random

import pytest

from dispatcher.scheduler.spread import NOTHING_ELIGIBLE, spread, water_fill

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("n", "rooms", "want"), [
    (3, [4, 4], [2, 1]),  # the one-more share goes first in order
    (6, [3, 5], [3, 3]),
    (6, [1, 36], [1, 5]),  # a small room caps its share, the rest goes on
    (2, [5, 5, 5], [1, 1, 0]),
    (10, [2, 3], [2, 3]),  # more work than room: every room filled
    (0, [3, 3], [0, 0]),
    (4, [0, 4, 0], [0, 4, 0]),
    (7, [], []),
])
def test_water_fill(n, rooms, want):
    assert water_fill(n, rooms) == want


def test_water_fill_is_as_even_as_rooms_allow():
    rng = random.Random(3)
    for _ in range(2_000):
        rooms = [rng.randint(0, 9) for _ in range(rng.randint(1, 6))]
        n = rng.randint(0, 50)
        shares = water_fill(n, rooms)
        assert sum(shares) == min(n, sum(rooms))
        assert all(0 <= s <= r for s, r in zip(shares, rooms, strict=True))
        # No share could move to a lower one: whoever got less has no room left.
        for s, r in zip(shares, rooms, strict=True):
            assert s == r or all(s >= t - 1 for t in shares)


class Pulls:
    """Pulls with room and a KV budget over a queue of requests' KV needs, the way the
    shells' `take` calls `PoolCore.select` (first pick always fits, unless `must_fit`)."""

    def __init__(self, queue: list[int], rooms: list[int], kv: list[int | None],
                 eligible: bool = True) -> None:
        self.queue, self.eligible = list(queue), eligible
        self.rooms, self.kv = rooms, kv
        self.got: list[list[int]] = [[] for _ in rooms]
        self.takes = 0

    def num_queued(self) -> int:
        return len(self.queue)

    def room(self, i: int) -> int:
        return self.rooms[i] - len(self.got[i])

    def take(self, i: int, n: int) -> int:
        self.takes += 1
        if not self.eligible:
            return NOTHING_ELIGIBLE if not self.got[i] else 0
        budget = self.kv[i]
        taken = 0
        while taken < n and self.queue:
            need = self.queue[0]
            if budget is not None and (self.got[i] or taken) and need > budget:
                break
            self.got[i].append(self.queue.pop(0))
            taken += 1
            if budget is not None:
                budget -= need
                self.kv[i] = budget
        return taken


def test_one_each_in_order_when_work_is_short():
    p = Pulls([1, 1], rooms=[4, 4, 4], kv=[None] * 3)
    assert spread(range(3), p.num_queued, p.take, p.room)
    assert [len(g) for g in p.got] == [1, 1, 0]
    assert p.takes == 2  # looked no further than the pulls it served


def test_backlog_is_spread_then_fills_every_room():
    p = Pulls([1] * 9, rooms=[4, 2, 4], kv=[None] * 3)
    spread(range(3), p.num_queued, p.take, p.room)
    assert [len(g) for g in p.got] == [4, 2, 3]
    p = Pulls([1] * 20, rooms=[4, 2, 4], kv=[None] * 3)
    spread(range(3), p.num_queued, p.take, p.room)
    assert [len(g) for g in p.got] == [4, 2, 4] and p.num_queued() == 10


def test_a_pull_out_of_kv_leaves_the_rest_to_the_others():
    # Pull 0 can hold 2 of these after its first; its share was more: pull 1 takes it.
    p = Pulls([10] * 8, rooms=[8, 8], kv=[30, None])
    spread(range(2), p.num_queued, p.take, p.room)
    assert [len(g) for g in p.got] == [3, 5] and p.num_queued() == 0


def test_nothing_eligible_stops_at_the_first_pull():
    p = Pulls([1, 1, 1], rooms=[4, 4, 4], kv=[None] * 3, eligible=False)
    assert not spread(range(3), p.num_queued, p.take, p.room)
    assert p.takes == 1
