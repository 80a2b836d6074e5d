"""`fairlane.gctune`: the collector's settings within, restored after; 0 leaves them alone."""

from __future__ import annotations

import gc

import pytest

from dispatcher.config import DispatcherSettings
from fairlane.gctune import DISPATCHER_YOUNG_OBJECTS, tuned_gc
from fairlane.settings import load_settings

pytestmark = pytest.mark.unit


def test_within_young_collections_wait_and_what_was_alive_is_frozen():
    before = gc.get_threshold(), gc.get_freeze_count()
    with tuned_gc(12_345):
        assert gc.get_threshold() == (12_345, 20, 20)
        assert gc.get_freeze_count() > before[1]  # the modules, this test's objects
    assert (gc.get_threshold(), gc.get_freeze_count()) == before


def test_restored_when_the_body_raises():
    before = gc.get_threshold(), gc.get_freeze_count()
    with pytest.raises(RuntimeError), tuned_gc(50_000):
        raise RuntimeError("boom")
    assert (gc.get_threshold(), gc.get_freeze_count()) == before


def test_zero_keeps_the_interpreters_settings():
    before = gc.get_threshold(), gc.get_freeze_count()
    with tuned_gc(0):
        assert (gc.get_threshold(), gc.get_freeze_count()) == before


def test_the_dispatcher_flag_and_its_default():
    assert load_settings(DispatcherSettings, []).gc_young_objects == DISPATCHER_YOUNG_OBJECTS
    assert load_settings(DispatcherSettings, ["--gc-young-objects", "0"]).gc_young_objects == 0
    with pytest.raises(SystemExit):
        load_settings(DispatcherSettings, ["--gc-young-objects", "-1"])
