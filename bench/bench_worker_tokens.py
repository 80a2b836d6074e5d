"""The worker's token path across commits: CPU per token, and how soon tokens leave.

    python bench/bench_worker_tokens.py [--base REV] [--reps 5] [--window-s 20]

One worker process streams `--streams` requests at once (closed loop: a request that
ends is replaced at once), outputs of 256 tokens, through a real nats-server and
dispatcher to a producer (`FairlaneClient`) in this process. Variants, each its own
fleet per run (a dispatcher and one `gpu_worker --engine sim --time-scale 1.0`):

- `base`: the worker from commit `--base` (default `BASE_REV`, the last commit whose
  worker held every token but the first for a whole coalescing window, with a
  `wait_for` per token), coalesce_ms 5;
- `now`: the worker from this checkout, coalesce_ms 5 (the default);
- `now-c0`: this checkout, coalesce_ms 0: every token published the moment it is
  read, the floor for both.

Only the worker differs: the dispatcher, nats-server and the client are this
checkout's. The base commit's tree comes from `git archive` into a temporary directory;
its worker runs from there (`bench.fleet.WorkerSpec.source`).

Engines (rows): `default` step model with 32 streams (this machine's fidelity fleet,
~13 ms steps, ~2,500 tokens/s) and `h100_llama7b_torch` with 128 streams (a 7B model on
one H100 as bench/calibrate_gpu.py measured it, ~11.5 ms steps, ~11,000 tokens/s: the
rate a GPU worker's event loop must keep up with).

Per run, in a window after a warm-up on the same load (`--warmup-s`), from the
chunks that arrive in it:
- **worker CPU µs per token**: the worker process's utime + stime over the window
  (/proc/<pid>/stat) ÷ the tokens its streams delivered in it; and its cores;
- **tokens/s** and **chunks per token** (1.0: every token its own message);
- **second-token gap p50**: per request, its second token's arrival minus its first's.
  The first token always goes out at once; a worker that holds the next for a
  coalescing window shows it here (a step plus the hold), and every later token is
  as late; the last rides on the final chunk either way, so the end-to-end time does
  not show it.
- **TPOT p50** (the mean gap per request from its first to its last token): a worker
  whose event loop falls behind its engine steps slower than the model.

Variants interleaved, order reversed every other repetition (`bench.harness`), `--reps`
(5) repetitions; results are medians (min–max) over repetitions. Writes
bench/results/worker_tokens.{md,json}. About 15 minutes with the defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.fidelity_load import prompt_of  # noqa: E402
from bench.fidelity_real import machine_ticks, proc_cpu_s  # noqa: E402
from bench.fleet import Fleet, WorkerSpec, base_tree  # noqa: E402
from bench.harness import RunMeta, run_interleaved, short_rev, write_results  # noqa: E402
from bench.render_worker_tokens import HOW_TO_READ, TITLE, VARIANT_LABELS, report  # noqa: E402
from fairlane.embedded import NatsServer  # noqa: E402
from producer.client import FairlaneClient, RequestError, RequestSpec, SamplingParams  # noqa: E402

# The commit before the worker's coalescing became a per-request rate limit.
BASE_REV = "b0eb9d9"
ENGINES = {"default": ("default", 32), "h100": ("h100_llama7b_torch", 128)}
VARIANTS = tuple(VARIANT_LABELS)  # base, now, now-c0 (module docstring)
OUTPUT_TOKENS = 256
PROMPT_TOKENS = 32
TENANTS_YAML = ("tiers:\n  - {name: free}\npools:\n  default: {policy: drr}\n"
                "tenants:\n  bench: {tier: free}\n")


@dataclass
class Stream:
    """One request's token arrivals (loop clock, s) and token counts per chunk."""

    t_chunks: list[float] = field(default_factory=list)
    n_chunks: list[int] = field(default_factory=list)


# --- figures (pure) -------------------------------------------------------------------------


def token_times(s: Stream) -> list[float]:
    """Each token's arrival: a chunk's tokens all arrive with it."""
    return [t for t, n in zip(s.t_chunks, s.n_chunks, strict=True) for _ in range(n)]


def second_token_gap_ms(times: list[float]) -> float | None:
    """From `token_times`: the second token's arrival minus the first's."""
    return (times[1] - times[0]) * 1000 if len(times) >= 3 else None  # not the last


def tpot_ms(times: list[float]) -> float | None:
    """From `token_times`: the mean gap from the first token to the last."""
    return (times[-1] - times[0]) * 1000 / (len(times) - 1) if len(times) >= 2 else None


def window_figures(streams: list[Stream], w0: float, w1: float, cpu_s: float,
                   busy_frac: float | None) -> dict[str, Any]:
    """The run's figures from the chunks arriving in [w0, w1) and the worker's CPU
    seconds over it; gaps and TPOT of the requests whose first token came in it."""
    tokens = chunks = 0
    for s in streams:
        for t, n in zip(s.t_chunks, s.n_chunks, strict=True):
            if w0 <= t < w1 and n:
                tokens += n
                chunks += 1
    timed = [token_times(s) for s in streams if s.t_chunks and w0 <= s.t_chunks[0] < w1]
    gaps = [g for t in timed if (g := second_token_gap_ms(t)) is not None]
    tpots = [x for t in timed if (x := tpot_ms(t)) is not None]
    span_s = w1 - w0
    return {
        "window_s": round(span_s, 3), "tokens": tokens, "chunks": chunks,
        "tokens_per_s": tokens / span_s if span_s > 0 else None,
        "chunks_per_token": chunks / tokens if tokens else None,
        "worker_cpu_s": cpu_s, "worker_cores": cpu_s / span_s if span_s > 0 else None,
        "worker_cpu_us_per_token": cpu_s * 1e6 / tokens if tokens else None,
        "second_token_gap_ms_p50": statistics.median(gaps) if gaps else None,
        "tpot_ms_p50": statistics.median(tpots) if tpots else None,
        "requests_timed": len(timed), "machine_busy_frac": busy_frac,
    }


# --- one run --------------------------------------------------------------------------------


async def closed_loop(client: FairlaneClient, n: int, streams: list[Stream],
                      stop: asyncio.Event, errors: list[str]) -> None:
    loop = asyncio.get_running_loop()

    async def one(i: int) -> None:
        # The loops' first requests end at staggered times (1/n .. n/n of a full
        # one), so requests start and finish spread out, not in waves of n.
        out = max(1, OUTPUT_TOKENS * (i + 1) // n)
        while not stop.is_set():
            s = Stream()
            streams.append(s)
            try:
                stream = await client.submit(RequestSpec(
                    tenant="bench", tier="free", prompt=prompt_of(PROMPT_TOKENS),
                    sampling=SamplingParams(max_tokens=out), expected_output_tokens=out))
                out = OUTPUT_TOKENS
                async for chunk in stream:
                    k = chunk.num_tokens or len(chunk.token_ids or ())
                    if k:
                        s.t_chunks.append(loop.time())
                        s.n_chunks.append(k)
                    if stop.is_set():
                        break
            except RequestError as exc:
                errors.append(exc.error.code.value)
                await asyncio.sleep(0.1)

    tasks = [loop.create_task(one(i)) for i in range(n)]
    await stop.wait()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class Bench:
    args: argparse.Namespace
    nats_url: str
    base_tree: Path
    log_root: Path
    notes: list[str] = field(default_factory=list)
    run_no: int = 0

    async def run_one(self, name: str, rep: int) -> dict[str, Any]:
        engine, _, variant = name.partition(":")
        step_model, streams_n = ENGINES[engine]
        self.run_no += 1
        prefix = f"wt{self.run_no}"
        spec = WorkerSpec(max_num_seqs=streams_n, prefetch_seqs=4, time_scale=1.0,
                          step_model=step_model, coalesce_ms=0 if variant == "now-c0" else 5,
                          heartbeat_ms=1000,
                          source=self.base_tree if variant == "base" else None)
        fleet = Fleet(self.nats_url, prefix, TENANTS_YAML, "drr", self.log_root / prefix,
                      num_workers=1, worker=spec)
        loop = asyncio.get_running_loop()
        streams: list[Stream] = []
        errors: list[str] = []
        stop = asyncio.Event()
        client = None
        try:
            await fleet.start()
            client = await FairlaneClient.connect(self.nats_url, prefix=prefix,
                                                  max_buffered_chunks=4096)
            worker_pid = next(p.pid for n, p in fleet.procs if n == "worker0")
            load = loop.create_task(closed_loop(client, streams_n, streams, stop, errors))
            await asyncio.sleep(self.args.warmup_s)  # the measured load, not counted
            w0, cpu0, ticks0 = loop.time(), proc_cpu_s(worker_pid), machine_ticks()
            await asyncio.sleep(self.args.window_s)
            w1, cpu1, ticks1 = loop.time(), proc_cpu_s(worker_pid), machine_ticks()
            stop.set()
            await load
        finally:
            stop.set()
            if client is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(client.close(), 15)
            with contextlib.suppress(Exception):
                await fleet.wait_idle(15)
            codes = await fleet.stop(grace_s=6.0)
            if any(c != 0 for c in codes.values()):
                self.notes.append(f"{name} rep {rep}: exit codes {codes}")
        if cpu0 is None or cpu1 is None:
            raise RuntimeError("the worker exited during the window")
        ticks = ticks1[1] - ticks0[1]
        busy = (ticks1[0] - ticks0[0]) / ticks if ticks else None
        out = window_figures(streams, w0, w1, cpu1 - cpu0, busy)
        out["errors"] = errors
        return out


async def amain(args: argparse.Namespace) -> int:
    meta = RunMeta.here()
    base_commit = short_rev(args.base)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fl-wtok-") as tmp:
        tree = base_tree(args.base, Path(tmp) / "base")
        with NatsServer(store_dir=str(Path(tmp) / "js")) as ns:
            bench = Bench(args, ns.url, tree, Path(tmp) / "logs")
            names = [f"{e}:{v}" for e in args.engines.split(",") for v in VARIANTS]
            records = await run_interleaved(names, args.reps, bench.run_one)
    data = {"base_commit": base_commit, "engines": {e: {"step_model": ENGINES[e][0],
                                                        "streams": ENGINES[e][1]}
                                                    for e in args.engines.split(",")},
            "output_tokens": OUTPUT_TOKENS, "prompt_tokens": PROMPT_TOKENS,
            "warmup_s": args.warmup_s, "window_s": args.window_s, "reps": args.reps,
            "wall_s": round(time.monotonic() - t0, 1), "notes": bench.notes,
            "records": [r.__dict__ for r in records]}
    body = report(data)
    print(body)
    md, js = write_results(Path(args.out), TITLE, body, data, meta, HOW_TO_READ)
    print(f"(written to {md} and {js})", file=sys.stderr)
    return 0 if all(r.error is None for r in records) else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default=BASE_REV, help="the commit the `base` worker runs")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup-s", type=float, default=8.0)
    ap.add_argument("--window-s", type=float, default=20.0)
    ap.add_argument("--engines", default=",".join(ENGINES), help="of: " + ", ".join(ENGINES))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "worker_tokens.md"))
    args = ap.parse_args(argv)
    unknown = set(args.engines.split(",")) - set(ENGINES)
    if unknown:
        ap.error(f"--engines: unknown {sorted(unknown)}")
    if args.reps < 1 or args.window_s <= 0 or args.warmup_s < 0:
        ap.error("--reps >= 1, --window-s > 0, --warmup-s >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(amain(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
