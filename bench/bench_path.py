"""TTFT overhead of the request path at light load: `python bench/bench_path.py`.

One request at a time (closed loop, concurrency 1), ``max_tokens`` 4 (a short request:
the figure is the time to the FIRST token, not throughput), the default simulator
step-time model at ``time_scale`` 1.0 (real time). Variants:

- ``direct``: `SimEngine.generate()` called in this process: the engine's own TTFT
  (one simulated step), the floor every other variant is compared with.
- ``inproc`` / ``inproc-c0``: producer (`FairlaneClient`) -> nats-server ->
  `Dispatcher` -> `Worker` with a `SimEngine`, dispatcher and worker in THIS process
  (one event loop): the logic + NATS hops without process hops; the worker's default
  ``coalesce_ms`` (5), and 0.
- ``procs`` / ``procs-c0``: the same with ``python -m dispatcher`` and ``python -m
  gpu_worker`` as separate processes, as in production (the headline: ``procs``).

Every variant is started once; then a warm-up (``--warmup`` requests per variant, on
the measured workload, not counted) and ``--reps`` (5) repetitions of
``--per-rep`` (100) requests per variant, interleaved by `bench.harness.run_interleaved`
(every variant once per repetition, the order reversed every other one), so the pooled
samples per variant (500) give a p99. TTFT is measured on ONE clock,
`time.perf_counter`, for every variant: from just before the producer's `submit()` to
its first chunk (``direct``: from `generate()` to the first delta).

Results: bench/results/path.md and path.json (every request's TTFT, per variant and
repetition) via `bench.harness.write_results`; the tables are bench/render_path.py's,
which also renders BENCHMARKS.md's. About a minute with the defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import uvloop  # noqa: E402

from bench.harness import RunMeta, run_interleaved, write_results  # noqa: E402
from bench.render_path import HOW_TO_READ, VARIANTS, report  # noqa: E402
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
RESULTS = ROOT / "bench" / "results" / "path.md"
TITLE = "bench_path: TTFT overhead of the request path at light load"


def make_dispatcher(ds: DispatcherSettings) -> Dispatcher:
    """A dispatcher configured as `python -m dispatcher` does (default tenants)."""
    return Dispatcher(ds, tenants=TenantsWatcher(ds.tenants_file or None))


# --- variants -----------------------------------------------------------------------------


class Direct:
    name = "direct"

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
        # render_path.VARIANTS: "procs", "inproc-c0", ...; the default coalesce_ms unnamed.
        self.name = ("procs" if procs else "inproc") + ("" if coalesce_ms == 5 else
                                                        f"-c{coalesce_ms}")
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
        deadline = time.perf_counter() + 30
        while True:
            try:
                await asyncio.wait_for(self.one(), 5)
                break
            except TimeoutError:
                if time.perf_counter() > deadline:
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


class Bench:
    """The variants, started once and shared by every repetition, and `run_one`."""

    def __init__(self, variants: dict, per_run: int) -> None:
        self.variants, self.per_run = variants, per_run

    async def run_one(self, variant: str, rep: int) -> dict:
        v = self.variants[variant]
        ttft_ms = [await v.one() for _ in range(self.per_run)]
        print(f"    {variant} rep {rep}: TTFT p50 {statistics.median(ttft_ms):.2f} ms",
              file=sys.stderr, flush=True)
        return {"ttft_ms": ttft_ms}


def make_variants(args, url: str) -> dict:
    """name -> variant, in render_path.VARIANTS order."""
    made = [Direct(args)] + [Fleet(args, url, procs, c) for procs in (False, True)
                             for c in (5, 0)]
    by_name = {v.name: v for v in made}
    assert set(by_name) == set(VARIANTS), sorted(by_name)
    return {k: by_name[k] for k in VARIANTS}


async def run(args) -> tuple[list, list, dict]:
    setup = {"reps": args.reps, "per_rep": args.per_rep, "warmup": args.warmup,
             "max_tokens": args.max_tokens, "step_model": args.step_model,
             "time_scale": args.time_scale, "nats_version": server_version(),
             "clock": "time.perf_counter", "variants": list(VARIANTS), "start_s": {},
             "loadavg_start": [round(x, 2) for x in os.getloadavg()]}
    server = NatsServer().start()
    variants: dict = {}
    try:
        variants = make_variants(args, server.url)
        for name, v in variants.items():
            t = time.perf_counter()
            await v.start()
            setup["start_s"][name] = round(time.perf_counter() - t, 2)
            print(f"started {name} in {setup['start_s'][name]:.1f} s", file=sys.stderr)
        t_bench = time.perf_counter()
        # Warm-up on the measured workload (first-call costs, connections, caches),
        # every variant in turn, not counted.
        warmup = await run_interleaved(list(variants), 1, Bench(variants, args.warmup).run_one)
        records = await run_interleaved(list(variants), args.reps,
                                        Bench(variants, args.per_rep).run_one)
        setup["bench_s"] = round(time.perf_counter() - t_bench, 1)
    finally:
        for v in variants.values():
            with contextlib.suppress(Exception):
                await v.stop()
        server.stop()
    setup["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    return records, warmup, setup


def server_version() -> str:
    from fairlane.embedded import find_nats_server
    with contextlib.suppress(Exception):
        out = subprocess.run([find_nats_server(), "--version"], capture_output=True, text=True, timeout=5)
        return out.stdout.strip().split()[-1]
    return "?"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5,
                    help="interleaved repetitions (every variant once in each)")
    ap.add_argument("--per-rep", type=int, default=100,
                    help="requests per variant per repetition (x reps >= 200: a pooled p99)")
    ap.add_argument("--warmup", type=int, default=10,
                    help="untimed requests per variant before the first repetition")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--step-model", default="default")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--output", type=Path, default=RESULTS,
                    help="results markdown; the JSON goes beside it (same stem)")
    a = ap.parse_args(argv)
    if a.reps < 1 or a.per_rep < 1 or a.warmup < 0:
        ap.error("--reps and --per-rep must be >= 1, --warmup >= 0")
    return a


def main() -> int:
    args = parse_args()
    # SIGTERM (a timeout) unwinds like Ctrl-C, so `run`'s finally stops nats-server.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    configure_logging("warning", False)
    meta = RunMeta.here()
    records, warmup, setup = uvloop.run(run(args))
    data = {"setup": setup, "warmup": warmup, "records": records}
    body = report({"setup": setup, "warmup": [asdict(r) for r in warmup],
                   "records": [asdict(r) for r in records]})
    md, js = write_results(args.output, TITLE, body, data, meta, HOW_TO_READ)
    print(body)
    print(f"-> {md}, {js}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
