"""Simulator fidelity (issue 12, item 5): `python bench/fidelity.py [--quick]`.

The same arrivals through the fleet simulator and through the real fleet, compared:
TTFT p50 and p99, output tokens/s and end-to-end p50 per traffic class, target within
10% (Vidur reports < 9% for single-tenant vLLM).

- **Arrivals**: a fleetsim workload file's `Workload.arrivals()` with seed = the
  repetition: the same times, tenants, tiers, prompt lengths, output lengths and
  max_tokens for both variants.
- **sim**: `fleetsim.fleet.Fleet` in-process (the production `PoolCore` over N
  `BatchCore` engines in virtual time), clients hinting the output length
  (`hint_output_tokens`).
- **real**: a loopback nats-server, a dispatcher and N `python -m gpu_worker --engine sim
  --time-scale 1.0` processes (`bench.fleet`), the same step model, slots and prefetch;
  a load generator submits each arrival at its time with the producer library (a
  prompt of 4 characters per token: the worker's estimate; the output length as
  `expected_output_tokens`, which the simulator engine generates exactly) and times
  every stream on the machine's monotonic clock (`bench/fidelity_real.py`). Each
  traffic class is its own client process (connection and event loop), as different
  tenants' clients are: one client for all held a quiet tenant's submits up behind a
  flood's burst of submits (up to 137 ms), which no fleet does.
- **real-shared** (only with `--variants sim,real,real-shared`): the real fleet with
  one client in this process for every class, the rig before per-class clients;
  reported beside the comparison, not judged.
- **real-gc-default** (only when asked for, as real-shared): the real fleet with its
  workers under Python's default garbage collector (`--gc-young-objects 0`), as every
  real run before 2026-11-30; reported beside the comparison, not judged.
- **Measurement window**: requests ARRIVING in [warmup_s, duration_s) count, in both;
  throughput is the output tokens generated inside that window ÷ its length. After the
  last arrival both keep running `drain_s` for the window's requests to finish; a
  request without its first token by then is censored (counted, not timed).
- **The simulator's delays** are measured before the scenarios, on the idle rig, not
  fitted to them: `network_ms`, one dispatcher<->worker message, is half a core-NATS
  request-reply round trip (`message_hop_ms`); the clients' legs (fleetsim's
  `client_ms`: publish, JetStream, the started record's ack, the token's way back,
  the worker's own time) are each idle probe's real TTFT (sequential 16-token probes)
  less the simulator's, one drawn per request, so the idle spread is kept.
  `sim-constant` (run by default, not judged) is the simulator as calibrated before:
  no legs, and the idle TTFT p50 less the simulator's without hops as `network_ms` on
  every message. `--network-ms` sets the hop instead, with no legs.
- Variants interleaved per scenario, the order reversed every other repetition
  (`bench.harness.run_interleaved`); errors are (sim - real) / real per repetition,
  reported as median (min-max) over repetitions (`bench/render_fidelity.py`).

Scenarios (bench/workloads/fidelity_*.yaml, written for 2 workers; their loads scale
with `--workers`): `steady` (4 tenants in 2 tiers, Poisson, prompts 32-512, outputs
128-384, ~70% of the slots busy) and `light` (bench/workloads/noisy_neighbor.yaml
scaled down: a 1,200-request burst per 2 workers and a 10/s prober with 16-48-token
outputs).

Scale: 4 workers x 32 slots by default, the largest this 2-core machine held with
headroom (measured with --quick --workers 2..16): the fleet takes ~0.1 core per
worker and the load generator ~0.05 (it reads every token chunk); from 6 workers on,
with the machine shared with other jobs, the light scenario's burst left the client
seconds behind (generator lag up to 2.5 s, which a client-side TTFT includes), at 12
workers the steady TTFT p99 doubled, at 16 the real fleet fell behind its arrivals.
`--workers 2,4` runs every scenario at each size (`steady@2w`, ...), all interleaved in
one run, one calibrated `network_ms` for all: how the error moves with the load the
real fleet puts on this machine (bench/results/fidelity_workers.md).

Writes bench/results/fidelity.{md,json} (`--out-dir`, `--stem`). Runtime on the 2-core
dev VM: full (5 reps) ~14 min, ~26 min with `real-shared` or `real-gc-default`, ~28
with `--workers 2,4`;
`--quick` (1 rep, 30 s scenarios) ~2 min.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import quantile  # noqa: E402
from bench.fidelity_obs import Observations, class_metrics  # noqa: E402
from bench.fidelity_real import (  # noqa: E402
    LIVE_FLEETS,
    PER_CLASS,
    SHARED,
    idle_ttft_ms,
    message_hop_ms,
    run_real,
)
from bench.fidelity_scenarios import (  # noqa: E402
    QUICK_DURATION_S,
    SCENARIOS,
    Scenario,
    class_of_tenants,
    load_scenario,
)
from bench.fidelity_texts import HOW_TO_READ  # noqa: E402
from bench.fleet import WorkerSpec  # noqa: E402
from bench.harness import RunMeta, run_interleaved, write_results  # noqa: E402
from bench.render_fidelity import (  # noqa: E402
    REAL,
    REAL_GC,
    REAL_SHARED,
    SIM,
    SIM_CONSTANT,
    report,
)
from fairlane.embedded import NatsServer  # noqa: E402
from fleetsim.cli import tuned_gc  # noqa: E402
from fleetsim.fleet import Fleet, FleetSettings  # noqa: E402
from fleetsim.records import Arrival  # noqa: E402
from fleetsim.workload import Workload  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_WORKERS = 4  # the largest fleet this machine holds (see the docstring)
TITLE = "Simulator fidelity: fleetsim vs the real fleet on the same arrivals"


# --- observations: bench/fidelity_obs.py ---------------------------------------------------


def network_ms_from(real_idle_ttft_ms: list[float], sim_idle_ttft_ms: list[float]) -> float:
    """The simulator's per-message latency that makes its idle first token as late as
    the real fleet's: the p50 difference (one message lies on that path), >= 0. The
    `sim-constant` model's one parameter."""
    if not real_idle_ttft_ms or not sim_idle_ttft_ms:
        raise ValueError("need idle TTFTs from both")
    diff = statistics.median(real_idle_ttft_ms) - statistics.median(sim_idle_ttft_ms)
    return round(max(0.0, diff), 2)


def client_legs_from(real_idle_ttft_ms: list[float],
                     sim_idle_ttft_ms: list[float]) -> tuple[float, ...]:
    """The `sim` model's clients' legs (`FleetSettings.client_ms`): each idle probe's
    real TTFT less the simulator's (its hop included), >= 0. What the simulator's idle
    first token lacks, kept probe by probe: its spread too, not only its median."""
    if not real_idle_ttft_ms or not sim_idle_ttft_ms:
        raise ValueError("need idle TTFTs from both")
    sim = statistics.median(sim_idle_ttft_ms)
    return tuple(round(max(0.0, x - sim), 3) for x in real_idle_ttft_ms)


def idle_probes(n: int, gap_s: float = 0.3, prompt_tokens: int = 32,
                output_tokens: int = 16) -> list[Arrival]:
    """Sequential probes of the idle fleet (for `network_ms`), tenant index 0."""
    return [Arrival(0.5 + gap_s * i, 0, prompt_tokens, output_tokens, output_tokens)
            for i in range(n)]


# --- the simulator ------------------------------------------------------------------------------


class ObservingSink:
    """fleetsim's `Sink`, feeding `Observations` per class (and the busy slots)."""

    def __init__(self, obs: Observations, class_of: list[str], network_ms: float) -> None:
        self.obs, self.class_of, self.network_s = obs, class_of, network_ms / 1000
        self.busy_slots: list[int] = []
        self.num_rejected = 0

    def on_rejected(self, tenant: int, t_s: float, code: str) -> None:
        self.num_rejected += 1

    def on_first_token(self, tenant: int, t_s: float, ttft_s: float) -> None:
        self.obs.first_token(self.class_of[tenant], t_s - ttft_s, ttft_s)

    def on_finished(self, tenant: int, t_s: float, e2e_s: float, ttft_s: float,
                    output_tokens: int, preemptions: int, worker_ttft_s: float = 0.0,
                    client_s: float = 0.0) -> None:
        cls, arrival_s = self.class_of[tenant], t_s - e2e_s
        self.obs.finished(cls, arrival_s, e2e_s, ttft_s, output_tokens)
        if not preemptions:  # its one dispatch took network_ms to reach its worker
            queue_s = max(0.0, ttft_s - worker_ttft_s - self.network_s - client_s)  # not -1e-17
            self.obs.ttft_split(cls, arrival_s, ttft_s, queue_s, worker_ttft_s)

    def on_tokens(self, tenant: int, start_s: float, end_s: float, num_tokens: int) -> None:
        self.obs.generated(self.class_of[tenant], start_s, end_s, num_tokens)

    def on_preempted(self, tenant: int, t_s: float) -> None:
        pass

    def on_recomputed(self, tenant: int, t_s: float, num_tokens: int) -> None:
        pass

    def sample(self, t_s: float, queued_by_tier: list[int], running: int,
               busy_workers: int) -> None:
        if self.obs.in_window(t_s):
            self.busy_slots.append(running)


def run_sim(wl: Workload, arrivals: list[Arrival], obs: Observations, settings: FleetSettings,
            run_s: float) -> dict[str, Any]:
    """The arrivals through fleetsim for `run_s` simulated seconds; diagnostics."""
    class_of = class_of_tenants(wl)
    for a in arrivals:
        obs.arrival(class_of[a.tenant], a.t_s)
    sink = ObservingSink(obs, class_of, settings.network_ms)
    fleet = Fleet(wl.scheduler_config, wl.tenants, sink, settings)
    t0 = time.perf_counter()
    with tuned_gc():
        fleet.run(iter(arrivals), run_s)
    return {"wall_s": round(time.perf_counter() - t0, 2), "preemptions": fleet.num_preemptions,
            "rejected": sink.num_rejected,
            "busy_slots_mean": round(statistics.mean(sink.busy_slots), 1)
            if sink.busy_slots else None}



def sim_idle_ttft_ms(wl: Workload, probes: list[Arrival], settings: FleetSettings) -> list[float]:
    """The simulator's TTFTs for the idle probes (`idle_probes`)."""
    obs = Observations(0.0, math.inf)
    run_sim(wl, probes, obs, settings, probes[-1].t_s + 5.0)
    return [x * 1000 for xs in obs.ttft_s.values() for x in xs]


# --- the benchmark ------------------------------------------------------------------------------

HEARTBEAT_MS = 1000  # the worker's default, and FleetSettings'
VARIANTS = (SIM, SIM_CONSTANT, REAL, REAL_SHARED, REAL_GC)  # --variants


def fleet_settings(args: argparse.Namespace, network_ms: float, workers: int | None = None,
                   client_ms: tuple[float, ...] = (), seed: int = 0) -> FleetSettings:
    return FleetSettings(num_workers=workers or max(args.workers), step_model=args.step_model,
                         max_num_seqs=args.max_num_seqs, prefetch_seqs=args.prefetch_seqs,
                         network_ms=network_ms, client_ms=client_ms, client_seed=seed,
                         heartbeat_ms=HEARTBEAT_MS, hint_output_tokens=True)


def worker_spec(args: argparse.Namespace) -> WorkerSpec:
    return WorkerSpec(max_num_seqs=args.max_num_seqs, prefetch_seqs=args.prefetch_seqs,
                      time_scale=1.0, step_model=args.step_model, heartbeat_ms=HEARTBEAT_MS)


def scenarios_of(args: argparse.Namespace) -> dict[str, Scenario]:
    """Each scenario at each fleet size of --workers; with one size the scenarios keep
    their names, with several each is `NAME@Kw` (e.g. `light@2w`)."""
    out = {}
    for name in args.scenarios.split(","):
        if name not in SCENARIOS:
            raise SystemExit(f"unknown scenario {name!r} (known: {', '.join(SCENARIOS)})")
        s = SCENARIOS[name]
        duration_s = args.duration_s or (QUICK_DURATION_S if args.quick else s.duration_s)
        if duration_s <= s.warmup_s:
            raise SystemExit(f"--duration-s must exceed {name}'s warm-up ({s.warmup_s:g} s)")
        for workers in args.workers:
            key = name if len(args.workers) == 1 else f"{name}@{workers}w"
            out[key] = replace(s, name=key, duration_s=duration_s, workers=workers)
    return out


@dataclass
class Bench:
    """One invocation: the nats-server, the scenarios and the calibrated network_ms."""

    args: argparse.Namespace
    scenarios: dict[str, Scenario]
    nats_url: str
    nats_pid: int | None
    log_root: Path
    run_id: str
    notes: list[str] = field(default_factory=list)
    network_ms: float = 0.0  # sim: one hop, measured
    client_ms: tuple[float, ...] = ()  # sim: the clients' legs, from the idle probes
    constant_ms: float = 0.0  # sim-constant: every message, the idle probes' p50

    def real_kwargs(self, prefix: str, workers: int, variant: str = REAL) -> dict[str, Any]:
        spec = worker_spec(self.args)
        if variant == REAL_GC:
            spec = replace(spec, gc_young_objects=0)
        suffix = {REAL_SHARED: "s", REAL_GC: "g"}.get(variant, "")
        return {"nats_url": self.nats_url, "prefix": prefix + suffix, "workers": workers,
                "spec": spec, "log_dir": self.log_root / (prefix + suffix),
                "notes": self.notes}

    async def calibrate(self) -> dict[str, Any]:
        """On the idle rig, never on the scenarios (`sim`): `network_ms` is one message's
        time (`message_hop_ms`), the clients' legs each idle probe's real TTFT less the
        simulator's; `sim-constant`: the idle TTFT p50 less the simulator's without
        hops, on every message. One calibration for every fleet size of --workers,
        measured on the largest: sequential probes meet an idle fleet, whatever its
        size. --network-ms: that, no legs, nothing measured."""
        if self.args.network_ms is not None:
            self.network_ms = self.constant_ms = self.args.network_ms
            return {"value": self.network_ms, "source": "flag"}
        workers = max(self.args.workers)
        wl, doc = load_scenario(next(iter(self.scenarios.values())), workers, 0)
        probes = idle_probes(self.args.idle_probes)
        real = await idle_ttft_ms(wl, doc, probes,
                                  **self.real_kwargs(f"fi{self.run_id}cal", workers))
        hops = await message_hop_ms(self.nats_url)
        self.network_ms = round(statistics.median(hops), 3)
        sim = sim_idle_ttft_ms(wl, probes, fleet_settings(self.args, self.network_ms, workers))
        sim0 = sim_idle_ttft_ms(wl, probes, fleet_settings(self.args, 0.0, workers))
        self.client_ms = client_legs_from(real, sim)
        self.constant_ms = network_ms_from(real, sim0)
        return {"value": self.network_ms, "source": "calibrated", "n": len(real),
                "hop_n": len(hops), "hop_p99_ms": round(quantile(hops, 0.99), 3),
                "client_ms": list(self.client_ms), "constant_ms": self.constant_ms,
                "real_idle_ttft_p50_ms": round(statistics.median(real), 2),
                "sim_idle_ttft_p50_ms": round(statistics.median(sim), 2),
                "sim0_idle_ttft_p50_ms": round(statistics.median(sim0), 2),
                "real_idle_ttft_ms": [round(x, 2) for x in real]}

    async def run_one(self, name: str, rep: int) -> dict[str, Any]:
        """One (scenario:variant, repetition): seed = the repetition."""
        scen_name, _, variant = name.partition(":")
        s = self.scenarios[scen_name]
        wl, doc = load_scenario(s, s.workers, rep)
        arrivals = list(wl.arrivals())
        obs = Observations(s.warmup_s, s.duration_s)
        run_s = s.duration_s + s.drain_s
        if variant == SIM:  # its legs' draws seeded by the repetition, as its arrivals
            diag = run_sim(wl, arrivals, obs, fleet_settings(
                self.args, self.network_ms, s.workers, self.client_ms, rep), run_s)
        elif variant == SIM_CONSTANT:
            diag = run_sim(wl, arrivals, obs,
                           fleet_settings(self.args, self.constant_ms, s.workers), run_s)
        else:
            prefix = f"fi{self.run_id}{scen_name[:2]}{s.workers}w{rep}"
            diag = await run_real(wl, doc, arrivals, class_of_tenants(wl), obs, run_s=run_s,
                                  nats_pid=self.nats_pid,
                                  clients=SHARED if variant == REAL_SHARED else PER_CLASS,
                                  **self.real_kwargs(prefix, s.workers, variant))
        return {"classes": class_metrics(obs, [c.name for c in wl.classes]), "diag": diag,
                "num_arrivals": len(arrivals)}


async def amain(args: argparse.Namespace) -> int:
    meta = RunMeta.here()
    scenarios = scenarios_of(args)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fl-fid-") as tmp:
        log_root = Path(args.log_dir) if args.log_dir else Path(tmp) / "logs"
        with NatsServer(store_dir=str(Path(tmp) / "js")) as ns:
            proc = getattr(ns, "proc", None)
            bench = Bench(args, scenarios, ns.url, proc.pid if proc else None, log_root,
                          str(os.getpid() % 100000))
            network = await bench.calibrate()
            print(f"network_ms = {bench.network_ms} ({network['source']})", file=sys.stderr)
            names = [f"{s}:{v}" for s in scenarios for v in variants_of(args)]
            records = await run_interleaved(names, args.reps, bench.run_one)
    workers: int | list[int] = args.workers[0] if len(args.workers) == 1 else args.workers
    data = {"args": vars(args), "workers": workers, "max_num_seqs": args.max_num_seqs,
            "prefetch_seqs": args.prefetch_seqs, "step_model": args.step_model,
            "network_ms": network, "wall_s": round(time.monotonic() - t0, 1),
            "scenarios": {name: {"workload": s.workload, "warmup_s": s.warmup_s,
                                 "duration_s": s.duration_s, "drain_s": s.drain_s,
                                 "workers": s.workers, "classes": _class_names(s)}
                          for name, s in scenarios.items()},
            "notes": bench.notes, "runs": [r.__dict__ for r in records]}
    body = report(data)
    print(body)
    stem = args.stem or ("fidelity.quick" if args.quick else "fidelity")
    md, js = write_results(Path(args.out_dir) / f"{stem}.md", TITLE, body, data, meta,
                           HOW_TO_READ)
    print(f"(written to {md} and {js})", file=sys.stderr)
    return 0 if all(r.error is None for r in records) else 1


def variants_of(args: argparse.Namespace) -> list[str]:
    """--variants in run order; sim and real are the comparison and must be there."""
    out = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in out if v not in VARIANTS]
    if unknown or SIM not in out or REAL not in out or len(set(out)) != len(out):
        raise ValueError(f"--variants: {SIM} and {REAL}, optionally {SIM_CONSTANT}, "
                         f"{REAL_SHARED} and {REAL_GC}, each once (got {args.variants!r})")
    if SIM_CONSTANT in out and args.network_ms is not None:
        raise ValueError(f"--variants {SIM_CONSTANT} is calibrated: not with --network-ms")
    return out


def _class_names(s: Scenario) -> list[str]:
    return [c.name for c in load_scenario(s, s.workers, 0)[0].classes]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"1 rep, {QUICK_DURATION_S:g} s scenarios: a smoke run (tails are max=)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 5; quick 1)")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="of: " + ", ".join(SCENARIOS))
    ap.add_argument("--workers", default=str(DEFAULT_WORKERS),
                    help="workers of 32 slots (the workloads' load scales with it); several, "
                         "comma-separated (2,4): every scenario at each size, interleaved")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--prefetch-seqs", type=int, default=4)
    ap.add_argument("--step-model", default="default")
    ap.add_argument("--duration-s", type=float, default=None,
                    help="every scenario's arrivals stop here (default: its own, quick 30)")
    ap.add_argument("--network-ms", type=float, default=None,
                    help="the simulator's message latency, and no clients' legs (default: "
                         "both calibrated on the idle real fleet)")
    ap.add_argument("--idle-probes", type=int, default=None,
                    help="sequential probes for the calibration (default 60; quick 30)")
    ap.add_argument("--variants", default=None,
                    help=f"of: {', '.join(VARIANTS)} (default: {SIM},{SIM_CONSTANT},{REAL}; "
                         f"{SIM},{REAL} with --network-ms); {SIM_CONSTANT} is the simulator as "
                         "calibrated before (one constant on every message), "
                         f"{REAL_SHARED} the real fleet with one client for every class "
                         f"(the earlier rig), {REAL_GC} its workers under Python's default "
                         "garbage collector, each for comparison")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--stem", default="",
                    help="results file name, without .md/.json (default fidelity; quick "
                         "fidelity.quick)")
    ap.add_argument("--log-dir", default="", help="keep process logs here (default: temp)")
    args = ap.parse_args(argv)
    if args.variants is None:
        args.variants = ",".join([SIM, REAL] if args.network_ms is not None
                                 else [SIM, SIM_CONSTANT, REAL])
    try:
        variants_of(args)
    except ValueError as exc:
        ap.error(str(exc))
    args.reps = args.reps or (1 if args.quick else 5)
    args.idle_probes = args.idle_probes or (30 if args.quick else 60)
    try:
        args.workers = [int(w) for w in args.workers.split(",")]
    except ValueError:
        ap.error(f"--workers: comma-separated integers (got {args.workers!r})")
    if not args.workers or min(args.workers) < 1 or len(set(args.workers)) != len(args.workers):
        ap.error("--workers: each >= 1, each once")
    return args


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM as Ctrl-C: the run's cleanup (client, fleet, nats-server) still happens.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return asyncio.run(amain(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        for fleet in list(LIVE_FLEETS.values()):  # interrupted mid-run: nothing may outlive us
            fleet.kill_now()


if __name__ == "__main__":
    sys.exit(main())
