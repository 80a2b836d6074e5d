"""Dispatcher memory per queued request, measured on the real shell.

    python bench/bench_dispatcher_memory.py [--num-requests 20000]

Publishes N valid requests to a real nats-server, starts an in-process Dispatcher (no
workers, so everything stays queued and held un-acked) and reports, per queued request,
the Python heap the dispatcher grew by (tracemalloc: its JetStream message, decoded
request, scheduler entry, held-message bookkeeping) and the process RSS growth.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import resource
import time
import tracemalloc
import uuid

import nats

from dispatcher.config import DispatcherSettings
from dispatcher.service import Dispatcher
from fairlane.embedded import NatsServer
from fairlane.poolconfig import SchedulerConfig
from fairlane.protocol import InferenceRequest, SamplingParams, encode
from fairlane.streams import StreamSettings, ensure_streams
from fairlane.subjects import REPLY_HEADER, Subjects


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


async def main(n: int, num_tenants: int) -> None:
    with NatsServer() as ns:
        subjects = Subjects("mem")
        nc = await nats.connect(ns.url)
        js = nc.jetstream()
        await ensure_streams(js, subjects, StreamSettings())
        futs = []
        for i in range(n):
            rid = uuid.uuid4().hex
            tenant = f"tenant{i % num_tenants}"
            req = InferenceRequest(request_id=rid, tenant=tenant, pool="p", tier="standard",
                                   reply_to=f"mem.inbox.bench.{rid}", prompt="hello " * 40,
                                   sampling=SamplingParams(max_tokens=128))
            futs.append(await js.publish_async(
                subjects.request("p", "standard", tenant), encode(req),
                headers={"Nats-Msg-Id": rid, REPLY_HEADER: req.reply_to}))
            if len(futs) >= 1000:
                await asyncio.gather(*futs)
                futs.clear()
        await asyncio.gather(*futs)
        await nc.close()

        gc.collect()
        tracemalloc.start()
        heap0, rss0 = tracemalloc.get_traced_memory()[0], rss_kib()
        d = Dispatcher(DispatcherSettings(nats_url=ns.url, prefix="mem", pool="p",
                                          log_level="warning"),
                       SchedulerConfig(policy="drr"))
        t0 = time.perf_counter()
        await d.start()
        while d.scheduler.num_queued < n:
            await asyncio.sleep(0.01)
        elapsed = time.perf_counter() - t0
        gc.collect()
        heap1, rss1 = tracemalloc.get_traced_memory()[0], rss_kib()
        tracemalloc.stop()
        await d.stop()
    print("# Dispatcher memory per queued request\n")
    print(f"- command: `python bench/bench_dispatcher_memory.py --num-requests {n}`")
    print(f"- {n:,} queued requests over {num_tenants} tenants (drr), ~280-char prompts, "
          f"held un-acked; ingested in {elapsed:.1f} s\n")
    print("| measure | total MiB | bytes per queued request |")
    print("|---|---:|---:|")
    print(f"| Python heap (tracemalloc) | {(heap1 - heap0) / 2**20:.1f} | {(heap1 - heap0) / n:,.0f} |")
    print(f"| process RSS growth | {(rss1 - rss0) / 1024:.1f} | {(rss1 - rss0) * 1024 / n:,.0f} |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=20_000)
    ap.add_argument("--num-tenants", type=int, default=100)
    a = ap.parse_args()
    asyncio.run(main(a.num_requests, a.num_tenants))
