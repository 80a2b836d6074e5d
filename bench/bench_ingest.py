"""The dispatcher's ingest rate vs raw nats-py on the same server: `python bench/bench_ingest.py`.

All on one nats-server (loopback, JetStream file storage), same stream config as
production (`fairlane.streams.ensure_streams`), same payloads (encoded
`InferenceRequest`s over 50 tenants with ``Nats-Msg-Id`` and reply headers, as the
producer sends), the same N (``--n``, 20,000) for every variant, each run on a fresh
stream of its own (deleted after it). Every rate is N ÷ an elapsed time on ONE clock,
`time.perf_counter` (CLOCK_MONOTONIC on Linux, which is system-wide, so the puller
child's reading is on the same clock; checked at start). What is timed:

- ``publish-sync``: raw `js.publish` awaited one by one, from the first publish to the
  last ack received.
- ``publish-async``: raw `js.publish_async`, acks gathered per 1,000, from the first
  publish to the last ack received.
- ``fetch-held``: N published first (not timed); a raw pull consumer (the dispatcher's
  consumer config) `fetch(batch)`s them, from the first fetch call to the last message
  received, messages left un-acked (as the dispatcher holds them).
- ``fetch-ack``: the same, acking each message; until the last ack is flushed.
- ``ingest``: N published first; the dispatcher (in this process, as `python -m
  dispatcher` builds it, no workers) from its first fetch call to the N-th request
  through `Dispatcher._ingest` (decoded, checked, queued, held).
- ``ingest-dispatch``: the same with a worker-like peer in a child process
  long-polling ``<prefix>.work.<pool>`` (``--pullers`` pulls of ``--max-items``
  outstanding), from the dispatcher's first fetch call to the peer holding N distinct
  requests.
- ``ingest-gc-default`` / ``ingest-dispatch-gc-default``: the same two with the
  interpreter's garbage-collector settings instead of the dispatcher's own
  (``--gc-young-objects``, `fairlane.gctune`, which ``ingest`` and ``ingest-dispatch``
  apply around the dispatcher as ``python -m dispatcher`` does): what that setting buys.

Variants run interleaved (`bench.harness.run_interleaved`: every variant once per
repetition, the order reversed every other one), ``--reps`` (5) repetitions after one
untimed warm-up repetition of ``--warmup-n`` requests. Reported: median (min–max) over
repetitions; ratios to ``fetch-held`` paired within a repetition. The in-process runs
also record this process's garbage-collector pauses inside the timed window.

Results: bench/results/ingest.md and ingest.json via `bench.harness.write_results`;
tables by bench/render_ingest.py (which renders BENCHMARKS.md's too). About 3 minutes.
``--profile`` adds a cProfile of one extra ``ingest`` and ``ingest-dispatch`` run each
(after the measured ones, not counted: the profiler slows them) to the markdown.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import io
import json
import os
import pstats
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import nats  # noqa: E402
import uvloop  # noqa: E402
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy  # noqa: E402

from bench.harness import RunMeta, run_interleaved, write_results  # noqa: E402
from bench.render_ingest import GC_DEFAULT, HOW_TO_READ, VARIANTS, note_for, report  # noqa: E402
from dispatcher.config import DispatcherSettings  # noqa: E402
from dispatcher.service import Dispatcher  # noqa: E402
from fairlane.embedded import NatsServer, find_nats_server  # noqa: E402
from fairlane.gctune import tuned_gc  # noqa: E402
from fairlane.logs import configure_logging  # noqa: E402
from fairlane.protocol import (  # noqa: E402
    InferenceRequest,
    PullRequest,
    SamplingParams,
    decode_work_batch,
    encode,
)
from fairlane.streams import ensure_streams  # noqa: E402
from fairlane.subjects import REPLY_HEADER, Subjects  # noqa: E402
from fairlane.tenants import TenantsWatcher  # noqa: E402

POOL = "default"  # the only pool of the default tenants config
TIER = "standard"
NUM_TENANTS = 50
RESULTS = ROOT / "bench" / "results" / "ingest.md"
TITLE = "bench_ingest: dispatcher ingest rate vs raw nats-py"
CLOCK = "time.perf_counter"


def server_version() -> str:
    with contextlib.suppress(Exception):
        out = subprocess.run([find_nats_server(), "--version"], capture_output=True, text=True,
                             timeout=5)
        return out.stdout.strip().split()[-1]
    return "?"


def requests(subjects: Subjects, n: int) -> list[tuple[str, bytes, dict]]:
    """(subject, body, headers) exactly as `FairlaneClient.submit_request` publishes."""
    inbox = subjects.inbox_prefix("bench")
    out = []
    for i in range(n):
        tenant = f"t{i % NUM_TENANTS}"
        rid = uuid.uuid4().hex
        req = InferenceRequest(request_id=rid, tenant=tenant, pool=POOL, tier=TIER,
                               reply_to=f"{inbox}.{rid}", prompt="Summarise this paragraph. " * 8,
                               sampling=SamplingParams(max_tokens=128),
                               created_ms=int(time.time() * 1000))
        out.append((subjects.request(POOL, TIER, tenant), encode(req),
                    {"Nats-Msg-Id": rid, REPLY_HEADER: req.reply_to}))
    return out


class ProcessCost:
    """This process's CPU time and garbage-collector pauses while entered: what the
    dispatcher (the only busy thing in this process during its runs) spent."""

    def __init__(self) -> None:
        self.gc_pause_s, self.collections, self._t_gc = 0.0, [0, 0, 0], 0.0
        self.cpu_s = 0.0

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t_gc = time.perf_counter()
        else:
            self.gc_pause_s += time.perf_counter() - self._t_gc
            self.collections[info["generation"]] += 1

    def __enter__(self) -> ProcessCost:
        gc.callbacks.append(self._cb)
        self._cpu0 = time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.cpu_s = time.process_time() - self._cpu0
        gc.callbacks.remove(self._cb)

    def figures(self) -> dict:
        return {"gc_pause_s": round(self.gc_pause_s, 4), "gc_collections": self.collections,
                "cpu_s": round(self.cpu_s, 4)}


class TimedDispatcher(Dispatcher):
    """The production dispatcher, stamping its first fetch call and the moment the
    `until`-th request came out of `_ingest`, on the bench's clock."""

    def __init__(self, *a, until: int, **kw) -> None:
        super().__init__(*a, **kw)
        self.until, self.ingested = until, 0
        self.t_first_fetch: float | None = None
        self.t_last_ingest: float | None = None
        self.all_ingested = asyncio.Event()

    async def _consumer(self, tier: str):
        sub = await super()._consumer(tier)
        fetch = sub.fetch

        async def timed_fetch(*a, **kw):
            if self.t_first_fetch is None:
                self.t_first_fetch = time.perf_counter()
            return await fetch(*a, **kw)

        sub.fetch = timed_fetch
        return sub

    async def _ingest(self, msg) -> None:
        await super()._ingest(msg)
        self.ingested += 1
        if self.ingested == self.until:
            self.t_last_ingest = time.perf_counter()
            self.all_ingested.set()


class Bench:
    """One nats-server and connection for every run; `run_one(variant, rep)`."""

    def __init__(self, args, url: str, nc, n: int, profile: bool = False) -> None:
        self.args, self.url, self.nc, self.js, self.n = args, url, nc, nc.jetstream(), n
        self.profiles: dict[str, str] | None = {} if profile else None  # variant -> top fns

    async def run_one(self, variant: str, rep: int) -> dict:
        s = Subjects(f"bi{uuid.uuid4().hex[:10]}")
        await ensure_streams(self.js, s)
        msgs = requests(s, self.n)
        try:
            if variant == "publish-sync":
                m = await self.publish_sync(msgs)
            elif variant == "publish-async":
                m = {"elapsed_s": await publish_async(self.js, msgs)}
            else:
                await publish_async(self.js, msgs)  # the backlog to consume: not timed
                m = await self.consume(variant, s)
        finally:
            await self.drop_streams(s)
        m = {"n": self.n, **m, "rate": self.n / m["elapsed_s"]}
        print(f"    {variant} rep {rep}: {m['rate']:,.0f} requests/s", file=sys.stderr, flush=True)
        return m

    async def publish_sync(self, msgs) -> dict:
        t0 = time.perf_counter()
        for subj, body, hdrs in msgs:
            await self.js.publish(subj, body, headers=hdrs)
        return {"elapsed_s": time.perf_counter() - t0}

    async def consume(self, variant: str, s: Subjects) -> dict:
        if variant in ("fetch-held", "fetch-ack"):
            return await raw_fetch(self.nc, self.js, s, self.n, self.args.batch,
                                   ack=variant == "fetch-ack")
        prof = None
        if self.profiles is not None and variant not in self.profiles:
            prof = cProfile.Profile()
        base, young = dispatcher_gc(variant)
        with tuned_gc(young):  # around the dispatcher's whole life, as its process does
            if base == "ingest":
                m = await dispatcher_ingest(self.url, s, self.n, self.args.batch, prof)
            elif base == "ingest-dispatch":
                m = await dispatcher_drain(self.url, s, self.n, self.args, prof)
            else:
                raise ValueError(f"unknown variant {variant!r}")
        if prof is not None:
            self.profiles[variant] = profile_text(prof)
        return m

    async def drop_streams(self, s: Subjects) -> None:
        """Each run's stream goes when the run ends: 20,000 requests are ~12 MB on disk."""
        for name in (s.requests_stream, s.usage_stream, f"KV_{s.prefix}_leader"):
            with contextlib.suppress(Exception):
                await self.js.delete_stream(name)


async def publish_async(js, msgs, window: int = 1000) -> float:
    """Seconds from the first publish to the last ack received."""
    t0 = time.perf_counter()
    for i in range(0, len(msgs), window):
        futs = [await js.publish_async(s, b, headers=h) for s, b, h in msgs[i:i + window]]
        await asyncio.gather(*futs)
    return time.perf_counter() - t0


async def raw_fetch(nc, js, subjects: Subjects, n: int, batch: int, ack: bool) -> dict:
    """A pull consumer configured as the dispatcher's (`dispatcher.ingest`), created
    before the clock starts; timed from the first fetch call to the N-th message
    received (and, acking, to the acks flushed to the server)."""
    name = f"raw_{uuid.uuid4().hex[:8]}"
    cfg = ConsumerConfig(durable_name=name, name=name,
                         filter_subject=subjects.requests_tier(POOL, TIER),
                         ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL,
                         ack_wait=30.0, max_ack_pending=200_000, max_deliver=-1, max_waiting=16)
    stream = subjects.requests_stream
    await js.add_consumer(stream, config=cfg)
    sub = await js.pull_subscribe_bind(durable=name, stream=stream)
    got = fetches = 0
    t0 = time.perf_counter()
    while got < n:
        try:
            msgs = await sub.fetch(batch, timeout=1.0)
        except (nats.errors.TimeoutError, TimeoutError):
            continue
        fetches += 1
        got += len(msgs)
        if ack:
            for m in msgs:
                await m.ack()
    if ack:
        await nc.flush()
    elapsed = time.perf_counter() - t0
    await sub.unsubscribe()
    return {"elapsed_s": elapsed, "fetches": fetches}


def make_dispatcher(url: str, subjects: Subjects, n: int, batch: int) -> TimedDispatcher:
    """A dispatcher configured as `python -m dispatcher` does (default tenants)."""
    ds = DispatcherSettings(nats_url=url, prefix=subjects.prefix, pool=POOL, fetch_batch=batch,
                            log_level="warning")
    return TimedDispatcher(ds, tenants=TenantsWatcher(ds.tenants_file or None), until=n)


def dispatcher_gc(variant: str) -> tuple[str, int]:
    """(the variant without its GC suffix, the collector setting it runs under): the
    dispatcher's own (`--gc-young-objects`, as `python -m dispatcher` applies it), or
    ``-gc-default``: the interpreter's (what every dispatcher ran before fairlane.gctune)."""
    if variant.endswith(GC_DEFAULT):
        return variant.removesuffix(GC_DEFAULT), 0
    return variant, DispatcherSettings().gc_young_objects


async def dispatcher_ingest(url: str, subjects: Subjects, n: int, batch: int,
                            prof: cProfile.Profile | None) -> dict:
    d = make_dispatcher(url, subjects, n, batch)
    if prof:
        prof.enable()
    with ProcessCost() as cost:  # from start(): a few ms more than the timed window
        t_start = time.perf_counter()
        await d.start()
        start_s = time.perf_counter() - t_start
        await asyncio.wait_for(d.all_ingested.wait(), 300)
    if prof:
        prof.disable()
    queued = d.scheduler.num_queued
    await d.stop()  # un-acked messages go back to the stream, which is dropped next
    return {"elapsed_s": d.t_last_ingest - d.t_first_fetch, "start_s": start_s,
            "queued_at_end": queued, **cost.figures()}


async def dispatcher_drain(url: str, subjects: Subjects, n: int, args,
                           prof: cProfile.Profile | None) -> dict:
    peer = subprocess.Popen(
        [sys.executable, __file__, "--puller", url, subjects.work(POOL), str(n),
         str(args.pullers), str(args.max_items)], stdout=subprocess.PIPE, text=True)
    loop = asyncio.get_running_loop()
    try:
        ready = await loop.run_in_executor(None, peer.stdout.readline)
        if ready.strip() != "ready":
            raise RuntimeError(f"puller did not start: {ready!r}")
        d = make_dispatcher(url, subjects, n, args.batch)
        if prof:
            prof.enable()
        with ProcessCost() as cost:  # from start() to the peer's report read
            await d.start()
            line = await asyncio.wait_for(loop.run_in_executor(None, peer.stdout.readline),
                                          300)
        if prof:
            prof.disable()
        res = json.loads(line)
        queued, in_flight = d.scheduler.num_queued, d.scheduler.num_in_flight
        await d.stop()
        return {"elapsed_s": res["t_done"] - d.t_first_fetch, "pulls": res["pulls"],
                "duplicates": res["duplicates"], "queued_at_end": queued,
                "in_flight_at_end": in_flight, **cost.figures()}
    finally:
        if peer.poll() is None:
            peer.terminate()
        peer.wait(10)


async def puller_main(url: str, subject: str, n: int, pullers: int, max_items: int) -> None:
    """Child process: `pullers` concurrent long-polls, like workers with room. Reports
    (on stdout) the perf_counter reading at which it held n distinct requests."""
    nc = await nats.connect(url)
    seen: set[str] = set()
    pulls = duplicates = 0
    done = asyncio.Event()
    t_done = 0.0

    async def loop(k: int) -> None:
        nonlocal pulls, duplicates, t_done
        pull = encode(PullRequest(worker_id=f"bench-w{k}", pool=POOL, max_items=max_items,
                                  wait_ms=1000))
        while not done.is_set():
            try:
                msg = await nc.request(subject, pull, timeout=3.0)
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                await asyncio.sleep(0.005)
                continue
            pulls += 1
            for item in decode_work_batch(msg.data).items:
                rid = item.request.request_id
                duplicates += rid in seen
                seen.add(rid)
            if len(seen) >= n and not done.is_set():
                t_done = time.perf_counter()
                done.set()

    print("ready", flush=True)
    tasks = [asyncio.create_task(loop(k)) for k in range(pullers)]
    await done.wait()
    for t in tasks:
        t.cancel()
    print(json.dumps({"t_done": t_done, "got": len(seen), "pulls": pulls,
                      "duplicates": duplicates}), flush=True)
    await nc.close()


def profile_text(prof: cProfile.Profile, top: int = 25) -> str:
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return "\n".join(ln for ln in buf.getvalue().splitlines() if ln.strip())


def check_clock() -> None:
    """The puller child's reading is compared with this process's: both must read the
    same system-wide clock."""
    impl = time.get_clock_info("perf_counter").implementation
    if "CLOCK_MONOTONIC" not in impl:
        raise SystemExit(f"perf_counter is {impl}, not CLOCK_MONOTONIC: the ingest-dispatch "
                         "row would compare two processes' clocks")


async def run(args) -> tuple[list, list, dict, dict]:
    setup = {"n": args.n, "batch": args.batch, "pullers": args.pullers,
             "max_items": args.max_items, "reps": args.reps, "warmup_n": args.warmup_n,
             "num_tenants": NUM_TENANTS, "body_bytes": len(requests(Subjects("x"), 1)[0][1]),
             "nats_version": server_version(), "clock": CLOCK, "variants": list(VARIANTS),
             "loadavg_start": [round(x, 2) for x in os.getloadavg()]}
    server = NatsServer().start()
    try:
        nc = await nats.connect(server.url)
        t_bench = time.perf_counter()
        warm = Bench(args, server.url, nc, args.warmup_n)
        warmup = await run_interleaved(VARIANTS, 1, warm.run_one)
        bench = Bench(args, server.url, nc, args.n)
        records = await run_interleaved(VARIANTS, args.reps, bench.run_one)
        setup["bench_s"] = round(time.perf_counter() - t_bench, 1)
        profiles = {}
        if args.profile:  # extra runs after the measured ones: a profiler slows its run
            profiled = Bench(args, server.url, nc, args.n, profile=True)
            for variant in ("ingest", "ingest-dispatch"):
                await profiled.run_one(variant, -1)
            profiles = profiled.profiles
        await nc.close()
    finally:
        server.stop()
    setup["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    return records, warmup, setup, profiles


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20_000, help="requests per run (every variant)")
    ap.add_argument("--batch", type=int, default=DispatcherSettings().fetch_batch)
    ap.add_argument("--pullers", type=int, default=4, help="concurrent pulls (ingest-dispatch)")
    ap.add_argument("--max-items", type=int, default=36, help="items per pull (32 seqs + 4)")
    ap.add_argument("--reps", type=int, default=5, help="interleaved repetitions")
    ap.add_argument("--warmup-n", type=int, default=2_000,
                    help="requests per variant in the untimed warm-up repetition")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile an extra (uncounted) ingest and ingest-dispatch run")
    ap.add_argument("--output", type=Path, default=RESULTS,
                    help="results markdown; the JSON goes beside it (same stem)")
    a = ap.parse_args(argv)
    if min(a.n, a.reps, a.warmup_n, a.batch, a.pullers, a.max_items) < 1:
        ap.error("--n, --reps, --warmup-n, --batch, --pullers, --max-items must be >= 1")
    return a


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--puller":
        url, subject, n, pullers, max_items = sys.argv[2:7]
        uvloop.run(puller_main(url, subject, int(n), int(pullers), int(max_items)))
        return 0
    args = parse_args()
    # SIGTERM (a timeout) unwinds like Ctrl-C, so `run`'s finally stops nats-server.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    check_clock()
    configure_logging("warning", False)
    meta = RunMeta.here()
    records, warmup, setup, profiles = uvloop.run(run(args))
    data = {"setup": setup, "warmup": [asdict(r) for r in warmup],
            "records": [asdict(r) for r in records]}
    data["note"] = note_for(data)
    body = report(data)
    for variant, text in profiles.items():
        body += (f"\n## cProfile of an extra `{variant}` run, not counted (by own time)\n\n"
                 f"```\n{text}\n```\n")
    md, js = write_results(args.output, TITLE, body, data, meta, HOW_TO_READ)
    print(body)
    print(f"-> {md}, {js}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
