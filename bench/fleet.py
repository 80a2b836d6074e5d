"""A real fairlane fleet on loopback, for benchmarks: nats-server + dispatcher + sim workers.

    with NatsServer() as nats:
        fleet = Fleet(nats.url, prefix="nb1", tenants_yaml=..., policy="drr", num_workers=2)
        await fleet.start()
        ...
        await fleet.stop()

Every process is a child in its own session; `stop()` sends SIGTERM, then SIGKILL after a
grace period, so nothing outlives the benchmark. Logs go to files under `log_dir`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import nats

from fairlane.protocol import Heartbeat, ProtocolError, decode_event
from fairlane.subjects import Subjects

REPO = Path(__file__).resolve().parents[1]
_PROBLEM_RE = re.compile(r'"level":\s*"(warning|error|critical)"|Traceback')


@dataclass
class WorkerSpec:
    max_num_seqs: int = 8
    prefetch_seqs: int = 4
    time_scale: float = 0.5
    step_model: str = "default"
    coalesce_ms: int = 5
    heartbeat_ms: int = 500
    # The workers' --gc-young-objects (0: Python's own collector settings); None: the
    # worker's default (fairlane/gctune.py).
    gc_young_objects: int | None = None
    # The source tree the workers run from (cwd and first on PYTHONPATH): another
    # commit's checkout, to compare workers across commits (bench/bench_worker_tokens.py).
    source: Path | None = None


def source_env(source: Path | None) -> dict[str, str]:
    """The environment of a process that runs from `source` (None: this checkout):
    that tree first on PYTHONPATH, ahead of the installed checkout."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if source is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(source), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def base_tree(rev: str, into: Path, paths: tuple[str, ...] = (),
              module: str = "gpu_worker") -> Path:
    """The repository at `rev` (only `paths`, if given), unpacked with `git archive`
    into `into`: a benchmark's `base` variant runs from it. Checks that a process run
    with `source_env(into)` imports `module` from that tree, not the installed checkout
    (an editable install's finder comes after PYTHONPATH; check rather than assume)."""
    root = Path(__file__).resolve().parents[1]
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(root), "archive", rev, "--", *paths],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    where = subprocess.run([sys.executable, "-c", f"import {module}; print({module}.__file__)"],
                           cwd=into, env=source_env(into), check=True, capture_output=True,
                           text=True).stdout.strip()
    if not Path(where).resolve().is_relative_to(into.resolve()):
        raise SystemExit(f"the base variant would import {where}, not the tree at {into}")
    return into


@dataclass
class Fleet:
    nats_url: str
    prefix: str
    tenants_yaml: str
    policy: str
    log_dir: Path
    num_workers: int = 2
    worker: WorkerSpec = field(default_factory=WorkerSpec)
    pool: str = "default"
    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    # Latest heartbeat per worker id (load, in-flight ids), from fl.evt.<pool>.
    heartbeats: dict[str, Heartbeat] = field(default_factory=dict)
    _nc: nats.NATS | None = None

    def _spawn(self, name: str, args: list[str], source: Path | None = None) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - closed with the proc
        proc = subprocess.Popen([sys.executable, "-m", *args], cwd=source or REPO, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env=source_env(source))
        log.close()
        self.procs.append((name, proc))
        return proc

    async def start(self, timeout_s: float = 30.0) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        tfile = self.log_dir / "tenants.yaml"
        tfile.write_text(self.tenants_yaml)
        self._nc = await nats.connect(self.nats_url, name="bench-fleet-watch")
        subjects = Subjects(self.prefix)
        await self._nc.subscribe(subjects.events(self.pool), cb=self._on_event)
        common = ["--nats-url", self.nats_url, "--prefix", self.prefix, "--pool", self.pool]
        self._spawn("dispatcher", ["dispatcher", *common, "--tenants-file", str(tfile),
                                   "--policy", self.policy, "--log-level", "info"])
        w = self.worker
        for i in range(self.num_workers):
            self._spawn(f"worker{i}", [
                "gpu_worker", *common, "--worker-id", f"{self.prefix}-w{i}", "--engine", "sim",
                "--max-num-seqs", str(w.max_num_seqs), "--prefetch-seqs", str(w.prefetch_seqs),
                "--time-scale", str(w.time_scale), "--step-model", w.step_model,
                "--coalesce-ms", str(w.coalesce_ms), "--heartbeat-ms", str(w.heartbeat_ms),
                *(() if w.gc_young_objects is None
                  else ("--gc-young-objects", str(w.gc_young_objects))),
                "--log-level", "warning"], w.source)
        deadline = time.monotonic() + timeout_s
        disp_log = self.log_dir / "dispatcher.log"
        while time.monotonic() < deadline:
            self.check_alive()
            ready = disp_log.exists() and b"dispatcher_started" in disp_log.read_bytes()
            if ready and len(self.heartbeats) >= self.num_workers:
                return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"fleet {self.prefix} not ready in {timeout_s}s "
                           f"(workers seen: {sorted(self.heartbeats)})")

    async def _on_event(self, msg) -> None:
        try:
            ev = decode_event(msg.data)
        except ProtocolError:
            return
        if isinstance(ev, Heartbeat):
            self.heartbeats[ev.worker_id] = ev

    def check_alive(self) -> None:
        for name, p in self.procs:
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with code {p.returncode} "
                                   f"(see {self.log_dir / (name + '.log')})")

    def num_in_flight(self) -> int:
        return sum(len(hb.in_flight_ids) for hb in self.heartbeats.values())

    async def wait_idle(self, timeout_s: float = 30.0) -> bool:
        """True once two consecutive heartbeat rounds show no work on any worker."""
        deadline = time.monotonic() + timeout_s
        quiet = 0
        while time.monotonic() < deadline:
            self.check_alive()
            busy = any(hb.in_flight_ids or hb.load.num_running or hb.load.num_waiting
                       for hb in self.heartbeats.values())
            quiet = 0 if busy else quiet + 1
            if quiet >= 2 * max(2, int(self.worker.heartbeat_ms / 250)):
                return True
            await asyncio.sleep(0.25)
        return False

    async def stop(self, grace_s: float = 10.0) -> dict[str, int | None]:
        """SIGTERM everyone (workers first, then the dispatcher); SIGKILL stragglers."""
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.close()
            self._nc = None
        order = [p for p in self.procs if p[0] != "dispatcher"] + \
                [p for p in self.procs if p[0] == "dispatcher"]
        for _, p in order:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        codes: dict[str, int | None] = {}
        for name, p in order:
            while p.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=5)
                codes[name] = None  # killed
            else:
                codes[name] = p.returncode
        self.procs.clear()
        return codes

    def kill_now(self) -> None:
        """Last resort (atexit / KeyboardInterrupt): SIGKILL every child group."""
        for _, p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
        self.procs.clear()

    def log_problems(self, max_lines: int = 8) -> list[str]:
        """Warning/error log lines (JSON level field) from every process of this fleet."""
        out: list[str] = []
        for f in sorted(self.log_dir.glob("*.log")):
            for line in f.read_text(errors="replace").splitlines():
                if _PROBLEM_RE.search(line):
                    out.append(f"{f.stem}: {line[:300]}")
        return out[:max_lines] if max_lines else out
