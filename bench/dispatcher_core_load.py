"""Does one dispatcher keep up with a big pool? The scheduling core's own CPU, measured.

    PYTHONPATH=. python bench/dispatcher_core_load.py \\
        [--scales 100x10000,1000x100000] [--duration-s 70] [--reps 5]

`fairlane simulate` assumes a dispatcher that keeps up: every message reaches the core
at once and every decision takes no time. The simulation runs the dispatcher's own
core (`PoolCore`, interpreted, as the dispatcher runs it), so timing its calls
(`fleetsim.core_clock`, `fairlane simulate --time-dispatcher`) measures what that core
alone would cost a dispatcher process serving this traffic on this machine's CPU:
a lower bound on the dispatcher's CPU (its shell's own work per message, JetStream,
msgspec, NATS and metrics, comes on top; BENCHMARKS §1 measures it).

Each scale runs `bench/bench_simulate_scale.py`'s workload (bench/workloads/scale.yaml's
mix scaled to the size, outputs 128-384 tokens, 32 slots, ~80% busy, drr, preemption
on) in a child process of its own; the core's time and calls are counted from
`WARMUP_S` simulated seconds on (the empty fleet's first seconds are not the steady
state) to the end. One clock: `time.perf_counter` (one thread of CPU work: wall = CPU;
the results keep both to show it). Repetitions run one after another, scale after
scale, the scales' order alternated; rows give the median (min–max).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_simulate_scale import build_workload, parse_scale  # noqa: E402
from bench.harness import RunMeta, run_children, write_results  # noqa: E402
from bench.render_dispatcher_load import HOW_TO_READ, TITLE, results_body  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "dispatcher_core_load.md"
WARMUP_S = 10.0


def child(a: argparse.Namespace, workers: int, tenants: int) -> dict:
    from fleetsim.cli import tuned_gc
    from fleetsim.compiled import is_compiled
    from fleetsim.core_clock import CoreClock
    from fleetsim.fleet import Fleet, FleetSettings
    from fleetsim.recorder import Recorder

    if is_compiled():
        raise SystemExit("the dispatcher runs the interpreted core: run without the compiled copy")
    wl, info = build_workload(workers, tenants, a.duration_s, a.slots, a.load, a.seed)
    recorder = Recorder(wl.tenants, a.duration_s)
    fleet = Fleet(wl.scheduler_config, wl.tenants, recorder,
                  FleetSettings(num_workers=workers, max_num_seqs=a.slots))
    clock = CoreClock(fleet.core)
    at_warmup: dict = {}

    def progress(t_s: float) -> None:
        if t_s >= WARMUP_S and not at_warmup:
            at_warmup.update(t_s=t_s, wall_s=time.perf_counter(), cpu_s=time.process_time(),
                             core=dict(clock.seconds), calls=dict(clock.calls),
                             arrivals=fleet.num_arrivals, events=fleet.num_events)

    with tuned_gc():  # as `fairlane simulate` runs
        fleet.run(wl.arrivals(), a.duration_s, progress, progress_every_s=1.0)
        wall_end, cpu_end = time.perf_counter(), time.process_time()
    w0 = at_warmup
    window_s = a.duration_s - w0["t_s"]
    core = {n: clock.seconds[n] - w0["core"][n] for n in clock.seconds}
    calls = {n: clock.calls[n] - w0["calls"][n] for n in clock.calls}
    core_s = sum(core.values())
    requests = fleet.num_arrivals - w0["arrivals"]
    return {
        "workers": workers, "tenants": tenants, "slots": a.slots, "load_target": a.load,
        "window_s": [w0["t_s"], a.duration_s],
        "wall_s": wall_end - w0["wall_s"], "cpu_s": cpu_end - w0["cpu_s"],
        "requests": requests, "requests_per_s": requests / window_s,
        "events": fleet.num_events - w0["events"],
        "core_s": core_s, "core_pct_of_a_core": 100 * core_s / window_s,
        "core_us_per_request": core_s / requests * 1e6 if requests else None,
        "core_share_of_run": core_s / (wall_end - w0["wall_s"]),
        "core_s_by_call": core, "calls": calls,
        # Requests the workers hold at the end: what each second's heartbeats list.
        "in_flight_at_end": sum(len(w.seqs) for w in fleet.workers),
        **info,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scales", default="100x10000,1000x100000")
    ap.add_argument("--duration-s", type=float, default=70.0,
                    help=f"simulated seconds (measured from {WARMUP_S:g} s on)")
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--load", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5, help="repetitions (>= 5 for a headline)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if not a.duration_s > WARMUP_S:
        raise SystemExit(f"--duration-s must be more than the {WARMUP_S:g} s warm-up")
    if a.child:
        scale, _, rep = a.child.partition("#")
        w, t = parse_scale(scale)
        print(json.dumps(child(a, w, t) | {"rep": int(rep)}))
        return
    scales = a.scales.split(",")
    items = [f"{s}#{rep}" for rep in range(a.reps)
             for s in (scales if rep % 2 == 0 else scales[::-1])]
    meta = RunMeta.here()
    runs, (load0, load1) = run_children(__file__, items)
    data = {"runs": runs, "load_avg": [load0, load1], "args": vars(a) | {"out": str(a.out)}}
    body = results_body(data) + f"\n\nLoad average before / after: {load0} / {load1}.\n"
    md, js = write_results(a.out, TITLE, body, data, meta, HOW_TO_READ)
    print(body)
    print(f"wrote {md} and {js}", file=sys.stderr)


if __name__ == "__main__":
    main()
