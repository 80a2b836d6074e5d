"""How fast does the streamer relay tokens, and how much latency does it add?

Loopback only, one machine. Starts a nats-server and the streamer (``python -m
streamer``, its own process) on free 127.0.0.1 ports; this process plays the fleet
(publishes TokenChunks to the requests' reply subjects) and the clients.

1. throughput: N websocket clients each stream T tokens (one token per chunk) through
   the streamer, fleet publishing as fast as it can; compared with the same publisher
   sending the same chunks to N raw core-NATS subscribers (no streamer).
2. added latency: the same N streams paced at R chunks/s each (well under capacity,
   so queues stay short); each chunk carries its publish time (CLOCK_MONOTONIC, shared
   by processes on one machine); p50/p99 of publish->client for raw NATS vs via the
   streamer, and the difference.

    python bench/bench_streamer.py --clients 8 --tokens 5000 --rate 200 --seconds 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import msgspec
import nats
import websockets

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import quantile  # noqa: E402
from fairlane.embedded import NatsServer, free_port  # noqa: E402
from fairlane.protocol import TokenChunk, decode_chunk, decode_request, encode  # noqa: E402
from fairlane.streams import ensure_streams  # noqa: E402
from fairlane.subjects import Subjects  # noqa: E402
from fairlane.tenants import hash_api_key  # noqa: E402

KEY = "sk-bench"
PREFIX = "bench"


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


def stamp() -> str:
    return str(time.monotonic_ns())


async def publish_streams(nc, reply_subjects: list[str], n: int, rate: float, rids: list[str]):
    """Publish n chunks to each subject, interleaved; paced at `rate` chunks/s/stream
    (0 = as fast as possible). The last chunk has finish_reason."""
    interval = 1.0 / rate if rate else 0.0
    start = time.monotonic()
    for seq in range(n):
        last = seq == n - 1
        for subj, rid in zip(reply_subjects, rids, strict=True):
            chunk = TokenChunk(request_id=rid, seq=seq, text=stamp(), num_tokens=1,
                               finish_reason="length" if last else None)
            await nc.publish(subj, encode(chunk))
        if interval:
            delay = start + (seq + 1) * interval - time.monotonic()
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
                    end[0] = time.monotonic()
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
                    return time.monotonic()
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
    total, end, lat = 0, 0.0, []
    for _ in ps:
        n, e, xs = await asyncio.to_thread(q.get, True, 180)
        total, end = total + n, max(end, e)
        lat.extend(xs)
    for p in ps:
        p.join(10)
    return total, end, lat


async def wait_ready_children(q, ps) -> None:
    for _ in ps:
        msg = await asyncio.to_thread(q.get, True, 60)
        assert msg == "ready", msg


async def raw_nats(url: str, clients: int, n: int, rate: float, procs: int
                   ) -> tuple[float, list[float]]:
    """Baseline: the same chunks to N plain core-NATS subscribers (no streamer)."""
    q, ps = start_children("raw", url, clients, procs)
    await wait_ready_children(q, ps)
    pub = await nats.connect(url)
    t0 = time.monotonic()
    ids = [f"c{i}" for i in range(clients)]
    await publish_streams(pub, [f"raw.{i}" for i in ids], n, rate, ids)
    total, end, lat = await gather_children(q, ps)
    await pub.close()
    return total / (end - t0), lat


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
                       procs: int, streamer_pid: int) -> tuple[float, list[float], float]:
    nc = await nats.connect(nats_url)
    fleet = Fleet(nc, Subjects(PREFIX))
    q, ps = start_children("ws", ws_url, clients, procs)
    reqs = await fleet.collect(clients)
    await wait_ready_children(q, ps)
    t0, cpu0 = time.monotonic(), cpu_s(streamer_pid)
    await publish_streams(nc, [r.reply_to for r in reqs], n, rate, [r.request_id for r in reqs])
    total, end, lat = await gather_children(q, ps)
    busy = (cpu_s(streamer_pid) - cpu0) / (time.monotonic() - t0)
    await nc.close()
    return total / (end - t0), lat, busy


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


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=5000, help="tokens per client (throughput)")
    ap.add_argument("--rate", type=float, default=200, help="chunks/s per stream (latency)")
    ap.add_argument("--seconds", type=float, default=3.0, help="latency phase length")
    ap.add_argument("--client-procs", type=int, default=1, help="processes running clients")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp, NatsServer() as ns:
        tenants = Path(tmp) / "tenants.yaml"
        tenants.write_text(f'tenants:\n  bench: {{api_keys: ["{hash_api_key(KEY)}"]}}\n')
        port = free_port()
        proc = start_streamer(ns.url, port, str(tenants))
        try:
            nc = await nats.connect(ns.url)
            await ensure_streams(nc.jetstream(), Subjects(PREFIX))
            await nc.close()
            base = f"http://127.0.0.1:{port}"
            await wait_ready(base, proc)
            ws_url = f"ws://127.0.0.1:{port}/v1/stream"
            c, n = args.clients, args.tokens
            print(f"clients={c} tokens/client={n} (1 token per chunk), loopback, "
                  f"streamer in its own process, clients in {args.client_procs} other(s), "
                  f"{os.cpu_count()} CPUs")
            p = args.client_procs
            raw_tps, _ = await raw_nats(ns.url, c, n, 0, p)
            ws_tps, _, busy = await via_streamer(ns.url, ws_url, c, n, 0, p, proc.pid)
            print(f"throughput  raw core NATS : {raw_tps:12,.0f} tokens/s")
            print(f"throughput  via streamer  : {ws_tps:12,.0f} tokens/s "
                  f"({ws_tps / raw_tps:.0%} of raw; streamer process CPU {busy:.0%} of one core)")
            m = max(2, int(args.rate * args.seconds))
            _, raw_lat = await raw_nats(ns.url, c, m, args.rate, p)
            _, ws_lat, _ = await via_streamer(ns.url, ws_url, c, m, args.rate, p, proc.pid)
            print(f"latency at {args.rate:g} chunks/s/stream x {c} streams "
                  f"({args.rate * c:,.0f} tokens/s), {len(ws_lat)} samples, ms publish->client:")
            for name, xs in (("raw core NATS", raw_lat), ("via streamer", ws_lat)):
                print(f"  {name:14s}: p50 {quantile(xs, 0.50):7.3f}  p99 {quantile(xs, 0.99):7.3f}  "
                      f"max {max(xs):7.3f}")
            print(f"  added by streamer: p50 {quantile(ws_lat, 0.50) - quantile(raw_lat, 0.50):+.3f} ms  "
                  f"p99 {quantile(ws_lat, 0.99) - quantile(raw_lat, 0.99):+.3f} ms")
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0


if __name__ == "__main__":
    import uvloop

    sys.exit(uvloop.run(main()))
