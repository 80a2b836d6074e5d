"""Dispatcher memory per queued request, measured on the real shell.

    PYTHONPATH=. python bench/bench_dispatcher_memory.py [--reps 5] [--output PATH.md]

Workload (say it with the figure): `--num-requests` (20,000) valid requests spread round
robin over `--num-tenants` (100) tenants of one tier (`standard`, policy drr), each with
a `--prompt-chars` (240) ASCII prompt and max_tokens 128, published to a real
nats-server. There are no workers, so every request stays queued in the dispatcher and
its JetStream message is held un-acked, as a backlog waits in production.

Two figures, each from runs of its own, never mixed:

- **RSS per queued request** (the headline), tracemalloc OFF: tracing costs memory of
  its own (an audit found it inflated this figure from about 2.3 to 4.3 KB). VmRSS
  from /proc/self/status.
- **Python heap per queued request**, tracemalloc ON: what the dispatcher's Python
  objects take (its held message, decoded request, scheduler entry, bookkeeping). RSS
  is not read in these runs.

Every run is a child process of its own (`bench.harness.run_children`): RSS is only
comparable from a fresh interpreter, not across runs in one process. The child starts
its own nats-server (stopped when the run ends) and an in-process Dispatcher on an
empty stream, lets it settle, takes the *idle* reading, then has a separate publisher
process publish the requests (so the publishing client's buffers are not counted, as
in production, where producers run elsewhere), waits until all are queued and takes
the *full* reading. Per queued request = (full - idle) / requests, both after
`gc.collect()`: the marginal cost of the backlog, without the dispatcher's fixed
start-up memory (reported on its own). The two kinds of run alternate
(`bench.harness.interleaved_order`) so a drift of the machine does not land on one.
Results: median (min-max) over `--reps` runs of each kind, written as markdown and JSON
(every run's raw readings) by `bench.harness.write_results`; BENCHMARKS.md's table is
rendered from that JSON by bench/render_memory.py.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import signal
import subprocess
import sys
import time
import tracemalloc
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.harness import (  # noqa: E402
    RunMeta,
    interleaved_order,
    run_children,
    write_results,
)
from bench.render_memory import HEAP, MODES, RSS, report  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "dispatcher_memory.md"
TITLE = "Dispatcher memory per queued request"
PREFIX, POOL, TIER, MAX_TOKENS = "mem", "p", "standard", 128
SETTLE_S = 1.0  # after start: the first housekeeping, stats and janitor passes have run
POLL_S = 0.01

HOW_TO_READ = """\
*RSS per queued request* (tracemalloc off) is what a backlog costs the dispatcher
process in memory the OS sees: (RSS with every request queued - RSS of the started,
idle dispatcher) / requests. *Python heap per queued request* (tracemalloc on, separate
runs) is what the dispatcher's live Python objects take, the same difference of traced
memory; RSS adds allocator slack and arenas on top. The two come from different runs and are
never combined: tracing inflates RSS, so no RSS figure is read with tracemalloc on.
Each run is a fresh process with its own nats-server; the requests come from a separate
publisher process. Figures are median (min-max) over the runs; every run's readings
are in the JSON."""


# --- the publisher (a process of its own) ---------------------------------------------------


def request_body(i: int, num_tenants: int, prompt_chars: int) -> tuple[str, str, bytes, str]:
    """(request id, tenant, encoded request, reply subject) of request `i`: tenants
    round robin, an ASCII prompt of exactly `prompt_chars` characters."""
    from fairlane.protocol import InferenceRequest, SamplingParams, encode

    rid = uuid.uuid4().hex
    tenant = f"tenant{i % num_tenants}"
    prompt = ("hello " * (prompt_chars // 6 + 1))[:prompt_chars]
    req = InferenceRequest(request_id=rid, tenant=tenant, pool=POOL, tier=TIER,
                           reply_to=f"{PREFIX}.inbox.bench.{rid}", prompt=prompt,
                           sampling=SamplingParams(max_tokens=MAX_TOKENS))
    return rid, tenant, encode(req), req.reply_to


async def publish(url: str, n: int, num_tenants: int, prompt_chars: int) -> None:
    """Publish `n` requests with JetStream acks, 1,000 in flight at a time."""
    import nats

    from fairlane.streams import StreamSettings, ensure_streams
    from fairlane.subjects import REPLY_HEADER, Subjects

    subjects = Subjects(PREFIX)
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await ensure_streams(js, subjects, StreamSettings())
        futs = []
        for i in range(n):
            rid, tenant, body, reply = request_body(i, num_tenants, prompt_chars)
            futs.append(await js.publish_async(
                subjects.request(POOL, TIER, tenant), body,
                headers={"Nats-Msg-Id": rid, REPLY_HEADER: reply}))
            if len(futs) >= 1000:
                await asyncio.gather(*futs)
                futs.clear()
        await asyncio.gather(*futs)
    finally:
        await nc.close()


def start_publisher(url: str, a: argparse.Namespace) -> subprocess.Popen:
    from fairlane.embedded import die_with_parent

    cmd = [sys.executable, __file__, "--publish-to", url, "--num-requests", str(a.num_requests),
           "--num-tenants", str(a.num_tenants), "--prompt-chars", str(a.prompt_chars)]
    return subprocess.Popen(cmd, preexec_fn=die_with_parent)


# --- one measured run (a child process) -----------------------------------------------------


def rss_kib() -> int:
    """VmRSS of this process, KiB (Linux /proc)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


def reading(mode: str) -> int:
    """The one figure this run's mode measures, after a full collection: RSS in KiB
    (tracemalloc off) or the traced Python heap in bytes (tracemalloc on)."""
    gc.collect()
    return rss_kib() if mode == RSS else tracemalloc.get_traced_memory()[0]


async def wait_queued(d: Any, n: int, publisher: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while d.scheduler.num_queued < n:
        if publisher.poll() not in (None, 0):
            raise RuntimeError(f"publisher failed ({publisher.returncode})")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{d.scheduler.num_queued:,} of {n:,} queued after {timeout_s} s")
        await asyncio.sleep(POLL_S)


async def measure(mode: str, url: str, a: argparse.Namespace) -> dict[str, Any]:
    """Readings before the dispatcher exists, once it idles on an empty stream, and
    with all `a.num_requests` queued; the seconds from publisher start to all queued."""
    from dispatcher.config import DispatcherSettings
    from dispatcher.service import Dispatcher
    from fairlane.poolconfig import SchedulerConfig

    if mode == HEAP:
        tracemalloc.start()  # before the dispatcher exists, so all of it is traced
    before = reading(mode)
    d = Dispatcher(DispatcherSettings(nats_url=url, prefix=PREFIX, pool=POOL,
                                      log_level="warning"), SchedulerConfig(policy="drr"))
    publisher = None
    try:
        await d.start()
        await asyncio.sleep(SETTLE_S)
        idle = reading(mode)
        t0 = time.monotonic()
        publisher = start_publisher(url, a)
        await wait_queued(d, a.num_requests, publisher, a.timeout_s)
        fill_s = time.monotonic() - t0
        if publisher.wait(timeout=a.timeout_s) != 0:
            raise RuntimeError(f"publisher failed ({publisher.returncode})")
        full = reading(mode)
        queued = d.scheduler.num_queued
    finally:
        if publisher is not None and publisher.poll() is None:
            publisher.kill()
            publisher.wait()
        await d.stop()
        tracemalloc.stop()
    unit = "kib" if mode == RSS else "bytes"
    key = "rss" if mode == RSS else "heap"
    return {f"{key}_before_{unit}": before, f"{key}_idle_{unit}": idle,
            f"{key}_full_{unit}": full, "queued": queued, "fill_s": round(fill_s, 3)}


def exit_with_parent() -> None:
    """Die with the parent bench (PR_SET_PDEATHSIG: run_children starts us without it),
    and take SIGTERM as SystemExit, so the finally blocks still stop the publisher, the
    dispatcher and nats-server."""
    from fairlane.embedded import die_with_parent

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    die_with_parent()


def child(item: str, a: argparse.Namespace) -> dict[str, Any]:
    """One run, `item` = MODE-REP: its own nats-server, stopped when it ends."""
    from fairlane.embedded import NatsServer

    exit_with_parent()
    mode, rep = item.rsplit("-", 1)
    if mode not in MODES:
        raise SystemExit(f"unknown mode {mode!r} (known: {MODES})")
    with NatsServer() as ns:
        readings = asyncio.run(measure(mode, ns.url, a))
    return {"mode": mode, "rep": int(rep), "num_requests": a.num_requests,
            "num_tenants": a.num_tenants, "prompt_chars": a.prompt_chars, **readings}


# --- the parent -----------------------------------------------------------------------------


def workload(a: argparse.Namespace) -> dict[str, Any]:
    return {"num_requests": a.num_requests, "num_tenants": a.num_tenants,
            "prompt_chars": a.prompt_chars, "max_tokens": MAX_TOKENS, "tiers": [TIER],
            "policy": "drr", "workers": 0, "held": "un-acked (no workers)",
            "publisher": "separate process", "settle_s": SETTLE_S}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, default=20_000)
    ap.add_argument("--num-tenants", type=int, default=100)
    ap.add_argument("--prompt-chars", type=int, default=240,
                    help="characters per prompt (ASCII)")
    ap.add_argument("--reps", type=int, default=5,
                    help="runs of each kind (RSS with tracemalloc off; heap with it on)")
    ap.add_argument("--timeout-s", type=float, default=300.0,
                    help="give up on a run whose requests are not all queued by then")
    ap.add_argument("--output", type=Path, default=RESULTS,
                    help="the results markdown; the JSON goes beside it (same stem)")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--publish-to", default="", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main() -> None:
    a = parse_args()
    if a.publish_to:
        asyncio.run(publish(a.publish_to, a.num_requests, a.num_tenants, a.prompt_chars))
        return
    if a.child:
        print(json.dumps(child(a.child, a)))  # run_children reads the last stdout line
        return
    if a.reps < 1 or a.num_requests < 1 or a.num_tenants < 1:
        raise SystemExit("--reps, --num-requests and --num-tenants must be >= 1")
    meta = RunMeta.here()
    t0 = time.monotonic()
    items = [f"{mode}-{rep}" for rep, mode in interleaved_order(MODES, a.reps)]
    runs, (load0, load1) = run_children(__file__, items)
    data = {"workload": workload(a), "runs": runs, "load_avg": [load0, load1],
            "wall_s": round(time.monotonic() - t0, 1),
            "args": {k: v for k, v in vars(a).items() if k not in ("child", "publish_to")}
            | {"output": str(a.output)}}
    body = report(data)
    md, js = write_results(a.output, TITLE, body, data, meta, HOW_TO_READ)
    print(body)
    print(f"wrote {md} and {js} in {data['wall_s']:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
