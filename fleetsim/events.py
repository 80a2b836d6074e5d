"""The simulator's timer queue: a binary min-heap of events by (time, sequence number).

`heapq` over (time, sequence, fn, arg) tuples does the same; compiled, its cost was
the comparisons. A tuple comparison goes through Python's generic rich-compare twice
per element (equal? then less?), and a pop among ~1,000 workers' step ends makes
about a dozen. Compiled (`fleetsim.compiled`), `EventHeap` keeps small event objects
and compares them as two C doubles; its algorithm is heapq's (a pop moves the hole
down to a leaf, puts the last item there and sifts it up). No two events share a
sequence number, so any correct heap pops them in the same order.

Interpreted, the opposite holds (a Python `before` call is slower than a tuple
comparison in C, and a Python `__init__` than a tuple): `event_heap()` gives heapq
over tuples there.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any


class _Event:
    __slots__ = ("t_ms", "seq", "fn", "arg")

    def __init__(self, t_ms: float, seq: int, fn: Callable[[Any], None], arg: object) -> None:
        self.t_ms = t_ms
        self.seq = seq
        self.fn = fn
        self.arg = arg

    def before(self, other: _Event) -> bool:
        return self.t_ms < other.t_ms or (self.t_ms == other.t_ms and self.seq < other.seq)


class EventHeap:
    """`fn(arg)` calls due at `t_ms`, the earliest (then the lowest `seq`) first."""

    def __init__(self) -> None:
        self._items: list[_Event] = []

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return len(self._items) > 0

    def head_t_ms(self) -> float:
        return self._items[0].t_ms

    def head_seq(self) -> int:
        return self._items[0].seq

    def push(self, t_ms: float, seq: int, fn: Callable[[Any], None], arg: object) -> None:
        items = self._items
        items.append(_Event(t_ms, seq, fn, arg))
        self._sift_up(len(items) - 1)

    def pop_and_run(self) -> None:
        """Remove the head and call it (the heap must not be empty)."""
        items = self._items
        head = last = items.pop()
        if items:
            head = items[0]
            # heapq's pop: move the smaller child up until the hole is a leaf, put the
            # last item there, then sift it up (fewer comparisons than sifting down).
            n = len(items)
            pos = 0
            child = 1
            while child < n:
                right = child + 1
                if right < n and not items[child].before(items[right]):
                    child = right
                items[pos] = items[child]
                pos = child
                child = 2 * pos + 1
            items[pos] = last
            self._sift_up(pos)
        head.fn(head.arg)

    def _sift_up(self, pos: int) -> None:
        items = self._items
        e = items[pos]
        while pos > 0:
            parent = (pos - 1) >> 1
            p = items[parent]
            if not e.before(p):
                break
            items[pos] = p
            pos = parent
        items[pos] = e


class _TupleEventHeap(EventHeap):
    """The same queue as heapq over (t_ms, seq, fn, arg) tuples: for the interpreter."""

    def __init__(self) -> None:
        super().__init__()
        self._tuples: list[tuple[float, int, Callable[[Any], None], object]] = []

    def __len__(self) -> int:
        return len(self._tuples)

    def __bool__(self) -> bool:
        return len(self._tuples) > 0

    def head_t_ms(self) -> float:
        return self._tuples[0][0]

    def head_seq(self) -> int:
        return self._tuples[0][1]

    def push(self, t_ms: float, seq: int, fn: Callable[[Any], None], arg: object) -> None:
        heapq.heappush(self._tuples, (t_ms, seq, fn, arg))

    def pop_and_run(self) -> None:
        _, _, fn, arg = heapq.heappop(self._tuples)
        fn(arg)


def event_heap() -> EventHeap:
    """The faster of the two for how the simulator runs (compiled or interpreted)."""
    # Imported here: fleetsim.compiled's test imports fleetsim.fleet, which imports this.
    from fleetsim.compiled import is_compiled

    return EventHeap() if is_compiled() else _TupleEventHeap()
