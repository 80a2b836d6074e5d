"""How fast `fairlane simulate` runs: workers x tenants x simulated seconds, wall clock.

    PYTHONPATH=. python bench/bench_simulate_scale.py \\
        [--scales 10x100,100x10000,1000x100000] [--duration-s 3600] [--max-wall-s 900] \\
        [--variants interpreted,compiled,compiled-pools2]

Issue 12's target: 1,000 workers x 100,000 tenants x one simulated hour in under 10
minutes on this 2-core machine, memory bounded. Each scale runs `fleetsim.fleet.Fleet`
with `fleetsim.recorder.Recorder` exactly as `fairlane simulate` does (`tuned_gc`
included), in its own child process (peak RSS is that process's own, and its pools'
processes', `resource.getrusage`, no tracemalloc), on `bench/workloads/scale.yaml`'s
traffic mix scaled to the size:

- the tenants of each class in proportion (100,000 -> the file's counts), at least one,
  each class keeping its share of the traffic;
- outputs uniform 128-384 tokens (`max_tokens` 384), the file's prompt lengths;
- every class's per-tenant rate multiplied by one factor so that the fleet's slots
  (`--slots` per worker, default 32) are `--load` (0.8) busy: the rate per worker is
  `n / (E[out] * step_ms(n) + n * prefill_ms(E[prompt]))` for n = load x slots (each
  admission's prefill stalls the batch for one step). The measured busy fraction
  (mean running / slots, after a warm-up of 10 simulated s) is in the table.

Each scale runs through `fleetsim.pools.run_pools`, as `fairlane simulate` does. Wall
time is `time.perf_counter` around it: building the pools' fleets (O(workers)), the run
and, with several pools, forking their processes and merging their recorders; the
workload's building and the report are not in it (seconds, O(tenants)). A scale that
would pass `--max-wall-s` stops at the next simulated second (every pool at the same
one): its row then shows the simulated time reached, and the hour is extrapolated
from its steady-state rate (labelled as such). `--duration-s 1000x100000:600` sets one
scale's duration.

A variant `-poolsK` (`compiled-pools2`) splits the fleet into K pools, one dispatcher
each (`fairlane simulate --pools K`: tenants and workers spread evenly), simulated side
by side in one process per pool (at most the CPUs at once). That is another fleet, the
deployment the README advises for ~1,000 GPUs, not the same fleet run faster: its
rows' TTFT and busy columns are its own. CPU time and peak RSS are the pools' sum.

`--base REV` with variants named `base-...` (`base-compiled`, `base-compiled-pools2`)
runs those from commit REV's simulator (its four packages unpacked with `git archive`,
compiled from that tree for `base-compiled`), in the same run and interleaved with this
checkout's: a change to the simulator measured against its base on one host, in one
hour, instead of against a figure from another session (hosts differ by up to 2.4x).
Each child checks that it imported the tree its variant names.

`--alt-python PATH` with variants named `alt-...` runs those under another interpreter
(`alt-compiled` with a compiled copy built by it): the simulator's speed depends on the
Python build as much as on its code. Each row records its interpreter, its version and
whether its libpython is a shared library (pyenv's default build) or linked into the
executable (Debian's python3), the difference measured.

`--variants interpreted,compiled` runs each scale twice, as `fairlane simulate` and as
`fairlane simulate --compiled` (the same modules compiled with mypyc,
`fleetsim.compiled`; built before the first run, not timed), one after the other, the
order reversed every other scale. The simulation is the same (the rows' requests,
busy and TTFT agree); only the wall time differs. `--reps N` runs all of it N times,
repetition after repetition (interleaved); a row then gives the median and min–max of
its times (`bench/render_scale.py`, which BENCHMARKS.md's table comes from too).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

# The checkout first, unless the path has it already: a `--variants compiled` child's
# PYTHONPATH puts the compiled copy ahead of it (fleetsim.compiled.env).
if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import RunMeta, run_children, short_rev, write_results  # noqa: E402
from bench.render_scale import (  # noqa: E402
    ALT_PREFIX,
    BASE_PREFIX,
    TARGET_SCALE,
    find_runs,
    scale_table,
    target_line,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "simulate_scale.md"
TEMPLATE = ROOT / "bench" / "workloads" / "scale.yaml"
TITLE = "Fleet simulator speed: workers x tenants x simulated time"
HOUR_S = 3600.0
WARMUP_S = 10.0
OUTPUT = {"dist": "uniform", "min": 128, "max": 384}


def parse_scale(text: str) -> tuple[int, int]:
    w, _, t = text.lower().partition("x")
    return int(w), int(t)


def scaled_counts(counts: list[int], num_tenants: int) -> list[int]:
    """The classes' tenant counts in proportion to `num_tenants` (largest remainder,
    each class at least one)."""
    total = sum(counts)
    exact = [c * num_tenants / total for c in counts]
    out = [max(1, math.floor(x)) for x in exact]
    order = sorted(range(len(counts)), key=lambda i: exact[i] - math.floor(exact[i]),
                   reverse=True)
    for i in order:
        if sum(out) >= num_tenants:
            break
        out[i] += 1
    return out


def _mean(dist: Any, n: int = 20_000) -> float:
    rng = random.Random(7)
    return sum(dist.draw(rng) for _ in range(n)) / n


def rate_per_worker(wl: Any, weights: list[float], step: Any, busy_slots: float) -> float:
    """Requests per second per worker that keep `busy_slots` sequences running on
    average (module docstring), with the classes' mean lengths weighted by traffic."""
    total = sum(weights)
    prompt = sum(w * _mean(c.prompt_tokens) for w, c in zip(weights, wl.classes, strict=True))
    output = sum(w * _mean(c.output_tokens) for w, c in zip(weights, wl.classes, strict=True))
    prompt, output = prompt / total, output / total
    n = busy_slots
    step_ms = step.step_ms(round(n), round(n * (prompt + output / 2)))
    return 1000.0 * n / (output * step_ms + n * step.prefill_ms(round(prompt)))


def build_workload(workers: int, tenants: int, duration_s: float, slots: int, load: float,
                   seed: int) -> tuple[Any, dict[str, Any]]:
    from fleetsim.workload import workload_from_dict
    from gpu_worker.sim.step_model import load_step_model

    doc = yaml.safe_load(TEMPLATE.read_text())
    doc["duration_s"], doc["seed"] = duration_s, seed
    template = workload_from_dict(copy.deepcopy(doc))
    share = [c.process.expected(c.num_tenants, duration_s) for c in template.classes]
    counts = scaled_counts([c.num_tenants for c in template.classes], tenants)
    for c, n in zip(doc["classes"], counts, strict=True):
        c["count"] = n
        c["output_tokens"] = dict(OUTPUT)
        c["max_tokens"] = OUTPUT["max"]
    wl = workload_from_dict(copy.deepcopy(doc))
    # Each class keeps its share of the traffic (a class rounded up to one tenant would
    # otherwise weigh more), then one factor for the load: expected() is linear in rate.
    have = [c.process.expected(c.num_tenants, duration_s) for c in wl.classes]
    want_per_s = rate_per_worker(wl, share, load_step_model("default"), load * slots) * workers
    factor = want_per_s * duration_s / sum(share)
    for c, s, h in zip(doc["classes"], share, have, strict=True):
        c["arrival"]["rate_per_s"] = c["arrival"]["rate_per_s"] * factor * s / h
    wl = workload_from_dict(doc)
    return wl, {"requests_per_s": wl.expected_requests() / duration_s,
                "traffic_vs_scale_yaml": factor, "class_counts": counts}


def parse_variant(variant: str) -> tuple[str, int]:
    """`compiled` -> ("compiled", 1); `compiled-pools2` -> ("compiled", 2); the same
    for `base-compiled-pools2` (the --base commit's) and `alt-...` (--alt-python's)."""
    own = variant.removeprefix(BASE_PREFIX) if variant.startswith(BASE_PREFIX) \
        else variant.removeprefix(ALT_PREFIX)
    base, _, pools = own.partition("-pools")
    if base not in ("interpreted", "compiled") or (pools and not pools.isdigit()) \
            or pools.startswith("0"):
        raise SystemExit(f"--variants: unknown {variant!r} (interpreted or compiled, "
                         "optionally -poolsK)")
    return base, int(pools or 1)


def merged_checkpoints(pools: list) -> list[tuple[float, float, float, float]]:
    """The pools' checkpoints at the simulated times they all reached: wall the
    slowest's, CPU and peak RSS the sum (the processes run side by side)."""
    common = set.intersection(*({c[0] for c in r.checkpoints} for r in pools))
    by_t = [{c[0]: c for c in r.checkpoints} for r in pools]
    return [(t, max(b[t][1] for b in by_t), sum(b[t][2] for b in by_t),
             sum(b[t][3] for b in by_t)) for t in sorted(common)]


def child(a: argparse.Namespace, workers: int, tenants: int, duration_s: float,
          variant: str) -> dict:
    from fleetsim.compiled import is_compiled
    from fleetsim.fleet import FleetSettings
    from fleetsim.pools import Job, run_pools

    base, num_pools = parse_variant(variant)
    where = sys.modules["fleetsim.fleet"].__file__ or ""
    source = os.environ.get("FL_BENCH_SOURCE")  # the tree this variant must run from
    if is_compiled() != (base == "compiled") or (
            source and not Path(where).resolve().is_relative_to(Path(source).resolve())):
        raise SystemExit(f"variant {variant}: fleetsim.fleet is {where}")

    wl, info = build_workload(workers, tenants, duration_s, a.slots, a.load, a.seed)
    job = Job(workload=wl, config=wl.scheduler_config,
              settings=FleetSettings(num_workers=workers, max_num_seqs=a.slots),
              duration_s=duration_s, num_pools=num_pools, checkpoint_every_s=a.progress_s)

    class Stop:
        requested = False

    stop, next_print_s = Stop(), 0.0
    # The interpreter, which moves the compiled simulator's speed: in
    # bench/results/sim_instructions.md a Python with a shared libpython (pyenv's build
    # here) executed ~14% more instructions than Debian's, linked into its executable.
    with open("/proc/self/maps") as maps:
        shared = any("libpython" in line for line in maps)
    python = {"python": platform.python_version(), "python_executable": sys.executable,
              "libpython_shared": shared}

    def progress(t_s: float, wall: float) -> None:
        nonlocal next_print_s
        if t_s >= next_print_s:
            next_print_s = t_s + a.progress_s
            print(f"  {workers}x{tenants} {variant}: simulated {t_s:,.0f} s in {wall:,.1f} s "
                  "wall", file=sys.stderr, flush=True)
        if wall > a.max_wall_s:
            stop.requested = True  # every pool ends at one simulated second

    # `run_pools` runs each pool as `fairlane simulate` does (`tuned_gc` included); one
    # pool here, in this process; several, one process each (as many as the CPUs).
    outcome = run_pools(job, os.cpu_count() or 1, stop, progress)
    assert outcome is not None
    wall_s, sim_s, stopped = outcome.wall_s, outcome.simulated_s, outcome.stopped
    cpu_s = sum(r.cpu_s for r in outcome.pools)
    checkpoints = merged_checkpoints(outcome.pools)
    recorder = outcome.recorder
    # This process's peak, and with pools in processes each one's own on top (a sum of
    # peaks: an upper bound on what the run held at once).
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if num_pools > 1:
        peak_rss_mib += sum(r.peak_rss_mib for r in outcome.pools)
    summary = recorder.summary()
    arrivals = sum(r.arrivals for r in outcome.pools)
    events = sum(r.events for r in outcome.pools)
    samp = summary["samples"]
    busy = [r for t, r in zip(samp["t_s"], samp["running"], strict=True) if WARMUP_S <= t <= sim_s]
    pool = summary["pool"]
    # The steady-state rate: from the first checkpoint past the warm-up to the end.
    steady = next(((s, w) for s, w, _, _ in checkpoints if s >= WARMUP_S), None)
    if steady is not None and sim_s > steady[0] and wall_s > steady[1]:
        steady_rate = (sim_s - steady[0]) / (wall_s - steady[1])
    else:
        steady_rate = sim_s / wall_s
    return {
        "variant": variant,
        "workers": workers, "tenants": tenants, "slots": a.slots, "load_target": a.load,
        "duration_s": duration_s, "simulated_s": sim_s, "stopped_early": stopped,
        "wall_s": round(wall_s, 2), "cpu_s": round(cpu_s, 2),
        "sim_s_per_wall_s": sim_s / wall_s, "steady_sim_s_per_wall_s": steady_rate,
        "hour_wall_s": HOUR_S / steady_rate if stopped or sim_s < HOUR_S else wall_s,
        "hour_extrapolated": stopped or sim_s < HOUR_S,
        "peak_rss_mib": round(peak_rss_mib, 1),
        "arrivals": arrivals, "events": events,
        "arrivals_per_wall_s": arrivals / wall_s, "events_per_wall_s": events / wall_s,
        "preemptions_ordered": sum(r.preemptions_ordered for r in outcome.pools),
        "pools": num_pools, "processes": min(num_pools, os.cpu_count() or 1),
        "busy_fraction": (sum(busy) / len(busy) / (workers * a.slots)) if busy else None,
        "finished": pool["finished"], "rejected": pool["rejected"],
        "throughput_tok_s": pool["throughput_tok_s"],
        "ttft_p50_s": pool["ttft_s"]["p50"], "ttft_p99_s": pool["ttft_s"]["p99"],
        "checkpoints": checkpoints, **info, **python,
    }


HOW_TO_READ = f"""\
One row per scale and variant: `workers x tenants`, {TEMPLATE.relative_to(ROOT)}'s traffic
mix scaled to it (module docstring), outputs 128-384 tokens, preemption on (the pool's
default), drr. *variant*: `interpreted` is `fairlane simulate`, `compiled` is `fairlane
simulate --compiled` (the same modules compiled with mypyc, `fleetsim.compiled`);
`-poolsK`: the fleet split into K pools, one dispatcher each (`fairlane simulate --pools
K`), each pool in its own process, side by side (another fleet: its latency columns are
its own). *reps*: the row's repetitions; its times are their median (min–max), its
simulation's columns the same in each (the simulator is deterministic; "differs" if
not). *wall s*: building the pools' fleets, the run and merging (perf_counter); *cpu
s* the pools' process time, summed (where cpu exceeds wall, pools ran side by side;
where wall exceeds cpu ÷ processes, something else ran). *sim-s / wall-s* over the whole run, *steady* from {WARMUP_S:g} simulated s on (the
empty fleet's first seconds are cheaper). *hour, wall* is the time one simulated hour
takes: measured where the row ran the hour, else extrapolated from the steady rate
(marked "extrapolated"). *busy* is mean running / slots after {WARMUP_S:g} s. Peak RSS
is the child process's own (getrusage), with Python, numpy and the scheduler loaded,
plus each pool process's own peak (a sum of peaks: an upper bound)."""


def report(runs: list[dict], base_commit: str | None = None) -> str:
    lines = ([f"*base-...* variants: the simulator of commit {base_commit} (`--base`), run "
              "from its tree in the same run.", ""] if base_commit else [])
    lines += [scale_table(runs), "",
             "Peak RSS so far (MiB) along each run, at simulated s (flat = bounded):", ""]
    for r in runs:
        cps = r["checkpoints"]
        picks = cps[:: max(1, len(cps) // 8)] + ([cps[-1]] if len(cps) % 8 else [])
        marks = ", ".join(f"{c[0]:,.0f}: {c[3]:,.0f}" for c in dict.fromkeys(
            tuple(c) for c in picks))
        lines.append(f"- {r['workers']:,} x {r['tenants']:,}, "
                     f"{r.get('variant', 'interpreted')}, rep {r.get('rep', 0)}: {marks}")
    if find_runs({"runs": runs}, TARGET_SCALE):
        lines += ["", target_line({"runs": runs})]
    return "\n".join(lines)


def parse_item(item: str) -> tuple[str, str, int]:
    """A child's item, `SCALE@VARIANT#REP` (main builds them): (scale, variant, rep)."""
    scale, _, rest = item.partition("@")
    variant, _, rep = rest.partition("#")
    return scale, variant, int(rep or 0)


def compiled_copy(python: str, root: Path) -> Path:
    """The compiled copy of the simulator at `root`, built as that tree builds it (its
    own `fleetsim.compiled` and module list) by and for `python`."""
    out = subprocess.run([python, "-m", "fleetsim.compiled"], cwd=root,
                         env=dict(os.environ, PYTHONPATH=str(root)), check=True,
                         capture_output=True, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def variant_envs(variants: list[str], base_rev: str | None, alt_python: str | None,
                 tmp: Path) -> dict[str, dict[str, str] | None]:
    """Each variant's child environment (None: this process's): a compiled variant
    imports its compiled copy first (`compiled_copy`: a base one of its commit's tree,
    an alt one built by `alt_python`), an interpreted base one its commit's tree;
    `FL_BENCH_SOURCE` names the tree the child must find `fleetsim` in."""
    from bench.fleet import base_tree, source_env
    from fleetsim import compiled

    tree = None
    if base_rev and any(v.startswith(BASE_PREFIX) for v in variants):
        tree = base_tree(base_rev, tmp / "base", compiled.PACKAGES, "fleetsim")
    out: dict[str, dict[str, str] | None] = {}
    builds: dict[tuple[str, Path], Path] = {}  # one per tree and interpreter
    for v in variants:
        src = tree if v.startswith(BASE_PREFIX) else None
        python = alt_python if v.startswith(ALT_PREFIX) and alt_python else sys.executable
        if parse_variant(v)[0] == "compiled":
            key = (python, src or ROOT)
            build = builds[key] = builds.get(key) or compiled_copy(*key)
            out[v] = compiled.env(build) | {"FL_BENCH_SOURCE": str(build)}
        elif src is not None:
            # The tree first; run_children appends this checkout (for `bench`).
            out[v] = source_env(src) | {"FL_BENCH_SOURCE": str(src)}
        else:
            out[v] = None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scales", default="10x100,100x10000,1000x100000")
    ap.add_argument("--duration-s", default="3600",
                    help="simulated seconds: one number, or SCALE:SECONDS,... per scale")
    ap.add_argument("--max-wall-s", type=float, default=900.0,
                    help="stop a scale at the next checkpoint past this much wall time")
    ap.add_argument("--progress-s", type=float, default=60.0, help="checkpoint every (sim s)")
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--load", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--variants", default="interpreted",
                    help="interpreted and/or compiled (fleetsim.compiled), each optionally "
                         "-poolsK (the fleet split into K pools, fleetsim.pools), "
                         "comma-separated")
    ap.add_argument("--reps", type=int, default=1,
                    help="repetitions of every scale and variant (>= 5 for a headline)")
    ap.add_argument("--base", default=None,
                    help="the commit the base-... variants run (module docstring)")
    ap.add_argument("--alt-python", default=None,
                    help="the interpreter the alt-... variants run under (an executable)")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    default_s, per_scale = 3600.0, {}
    for part in a.duration_s.split(","):
        if ":" in part:
            k, v = part.split(":")
            per_scale[k.lower()] = float(v)
        else:
            default_s = float(part)
    if a.child:
        scale, variant, rep = parse_item(a.child)
        w, t = parse_scale(scale)
        out = child(a, w, t, per_scale.get(scale.lower(), default_s), variant)
        print(json.dumps(out | {"rep": rep}))
        return
    variants = a.variants.split(",")
    for v in variants:
        parse_variant(v)
    if any(v.startswith(BASE_PREFIX) for v in variants) and not a.base:
        raise SystemExit("--variants base-...: name the commit with --base")
    if any(v.startswith(ALT_PREFIX) for v in variants) and not a.alt_python:
        raise SystemExit("--variants alt-...: name the interpreter with --alt-python")
    # Repetition by repetition, every scale in each; the variants' order alternates
    # from one (scale, repetition) to the next, so neither always runs first.
    scales = a.scales.split(",")
    items = [f"{scale}@{v}#{rep}" for rep in range(a.reps) for i, scale in enumerate(scales)
             for v in (variants if (rep * len(scales) + i) % 2 == 0 else variants[::-1])]
    meta = RunMeta.here()
    extra: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="fl-scale-") as tmp:
        envs = variant_envs(variants, a.base, a.alt_python, Path(tmp))
        if a.base:
            extra["base_commit"] = short_rev(a.base)
        runs, (load0, load1) = run_children(
            __file__, items, lambda item: envs[parse_item(item)[1]],
            lambda item: a.alt_python if parse_item(item)[1].startswith(ALT_PREFIX) else None)
    body = report(runs, extra.get("base_commit"))
    body += f"\n\nLoad average before / after: {load0} / {load1}.\n"
    md, js = write_results(a.out, TITLE, body, {"runs": runs, "load_avg": [load0, load1],
                                                "args": vars(a) | {"out": str(a.out)},
                                                **extra}, meta, HOW_TO_READ)
    print(body)
    print(f"wrote {md} and {js}", file=sys.stderr)


if __name__ == "__main__":
    main()
