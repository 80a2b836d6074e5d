"""What does the fleet cost on a real engine, and how faithful is the simulator?

    python bench/bench_vllm.py [--requests 128] [--prompt-tokens 128] [--max-tokens 128]

Loopback only, one machine, bounded (about 2-3 minutes on two cores). Starts a
nats-server and ONE vLLM-CPU engine (`VllmEngine`, the tiny random-weight Llama from
tests/vllm, fp32, enforce_eager, prefix caching off so repeated phases really
compute) and, in this process, a `Dispatcher` and a `Worker` around that engine, and
a `FairlaneClient`. The same engine serves both sides of every comparison; phases
alternate A B A B.

1. throughput: N requests with fixed prompt token ids (distinct per request) and
   exactly `max_tokens` output tokens each (the tiny model has no EOS token), all
   submitted at once; output tokens/s from first submit to last token.
   *direct*: `VllmEngine.generate` on the engine (vLLM queues what exceeds
   max_num_seqs itself); *fleet*: producer -> nats -> dispatcher -> worker -> engine.
2. TTFT at light load: one request at a time (~30), submit -> first token, as the
   caller sees it; p50/p99 direct vs fleet and the difference (fleet overhead).
3. simulator vs real: the same two workloads on a `SimEngine` with the
   `vllm_cpu_tiny` step model (calibrated on this engine by bench/calibrate_sim.py),
   time_scale 1.0, fed directly and through a fleet.

A Worker assumes it owns its engine (its pull loop waits for its own requests to
free a slot), so a fresh Worker runs around the shared engine for each fleet phase
and stops before the next direct phase; the Dispatcher and client stay up.

Writes a markdown table to bench/results/vllm.md (and prints it).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.bench_vllm_report import report  # noqa: E402
from bench.common import quantile  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "vllm.md"
MAX_NUM_SEQS = 32
MAX_MODEL_LEN = 1024
POOL = "bench"
TTFT_PROMPT_TOKENS = 128
TTFT_MAX_TOKENS = 8


@dataclass
class PhaseResult:
    name: str
    wall_s: float
    output_tokens: int
    ttft_ms: list[float]
    e2e_ms: list[float]
    cpu_main_s: float = 0.0  # this process: vLLM front end + fleet + clients
    cpu_engine_s: float = 0.0  # child processes: vLLM's engine core and its worker
    cpu_nats_s: float = 0.0  # the nats-server child
    mean_running: float = 0.0  # sequences in the engine's batch, sampled every 10 ms

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    def row(self) -> str:
        return (
            f"| {self.name} | {self.wall_s:.2f} | {self.output_tokens} | {self.tok_s:,.0f} | "
            f"{quantile(self.ttft_ms, 0.50):.1f} | {quantile(self.ttft_ms, 0.99):.1f} | "
            f"{quantile(self.e2e_ms, 0.50):.1f} | {quantile(self.e2e_ms, 0.99):.1f} | "
            f"{self.mean_running:.1f} | {self.cpu_main_s:.1f} | {self.cpu_engine_s:.1f} | "
            f"{self.cpu_nats_s:.1f} |"
        )


class Probe:
    """CPU seconds of this process and its children, and the engine's mean batch."""

    def __init__(self, engine) -> None:
        self.engine = engine

    async def __aenter__(self) -> Probe:
        import psutil

        self.proc = psutil.Process()
        self.cpu0 = self._cpu()
        self.samples: list[int] = []
        self.task = asyncio.create_task(self._sample())
        return self

    def _cpu(self) -> tuple[float, float, float]:
        t = self.proc.cpu_times()
        kids = nats = 0.0
        for c in self.proc.children(recursive=True):
            try:
                ct = c.cpu_times()
                if "nats-server" in c.name():
                    nats += ct.user + ct.system
                else:
                    kids += ct.user + ct.system
            except Exception:  # noqa: BLE001 - a child may exit meanwhile
                pass
        return t.user + t.system, kids, nats

    async def _sample(self) -> None:
        while True:
            self.samples.append(self.engine.load().num_running)
            await asyncio.sleep(0.01)

    async def __aexit__(self, *exc) -> None:
        self.task.cancel()
        cpu1 = self._cpu()
        self.main_s = cpu1[0] - self.cpu0[0]
        self.engine_s = cpu1[1] - self.cpu0[1]
        self.nats_s = cpu1[2] - self.cpu0[2]
        self.mean_running = statistics.fmean(self.samples) if self.samples else 0.0

    def fill(self, res: PhaseResult) -> PhaseResult:
        res.cpu_main_s, res.cpu_engine_s, res.cpu_nats_s = self.main_s, self.engine_s, self.nats_s
        res.mean_running = self.mean_running
        return res


def prompt_ids(i: int, n: int) -> list[int]:
    # Distinct per request, deterministic, in the tiny vocabulary (< 512).
    return [((j * 31 + i * 17) % 500) + 1 for j in range(n)]


def work_item(i: int, prompt_tokens: int, max_tokens: int, tenant: str):
    from fairlane.protocol import InferenceRequest, SamplingParams, WorkItem

    req = InferenceRequest(
        request_id=f"d-{uuid.uuid4().hex[:16]}", tenant=tenant, pool=POOL, tier="standard",
        reply_to="_INBOX.bench", prompt_token_ids=prompt_ids(i, prompt_tokens),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=1.0),
        expected_output_tokens=max_tokens,
    )
    return WorkItem(request=req, cache_salt=tenant)


# --- direct: the engine's own generate() -------------------------------------------


async def direct_one(engine, item, t0: float) -> tuple[float, float, int]:
    first = 0.0
    n = 0
    async for d in engine.generate(item):
        if not first and (d.token_ids or d.text):
            first = time.monotonic()
        n = d.num_output_tokens
    return (first - t0) * 1000, (time.monotonic() - t0) * 1000, n


async def direct_throughput(engine, name, n, prompt_tokens, max_tokens) -> PhaseResult:
    items = [work_item(i, prompt_tokens, max_tokens, f"t{i % 4}") for i in range(n)]
    t0 = time.monotonic()
    res = await asyncio.gather(*(direct_one(engine, it, t0) for it in items))
    wall = time.monotonic() - t0
    _check_lengths(name, [r[2] for r in res], max_tokens)
    return PhaseResult(name, wall, sum(r[2] for r in res), [r[0] for r in res],
                       [r[1] for r in res])


async def direct_ttft(engine, name, n) -> PhaseResult:
    ttft, e2e, toks = [], [], 0
    t_start = time.monotonic()
    for i in range(n):
        item = work_item(1000 + i, TTFT_PROMPT_TOKENS, TTFT_MAX_TOKENS, "light")
        t0 = time.monotonic()
        a, b, k = await direct_one(engine, item, t0)
        ttft.append(a)
        e2e.append(b)
        toks += k
    return PhaseResult(name, time.monotonic() - t_start, toks, ttft, e2e)


# --- fleet: producer -> nats -> dispatcher -> worker -> engine ----------------------


class Fleet:
    """A Dispatcher and a client on one prefix; a Worker per phase around `engine`."""

    def __init__(self, nats_url: str, engine, engine_kind: str, prefetch_seqs: int) -> None:
        from fairlane.subjects import Subjects

        self.prefetch_seqs = prefetch_seqs
        self.nats_url = nats_url
        self.engine = engine
        self.engine_kind = engine_kind
        self.subjects = Subjects(f"bv{uuid.uuid4().hex[:8]}")
        self.num_workers = 0

    async def start(self) -> None:
        from dispatcher.config import DispatcherSettings
        from dispatcher.service import Dispatcher
        from fairlane.poolconfig import SchedulerConfig
        from producer.client import FairlaneClient

        self.dispatcher = Dispatcher(
            DispatcherSettings(nats_url=self.nats_url, prefix=self.subjects.prefix, pool=POOL,
                               max_tokens=MAX_MODEL_LEN, log_json=False),
            SchedulerConfig(policy="drr"),
        )
        await self.dispatcher.start()
        self.client = await FairlaneClient.connect(self.nats_url, prefix=self.subjects.prefix,
                                                   max_buffered_chunks=1 << 16)

    async def stop(self) -> None:
        await self.client.close()
        await self.dispatcher.stop()

    async def _start_worker(self):
        from gpu_worker.config import WorkerSettings
        from gpu_worker.service import Worker

        self.num_workers += 1
        settings = WorkerSettings(
            nats_url=self.nats_url, prefix=self.subjects.prefix, pool=POOL,
            worker_id=f"bench-{self.engine_kind}-{self.num_workers}", engine=self.engine_kind,
            max_num_seqs=MAX_NUM_SEQS, prefetch_seqs=self.prefetch_seqs, max_model_len=MAX_MODEL_LEN,
            log_json=False,
        )
        worker = Worker(settings, self.engine, owns_engine=False)
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        while worker.num_pulls == 0:  # its first pull is on the wire: it is serving
            if task.done():
                raise RuntimeError(f"worker exited early: {task.result()}")
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        return stop, task

    async def _stop_worker(self, stop, task) -> None:
        stop.set()
        rc = await asyncio.wait_for(task, 30)
        if rc != 0:
            raise RuntimeError(f"worker exited with {rc}")

    async def one(self, i, prompt_tokens, max_tokens, tenant, t0=None):
        t_submit = time.monotonic() if t0 is None else t0
        from producer.client import RequestSpec, SamplingParams

        stream = await self.client.submit(RequestSpec(
            tenant=tenant, pool=POOL, prompt_token_ids=prompt_ids(i, prompt_tokens),
            sampling=SamplingParams(max_tokens=max_tokens, temperature=1.0),
            expected_output_tokens=max_tokens,
        ))
        first = 0.0
        n = 0
        async for chunk in stream:
            if not first:
                first = time.monotonic()
            if chunk.finish_reason is not None:
                n = chunk.usage.completion_tokens if chunk.usage else 0
        return (first - t_submit) * 1000, (time.monotonic() - t_submit) * 1000, n

    async def throughput(self, name, n, prompt_tokens, max_tokens) -> PhaseResult:
        stop, task = await self._start_worker()
        try:
            t0 = time.monotonic()
            res = await asyncio.gather(
                *(self.one(i, prompt_tokens, max_tokens, f"t{i % 4}", t0) for i in range(n)))
            wall = time.monotonic() - t0
        finally:
            await self._stop_worker(stop, task)
        _check_lengths(name, [r[2] for r in res], max_tokens)
        return PhaseResult(name, wall, sum(r[2] for r in res), [r[0] for r in res],
                           [r[1] for r in res])

    async def ttft(self, name, n) -> PhaseResult:
        stop, task = await self._start_worker()
        ttft, e2e, toks = [], [], 0
        try:
            t_start = time.monotonic()
            for i in range(n):
                a, b, k = await self.one(1000 + i, TTFT_PROMPT_TOKENS, TTFT_MAX_TOKENS, "light")
                ttft.append(a)
                e2e.append(b)
                toks += k
            wall = time.monotonic() - t_start
        finally:
            await self._stop_worker(stop, task)
        return PhaseResult(name, wall, toks, ttft, e2e)


def _check_lengths(name: str, lengths: list[int], max_tokens: int) -> None:
    bad = [n for n in lengths if n != max_tokens]
    if bad:
        raise RuntimeError(f"{name}: {len(bad)} requests did not produce {max_tokens} tokens: "
                           f"{bad[:5]}")


# --- the run -----------------------------------------------------------------------


def describe_machine() -> str:
    from bench.calibrate_sim import describe_machine as calib_describe

    load = os.getloadavg()
    return calib_describe() + f"; loadavg at start {load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f}"


async def run(args, command: str) -> str:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from fairlane.embedded import NatsServer
    from gpu_worker.sim.engine import SimEngine
    from gpu_worker.vllm_engine import VllmEngine, VllmEngineConfig
    from tests.vllm.tiny_model import write_tiny_model

    machine = describe_machine()
    n, p, m, nt = args.requests, args.prompt_tokens, args.max_tokens, args.ttft_requests
    model_dir = write_tiny_model(Path(tempfile.mkdtemp(prefix="tiny-llama-")))
    engine = VllmEngine(VllmEngineConfig(
        model=str(model_dir), max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN,
        dtype="float32", enforce_eager=True, load_format="dummy",
        enable_prefix_caching=False,
    ))
    nats_server = NatsServer().start()
    t = time.monotonic()
    await engine.start()
    print(f"vLLM engine started in {time.monotonic() - t:.1f}s", flush=True)
    sim = SimEngine("vllm_cpu_tiny", max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN,
                    time_scale=1.0)
    await sim.start()
    real_fleet = Fleet(nats_server.url, engine, "vllm", args.prefetch_seqs)
    sim_fleet = Fleet(nats_server.url, sim, "sim", args.prefetch_seqs)
    results: list[PhaseResult] = []
    t_bench = time.monotonic()
    try:
        await real_fleet.start()
        await sim_fleet.start()
        # Warm-up (not reported): oneDNN paths, first JetStream consumers, etc.
        await direct_throughput(engine, "warm-up direct", MAX_NUM_SEQS, p, 16)
        await real_fleet.throughput("warm-up fleet", MAX_NUM_SEQS, p, 16)
        print("warm-up done", flush=True)

        for rnd in (1, 2):
            for phase in (
                lambda r=rnd: direct_throughput(engine, f"vLLM direct #{r}", n, p, m),
                lambda r=rnd: real_fleet.throughput(f"vLLM fleet #{r}", n, p, m),
            ):
                async with Probe(engine) as probe:
                    res = await phase()
                results.append(probe.fill(res))
                print(res.row(), flush=True)
        for rnd in (1, 2):
            for phase in (
                lambda r=rnd: direct_ttft(engine, f"vLLM direct light #{r}", nt),
                lambda r=rnd: real_fleet.ttft(f"vLLM fleet light #{r}", nt),
            ):
                async with Probe(engine) as probe:
                    res = await phase()
                results.append(probe.fill(res))
                print(res.row(), flush=True)
        for phase in (
            lambda: direct_throughput(sim, "sim direct", n, p, m),
            lambda: sim_fleet.throughput("sim fleet", n, p, m),
            lambda: direct_ttft(sim, "sim direct light", nt),
            lambda: sim_fleet.ttft("sim fleet light", nt),
        ):
            async with Probe(sim) as probe:
                res = await phase()
            results.append(probe.fill(res))
            print(res.row(), flush=True)
    finally:
        for f in (real_fleet, sim_fleet):
            try:
                await f.stop()
            except Exception as exc:  # noqa: BLE001 - best effort on the way out
                print(f"fleet stop failed: {exc!r}")
        await sim.close()
        await engine.close()
        nats_server.stop()
    bench_s = time.monotonic() - t_bench
    return report(results, command, machine, args, bench_s, max_num_seqs=MAX_NUM_SEQS,
                  max_model_len=MAX_MODEL_LEN, ttft_prompt_tokens=TTFT_PROMPT_TOKENS,
                  ttft_max_tokens=TTFT_MAX_TOKENS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--ttft-requests", type=int, default=30)
    parser.add_argument("--prefetch-seqs", type=int, default=4,
                        help="the worker's prefetch beyond max_num_seqs (its default: 4)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.prompt_tokens + args.max_tokens > MAX_MODEL_LEN:
        parser.error(f"prompt + output tokens must fit max_model_len {MAX_MODEL_LEN}")
    from fairlane.logs import configure_logging

    configure_logging("warning", json=False)
    logging.getLogger("vllm").setLevel(logging.WARNING)
    command = "python bench/bench_vllm.py " + " ".join(sys.argv[1:])
    md = asyncio.run(asyncio.wait_for(run(args, command.strip()), 360))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(md)
    print()
    print(md)
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
