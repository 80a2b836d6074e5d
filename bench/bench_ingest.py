"""The dispatcher's ingest rate vs raw nats-py on the same server: `python bench/bench_ingest.py`.

All on one nats-server (loopback, JetStream file storage), same stream config as
production (`fairlane.streams.requests_config`), same payloads (encoded
`InferenceRequest`s with ``Nats-Msg-Id`` and reply headers, as the producer sends):

1. raw JetStream publish, sync (`js.publish`, one ack round trip each);
2. raw JetStream publish, async (`js.publish_async`, acks awaited in windows);
3. raw pull consumer, `fetch(batch)` with the dispatcher's batch size: fetch only
   (messages held un-acked, as the dispatcher holds them) and fetch + ack each;
4. the dispatcher (in this process, as `python -m dispatcher` builds it, no workers):
   N requests published first, then time from `start()` until
   ``scheduler.num_queued == N``;
5. the same with a stream of pulls draining the queue: a worker-like peer in a child
   process long-polls ``fl.work.<pool>`` (several pulls outstanding) and the time is
   until it has received all N.

Bounded: well under 3 minutes. ``--profile`` adds a cProfile of run 4.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import datetime as dt
import io
import json
import pstats
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import nats  # noqa: E402
import uvloop  # noqa: E402
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy  # noqa: E402

from bench.common import git_rev, machine  # noqa: E402
from dispatcher.config import DispatcherSettings  # noqa: E402
from dispatcher.service import Dispatcher  # noqa: E402
from fairlane.embedded import NatsServer, find_nats_server  # noqa: E402
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


def make_dispatcher(ds: DispatcherSettings) -> Dispatcher:
    """A dispatcher configured as `python -m dispatcher` does (default tenants)."""
    return Dispatcher(ds, tenants=TenantsWatcher(ds.tenants_file or None))


def server_version() -> str:
    with contextlib.suppress(Exception):
        out = subprocess.run([find_nats_server(), "--version"], capture_output=True, text=True,
                             timeout=5)
        return out.stdout.strip().split()[-1]
    return "?"


def requests(subjects: Subjects, n: int) -> list[tuple[str, bytes, dict]]:
    """(subject, body, headers) exactly as `FairlaneClient.submit_request` publishes."""
    inbox = subjects.inbox_prefix("bench") if hasattr(subjects, "inbox_prefix") else "_INBOX.b"
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


async def publish_sync(js, msgs) -> float:
    t0 = time.perf_counter()
    for subj, body, hdrs in msgs:
        await js.publish(subj, body, headers=hdrs)
    return time.perf_counter() - t0


async def publish_async(js, msgs, window: int = 1000) -> float:
    t0 = time.perf_counter()
    for i in range(0, len(msgs), window):
        futs = [await js.publish_async(s, b, headers=h) for s, b, h in msgs[i:i + window]]
        await asyncio.gather(*futs)
    return time.perf_counter() - t0


async def raw_fetch(js, subjects: Subjects, n: int, batch: int, ack: bool) -> float:
    name = f"raw_{uuid.uuid4().hex[:8]}"
    cfg = ConsumerConfig(durable_name=name, name=name,
                         filter_subject=subjects.requests_tier(POOL, TIER),
                         ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL,
                         ack_wait=30.0, max_ack_pending=200_000, max_deliver=-1, max_waiting=16)
    stream = subjects.requests_stream
    await js.add_consumer(stream, config=cfg)
    sub = await js.pull_subscribe_bind(durable=name, stream=stream)
    got = 0
    t0 = time.perf_counter()
    while got < n:
        try:
            msgs = await sub.fetch(batch, timeout=1.0)
        except nats.errors.TimeoutError:
            continue
        got += len(msgs)
        if ack:
            for m in msgs:
                await m.ack()
    dt_s = time.perf_counter() - t0
    await sub.unsubscribe()
    await js.delete_consumer(stream, name)
    return dt_s


async def dispatcher_ingest(url: str, subjects: Subjects, n: int, batch: int,
                            profile: cProfile.Profile | None) -> tuple[float, float]:
    """(seconds from start() to num_queued == n, seconds start() itself took)."""
    ds = DispatcherSettings(nats_url=url, prefix=subjects.prefix, pool=POOL, fetch_batch=batch,
                            log_level="warning")
    d = make_dispatcher(ds)
    if profile:
        profile.enable()
    t0 = time.perf_counter()
    await d.start()
    t_started = time.perf_counter() - t0
    while d.scheduler.num_queued < n:
        await asyncio.sleep(0.005)
    elapsed = time.perf_counter() - t0
    if profile:
        profile.disable()
    # Leave the messages un-acked for nobody: terminate nothing, just stop (nak back).
    await d.stop()
    return elapsed, t_started


async def dispatcher_drain(url: str, subjects: Subjects, n: int, batch: int,
                           pullers: int, max_items: int) -> tuple[float, int]:
    ds = DispatcherSettings(nats_url=url, prefix=subjects.prefix, pool=POOL, fetch_batch=batch,
                            log_level="warning")
    peer = subprocess.Popen(
        [sys.executable, __file__, "--puller", url, subjects.work(POOL), str(n), str(pullers),
         str(max_items)], stdout=subprocess.PIPE, text=True)
    try:
        ready = peer.stdout.readline()  # the peer is connected and pulling
        assert ready.strip() == "ready", ready
        d = make_dispatcher(ds)
        t0 = time.time()
        await d.start()
        line = await asyncio.get_running_loop().run_in_executor(None, peer.stdout.readline)
        res = json.loads(line)
        await d.stop()
        return res["t_done"] - t0, res["pulls"]
    finally:
        if peer.poll() is None:
            peer.terminate()
        peer.wait(10)


async def puller_main(url: str, subject: str, n: int, pullers: int, max_items: int) -> None:
    """Child process: `pullers` concurrent long-polls, like workers with room."""
    nc = await nats.connect(url)
    got = 0
    pulls = 0
    done = asyncio.Event()

    async def loop(k: int) -> None:
        nonlocal got, pulls
        pull = encode(PullRequest(worker_id=f"bench-w{k}", pool=POOL, max_items=max_items,
                                  wait_ms=1000))
        while not done.is_set():
            try:
                msg = await nc.request(subject, pull, timeout=3.0)
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                await asyncio.sleep(0.005)
                continue
            pulls += 1
            got += len(decode_work_batch(msg.data).items)
            if got >= n:
                done.set()

    print("ready", flush=True)
    tasks = [asyncio.create_task(loop(k)) for k in range(pullers)]
    await done.wait()
    t_done = time.time()
    for t in tasks:
        t.cancel()
    print(json.dumps({"t_done": t_done, "got": got, "pulls": pulls}), flush=True)
    await nc.close()


async def main_async(args) -> str:
    n, batch = args.n, args.batch
    server = NatsServer().start()
    rows: list[tuple[str, float, str]] = []
    prof = cProfile.Profile() if args.profile else None
    try:
        nc = await nats.connect(server.url)
        js = nc.jetstream()

        # 1, 2: publish rates (each on its own prefix = its own stream).
        s_sync = Subjects(f"bs{uuid.uuid4().hex[:8]}")
        await ensure_streams(js, s_sync)
        m_sync = requests(s_sync, n)
        t = await publish_sync(js, m_sync)
        rows.append(("raw JetStream publish, sync (await js.publish each)", n / t, f"{t:.2f} s for N"))

        # 2-4, interleaved over reps (the machine is shared: medians of side-by-side runs).
        pub, held, acked, disp = [], [], [], []
        t_start = 0.0
        for _ in range(args.reps):
            s_raw = Subjects(f"br{uuid.uuid4().hex[:8]}")
            await ensure_streams(js, s_raw)
            pub.append(n / await publish_async(js, requests(s_raw, n)))
            held.append(n / await raw_fetch(js, s_raw, n, batch, ack=False))
            # Same messages again (still un-acked), this time acked.
            acked.append(n / await raw_fetch(js, s_raw, n, batch, ack=True))
            s_d = Subjects(f"bd{uuid.uuid4().hex[:8]}")
            await ensure_streams(js, s_d)
            await publish_async(js, requests(s_d, n))
            t, t_start = await dispatcher_ingest(server.url, s_d, n, batch,
                                                 prof if not disp else None)
            disp.append(n / t)

        def agg(xs: list[float]) -> tuple[float, str]:
            return statistics.median(xs), f"median of {len(xs)}: " + ", ".join(f"{x:,.0f}" for x in xs)

        rows.append(("raw JetStream publish_async, acks gathered per 1,000", *agg(pub)))
        rows.append((f"raw pull fetch({batch}), held un-acked (as the dispatcher holds)", *agg(held)))
        raw_fetch_rate = statistics.median(held)
        rows.append((f"raw pull fetch({batch}) + ack each", *agg(acked)))
        disp_rate, detail = agg(disp)
        rows.append((f"dispatcher ingest, fetch_batch={batch}, no workers (start() until num_queued == N)",
                     disp_rate, f"{detail} (start() itself {t_start * 1000:.0f} ms)"))

        # 5: the dispatcher with pulls draining.
        s_w = Subjects(f"bw{uuid.uuid4().hex[:8]}")
        await ensure_streams(js, s_w)
        await publish_async(js, requests(s_w, n))
        t, pulls = await dispatcher_drain(server.url, s_w, n, batch, args.pullers, args.max_items)
        drain_rate = n / t
        rows.append((f"dispatcher ingest + dispatch, {args.pullers} concurrent pulls of "
                     f"max_items={args.max_items} (until all N received)", drain_rate,
                     f"{t:.2f} s for N, {pulls} pulls"))
        await nc.close()
    finally:
        server.stop()

    cmd = "python " + " ".join([str(Path(sys.argv[0]))] + sys.argv[1:])
    lines = [
        "# bench_ingest: dispatcher ingest rate vs raw nats-py",
        "",
        f"- command: `{cmd}`",
        f"- machine: {machine()}",
        f"- date: {dt.datetime.now(dt.UTC).isoformat(timespec='seconds')}; code: {git_rev()}",
        f"- N = {n:,} requests ({NUM_TENANTS} tenants, one tier, ~{len(m_sync[0][1])} B bodies "
        f"+ Nats-Msg-Id/reply headers), fetch batch {batch}; one nats-server {server_version()} "
        "(loopback, JetStream file storage, production stream config); uvloop; each row in turn "
        "on its own stream",
        "",
        "| what | requests/s | detail (requests/s per rep, or time) |",
        "|---|---:|---|",
    ]
    for what, rate, t in rows:
        lines.append(f"| {what} | {rate:,.0f} | {t} |")
    lines += [
        "",
        f"- ratio dispatcher ingest / raw fetch (held): **{disp_rate / raw_fetch_rate:.2f}**",
        f"- ratio dispatcher ingest+dispatch / raw fetch (held): **{drain_rate / raw_fetch_rate:.2f}**",
    ]
    if prof is not None:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        lines += ["", "## cProfile of the dispatcher ingest run (by own time, top 25)", "",
                  "```", *[ln for ln in buf.getvalue().splitlines() if ln.strip()][:40], "```"]
    return "\n".join(lines) + "\n"


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--puller":
        url, subject, n, pullers, max_items = sys.argv[2:7]
        uvloop.run(puller_main(url, subject, int(n), int(pullers), int(max_items)))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--batch", type=int, default=DispatcherSettings().fetch_batch)
    ap.add_argument("--pullers", type=int, default=4, help="concurrent pulls in the drain run")
    ap.add_argument("--max-items", type=int, default=36, help="items per pull (32 seqs + 4)")
    ap.add_argument("--reps", type=int, default=3, help="side-by-side reps of rows 2-4")
    ap.add_argument("--profile", action="store_true", help="cProfile the dispatcher ingest run")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "ingest.md"))
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
