"""The simulator's timer queue (fleetsim.events) runs events in (time, sequence) order,
both kinds: the heap the compiled simulator uses and the tuple heap the interpreter does."""

from __future__ import annotations

import heapq
import random

import pytest

from fleetsim.events import EventHeap, _TupleEventHeap, event_heap

pytestmark = [pytest.mark.unit, pytest.mark.timeout(20)]


@pytest.mark.parametrize("make", [EventHeap, _TupleEventHeap])
def test_runs_in_time_then_sequence_order_as_heapq_pops(make):
    rng = random.Random(3)
    heap, ref = make(), []
    ran: list[tuple[float, int]] = []
    expected: list[tuple[float, int]] = []
    seq = 0
    for _ in range(30_000):
        if ref and rng.random() < 0.45:
            heap.pop_and_run()
            expected.append(heapq.heappop(ref))
        else:
            seq += 1
            t = float(rng.randint(0, 200))  # many ties in time: the sequence decides
            heap.push(t, seq, ran.append, (t, seq))
            heapq.heappush(ref, (t, seq))
        assert len(heap) == len(ref) and bool(heap) == bool(ref)
        if ref:
            assert (heap.head_t_ms(), heap.head_seq()) == ref[0]
    while ref:
        heap.pop_and_run()
        expected.append(heapq.heappop(ref))
    assert ran == expected and not heap


def test_the_interpreter_gets_the_tuple_heap():
    # The test suite imports the source, never the compiled copy.
    assert type(event_heap()) is _TupleEventHeap
