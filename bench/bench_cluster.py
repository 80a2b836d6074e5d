"""A 3-node NATS cluster vs one nats-server, same run: `python bench/bench_cluster.py`.

Issue 13: what replicating every stream three ways costs. Each round starts a fresh
broker (one node, or three on loopback with routes and R3 streams and lease bucket),
`python -m dispatcher` and two `python -m gpu_worker` (simulator, fast time scale, so
the broker path rather than simulated decode bounds the rate), and the producer
library in this process, then measures:

- light-load TTFT: one request at a time (4 output tokens), from just before
  `submit()` to the first chunk; every sample is kept, and a round's p99 is one only
  from >= 200 of them (bench.harness.p99; the default is 200);
- throughput: a closed loop with `--concurrency` requests in flight (2 output tokens
  each), completed requests per second.

One clock (`time.perf_counter`). Each round starts with an untimed warm-up on the
measured workload (light requests, then a loaded burst) on its fresh fleet. `--reps`
(alias `--rounds`, default 5) rounds each run both topologies, the order reversed every
other round (bench.harness.run_interleaved: 1 3, 3 1, ...) so drift on a shared
machine hits both alike. Everything runs on this one machine: the three nodes share its
CPUs with the fleet and the client, so the ratio is an upper bound on replication's cost
on separate hosts (where the nodes do not compete for CPU, but add network RTT).
Writes bench/results/cluster.md and cluster.json (bench.harness.write_results; the
tables are bench/render_edge.py's). About a minute at the defaults (2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import RunMeta, run_interleaved, write_results  # noqa: E402
from bench.render_edge import CLUSTER_VARIANTS, ONE, THREE, cluster_report  # noqa: E402
from fairlane.embedded import die_with_parent  # noqa: E402
from fairlane.natscluster import NatsCluster, default_replicas  # noqa: E402
from producer.client import FairlaneClient, RequestSpec, SamplingParams  # noqa: E402

PREFIX, POOL = "bc", "default"
SIZES = {ONE: 1, THREE: 3}
WORKERS = 2
RESULTS = ROOT / "bench" / "results" / "cluster.md"


async def _one_round(size: int, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="fl-bench-cluster-") as tmp:
        cluster = NatsCluster(size, f"{tmp}/nats", log_dir=tmp).start()
        procs: list[subprocess.Popen] = []
        common = ["--nats-url", cluster.url, "--prefix", PREFIX, "--pool", POOL,
                  "--stream-replicas", str(default_replicas(size)), "--log-level", "warning"]

        def spawn(name: str, *a: str) -> None:
            with open(f"{tmp}/{name}.log", "ab") as out:
                procs.append(subprocess.Popen([sys.executable, "-m", *a], stdout=out,
                                              stderr=out, preexec_fn=die_with_parent))

        try:
            spawn("dispatcher", "dispatcher", *common)
            for i in range(WORKERS):
                spawn(f"worker-{i}", "gpu_worker", *common, "--worker-id", f"w{i}",
                      "--time-scale", str(args.time_scale), "--max-num-seqs", "64",
                      "--coalesce-ms", "0")
            client = await FairlaneClient.connect(cluster.url, prefix=PREFIX)
            try:
                return await _measure(client, args)
            finally:
                await client.close()
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
            cluster.stop()


def _spec(n: int) -> RequestSpec:
    return RequestSpec(tenant="bench", pool=POOL, tier="standard", prompt="hello",
                       sampling=SamplingParams(max_tokens=n), expected_output_tokens=n)


async def _ready(client: FairlaneClient) -> None:
    """Until a request goes through: the dispatcher leads and both workers pull."""
    deadline = time.perf_counter() + 60
    while True:
        try:
            await asyncio.wait_for((await client.submit(_spec(2))).collect(), 10)
            return
        except Exception:
            if time.perf_counter() > deadline:
                raise
            await asyncio.sleep(0.5)


async def _light(client: FairlaneClient, n: int) -> list[float]:
    """TTFT of `n` requests one at a time, ms, from just before submit to the first chunk."""
    ttft_ms = []
    for _ in range(n):
        t0 = time.perf_counter()
        stream = await client.submit(_spec(4))
        first = None
        async for _chunk in stream:
            if first is None:
                first = time.perf_counter()
        ttft_ms.append((first - t0) * 1000)
    return ttft_ms


async def _load(client: FairlaneClient, n: int, concurrency: int) -> tuple[int, float]:
    """(completed, wall s) of `n` requests with `concurrency` in flight."""
    sem = asyncio.Semaphore(concurrency)
    done = 0

    async def one() -> None:
        nonlocal done
        async with sem:
            await (await client.submit(_spec(2))).collect()
            done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    return done, time.perf_counter() - t0


async def _measure(client: FairlaneClient, args: argparse.Namespace) -> dict:
    await _ready(client)
    # Warm-up on the measured workload, not counted: this round's fleet is fresh.
    await _light(client, args.warmup_light)
    await _load(client, args.warmup_load, args.concurrency)
    ttft_ms = await _light(client, args.light_requests)
    done, wall_s = await _load(client, args.load_requests, args.concurrency)
    return {"req_per_s": done / wall_s, "load_requests": done, "load_wall_s": wall_s,
            "ttft_ms": [round(x, 4) for x in ttft_ms]}


async def _run_one(variant: str, _rep: int, args: argparse.Namespace) -> dict:
    size = SIZES[variant]
    return {"size": size, **await _one_round(size, args)}


def setup_of(args: argparse.Namespace) -> dict:
    return {"reps": args.reps, "variants": list(CLUSTER_VARIANTS), "workers": WORKERS,
            "light_requests": args.light_requests, "load_requests": args.load_requests,
            "concurrency": args.concurrency, "time_scale": args.time_scale,
            "warmup_light": args.warmup_light, "warmup_load": args.warmup_load,
            "cpus": os.cpu_count()}


async def run(args: argparse.Namespace) -> dict:
    setup = setup_of(args)
    setup["loadavg_start"] = [round(x, 2) for x in os.getloadavg()]
    t0 = time.perf_counter()
    records = await run_interleaved(CLUSTER_VARIANTS, args.reps,
                                    lambda v, r: _run_one(v, r, args))
    setup["bench_s"] = time.perf_counter() - t0
    setup["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    # As the JSON holds them: the markdown is rendered from the same dicts the renderer
    # reads. The warm-up runs inside each round (its fleet is fresh), so none is listed.
    return {"setup": setup, "warmup": [], "records": [asdict(r) for r in records]}


HOW_TO_READ = """\
`1-node`: one nats-server, streams R1; `3-node`: three nats-servers on loopback with
routes, streams and the lease bucket R3. Both run in every round, the order reversed on
every other round; each round's fleet (broker, dispatcher, workers) is fresh and warmed
up on the measured workload before anything is timed. Figures are median (min–max) over
rounds; 3 ÷ 1 is paired per round (both topologies of the same round), then median
(min–max). A round's TTFT p99 is one only from >= 200 light-load samples, else the
table says max. Every sample is in the JSON beside this file."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", "--rounds", dest="reps", type=int, default=5,
                    help="rounds, each running both topologies (order alternated)")
    ap.add_argument("--light-requests", type=int, default=200,
                    help="light-load requests per round (a round's p99 needs >= 200)")
    ap.add_argument("--load-requests", type=int, default=1500)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--time-scale", type=float, default=0.02)
    ap.add_argument("--warmup-light", type=int, default=20,
                    help="untimed light requests per round before the measured ones")
    ap.add_argument("--warmup-load", type=int, default=300,
                    help="untimed loaded requests per round before the measured ones")
    ap.add_argument("--out", "--output", dest="out", type=Path, default=RESULTS,
                    help="results markdown; the JSON goes beside it")
    args = ap.parse_args()
    meta = RunMeta.here()
    data = asyncio.run(run(args))
    md, js = write_results(args.out, "3-node NATS cluster (R3) vs one node",
                           cluster_report(data), data, meta, HOW_TO_READ)
    print(md.read_text())
    print(f"-> {md}, {js}")


if __name__ == "__main__":
    main()
