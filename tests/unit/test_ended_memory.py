"""The pool's memory of ended requests (dispatcher.scheduler.ended)."""

from __future__ import annotations

import pytest

from dispatcher.scheduler.ended import EndedMemory

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


def test_an_end_is_remembered_for_the_window_then_forgotten():
    m = EndedMemory(ttl_ms=100.0, max_entries=10)
    m.add("a", 1, None, 0.0)
    m.add("b", 2, None, 50.0)
    assert m.get("a", 100.0).attempt == 1
    assert m.get("a", 101.0) is None  # past its window, even before a trim
    m.trim(120.0)
    assert len(m) == 1 and m.get("b", 120.0).attempt == 2
    m.trim(151.0)
    assert len(m) == 0


def test_the_oldest_ends_go_first_beyond_the_bound():
    m = EndedMemory(ttl_ms=1e9, max_entries=3)
    for i in range(5):
        m.add(f"r{i}", 1, None, float(i))
        m.trim(float(i))
    assert len(m) == 3
    assert [m.get(f"r{i}", 5.0) is not None for i in range(5)] == [False, False, True, True, True]


def test_a_request_ended_again_keeps_its_latest_end():
    """The replaced entry stays in the order queue; reaching it forgets nothing."""
    m = EndedMemory(ttl_ms=100.0, max_entries=10)
    m.add("a", 1, None, 0.0)
    m.add("b", 1, None, 10.0)
    m.add("a", 2, None, 60.0)  # a new attempt of "a" ended
    m.trim(105.0)  # "a"'s first end is past the window, its second is not
    assert m.get("a", 105.0).attempt == 2 and m.get("b", 105.0).attempt == 1
    m.trim(115.0)
    assert m.get("b", 115.0) is None and m.get("a", 115.0).attempt == 2 and len(m) == 1
    m.trim(161.0)
    assert len(m) == 0 and len(m._order) == 0
