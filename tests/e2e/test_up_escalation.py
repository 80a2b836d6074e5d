"""`fairlane up`'s stop: SIGTERM, then SIGKILL after the grace period.

There is no setting that lets `fairlane up` start an arbitrary (stubborn) child: every
child is `python -m <fairlane module>`. So this drives the supervisor `fairlane up`
uses (`fairlane.cli.Fleet`) with a child that ignores SIGTERM, spawned through its own
`_spawn` by pointing the module at a test script (test-only, no product change)."""

from __future__ import annotations

import time

import pytest

from fairlane.cli import Fleet, UpSettings
from tests.procs import alive

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

STUBBORN = """
import signal, sys, time, pathlib
signal.signal(signal.SIGTERM, lambda *a: pathlib.Path(sys.argv[1]).write_text("got TERM"))
pathlib.Path(sys.argv[2]).write_text("ready")
while True:
    time.sleep(0.05)
"""


def test_child_ignoring_sigterm_is_sigkilled_after_grace(tmp_path, monkeypatch):
    (tmp_path / "stubborn_child.py").write_text(STUBBORN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    fleet = Fleet(UpSettings(data_dir=str(tmp_path / "fl")))
    term, ready = tmp_path / "term", tmp_path / "ready"
    fleet._spawn("stubborn", "stubborn_child", [str(term), str(ready)])
    (_, proc), = fleet.procs
    try:
        for _ in range(200):  # bounded wait for the handler to be installed
            if ready.exists():
                break
            time.sleep(0.05)
        assert ready.exists()
        t0 = time.monotonic()
        fleet.stop(grace_s=1.0)
        took = time.monotonic() - t0
        assert term.read_text() == "got TERM"  # SIGTERM first...
        assert proc.returncode == -9  # ...then SIGKILL
        assert 0.9 <= took < 10, took
        assert not alive(proc.pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
