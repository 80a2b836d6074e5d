"""A 3-node NATS cluster vs one nats-server, same run: `python bench/bench_cluster.py`.

Issue 13: what replicating every stream three ways costs. Each round starts a fresh
broker (one node, or three on loopback with routes and R3 streams and lease bucket),
`python -m dispatcher` and two `python -m gpu_worker` (simulator, fast time scale, so
the broker path rather than simulated decode bounds the rate), and the producer
library in this process, then measures:

- light-load TTFT: one request at a time (4 output tokens), monotonic time from just
  before `submit()` to the first chunk;
- throughput: a closed loop with `--concurrency` requests in flight (2 output tokens
  each), completed requests per second.

Topologies alternate round by round (1, 3, 1, 3, ...) so drift on a shared machine
hits both alike. Everything runs on this one machine: the three nodes share its CPUs
with the fleet and the client, so the ratio is an upper bound on replication's cost
on separate hosts (where the nodes do not compete for CPU, but add network RTT).
Bounded: ~3 minutes at the defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import git_rev, machine, quantile  # noqa: E402
from fairlane.embedded import die_with_parent  # noqa: E402
from fairlane.natscluster import NatsCluster, default_replicas  # noqa: E402
from producer.client import FairlaneClient, RequestSpec, SamplingParams  # noqa: E402

PREFIX, POOL = "bc", "default"


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
            for i in range(2):
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


async def _measure(client: FairlaneClient, args: argparse.Namespace) -> dict:
    # Warm-up: the dispatcher leads and both workers pull before anything is timed.
    deadline = time.monotonic() + 60
    while True:
        try:
            await asyncio.wait_for((await client.submit(_spec(2))).collect(), 10)
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)
    ttft_ms = []
    for _ in range(args.light_requests):
        t0 = time.monotonic()
        stream = await client.submit(_spec(4))
        first = None
        async for _chunk in stream:
            if first is None:
                first = time.monotonic()
        ttft_ms.append((first - t0) * 1000)
    sem = asyncio.Semaphore(args.concurrency)
    done = 0

    async def one() -> None:
        nonlocal done
        async with sem:
            await (await client.submit(_spec(2))).collect()
            done += 1

    t0 = time.monotonic()
    await asyncio.gather(*(one() for _ in range(args.load_requests)))
    elapsed = time.monotonic() - t0
    return {"ttft_ms_p50": quantile(ttft_ms, 0.5), "ttft_ms_p99": quantile(ttft_ms, 0.99),
            "req_per_s": done / elapsed}


def _report(rounds: list[dict], args: argparse.Namespace) -> str:
    def pooled(size: int, key: str) -> list[float]:
        return [r[key] for r in rounds if r["size"] == size]

    def med(xs: list[float]) -> float:
        return quantile(xs, 0.5)

    def rng(xs: list[float]) -> str:
        return f"{min(xs):.1f}–{max(xs):.1f}"

    command = "python bench/bench_cluster.py " + " ".join(sys.argv[1:])
    lines = [f"# 3-node NATS cluster vs one node ({dt.date.today()}, `{command.strip()}`)", "",
             f"Machine: {machine()}; commit {git_rev()}. {args.rounds} rounds, each running "
             f"both topologies, the order alternated every round; light load "
             f"{args.light_requests} sequential requests (4 tokens) per round (each round's "
             f"p99 from those samples), throughput {args.load_requests} requests (2 tokens) at "
             f"concurrency {args.concurrency}; simulator time scale {args.time_scale}. All on "
             "one machine. Median of rounds (min–max).",
             "", "| metric | 1 node | 3 nodes, R3 | 3 ÷ 1 (median of per-round ratios) |",
             "|---|---|---|---|"]
    for key, label in (("req_per_s", "throughput, requests/s"),
                       ("ttft_ms_p50", "light-load TTFT p50, ms"),
                       ("ttft_ms_p99", "light-load TTFT p99, ms")):
        ones, threes = pooled(1, key), pooled(3, key)
        ratios = [t / o for o, t in zip(ones, threes, strict=True)]
        lines.append(f"| {label} | {med(ones):.1f} ({rng(ones)}) | {med(threes):.1f} "
                     f"({rng(threes)}) | {med(ratios):.2f} ({min(ratios):.2f}–"
                     f"{max(ratios):.2f}) |")
    lines += ["", "Rounds:", "", "```", *(json.dumps(r) for r in rounds), "```", ""]
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> str:
    rounds = []
    for i in range(args.rounds):
        for size in ((1, 3) if i % 2 == 0 else (3, 1)):  # order alternated
            r = await _one_round(size, args)
            r.update(round=i, size=size)
            print(json.dumps(r), flush=True)
            rounds.append(r)
    return _report(rounds, args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--light-requests", type=int, default=200)  # a p99 needs >= 200
    ap.add_argument("--load-requests", type=int, default=1500)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--time-scale", type=float, default=0.02)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cluster.md"))
    args = ap.parse_args()
    text = asyncio.run(run(args))
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
