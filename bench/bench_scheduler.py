"""Benchmarks of the pure scheduler core (no NATS, no engine).

    python bench/bench_scheduler.py [--reps 5] [--quick] [--output PATH.md]

1. Cost per scheduling decision (µs) at 10 … 100,000 backlogged tenants, per policy
   (fifo, drr, vtc), plus drr with half the tenants quota-blocked (parking cost), and
   drr's cost per submit. Timed with `time.perf_counter`, GC off: a loop of
   `--decisions` `select(1)` calls on one scheduler, after `--warmup-decisions` untimed
   ones on the same scheduler (the measured workload); a run's figure is the loop's time
   ÷ its decisions. Every (policy, tenant count) is a variant run once per repetition on
   a fresh scheduler, the order reversed every other repetition
   (`bench.harness.run_interleaved`); each cell is the median (min–max) over `--reps`.
2. Core memory per queued request (tracemalloc).
3. The noisy-neighbour scenario (tenant A bursts 10,000, tenant B sends 5) on a
   simulated pool with fixed slots and a fixed service time: B's queue wait per policy.
4. Weighted shares 1:2:4 of continuously backlogged tenants, with Jain's index on
   weight-normalised service.

2-4 are deterministic (tracemalloc counts, simulated time) and run once. Writes
bench/results/scheduler.md + .json (`--output`; the JSON holds every run) through
`bench.harness.write_results`; the markdown and BENCHMARKS.md's §2 table are rendered
by bench/render_scheduler.py. About 2 minutes on a 2-core machine; `--quick` seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import heapq
import os
import sys
import time
import tracemalloc
from collections import deque
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.harness import RunMeta, run_interleaved, write_results  # noqa: E402
from bench.render_scheduler import BLOCKED, COLUMNS, report  # noqa: E402
from dispatcher.scheduler.core import Scheduler  # noqa: E402
from dispatcher.scheduler.types import QueuedRequest  # noqa: E402
from fairlane.poolconfig import SchedulerConfig, TenantConfig  # noqa: E402

POLICIES = ["fifo", "drr", "vtc"]
RESULTS = ROOT / "bench" / "results" / "scheduler.md"
TITLE = "Scheduler core: cost per decision, memory, noisy neighbour, weighted shares"
HOW_TO_READ = """\
Cost per decision: each cell is the median (min–max) over the repetitions of one
(policy, tenant count), each repetition the mean µs per `select(1)` over its timed
loop; lower is better, and "flat" from 10 to 100,000 tenants is the claim (amortised
O(1) for drr). The other sections are deterministic and ran once."""


def _req(rid: int, tenant: str) -> QueuedRequest:
    return QueuedRequest(f"r{rid}", tenant, "standard", 100, 100, 100)


# --- 1. cost per decision ---------------------------------------------------------------------


def variant_name(column: str, tenants: int) -> str:
    return f"{column}/{tenants}"


def parse_variant(name: str) -> tuple[str, int]:
    column, _, n = name.partition("/")
    return column, int(n)


def backlog(num_tenants: int, per_tenant: int) -> list[QueuedRequest]:
    """`per_tenant` requests for each tenant, submitted round robin over the tenants."""
    return [_req(i * num_tenants + t, f"t{t}")
            for i in range(per_tenant) for t in range(num_tenants)]


def decision_cost(column: str, num_tenants: int, num_decisions: int,
                  warmup_decisions: int) -> dict[str, Any]:
    """One run: a fresh scheduler, every tenant backlogged; µs per submit (the whole
    backlog) and per decision (the timed loop after the warm-up)."""
    blocked = column == BLOCKED
    policy = "drr" if blocked else column
    default = TenantConfig("_default", max_concurrent=1 if blocked else None)
    s = Scheduler(SchedulerConfig(policy=policy, throttle_window_ms=0, default_tenant=default))
    total = warmup_decisions + num_decisions
    # Every policy serves the tenants evenly here; blocked tenants come back in bursts,
    # so give them twice the share. +2: no tenant runs dry at the end.
    per_tenant = -(-total // num_tenants) * (2 if blocked else 1) + 2
    reqs = backlog(num_tenants, per_tenant)
    # At most this many tenants hold a request in flight (blocked runs): the oldest is
    # finished beyond it, so half the tenants stay parked and one comes back per decision.
    max_in_flight = max(1, num_tenants // 2)
    in_flight: deque[str] = deque()
    now_ms = 1.0

    def decide(count: int) -> int:
        nonlocal now_ms
        done = 0
        while done < count:
            out = s.select(1, now_ms)
            if not out:
                break
            done += 1
            if blocked:
                in_flight.append(out[0].request.request_id)
                if len(in_flight) > max_in_flight:
                    s.on_finished(in_flight.popleft(), None, now_ms)
            now_ms += 0.001
        return done

    gc.collect()
    gc.disable()  # a collection inside the loop would land on one variant at random
    try:
        t0 = time.perf_counter()
        for r in reqs:
            s.submit(r, 0.0)
        t1 = time.perf_counter()
        warmed = decide(warmup_decisions)
        t2 = time.perf_counter()
        done = decide(num_decisions)
        t3 = time.perf_counter()
    finally:
        gc.enable()
    if warmed < warmup_decisions or done < num_decisions:
        # A figure over fewer decisions than asked would not be the cell it claims.
        raise RuntimeError(f"{column} at {num_tenants:,} tenants ran dry: {warmed:,} warm-up "
                           f"and {done:,} timed decisions of {warmup_decisions:,} + "
                           f"{num_decisions:,}")
    return {"column": column, "policy": policy, "tenants": num_tenants,
            "requests": len(reqs), "warmup_decisions": warmed, "decisions": done,
            "us_per_submit": (t1 - t0) / len(reqs) * 1e6,
            "us_per_decision": (t3 - t2) / done * 1e6}


def bench_decisions(sizes: list[int], reps: int, num_decisions: int,
                    warmup_decisions: int) -> list[dict[str, Any]]:
    """Every (column, tenant count) once per repetition, interleaved; the records as
    dicts for the JSON and the renderer."""
    variants = [variant_name(c, n) for n in sizes for c in COLUMNS]

    async def run_one(variant: str, _rep: int) -> dict[str, Any]:
        column, n = parse_variant(variant)
        return decision_cost(column, n, num_decisions, warmup_decisions)

    records = asyncio.run(run_interleaved(variants, reps, run_one, log=lambda _s: None))
    return [asdict(r) for r in records]


# --- 2. memory per queued request ---------------------------------------------------------------


def bench_memory(num_requests: int, num_tenants: int) -> dict[str, Any]:
    rows = []
    for policy in POLICIES:
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        reqs = [QueuedRequest(f"req-{i:08d}", f"tenant-{i % num_tenants}", "standard",
                              100, 100, 100, deadline_ms=1e9) for i in range(num_requests)]
        with_reqs = tracemalloc.get_traced_memory()[0]
        s = Scheduler(SchedulerConfig(policy=policy, throttle_window_ms=0))
        for r in reqs:
            s.submit(r, 0.0)
        total = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        rows.append({"policy": policy, "core_b_per_request": (total - with_reqs) / num_requests,
                     "incl_b_per_request": (total - base) / num_requests})
        del s, reqs
    return {"queued": num_requests, "tenants": num_tenants, "rows": rows}


# --- 3. noisy neighbour --------------------------------------------------------------------------


def simulate_noisy_neighbour(policy: str, num_slots: int = 64, service_ms: float = 50.0,
                             burst: int = 10_000, small: int = 5,
                             b_at_ms: float = 10.0) -> dict[str, float]:
    """A bursts `burst` requests at t=0; B sends `small` at `b_at_ms`. A pool of
    `num_slots` slots serves each request in `service_ms`. Returns queue waits (ms)."""
    s = Scheduler(SchedulerConfig(policy=policy, throttle_window_ms=0))
    arrivals = [(0.0, f"a{i}", "A") for i in range(burst)]
    arrivals += [(b_at_ms, f"b{i}", "B") for i in range(small)]
    arrivals.sort()
    finishing: list[tuple[float, str]] = []  # (finish time, request id)
    waits: dict[str, list[float]] = {"A": [], "B": []}
    arrived_at: dict[str, float] = {}
    now, ai, free = 0.0, 0, num_slots
    while ai < len(arrivals) or s.num_queued or finishing:
        # Next event: an arrival or a finish.
        next_arrival = arrivals[ai][0] if ai < len(arrivals) else float("inf")
        next_finish = finishing[0][0] if finishing else float("inf")
        now = min(next_arrival, next_finish)
        while ai < len(arrivals) and arrivals[ai][0] <= now:
            t, rid, tenant = arrivals[ai]
            s.submit(QueuedRequest(rid, tenant, "standard", 100, 100, 100), t)
            arrived_at[rid] = t
            ai += 1
        while finishing and finishing[0][0] <= now:
            _, rid = heapq.heappop(finishing)
            s.on_finished(rid, None, now)
            free += 1
        for d in s.select(free, now):
            rid = d.request.request_id
            waits[d.request.tenant].append(now - arrived_at[rid])
            heapq.heappush(finishing, (now + service_ms, rid))
            free -= 1
    return {"b_mean_ms": sum(waits["B"]) / len(waits["B"]), "b_max_ms": max(waits["B"]),
            "a_mean_ms": sum(waits["A"]) / len(waits["A"]), "makespan_ms": now}


def bench_noisy_neighbour(slots: int = 64, service_ms: float = 50.0, burst: int = 10_000,
                          small: int = 5, b_at_ms: float = 10.0) -> dict[str, Any]:
    rows = [{"policy": p, **simulate_noisy_neighbour(p, slots, service_ms, burst, small,
                                                     b_at_ms)} for p in POLICIES]
    return {"slots": slots, "service_ms": service_ms, "burst": burst, "small": small,
            "b_at_ms": b_at_ms, "rows": rows}


# --- 4. weighted shares ----------------------------------------------------------------------------


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


def bench_weights(weights: tuple[int, ...] = (1, 2, 4), num_decisions: int = 7_000) -> dict:
    rows = []
    for policy in POLICIES:
        cfg = SchedulerConfig(policy=policy, cost_model="tokens", quantum=200.0,
                              throttle_window_ms=0,
                              tenants={f"w{i}": TenantConfig(f"w{i}", weight=w)
                                       for i, w in enumerate(weights)})
        s = Scheduler(cfg)
        rid = 0
        for j in range(num_decisions):
            for i in range(len(weights)):
                prompt = 20 + (j * 37 + i * 11) % 180  # deterministic spread of sizes
                s.submit(QueuedRequest(f"r{rid}", f"w{i}", "standard", prompt, 10, 10), 0.0)
                rid += 1
        served = [0.0] * len(weights)
        for d in s.select(num_decisions, 1.0):
            served[int(d.request.tenant[1:])] += d.cost
        total = sum(served)
        shares = [x / total for x in served]
        rows.append({"policy": policy, "shares": shares,
                     "jain": jain([sh / w for sh, w in zip(shares, weights, strict=True)])})
    return {"weights": list(weights), "decisions": num_decisions, "rows": rows}


# --- main ------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="10, 1,000 and 10,000 tenants, 5,000 decisions (seconds; a smoke run)")
    ap.add_argument("--reps", type=int, default=5, help="interleaved repetitions")
    ap.add_argument("--sizes", default="", help="tenant counts, comma-separated "
                    "(default 10,1000,10000,100000; --quick 10,1000,10000)")
    ap.add_argument("--decisions", type=int, default=0,
                    help="timed select(1) calls per run (default 20,000; --quick 5,000)")
    ap.add_argument("--warmup-decisions", type=int, default=-1,
                    help="untimed select(1) calls before them (default a tenth)")
    ap.add_argument("--output", type=Path, default=RESULTS,
                    help="the results markdown; the JSON goes beside it (same stem)")
    a = ap.parse_args(argv)
    default_sizes = "10,1000,10000" if a.quick else "10,1000,10000,100000"
    a.sizes = [int(x) for x in (a.sizes or default_sizes).split(",")]
    a.decisions = a.decisions or (5_000 if a.quick else 20_000)
    if a.warmup_decisions < 0:
        a.warmup_decisions = a.decisions // 10
    if a.reps < 1 or a.decisions < 1 or min(a.sizes) < 1:
        raise SystemExit("--reps, --decisions and every size must be >= 1")
    return a


def main() -> None:
    a = parse_args()
    meta = RunMeta.here()
    load0 = tuple(round(x, 2) for x in os.getloadavg())
    t0 = time.perf_counter()
    records = bench_decisions(a.sizes, a.reps, a.decisions, a.warmup_decisions)
    data = {
        "setup": {"sizes": a.sizes, "columns": list(COLUMNS), "reps": a.reps,
                  "decisions": a.decisions, "warmup_decisions": a.warmup_decisions,
                  "timed": "select(1) loop after the warm-up, perf_counter, GC off",
                  "python": sys.version.split()[0]},
        "records": records,
        "memory": bench_memory(num_requests=20_000 if a.quick else 100_000, num_tenants=1_000),
        "noisy_neighbour": bench_noisy_neighbour(),
        "weights": bench_weights(),
    }
    data["load_avg"] = [load0, tuple(round(x, 2) for x in os.getloadavg())]
    data["wall_s"] = round(time.perf_counter() - t0, 1)
    data["args"] = {k: v for k, v in vars(a).items() if k != "output"} | {
        "output": str(a.output)}
    body = report(data)
    md, js = write_results(a.output, TITLE, body, data, meta, HOW_TO_READ)
    print(body)
    print(f"wrote {md} and {js} in {data['wall_s']:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
