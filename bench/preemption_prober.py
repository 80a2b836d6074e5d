"""A prober in a client process of its own, for `bench/preemption.py` (`--prober process`).

A quiet tenant and a flooding one are different organisations: their clients are
different processes (usually different machines), each with its own NATS connection
and event loop. With both in the bench's one process, the prober's first chunk waited
in the same loop and the same socket as the flood's ~64 token streams, and that wait
(the "rest" of the prober's TTFT: p50 4 ms, p99 15.5 ms during A's burst at 90dd073)
was counted as the fleet's. Here the prober runs `bench.preemption_fleet.probe` in its
own process, so the bench measures what the fleet gives a tenant whose client is not
its neighbour's.

Protocol with the parent (`run_prober`): the child connects, prints `READY`, waits for
one line on stdin (`GO`), probes and cancels what is left (`probe_records`), and prints
one JSON line with the probe records (`preempted_for` left to the parent: it reads the
dispatcher's log). The parent's clock marks the window at `GO`.

    python bench/preemption_prober.py --nats-url URL --prefix P --tenant L --seed 7 \\
        --duration-s 20.5 --out-min 16 --out-max 48
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.preemption_fleet import probe_records  # noqa: E402
from producer.client import FairlaneClient  # noqa: E402

READY, GO = "READY", "GO"
READY_TIMEOUT_S = 60.0


def prober_argv(*, nats_url: str, prefix: str, tenant: str, seed: int, duration_s: float,
                out_range: tuple[int, int], args, done_grace_s: float | None) -> list[str]:
    """The child's command line (everything `probe` reads from the bench's args)."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--nats-url", nats_url,
            "--prefix", prefix, "--tenant", tenant, "--seed", str(seed),
            "--duration-s", repr(duration_s), "--out-min", str(out_range[0]),
            "--out-max", str(out_range[1]),
            "--probe-interval-s", repr(args.probe_interval_s),
            "--first-grace-s", repr(args.first_grace_s),
            "--done-grace-s", repr(args.done_grace_s if done_grace_s is None else done_grace_s)]
    if args.client_silence_s:
        argv += ["--client-silence-s", repr(args.client_silence_s)]
    return argv


async def run_prober(argv: list[str], timeout_s: float) -> tuple[list[dict], float]:
    """Start the prober, let it probe once it is connected; (records, the parent's
    loop time at GO). Raises RuntimeError if the child fails or runs over `timeout_s`
    after GO (it is killed then)."""
    loop = asyncio.get_running_loop()
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        limit=1 << 24)  # the records are one line: ~180 bytes a probe
    assert proc.stdin is not None and proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), READY_TIMEOUT_S)
        if line.decode().strip() != READY:
            raise RuntimeError(f"prober did not start: {line!r}")
        t_go = loop.time()
        proc.stdin.write(f"{GO}\n".encode())
        await proc.stdin.drain()
        out = await asyncio.wait_for(proc.stdout.readline(), timeout_s)
        rc = await asyncio.wait_for(proc.wait(), 30)
        if rc != 0 or not out:
            raise RuntimeError(f"prober exited {rc} with {out[:200]!r}")
        return json.loads(out)["probes"], t_go
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def amain(a: argparse.Namespace) -> int:
    extra = {"silence_s": a.client_silence_s} if a.client_silence_s else {}
    client = await FairlaneClient.connect(a.nats_url, prefix=a.prefix, max_buffered_chunks=4096,
                                          **extra)
    try:
        await client.nc.flush(timeout=10)
        print(READY, flush=True)
        line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        if line.strip() != GO:
            return 2
        records, _ = await probe_records(client, a.tenant, a, a.seed, a.duration_s,
                                         (a.out_min, a.out_max), a.done_grace_s)
    finally:
        await asyncio.wait_for(client.close(), 15)
    print(json.dumps({"probes": records}), flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nats-url", required=True)
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--tenant", required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--duration-s", type=float, required=True)
    ap.add_argument("--out-min", type=int, required=True)
    ap.add_argument("--out-max", type=int, required=True)
    ap.add_argument("--probe-interval-s", type=float, default=0.1)
    ap.add_argument("--first-grace-s", type=float, default=5.0)
    ap.add_argument("--done-grace-s", type=float, default=5.0)
    ap.add_argument("--client-silence-s", type=float, default=0.0)
    # The bench's own loop (asyncio's default), so that the process boundary is the
    # only difference from `--prober inline`.
    return asyncio.run(amain(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
