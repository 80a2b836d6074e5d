"""Starting and stopping the fleet's processes from tests (always cleaned up)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from fairlane.embedded import die_with_parent


class Procs:
    """Child processes of one test; `close()` kills whatever is still running."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []

    def spawn(self, name: str, *args: str, env: dict | None = None) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        proc = subprocess.Popen(
            [sys.executable, *args], stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})}, start_new_session=True,
            preexec_fn=die_with_parent,
        )
        log.close()
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def descendants(pid: int) -> set[int]:
    """All live descendants of `pid`, from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out: set[int] = set()
    todo = [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "?"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def kill9(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)


async def start_fairlane_up(data_dir: Path) -> tuple[subprocess.Popen, str]:
    """`fairlane up` (2 sim workers, free ports) as a user starts it; returns the
    process and its output once it says it is up (fails the test if it exits first)."""
    import asyncio
    import time

    import pytest

    proc = subprocess.Popen(  # noqa: ASYNC220 - Popen returns at once; output read in a thread
        [sys.executable, "-m", "fairlane.cli", "up", "--data-dir", str(data_dir),
         "--nats-port", "0", "--http-port", "0", "--workers", "2", "--time-scale", "0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    out = ""
    deadline = time.monotonic() + 90
    while "Ctrl-C stops everything" not in out:
        assert time.monotonic() < deadline, out
        line = await asyncio.to_thread(proc.stdout.readline)
        if not line:
            proc.kill()
            pytest.fail(f"fairlane up exited early:\n{out}")
        out += line
    return proc, out
