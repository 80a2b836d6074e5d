"""Benchmarks of the pure scheduler core (no NATS, no engine): `python bench/bench_scheduler.py`.

1. Cost per scheduling decision (µs) at 10 … 100,000 backlogged tenants, per policy,
   plus DRR with every tenant quota-blocked after one dispatch (parking cost).
2. Core memory per queued request (tracemalloc).
3. The noisy-neighbour scenario (tenant A bursts 10,000, tenant B sends 5) on a
   simulated pool with fixed slots and a fixed service time: B's queue wait per policy.
4. Weighted shares 1:2:4 of continuously backlogged tenants, with Jain's index on
   weight-normalised service.

Bounded: well under two minutes. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import gc
import heapq
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dispatcher.scheduler.core import Scheduler  # noqa: E402
from dispatcher.scheduler.types import QueuedRequest  # noqa: E402
from fairlane.poolconfig import SchedulerConfig, TenantConfig  # noqa: E402

POLICIES = ["fifo", "drr", "vtc"]


def _req(rid: int, tenant: str) -> QueuedRequest:
    return QueuedRequest(f"r{rid}", tenant, "standard", 100, 100, 100)


# --- 1. cost per decision ---------------------------------------------------------------------


def decision_cost(policy: str, num_tenants: int, num_decisions: int,
                  blocked: bool = False) -> tuple[float, float]:
    """(µs per submit, µs per decision) with every tenant backlogged."""
    default = TenantConfig("_default", max_concurrent=1 if blocked else None)
    cfg = SchedulerConfig(policy=policy, throttle_window_ms=0, default_tenant=default)
    s = Scheduler(cfg)
    per_tenant = max(2, -(-(num_decisions + 1) // num_tenants) + 1)
    reqs = [_req(i * num_tenants + t, f"t{t}")
            for i in range(per_tenant) for t in range(num_tenants)]
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        for r in reqs:
            s.submit(r, 0.0)
        t1 = time.perf_counter()
        done = 0
        now = 1.0
        while done < num_decisions:
            out = s.select(1, now)
            if not out:
                break
            done += 1
            if blocked and done % 2 == 0:  # release some, so parked tenants come back
                s.on_finished(out[0].request.request_id, None, now)
            now += 0.001
        t2 = time.perf_counter()
    finally:
        gc.enable()
    return (t1 - t0) / len(reqs) * 1e6, (t2 - t1) / max(done, 1) * 1e6


def bench_decisions(sizes: list[int], num_decisions: int) -> None:
    print("\n## Scheduler cost per decision (select(1)), every tenant backlogged\n")
    cols = [*POLICIES, "drr, quota-blocked"]
    print("| tenants | " + " | ".join(f"{c} µs/decision" for c in cols) + " | drr µs/submit |")
    print("|---:|" + "---:|" * (len(cols) + 1))
    for n in sizes:
        row, submit_us = [], 0.0
        for policy in POLICIES:
            sub, dec = decision_cost(policy, n, num_decisions)
            row.append(dec)
            if policy == "drr":
                submit_us = sub
        row.append(decision_cost("drr", n, num_decisions, blocked=True)[1])
        print(f"| {n:,} | " + " | ".join(f"{v:.2f}" for v in row) + f" | {submit_us:.2f} |")


# --- 2. memory per queued request ---------------------------------------------------------------


def bench_memory(num_requests: int, num_tenants: int) -> None:
    print("\n## Core memory per queued request (tracemalloc)\n")
    print("| policy | queued | tenants | core overhead B/request | incl. QueuedRequest B/request |")
    print("|---|---:|---:|---:|---:|")
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
        core = (total - with_reqs) / num_requests
        incl = (total - base) / num_requests
        print(f"| {policy} | {num_requests:,} | {num_tenants:,} | {core:.0f} | {incl:.0f} |")
        del s, reqs


# --- 3. noisy neighbour --------------------------------------------------------------------------


def simulate_noisy_neighbour(policy: str, num_slots: int = 64, service_ms: float = 50.0,
                             burst: int = 10_000, small: int = 5) -> dict[str, float]:
    """A bursts `burst` requests at t=0; B sends `small` at t=10 ms. A pool of
    `num_slots` slots serves each request in `service_ms`. Returns queue waits (ms)."""
    s = Scheduler(SchedulerConfig(policy=policy, throttle_window_ms=0))
    arrivals = [(0.0, f"a{i}", "A") for i in range(burst)]
    arrivals += [(10.0, f"b{i}", "B") for i in range(small)]
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
    return {"b_mean": sum(waits["B"]) / len(waits["B"]), "b_max": max(waits["B"]),
            "a_mean": sum(waits["A"]) / len(waits["A"]), "makespan": now}


def bench_noisy_neighbour() -> None:
    print("\n## Noisy neighbour: A bursts 10,000, B sends 5 "
          "(64 slots, 50 ms per request, simulated)\n")
    print("| policy | B mean wait ms | B max wait ms | A mean wait ms | makespan ms |")
    print("|---|---:|---:|---:|---:|")
    for policy in POLICIES:
        r = simulate_noisy_neighbour(policy)
        print(f"| {policy} | {r['b_mean']:.0f} | {r['b_max']:.0f} | {r['a_mean']:.0f} | "
              f"{r['makespan']:.0f} |")


# --- 4. weighted shares ----------------------------------------------------------------------------


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


def bench_weights(weights: tuple[int, ...] = (1, 2, 4), num_decisions: int = 7_000) -> None:
    print(f"\n## Weighted shares {':'.join(map(str, weights))}, all continuously backlogged "
          f"({num_decisions:,} decisions, tokens cost, random prompt sizes)\n")
    print("| policy | " + " | ".join(f"w={w} share" for w in weights)
          + " | ideal | Jain (weight-normalised) |")
    print("|---|" + "---:|" * (len(weights) + 2))
    ideal = "/".join(f"{w / sum(weights):.3f}" for w in weights)
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
        fairness = jain([sh / w for sh, w in zip(shares, weights, strict=True)])
        print(f"| {policy} | " + " | ".join(f"{x:.3f}" for x in shares)
              + f" | {ideal} | {fairness:.4f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes (for CI)")
    args = ap.parse_args()
    sizes = [10, 1_000, 10_000] if args.quick else [10, 1_000, 10_000, 100_000]
    t0 = time.perf_counter()
    print(f"# fairlane scheduler core benchmark (python {sys.version.split()[0]})")
    bench_decisions(sizes, num_decisions=20_000 if not args.quick else 5_000)
    bench_memory(num_requests=100_000 if not args.quick else 20_000, num_tenants=1_000)
    bench_noisy_neighbour()
    bench_weights()
    print(f"\n(total {time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
