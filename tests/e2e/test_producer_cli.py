"""The producer CLI (`python -m producer`) against a real fleet (nats-server, dispatcher
and a simulated worker as subprocesses)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.procs import Procs

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


@pytest.fixture
def fleet(nats_server, uid, tmp_path):
    procs = Procs(tmp_path)
    prefix = f"t{uid}"
    url = nats_server.url
    procs.spawn("dispatcher", "-m", "dispatcher", "--nats-url", url, "--prefix", prefix,
                "--pool", "p", "--housekeeping-ms", "50")
    procs.spawn("worker", "-m", "gpu_worker", "--nats-url", url, "--prefix", prefix,
                "--pool", "p", "--worker-id", "w1", "--time-scale", "0.05",
                "--max-num-seqs", "8", "--heartbeat-ms", "200")
    yield url, prefix, tmp_path
    procs.close()


def _producer(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "producer", *args],
                          capture_output=True, text=True, timeout=timeout)


def _until_served(url: str, prefix: str) -> subprocess.CompletedProcess:
    """The first request may race the fleet's start: retry a bounded number of times."""
    deadline = time.monotonic() + 40
    while True:
        res = _producer("--nats-url", url, "--prefix", prefix, "--pool", "p",
                        "--tenant", "acme", "--prompt", "hello", "--max-tokens", "5")
        if res.returncode == 0 or time.monotonic() > deadline:
            return res
        time.sleep(0.5)


def test_streamed_request_prints_tokens_and_exits_0(fleet):
    url, prefix, _ = fleet
    res = _until_served(url, prefix)
    assert res.returncode == 0, (res.stdout, res.stderr)
    assert res.stdout.strip(), res.stderr


def test_load_mode_prints_a_summary(fleet):
    url, prefix, _ = fleet
    assert _until_served(url, prefix).returncode == 0
    res = _producer("--nats-url", url, "--prefix", prefix, "--pool", "p", "--tenant", "acme",
                    "--prompt", "hello", "--max-tokens", "3", "--count", "6",
                    "--concurrency", "3", "--json-summary")
    assert res.returncode == 0, (res.stdout, res.stderr)
    line = [ln for ln in res.stdout.splitlines() if ln.strip().startswith("{")][-1]
    summary = json.loads(line)
    assert summary, res.stdout


@pytest.mark.parametrize("args", [
    ["--max-tokens", "abc"],
    ["--count", "-1"],
    ["--log-level", "loud"],
    ["--no-such-flag"],
])
def test_bad_args_exit_2_with_one_line(args):
    res = _producer(*args, timeout=30)
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    lines = [ln for ln in (res.stderr + res.stdout).splitlines() if ln.strip()]
    assert len(lines) == 1, lines
