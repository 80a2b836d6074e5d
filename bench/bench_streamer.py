"""How fast does the streamer relay tokens, and how much latency does it add?

Loopback only, one machine. Starts a nats-server and the streamer (``python -m
streamer``, its own process) on free 127.0.0.1 ports; this process plays the fleet
(publishes TokenChunks to the requests' reply subjects) and the clients.

Two variants, compared side by side: `raw` (the same publisher sending the same chunks
to N plain core-NATS subscribers, no streamer) and `streamer` (N websocket clients
through the streamer). Each run of a variant has two phases:

1. throughput: every client streams T tokens (one token per chunk), the fleet
   publishing as fast as it can; tokens/s = all tokens / (publish start -> last end);
2. latency: the same N streams paced at R chunks/s each (well under capacity, so queues
   stay short); each chunk carries its publish time, the client its receipt time.

One clock for everything: CLOCK_MONOTONIC (`time.monotonic_ns`), the one clock the
publisher and the client processes share on one machine. `--reps` repetitions (default
5) each run both variants, the order reversed every other repetition
(bench.harness.run_interleaved), after one untimed run of each on the measured workload
(warm-up). The figures (bench/render_edge.py): tokens/s and latency p50 per repetition,
median (min–max); streamer ÷ raw and the added p50 paired per repetition; p99 pooled
over repetitions, only from >= 200 samples. Writes bench/results/streamer.md and
streamer.json (bench.harness.write_results). About a minute at the defaults.

    python bench/bench_streamer.py                      # the headline run
    python bench/bench_streamer.py --quick --output /tmp/streamer.md   # a smoke run
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

import httpx
import msgspec
import nats
import websockets

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import RunMeta, RunRecord, run_interleaved, write_results  # noqa: E402
from bench.render_edge import STREAMER_VARIANTS, streamer_report  # noqa: E402
from fairlane.embedded import NatsServer, free_port  # noqa: E402
from fairlane.protocol import TokenChunk, decode_chunk, decode_request, encode  # noqa: E402
from fairlane.streams import ensure_streams  # noqa: E402
from fairlane.subjects import Subjects  # noqa: E402
from fairlane.tenants import hash_api_key  # noqa: E402

KEY = "sk-bench"
PREFIX = "bench"
RESULTS = Path(__file__).resolve().parent / "results" / "streamer.md"


class Frame(msgspec.Struct):
    type: str
    id: str | None = None
    text: str = ""


decode_frame = msgspec.json.Decoder(Frame)


def cpu_s(pid: int) -> float:
    """User+system CPU seconds of a process (Linux /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return float("nan")


def now_s() -> float:
    """The one clock of this bench (CLOCK_MONOTONIC): publisher, clients and timers."""
    return time.monotonic_ns() / 1e9


def stamp() -> str:
    """A chunk's publish time, on the same clock, in ns (the client subtracts it)."""
    return str(time.monotonic_ns())


async def publish_streams(nc, reply_subjects: list[str], n: int, rate: float, rids: list[str]):
    """Publish n chunks to each subject, interleaved; paced at `rate` chunks/s/stream
    (0 = as fast as possible). The last chunk has finish_reason."""
    interval = 1.0 / rate if rate else 0.0
    start = now_s()
    for seq in range(n):
        last = seq == n - 1
        for subj, rid in zip(reply_subjects, rids, strict=True):
            chunk = TokenChunk(request_id=rid, seq=seq, text=stamp(), num_tokens=1,
                               finish_reason="length" if last else None)
            await nc.publish(subj, encode(chunk))
        if interval:
            delay = start + (seq + 1) * interval - now_s()
            if delay > 0:
                await nc.flush()
                await asyncio.sleep(delay)
        elif seq % 64 == 63:
            await asyncio.sleep(0)  # let the subscribers' loop breathe
    await nc.flush()


# --- clients: run in child processes so the client side is not the bottleneck -------


def _child(mode: str, url: str, ids: list[str], out) -> None:
    import uvloop

    out.put(uvloop.run(_child_main(mode, url, ids, out)))


async def _child_main(mode: str, url: str, ids: list[str], out) -> tuple[int, float, list[float]]:
    lat: list[float] = []
    if mode == "raw":
        nc = await nats.connect(url)
        left = [len(ids)]
        done = asyncio.Event()
        end = [0.0]

        async def on_msg(msg):
            c = decode_chunk(msg.data)
            lat.append((time.monotonic_ns() - int(c.text)) / 1e6)
            if c.finish_reason is not None:
                left[0] -= 1
                if left[0] == 0:
                    end[0] = now_s()
                    done.set()

        for i in ids:
            await nc.subscribe(f"raw.{i}", cb=on_msg, pending_msgs_limit=10_000_000,
                               pending_bytes_limit=1 << 31)
        await nc.flush()
        out.put("ready")
        await done.wait()
        await nc.close()
        return len(lat), end[0], lat

    async def one(cid: str, ready: asyncio.Event) -> float:
        async with websockets.connect(url, additional_headers={"Authorization": f"Bearer {KEY}"},
                                      max_size=1 << 22, max_queue=4096) as ws:
            await ws.send(msgspec.json.encode({"type": "request", "id": cid, "prompt": "bench",
                                               "max_tokens": 4096}).decode())
            ready.set()
            async for raw in ws:
                f = decode_frame.decode(raw)
                if f.type == "token":
                    lat.append((time.monotonic_ns() - int(f.text)) / 1e6)
                elif f.type == "end":
                    return now_s()
                elif f.type == "error":
                    raise RuntimeError(f"stream failed: {raw}")
        raise RuntimeError("socket closed before the end frame")

    readies = [asyncio.Event() for _ in ids]
    tasks = [asyncio.create_task(one(cid, r)) for cid, r in zip(ids, readies, strict=True)]
    await asyncio.gather(*(r.wait() for r in readies))
    out.put("ready")
    ends = await asyncio.gather(*tasks)
    return len(lat), max(ends), lat


def start_children(mode: str, url: str, clients: int, procs: int):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ids = [f"c{i}" for i in range(clients)]
    shares = [ids[k::procs] for k in range(procs) if ids[k::procs]]
    ps = [ctx.Process(target=_child, args=(mode, url, share, q)) for share in shares]
    for p in ps:
        p.start()
    return q, ps


async def gather_children(q, ps) -> tuple[int, float, list[float]]:
    """(tokens received, the last client's end time, latency samples) over the client
    processes; the processes are joined afterwards (`join_children`), so a slow exit is
    not timed."""
    total, end, lat = 0, 0.0, []
    for _ in ps:
        n, e, xs = await asyncio.to_thread(q.get, True, 180)
        total, end = total + n, max(end, e)
        lat.extend(xs)
    return total, end, lat


async def join_children(ps) -> None:
    for p in ps:
        await asyncio.to_thread(p.join, 10)


async def wait_ready_children(q, ps) -> None:
    for _ in ps:
        msg = await asyncio.to_thread(q.get, True, 60)
        assert msg == "ready", msg


def phase_metrics(tokens: int, t0_s: float, end_s: float, lat: list[float]) -> dict:
    """One phase's figures; latency samples rounded to the microsecond (the JSON keeps
    every one, for the pooled p99)."""
    return {"tokens": tokens, "wall_s": end_s - t0_s, "tokens_per_s": tokens / (end_s - t0_s),
            "lat_ms": [round(x, 3) for x in lat]}


async def raw_nats(url: str, clients: int, n: int, rate: float, procs: int) -> dict:
    """Baseline: the same chunks to N plain core-NATS subscribers (no streamer)."""
    q, ps = start_children("raw", url, clients, procs)
    await wait_ready_children(q, ps)
    pub = await nats.connect(url)
    t0 = now_s()
    ids = [f"c{i}" for i in range(clients)]
    await publish_streams(pub, [f"raw.{i}" for i in ids], n, rate, ids)
    total, end, lat = await gather_children(q, ps)
    await pub.close()
    await join_children(ps)
    return phase_metrics(total, t0, end, lat)


class Fleet:
    """Collects `clients` requests from <PREFIX>_REQUESTS, then streams to all of them."""

    def __init__(self, nc, subjects: Subjects) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.subjects = subjects

    async def collect(self, clients: int) -> list:
        psub = await self.js.pull_subscribe(self.subjects.requests_all(), durable="bench-fleet",
                                            stream=self.subjects.requests_stream)
        reqs = []
        while len(reqs) < clients:
            try:
                msgs = await psub.fetch(clients - len(reqs), timeout=1)
            except (TimeoutError, nats.errors.TimeoutError):
                continue
            for m in msgs:
                await m.ack()
                reqs.append(decode_request(m.data))
        await psub.unsubscribe()
        return reqs


async def via_streamer(nats_url: str, ws_url: str, clients: int, n: int, rate: float,
                       procs: int, streamer_pid: int) -> dict:
    """The chunks to N websocket clients through the streamer; also the streamer
    process's CPU (share of one core) from publish start to the last client's end."""
    nc = await nats.connect(nats_url)
    fleet = Fleet(nc, Subjects(PREFIX))
    q, ps = start_children("ws", ws_url, clients, procs)
    reqs = await fleet.collect(clients)
    await wait_ready_children(q, ps)
    t0, cpu0 = now_s(), cpu_s(streamer_pid)
    await publish_streams(nc, [r.reply_to for r in reqs], n, rate, [r.request_id for r in reqs])
    total, end, lat = await gather_children(q, ps)
    busy = (cpu_s(streamer_pid) - cpu0) / (now_s() - t0)
    await nc.close()
    await join_children(ps)
    return {**phase_metrics(total, t0, end, lat), "streamer_cpu": busy}


async def wait_ready(base: str, proc: subprocess.Popen) -> None:
    async with httpx.AsyncClient() as http:
        for _ in range(300):
            if proc.poll() is not None:
                raise RuntimeError("streamer exited")
            try:
                if (await http.get(base + "/readyz")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.05)
    raise RuntimeError("streamer not ready")


def start_streamer(nats_url: str, port: int, tenants: str) -> subprocess.Popen:
    # Big buffers: this measures relay speed, not the slow-consumer cut-off.
    env = dict(os.environ, FAIRLANE_LOG_LEVEL="warning")
    return subprocess.Popen(
        [sys.executable, *os.environ.get("BENCH_STREAMER_PY_ARGS", "").split(), "-m", "streamer", "--nats-url", nats_url, "--prefix", PREFIX,
         "--port", str(port), "--redis-url", "", "--tenants-file", tenants,
         "--ws-send-buffer", "100000", "--max-buffered-chunks", "100000",
         "--no-usage-settler"],
        cwd=str(Path(__file__).resolve().parent.parent), env=env)


class Bench:
    """One nats-server and one streamer for the whole run; `run_one` runs one variant's
    throughput phase then its latency phase."""

    def __init__(self, args: argparse.Namespace, nats_url: str, ws_url: str, streamer_pid: int):
        self.args, self.nats_url, self.ws_url, self.pid = args, nats_url, ws_url, streamer_pid

    async def _phase(self, variant: str, chunks: int, rate: float) -> dict:
        a = self.args
        if variant == "raw":
            return await raw_nats(self.nats_url, a.clients, chunks, rate, a.client_procs)
        return await via_streamer(self.nats_url, self.ws_url, a.clients, chunks, rate,
                                  a.client_procs, self.pid)

    async def run_one(self, variant: str, _rep: int) -> dict:
        a = self.args
        thr = await self._phase(variant, a.tokens, 0)
        thr.pop("lat_ms")  # latency at saturation is queueing, not the relay's cost
        lat = await self._phase(variant, latency_chunks(a), a.rate)
        lat.pop("streamer_cpu", None)
        print(f"  {variant}: {thr['tokens_per_s']:,.0f} tokens/s; latency p50 "
              f"{sorted(lat['lat_ms'])[len(lat['lat_ms']) // 2]:.3f} ms", file=sys.stderr)
        return {"throughput": thr, "latency": {**lat, "chunks": latency_chunks(a)}}


def latency_chunks(args: argparse.Namespace) -> int:
    return max(2, int(args.rate * args.seconds))


def setup_of(args: argparse.Namespace) -> dict:
    return {"clients": args.clients, "tokens": args.tokens, "rate": args.rate,
            "seconds": args.seconds, "client_procs": args.client_procs, "reps": args.reps,
            "variants": list(STREAMER_VARIANTS), "cpus": os.cpu_count(),
            "warmup": "one untimed run of each variant on the measured workload"}


def slim(records: list[RunRecord]) -> list[RunRecord]:
    """Warm-up records without their latency samples: not counted, not kept."""
    for r in records:
        r.metrics.get("latency", {}).pop("lat_ms", None)
    return records


async def run(args: argparse.Namespace) -> dict:
    setup = setup_of(args)
    setup["loadavg_start"] = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory() as tmp, NatsServer() as ns:
        tenants = Path(tmp) / "tenants.yaml"
        tenants.write_text(f'tenants:\n  bench: {{api_keys: ["{hash_api_key(KEY)}"]}}\n')
        port = free_port()
        proc = start_streamer(ns.url, port, str(tenants))
        try:
            nc = await nats.connect(ns.url)
            await ensure_streams(nc.jetstream(), Subjects(PREFIX))
            await nc.close()
            await wait_ready(f"http://127.0.0.1:{port}", proc)
            bench = Bench(args, ns.url, f"ws://127.0.0.1:{port}/v1/stream", proc.pid)
            t0 = now_s()
            print("warm-up: one untimed run of each variant", file=sys.stderr)
            warmup = slim(await run_interleaved(STREAMER_VARIANTS, 1, bench.run_one))
            records = await run_interleaved(STREAMER_VARIANTS, args.reps, bench.run_one)
            setup["bench_s"] = now_s() - t0
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
    setup["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    # As the JSON holds them: the markdown is rendered from the same dicts the renderer reads.
    return {"setup": setup, "warmup": [asdict(r) for r in warmup],
            "records": [asdict(r) for r in records]}


HOW_TO_READ = """\
`raw`: the publisher sends the chunks to plain core-NATS subscribers (no streamer);
`streamer`: the same chunks go to the requests' reply subjects and the streamer relays
them to websocket clients. Both variants run in every repetition, the order reversed on
every other one. tokens/s and the latency p50 are per repetition, median (min–max);
the ratio and the added p50 are paired (both variants of one repetition); the p99 is
pooled over repetitions and printed only from >= 200 samples ("max=" otherwise). The
streamer is one process for the whole run (warmed up by the untimed first run)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=5000, help="tokens per client (throughput)")
    ap.add_argument("--rate", type=float, default=200, help="chunks/s per stream (latency)")
    ap.add_argument("--seconds", type=float, default=3.0, help="latency phase length")
    ap.add_argument("--client-procs", type=int, default=1, help="processes running clients")
    ap.add_argument("--reps", type=int, default=5,
                    help="repetitions, each running both variants (order alternated)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 2 reps, 1,000 tokens per client, 1 s of latency")
    ap.add_argument("--output", type=Path, default=RESULTS,
                    help="results markdown; the JSON goes beside it")
    args = ap.parse_args(argv)
    if args.quick:
        args.reps, args.tokens, args.seconds = 2, 1000, 1.0
    return args


def main() -> int:
    import uvloop

    args = parse_args()
    meta = RunMeta.here()
    data = uvloop.run(run(args))
    md, js = write_results(args.output, "Streamer: websocket relay vs raw core NATS",
                           streamer_report(data), data, meta, HOW_TO_READ)
    print(md.read_text())
    print(f"-> {md}, {js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
