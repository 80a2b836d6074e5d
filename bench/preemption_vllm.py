"""Noisy neighbour on a REAL engine: vLLM's CPU build with the tiny model, drr vs drr+preemption
(issue 10): `python bench/preemption_vllm.py [--reps 3]`.

Loopback only, one machine, bounded (~4-5 min on two cores, more when the machine is
shared). The production process layout, each process with its own event loop:

- a nats-server;
- ONE `python -m gpu_worker --engine vllm` for the whole bench (the tiny random-weight
  Llama from tests/vllm, fp32, `--enforce-eager`, `--load-format dummy`, prefix caching
  on as the worker's default: a continuation's recompute is cheap on its own worker;
  `--max-num-seqs` 16, the default prefetch 4, `--kv-cache-space-gib` 1); vLLM's engine
  core and model worker are its child processes. It starts once (~30 s) and serves
  every run. Those two processes get a core of their own (`--engine-cpus`, default the
  last core; bench/cpu_layout.py), every other process the rest: on a GPU host the
  model's compute is on the GPU and the control plane never waits for it;
- per (variant, repetition) a fresh `python -m dispatcher` with the variant's tenants
  file, on the same prefix and pool: dispatchers hand over one after another (the old
  one stops, releasing its lease, only once it holds nothing and the engine is idle).
  A fresh one per run, not one per variant: a tenant's DRR debt, its share windows and
  the preemption hysteresis outlive a run inside a dispatcher, so a reused one would
  start each repetition where the last left A;
- in this process only the user: one `FairlaneClient` (per run), alone in its loop.

The bench sees the engine through the worker's heartbeats on the pool's events subject
and the dispatcher through its /metrics (queue, in flight, preemptions). While B probes
the busy engine it also records stall diagnostics: the longest silence of all token
streams, the longest gap between the worker's heartbeats, its own loop's worst lag.

- alone (first repetition, per variant): B probes the idle engine, one request every
  100 ms for `--probe-s` (20.5 s -> >= 200 samples), 32-token prompts, `--b-tokens`
  (16) output tokens: B holds ~2 of the 16 slots, well under its equal-weight share.
- noisy: A (same tier, same weight) submits `--burst` requests of `--a-tokens` (512)
  output tokens, over twice what the engine finishes in the window, so every slot
  stays busy; when a heartbeat shows the engine full, and `--turnover-s` later, B
  probes as above. TTFT = the client's monotonic clock from `submit()` to the first
  chunk. Then the client closes (A's open requests are cancelled upstream) and the run
  waits until the dispatcher holds nothing and the engine is idle.

Variants differ only in the pool's `preemption: {enabled: ...}` (drr: false;
drr+preempt: true, the pool defaults otherwise) and run interleaved with the order
reversed every other repetition (`bench.harness`). Reported: median (min–max) over
repetitions; a p99 only from >= 200 samples. Lease and worker timeouts are the
production defaults. Writes bench/results/preemption_vllm.md + .json (`--output`).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import os
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import quantile  # noqa: E402
from bench.cpu_layout import (  # noqa: E402
    add_engine_cpus_arg,
    describe,
    engine_cpus_of,
    isolate_engine,
    omp_bind,
)
from bench.harness import (  # noqa: E402
    RunMeta,
    collect,
    fmt_tail,
    run_interleaved,
    summarize,
    verdict,
    write_results,
)
from bench.preemption_vllm_figures import TARGET_RATIO, VARIANTS, variant_figures  # noqa: E402
from bench.preemption_vllm_proc import (  # noqa: E402
    PREEMPTIONS,
    TIER,
    DispatcherProc,
    WorkerProc,
    problems,
    tenants_yaml,
    wait_idle,
)
from fairlane.embedded import free_port  # noqa: E402

POOL = "bench"
MAX_MODEL_LEN = 1024
PROMPT_TOKENS = 32
RESULTS = ROOT / "bench" / "results" / "preemption_vllm.md"


def prompt_ids(i: int) -> list[int]:
    # Distinct per request, deterministic, in the tiny vocabulary (< 512).
    return [(i * 7 + k) % 500 + 1 for k in range(PROMPT_TOKENS)]


def worker_argv(args, nats_url: str, prefix: str, worker_id: str, model_dir: Path) -> list[str]:
    return ["--nats-url", nats_url, "--prefix", prefix, "--pool", POOL,
            "--worker-id", worker_id, "--engine", "vllm", "--model", str(model_dir),
            "--dtype", "float32", "--enforce-eager", "--load-format", "dummy",
            "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(MAX_MODEL_LEN),
            "--kv-cache-space-gib", "1", "--log-level", "info"]


class Run:
    """One (variant, repetition): a dispatcher process and a client, on the bench's one
    prefix, served by the bench's one worker process."""

    def __init__(self, args, worker: WorkerProc, log_dir: Path, variant: str, rep: int):
        self.args, self.worker, self.seq = args, worker, 0
        # Stall diagnostics while B probes a busy engine: the longest silence of the
        # token streams (all of them; the engine is never idle then, so a silence is a
        # stall of the engine, the worker or the machine) and of this loop.
        self.watch, self.last_chunk, self.silence_s, self.lag_s = False, 0.0, 0.0, 0.0
        self.disp = DispatcherProc(
            worker.nats_url, worker.prefix,
            tenants_yaml(variant, POOL, PROMPT_TOKENS + 2 * args.a_tokens, MAX_MODEL_LEN),
            "drr", log_dir / f"{variant.replace('+', '-')}-{rep}", num_workers=0, pool=POOL,
            metrics_port=free_port())
        atexit.register(self.disp.kill_now)  # last resort if `close` is cut short
        self.client = None

    async def __aenter__(self) -> Run:
        from producer.client import FairlaneClient

        try:
            await self.disp.start(timeout_s=60.0)
            # The last run left nothing behind (checked before its dispatcher stopped);
            # checked again so that a run never starts on a busy engine.
            await wait_idle(self.worker, self.disp, 30.0)
            self.client = await FairlaneClient.connect(
                self.disp.nats_url, prefix=self.disp.prefix, max_buffered_chunks=1 << 16)
            # One request through the whole path (dispatcher leading, worker pulling from
            # it) before anything is measured.
            await asyncio.wait_for(self.ttft("W", self.args.b_tokens), 60)
        except BaseException as exc:
            await self.close(failed=type(exc))
            raise
        return self

    async def __aexit__(self, exc_type, *exc) -> None:
        await self.close(failed=exc_type)

    async def close(self, failed: type[BaseException] | None = None) -> None:
        try:
            if self.client is not None:
                await self.client.close()  # cancels what is still open upstream
            # Its queue and the engine must be empty before this dispatcher stops, or
            # the next run inherits A's requests. A failed run still tries (its error is
            # the one reported); an interrupted one (Ctrl-C) does not wait.
            if failed is None:
                await wait_idle(self.worker, self.disp, 60.0)
            elif issubclass(failed, Exception):
                with contextlib.suppress(Exception):
                    await wait_idle(self.worker, self.disp, 60.0)
        finally:
            codes = await self.disp.stop()  # SIGTERM: it releases its lease and exits
            atexit.unregister(self.disp.kill_now)
            if codes.get("dispatcher") != 0:
                print(f"  dispatcher exit: {codes}", flush=True)

    async def metrics(self) -> dict[str, float]:
        m = await asyncio.to_thread(self.disp.scrape)
        if m is None:
            raise RuntimeError("the dispatcher's /metrics did not answer")
        return m

    async def submit(self, tenant: str, max_tokens: int):
        from producer.client import RequestSpec, SamplingParams

        self.seq += 1
        # The tier is given, as the edge does from the tenants file: no pool-info round
        # trip to the dispatcher on the measured path.
        return await self.client.submit(RequestSpec(
            tenant=tenant, pool=POOL, tier=TIER, prompt_token_ids=prompt_ids(self.seq),
            sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
            expected_output_tokens=max_tokens))

    async def ttft(self, tenant: str, max_tokens: int) -> float | None:
        t0 = time.monotonic()
        stream = await self.submit(tenant, max_tokens)
        first = None
        async for _chunk in stream:
            self.saw_chunk()
            if first is None:
                first = time.monotonic()
        return None if first is None else (first - t0) * 1000

    def saw_chunk(self) -> None:
        now = time.monotonic()
        if self.watch:
            self.silence_s = max(self.silence_s, now - self.last_chunk)
        self.last_chunk = now

    async def watched_probe(self, window_s: float) -> tuple[list[float], list[str]]:
        """`probe`, measuring the stall diagnostics meanwhile."""
        async def lag() -> None:
            while True:
                t = time.monotonic()
                await asyncio.sleep(0.01)
                self.lag_s = max(self.lag_s, time.monotonic() - t - 0.01)

        self.watch, self.last_chunk = True, time.monotonic()
        ticker = asyncio.create_task(lag())
        try:
            return await self.probe(window_s)
        finally:
            self.watch = False
            ticker.cancel()

    async def probe(self, window_s: float) -> tuple[list[float], list[str]]:
        """B: one request every probe interval for `window_s`; TTFT of each (ms), and
        what went wrong with those that gave none."""
        tasks = []
        t_start = time.monotonic()
        n = int(window_s / self.args.probe_interval_s)
        for i in range(n):
            await asyncio.sleep(max(0.0, t_start + i * self.args.probe_interval_s
                                    - time.monotonic()))
            tasks.append(asyncio.create_task(self.ttft("B", self.args.b_tokens)))
        done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 120)
        return ([x for x in done if isinstance(x, float)],
                [repr(x) if x is not None else "no token" for x in done
                 if not isinstance(x, float)])

    async def flood(self) -> tuple[list[asyncio.Task], list[str]]:
        errors: list[str] = []

        async def drain(stream) -> None:
            try:
                async for _chunk in stream:
                    self.saw_chunk()
            except Exception as exc:  # noqa: BLE001 - counted; closing fails the rest
                errors.append(repr(exc))

        streams = await asyncio.gather(*(self.submit("A", self.args.a_tokens)
                                         for _ in range(self.args.burst)))
        tasks = [asyncio.create_task(drain(s)) for s in streams]
        await self.worker.wait_running(self.args.max_num_seqs, 60.0)
        await asyncio.sleep(self.args.turnover_s)
        return tasks, errors


async def run(args) -> str:
    from fairlane.embedded import NatsServer
    from tests.vllm.tiny_model import write_tiny_model

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # inherited by the worker
    # vLLM-CPU's default ("auto") pins the model's OpenMP thread to core 0 and leaves
    # every other process free to run there too. Measured on this 2-core VM with the
    # fleet's processes beside it: whole-machine stalls of 2-5 s (token streams,
    # heartbeats, this loop and an unrelated sleeping process all stop at once). So
    # OpenMP binds to the engine's cores when it has cores of its own (--engine-cpus,
    # where every other process is kept off them), else it is unpinned ("nobind").
    # Set it in the environment to measure another.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", omp_bind(args.engine_cpu_set))
    meta = RunMeta.here()
    load0 = os.getloadavg()[0]  # other work on the machine shows in every figure here
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="preemption-vllm-"))
    print(f"logs: {log_dir}", flush=True)
    model_dir = write_tiny_model(Path(tempfile.mkdtemp(prefix="tiny-llama-")))
    nats_server = NatsServer().start()
    prefix = f"pv{uuid.uuid4().hex[:8]}"
    worker = WorkerProc(nats_server.url, prefix, "", "", log_dir, num_workers=0, pool=POOL,
                        worker_id=f"{prefix}-w0")
    atexit.register(worker.kill_now)  # last resort if the cleanup below is cut short
    t_bench = time.monotonic()
    try:
        start_s = await worker.start_worker(
            worker_argv(args, nats_server.url, prefix, worker.worker_id, model_dir))
        print(f"vLLM worker up in {start_s:.1f}s", flush=True)
        # The worker's engine processes (its children) get their cores; the worker's
        # own loop, nats-server, this process and the dispatchers spawned from it later
        # (they inherit this thread's cores) the rest.
        isolate_engine(args.engine_cpu_set)

        async def one(variant: str, rep: int) -> dict:
            out: dict = {}
            r = Run(args, worker, log_dir, variant, rep)
            async with r:
                if rep < args.alone_reps:
                    out["alone"], out["alone_failed"] = await r.probe(args.probe_s)
                a_tasks, a_errors = await r.flood()
                pre0 = (await r.metrics())[PREEMPTIONS]
                t0 = time.monotonic()
                load1 = os.getloadavg()[0]
                out["during"], out["during_failed"] = await r.watched_probe(args.probe_s)
                span_s = time.monotonic() - t0
                out["stalls"] = {"token_silence_ms": r.silence_s * 1000,
                                 "client_loop_lag_ms": r.lag_s * 1000,
                                 "heartbeat_gap_ms": worker.heartbeat_gap(t0) * 1000,
                                 "load1": load1}
                out["preemptions_per_s"] = ((await r.metrics())[PREEMPTIONS] - pre0) / span_s
                # A's streams that failed while the run was on (closing fails the rest).
                out["a_failed"] = list(a_errors)
            await asyncio.gather(*a_tasks, return_exceptions=True)
            out["log_problems"] = problems(r.disp.log_dir)
            print(f"  {variant}#{rep}: during p50 {quantile(out['during'], 0.5):.1f} ms, "
                  f"n={len(out['during'])}, preemptions/s {out['preemptions_per_s']:.1f}, "
                  f"failed B {len(out['during_failed']) + len(out.get('alone_failed', []))}"
                  f" A {len(out['a_failed'])}, log problems {len(out['log_problems'])}",
                  flush=True)
            return out

        records = await run_interleaved(VARIANTS, args.reps, one, log=print)
    finally:
        codes = await worker.stop_all()
        nats_server.stop()
        print(f"worker exit: {codes}", flush=True)
    worker_problems = problems(log_dir)
    wall_s = time.monotonic() - t_bench
    args.load = f"{load0:.1f} at start, {os.getloadavg()[0]:.1f} at end"
    body = report(records, args, wall_s, start_s, worker_problems)
    write_results(Path(args.output) if args.output else RESULTS,
                  "Noisy neighbour on vLLM-CPU (tiny model): drr vs drr+preemption",
                  body, [r.__dict__ for r in records], meta)
    return body


def report(records, args, wall_s: float, start_s: float, worker_problems: list[str]) -> str:
    lines = [
        "## Setup\n",
        f"- production process layout: one `python -m gpu_worker --engine vllm` process "
        f"(tiny Llama, fp32, eager, prefix caching on, `max_num_seqs` {args.max_num_seqs}, "
        f"prefetch 4; up in {start_s:.0f} s) for the whole bench; a fresh `python -m "
        f"dispatcher` process per (variant, repetition), handing over on one prefix once "
        f"the last holds nothing and the engine is idle; the client (the user) alone in "
        f"the bench process; each its own event loop. Lease and worker timeouts: the "
        f"production defaults (3 s, 3.5 s); `VLLM_CPU_OMP_THREADS_BIND="
        f"{os.environ['VLLM_CPU_OMP_THREADS_BIND']}`; CPU layout: "
        f"{describe(args.engine_cpu_set, os.cpu_count() or 1)}",
        f"- A: {args.burst} requests × {args.a_tokens} output tokens (greedy; the tiny "
        f"model has no EOS, so exactly that many), {PROMPT_TOKENS}-token prompts; B: one "
        f"request every {args.probe_interval_s * 1000:g} ms × {args.b_tokens} output tokens "
        f"for {args.probe_s:g} s, alone (first {args.alone_reps} repetition(s)) and during "
        f"A's burst ({args.turnover_s:g} s after a heartbeat showed the engine full)",
        f"- tenants file per variant: policy drr, `cost_model: tokens`, quantum "
        f"{PROMPT_TOKENS + 2 * args.a_tokens} (one A request's cost); drr = `preemption: "
        f"{{enabled: false}}`; drr+preempt = `{{enabled: true}}` (the pool defaults); "
        f"{args.reps} repetitions, order alternated; total {wall_s / 60:.1f} min; "
        f"1-min load average {args.load} (2 cores: other work shows here)\n",
        "| variant | alone n | alone p50 ms | alone tail ms | during p50 ms | during tail ms "
        "| **tail ratio during ÷ alone** | preemptions/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ratios = {}
    for v in VARIANTS:
        f = variant_figures(records, v)
        ratios[v] = f.ratios
        lines.append(
            f"| {v} | {len(f.alone)} | {quantile(f.alone, 0.5):.1f} | {fmt_tail(f.alone)} | "
            f"{f.p50s.fmt()} | {f.tails.fmt()} (n {'/'.join(str(len(xs)) for xs in f.during)})"
            f" | **{f.ratios.fmt(2)}** | {f.preemptions_per_s.fmt()} |")
    lines.append("\nStall diagnostics while B probed the busy engine, median (min–max) over "
                 "repetitions: the longest silence of all token streams, the longest "
                 "worker heartbeat gap (nominal ~1,000), this process's worst loop lag, "
                 "the machine's 1-min load average (2 cores).\n")
    for v in VARIANTS:
        st = [summarize(collect(records, v, f"stalls.{k}")).fmt()
              for k in ("token_silence_ms", "heartbeat_gap_ms", "client_loop_lag_ms")]
        lines.append(f"- {v}: silence {st[0]} ms, heartbeat gap {st[1]} ms, loop lag "
                     f"{st[2]} ms, load {summarize(collect(records, v, 'stalls.load1')).fmt()}")
    failed = [r for r in records if r.error]
    if failed:
        lines.append("\n**failed runs**: " + "; ".join(f"{r.variant}#{r.rep}: {r.error}"
                                                      for r in failed))
    ok = [r for r in records if not r.error]
    lost = sum(len(r.metrics.get(k, [])) for r in ok for k in ("alone_failed", "during_failed"))
    a_lost = sum(len(r.metrics.get("a_failed", [])) for r in ok)
    logged = [f"{r.variant}#{r.rep} dispatcher: {line}" for r in ok
              for line in r.metrics.get("log_problems", [])]
    lines.append(f"\nRequests without a first token: B {lost}; A streams failed before the "
                 f"client closed: {a_lost}. Warning/error log lines: {len(logged)} "
                 f"(dispatchers), {len(worker_problems)} (worker).")
    lines += [f"    {line[:200]}" for line in (logged + worker_problems)[:6]]
    r = ratios["drr+preempt"].median
    lines.append(f"\nTarget (issue 10): B's TTFT p99 during ÷ alone ≤ {TARGET_RATIO} with "
                 f"preemption: {r:.2f} — {verdict(r, TARGET_RATIO)}.")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--alone-reps", type=int, default=1)
    ap.add_argument("--burst", type=int, default=200)
    ap.add_argument("--a-tokens", type=int, default=512)
    ap.add_argument("--b-tokens", type=int, default=16)
    ap.add_argument("--probe-s", type=float, default=20.5)
    ap.add_argument("--probe-interval-s", type=float, default=0.1)
    ap.add_argument("--turnover-s", type=float, default=3.0)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--output", help=f"results markdown (JSON beside it); default {RESULTS}")
    ap.add_argument("--log-dir", help="the processes' logs; default a fresh temp dir")
    add_engine_cpus_arg(ap)
    args = ap.parse_args()
    args.engine_cpu_set = engine_cpus_of(ap, args)
    # SIGTERM as Ctrl-C: the finally blocks stop every process this bench started.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    print(asyncio.run(run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
