"""TTFT overhead of the request path at light load: `python bench/bench_path.py`.

One request at a time (closed loop, concurrency 1), small ``max_tokens``, the default
simulator step-time model at ``time_scale`` 1.0 (real time). Variants, run side by side in
interleaved rounds so that drift on a shared machine hits all of them alike:

- ``direct``: `SimEngine.generate()` called in this process: the engine's own TTFT
  (one simulated step), the floor every other variant is compared with.
- ``inproc``: producer (`FairlaneClient`) -> nats-server -> `Dispatcher` -> `Worker`
  with a `SimEngine`, dispatcher and worker in THIS process (one event loop), so the
  difference to ``direct`` is the logic + NATS hops without process hops.
- ``procs``: the same with ``python -m dispatcher`` and ``python -m gpu_worker`` as
  separate processes, as in production.

Each fleet variant runs with the worker's default ``coalesce_ms`` (5) and with 0, because
the worker holds the FIRST token up to ``coalesce_ms`` too (see the results file).

TTFT is measured by the producer: monotonic time from just before `submit()` to the
first chunk out of the stream. Bounded: well under 3 minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import uvloop  # noqa: E402

from bench.common import git_rev, machine, quantile  # noqa: E402
from dispatcher.config import DispatcherSettings  # noqa: E402
from dispatcher.service import Dispatcher  # noqa: E402
from fairlane.embedded import NatsServer  # noqa: E402
from fairlane.logs import configure_logging  # noqa: E402
from fairlane.protocol import InferenceRequest, SamplingParams, WorkItem  # noqa: E402
from fairlane.subjects import Subjects  # noqa: E402
from fairlane.tenants import TenantsWatcher  # noqa: E402
from gpu_worker.config import WorkerSettings  # noqa: E402
from gpu_worker.service import Worker  # noqa: E402
from gpu_worker.sim.engine import SimEngine  # noqa: E402
from producer.client import FairlaneClient, RequestSpec  # noqa: E402

POOL = "default"  # the only pool of the default tenants config
TENANT = "bench"
TIER = "standard"  # explicit: no tier look-up round trip on the measured path
PROMPT = "Say hello to the benchmark."


def make_dispatcher(ds: DispatcherSettings) -> Dispatcher:
    """A dispatcher configured as `python -m dispatcher` does (default tenants)."""
    return Dispatcher(ds, tenants=TenantsWatcher(ds.tenants_file or None))


# --- variants -----------------------------------------------------------------------------


class Direct:
    name = "direct (SimEngine in-process)"

    def __init__(self, args) -> None:
        self.engine = SimEngine(args.step_model, time_scale=args.time_scale)
        self.args = args

    async def start(self) -> None:
        await self.engine.start()

    async def one(self) -> float:
        req = InferenceRequest(request_id=uuid.uuid4().hex, tenant=TENANT, pool=POOL, tier=TIER,
                               reply_to="_", prompt=PROMPT,
                               sampling=SamplingParams(max_tokens=self.args.max_tokens))
        t0 = time.perf_counter()
        ttft = None
        async for d in self.engine.generate(WorkItem(request=req)):
            if ttft is None and (d.token_ids or d.text):
                ttft = time.perf_counter() - t0
        assert ttft is not None
        return ttft * 1000

    async def stop(self) -> None:
        await self.engine.close()


class Fleet:
    """Producer -> nats -> dispatcher -> worker; dispatcher/worker in-process or not."""

    def __init__(self, args, url: str, procs: bool, coalesce_ms: int) -> None:
        self.args, self.url, self.procs, self.coalesce_ms = args, url, procs, coalesce_ms
        where = "separate processes" if procs else "in-process"
        self.name = f"{'procs' if procs else 'inproc'}: dispatcher+worker {where}, coalesce_ms={coalesce_ms}"
        self.subjects = Subjects(f"b{uuid.uuid4().hex[:10]}")
        self.children: list[subprocess.Popen] = []
        self.stop_event = asyncio.Event()
        self.tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        a, prefix = self.args, self.subjects.prefix
        if self.procs:
            env = dict(os.environ, FAIRLANE_LOG_LEVEL="warning")
            common = ["--nats-url", self.url, "--prefix", prefix, "--pool", POOL]
            self.children.append(subprocess.Popen(
                [sys.executable, "-m", "dispatcher", *common], cwd=ROOT, env=env,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            self.children.append(subprocess.Popen(
                [sys.executable, "-m", "gpu_worker", *common, "--engine", "sim",
                 "--step-model", a.step_model, "--time-scale", str(a.time_scale),
                 "--coalesce-ms", str(self.coalesce_ms)],
                cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        else:
            ds = DispatcherSettings(nats_url=self.url, prefix=prefix, pool=POOL)
            self.dispatcher = make_dispatcher(ds)
            await self.dispatcher.start()
            ws = WorkerSettings(nats_url=self.url, prefix=prefix, pool=POOL, engine="sim",
                                step_model=a.step_model, time_scale=a.time_scale,
                                coalesce_ms=self.coalesce_ms)
            self.worker = Worker(ws, SimEngine.from_settings(ws))
            self.tasks.append(asyncio.create_task(self.worker.run(self.stop_event)))
        self.client = await FairlaneClient.connect(self.url, prefix=prefix)
        # Ready = one request makes it all the way through.
        deadline = time.monotonic() + 30
        while True:
            try:
                await asyncio.wait_for(self.one(), 5)
                break
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name}: fleet not ready in 30 s") from None

    async def one(self) -> float:
        t0 = time.perf_counter()
        stream = await self.client.submit(RequestSpec(
            tenant=TENANT, pool=POOL, tier=TIER, prompt=PROMPT,
            sampling=SamplingParams(max_tokens=self.args.max_tokens)))
        ttft = None
        async for _chunk in stream:
            if ttft is None:
                ttft = time.perf_counter() - t0
        assert ttft is not None
        return ttft * 1000

    async def stop(self) -> None:
        await self.client.close()
        if self.procs:
            for p in self.children:
                p.terminate()
            for p in self.children:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        else:
            self.stop_event.set()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            await self.dispatcher.stop()


async def main_async(args) -> str:
    server = NatsServer().start()
    variants: list = []
    try:
        variants = [Direct(args)]
        for procs in (False, True):
            for c in (5, 0):
                variants.append(Fleet(args, server.url, procs, c))
        for v in variants:
            t = time.perf_counter()
            await v.start()
            print(f"started {v.name} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
        for v in variants:  # warm-up (imports, first-call costs, JIT-free but cache-y)
            for _ in range(args.warmup):
                await v.one()
        samples: dict[str, list[float]] = {v.name: [] for v in variants}
        per_round = max(1, args.n // args.rounds)
        t_start = time.perf_counter()
        for _ in range(args.rounds):
            for v in variants:
                for _ in range(per_round):
                    samples[v.name].append(await v.one())
        elapsed = time.perf_counter() - t_start
    finally:
        for v in variants:
            with contextlib.suppress(Exception):
                await v.stop()
        server.stop()

    base = samples[variants[0].name]
    b50, b99 = quantile(base, 0.5), quantile(base, 0.99)
    cmd = "python " + " ".join([str(Path(sys.argv[0]))] + sys.argv[1:])
    lines = [
        "# bench_path: TTFT at light load (one request at a time)",
        "",
        f"- command: `{cmd}`",
        f"- machine: {machine()}",
        f"- date: {dt.datetime.now(dt.UTC).isoformat(timespec='seconds')}; code: {git_rev()}",
        f"- {len(base)} requests per variant, in {args.rounds} interleaved rounds; "
        f"max_tokens={args.max_tokens}; step model `{args.step_model}`, time_scale={args.time_scale}; "
        f"uvloop; nats-server {server_version()} on loopback; measured phase {elapsed:.1f} s",
        "- TTFT = producer-side time from before `submit()` to the first chunk "
        "(direct: from `generate()` to the first delta)",
        "",
        "| variant | n | p50 ms | p99 ms | mean ms | overhead p50 ms | overhead p99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for v in variants:
        xs = samples[v.name]
        p50, p99 = quantile(xs, 0.5), quantile(xs, 0.99)
        lines.append(f"| {v.name} | {len(xs)} | {p50:.2f} | {p99:.2f} | {statistics.fmean(xs):.2f} "
                     f"| {p50 - b50:+.2f} | {p99 - b99:+.2f} |")
    lines.append("")
    lines.append("overhead = variant minus `direct` at the same percentile.")
    return "\n".join(lines) + "\n"


def server_version() -> str:
    from fairlane.embedded import find_nats_server
    with contextlib.suppress(Exception):
        out = subprocess.run([find_nats_server(), "--version"], capture_output=True, text=True, timeout=5)
        return out.stdout.strip().split()[-1]
    return "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200, help="requests per variant")
    ap.add_argument("--rounds", type=int, default=8, help="interleaved rounds")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--step-model", default="default")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "path.md"))
    args = ap.parse_args()
    configure_logging("warning", False)
    report = uvloop.run(main_async(args))
    print(report)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
