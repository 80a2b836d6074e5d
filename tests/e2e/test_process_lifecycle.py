"""Each process as a user starts it: prompt exit on SIGTERM/SIGINT (even while NATS is
unreachable), and start-up failures reported in one line, never a hang or a traceback."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fairlane.embedded import free_port
from tests.procs import Procs

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


@pytest.fixture
def procs(tmp_path):
    p = Procs(tmp_path)
    yield p
    p.close()


def _wait_for_line(log: Path, needle: str, proc: subprocess.Popen, timeout_s: float = 20) -> None:
    """Block until `needle` shows in the child's log (its own event, not a guess)."""
    deadline = time.monotonic() + timeout_s
    while needle not in log.read_text(errors="replace"):
        assert proc.poll() is None, f"exited early:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"no {needle!r} in:\n{log.read_text()}"
        time.sleep(0.05)


@pytest.mark.parametrize("module,sig", [
    ("dispatcher", signal.SIGTERM), ("gpu_worker", signal.SIGTERM),
    ("streamer", signal.SIGTERM), ("dispatcher", signal.SIGINT),
])
def test_stop_signal_while_nats_is_unreachable_exits_within_2s(procs, tmp_path, module, sig):
    url = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    extra = ["--port", str(free_port())] if module == "streamer" else []
    proc = procs.spawn(module, "-m", module, "--nats-url", url, *extra)
    # nats-py reports each refused attempt: the process is inside its connect loop.
    _wait_for_line(tmp_path / f"{module}.log", "Connection refused", proc)
    t0 = time.monotonic()
    proc.send_signal(sig)
    rc = proc.wait(timeout=10)
    assert time.monotonic() - t0 < 2.0
    assert rc == 0


def test_fairlane_up_with_its_nats_port_taken_fails_naming_the_port(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run(
            [sys.executable, "-m", "fairlane.cli", "up", "--data-dir", str(tmp_path / "fl"),
             "--nats-port", str(port), "--http-port", "0", "--no-redis"],
            capture_output=True, text=True, timeout=30)
    assert r.returncode != 0
    assert f"port {port} (--nats-port) is already in use" in r.stderr
    assert "fairlane is up" not in r.stdout


def test_fairlane_up_reports_a_child_dying_at_start_with_its_own_words(tmp_path):
    # --no-auth: with NATS auth on, `up` reads the tenants file itself (one NATS user
    # per tenant) and stops before any child starts (the next test).
    r = subprocess.run(
        [sys.executable, "-m", "fairlane.cli", "up", "--data-dir", str(tmp_path / "fl"),
         "--nats-port", "0", "--http-port", "0", "--no-redis", "--no-streamer", "--no-auth",
         "--tenants-file", str(tmp_path / "missing.yaml")],
        capture_output=True, text=True, timeout=50)
    assert r.returncode == 1
    assert "fairlane is up" not in r.stdout
    assert "dispatcher (exit 2): dispatcher: error:" in r.stderr
    assert "missing.yaml: cannot read" in r.stderr


def test_fairlane_up_with_auth_and_a_missing_tenants_file_says_so_in_one_line(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "fairlane.cli", "up", "--data-dir", str(tmp_path / "fl"),
         "--nats-port", "0", "--http-port", "0", "--no-redis", "--no-streamer",
         "--tenants-file", str(tmp_path / "missing.yaml")],
        capture_output=True, text=True, timeout=50)
    assert r.returncode == 1
    assert "fairlane is up" not in r.stdout
    assert r.stderr.splitlines()[0].startswith("fairlane up failed: ")
    assert "missing.yaml: cannot read" in r.stderr


def test_fairlane_up_stops_within_2s_of_sigterm_during_start(procs, tmp_path):
    proc = procs.spawn("up", "-m", "fairlane.cli", "up", "--data-dir", str(tmp_path / "fl"),
                       "--nats-port", "0", "--http-port", "0", "--no-redis")
    # nats-server's log appears as it starts: the fleet is mid-start-up from then on.
    deadline = time.monotonic() + 20
    while not (tmp_path / "fl" / "logs" / "nats-server.log").exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=15)
    assert time.monotonic() - t0 < 2.0
    assert "fairlane stopped" in (tmp_path / "up.log").read_text()


def test_producer_with_unreachable_nats_prints_one_line_and_fails():
    url = f"nats://127.0.0.1:{free_port()}"
    r = subprocess.run([sys.executable, "-m", "producer", "--nats-url", url],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert lines == [f"producer: error: cannot reach NATS at {url}: "
                     "[Errno 111] Connection refused"], r.stderr


def test_producer_sigint_while_connecting_exits_at_once(procs):
    # A server that accepts but never speaks NATS: the producer waits in its connect.
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        mute.settimeout(20)
        url = f"nats://127.0.0.1:{mute.getsockname()[1]}"
        proc = procs.spawn("producer", "-m", "producer", "--nats-url", url)
        conn, _ = mute.accept()
        with conn:
            t0 = time.monotonic()
            proc.send_signal(signal.SIGINT)
            rc = proc.wait(timeout=10)
    assert time.monotonic() - t0 < 2.0
    assert rc == 130
