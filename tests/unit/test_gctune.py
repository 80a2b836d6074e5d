"""`fairlane.gctune`: the collector's settings within, restored after; 0 leaves them alone."""

from __future__ import annotations

import gc

import pytest

import gpu_worker.__main__ as worker_main
import streamer.__main__ as streamer_main
from dispatcher.config import DispatcherSettings
from fairlane.gctune import YOUNG_OBJECTS, refreeze, tuned_gc
from fairlane.settings import load_settings
from gpu_worker.config import WorkerSettings
from streamer.config import StreamerSettings

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
    assert load_settings(DispatcherSettings, []).gc_young_objects == YOUNG_OBJECTS
    assert load_settings(DispatcherSettings, ["--gc-young-objects", "0"]).gc_young_objects == 0
    with pytest.raises(SystemExit):
        load_settings(DispatcherSettings, ["--gc-young-objects", "-1"])


@pytest.mark.parametrize("settings", [WorkerSettings, StreamerSettings])
def test_the_worker_and_streamer_flags_and_their_default(settings):
    assert load_settings(settings, []).gc_young_objects == YOUNG_OBJECTS
    assert load_settings(settings, ["--gc-young-objects", "0"]).gc_young_objects == 0
    with pytest.raises(SystemExit):
        load_settings(settings, ["--gc-young-objects", "-1"])


def test_refreeze_freezes_what_start_up_made_after_the_imports():
    before = gc.get_freeze_count()
    with tuned_gc(50_000):
        frozen = gc.get_freeze_count()
        made_at_start_up = [[i] for i in range(1_000)]  # containers: tracked
        refreeze()
        assert gc.get_freeze_count() >= frozen + len(made_at_start_up)
    assert gc.get_freeze_count() == before


def test_refreeze_outside_tuned_gc_freezes_nothing():
    before = gc.get_freeze_count()
    refreeze()
    assert gc.get_freeze_count() == before


@pytest.mark.parametrize(("argv", "expected"), [([], (YOUNG_OBJECTS, 20, 20)),
                                                (["--gc-young-objects", "0"], None)])
@pytest.mark.parametrize("module", [worker_main, streamer_main])
def test_the_worker_and_streamer_processes_run_under_their_setting(
        monkeypatch, module, argv, expected):
    """`python -m gpu_worker` and `python -m streamer` serve inside
    `tuned_gc(--gc-young-objects)`."""
    default = gc.get_threshold()
    seen = []

    def fake_run(main):  # the event loop itself is not under test here
        seen.append((gc.get_threshold(), gc.get_freeze_count()))
        return 0

    if module is worker_main:
        monkeypatch.setattr(worker_main.runtime, "run", fake_run)
    else:
        monkeypatch.setattr(streamer_main, "run", fake_run)
    # process-wide state a process's main() sets and a test must not
    monkeypatch.setattr(module, "configure_logging", lambda *_a, **_k: None)
    monkeypatch.setattr(module.otel, "setup", lambda *_a: None)
    monkeypatch.setattr(module.otel, "shutdown", lambda: None)
    assert module.main(argv) == 0
    threshold, frozen = seen[0]
    assert threshold == (expected or default)
    assert (frozen > 0) == (expected is not None)
    assert gc.get_threshold() == default
