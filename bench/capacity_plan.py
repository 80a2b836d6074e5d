"""Capacity planning: how many workers keep paid-tier TTFT p99 <= 2 s for a tenant mix.

    PYTHONPATH=. python bench/capacity_plan.py                  # the full sweep
    PYTHONPATH=. python bench/capacity_plan.py --quick --out-dir /tmp/cap   # ~1-minute smoke
    PYTHONPATH=. python bench/capacity_plan.py --workload my_mix.yaml --workers 16,24,32

Issue 12, item 6. Runs a workload (default bench/workloads/capacity_mix.yaml) through
the fleet simulator (`fleetsim`: the production `PoolCore` over simulated engines, in
virtual time, deterministic per seed) for every worker count of `--workers` x fleet
preemption on (the pool default) and off x `--seeds` workload seeds (the same seeds
at every worker count, so a column differs only in the fleet). Each run is assembled
as `fairlane simulate` assembles one (`fleetsim.cli.cmd_simulate`), in a process of
its own (`--jobs` at a time; each run is single-threaded).

Requests that arrive in the first `--warmup-s` simulated seconds are left out of every
statistic (`AfterWarmup`): the fleet starts empty, so they would see no queue and pull
the percentiles down. The recorder has no warm-up of its own, hence the wrapper.

Writes `capacity_plan.md`, `.json` ({"meta", "data"}, bench.harness.write_results) and
`.png` into `--out-dir` (default bench/results; `--stem` names them otherwise). The
answer, per preemption setting: the smallest worker count whose paid-tier TTFT p99
meets the target in every seed (and, looser, by the median over seeds), counting a
count only if every larger swept count meets it too (`smallest_meeting`). BENCHMARKS' table: bench/render_capacity.py.

Cost: the default sweep (7 counts x 2 x 5 seeds = 70 runs of 240 simulated s) takes
~9 minutes with `--jobs 2` on a 2-core machine. Underprovisioned fleets with
preemption on are the slow runs (20-40 s each, against 3-8 s for the rest): with
thousands of backlogged tenants, every preemption decision ranks them all.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.harness import RunMeta, fmt_num, summarize, write_results  # noqa: E402

TITLE = "Capacity plan: workers for paid-tier TTFT p99 <= target"
WORKLOAD = ROOT / "bench" / "workloads" / "capacity_mix.yaml"
PREEMPTION = ("on", "off")
DEFAULT_WORKERS = "10,12,14,16,20,24,32"
TARGET_S = 2.0
# --quick: a smoke of the whole path (runs, files, plot) in about a minute, not a plan.
QUICK = {"workers": "10,16,32", "seeds": 2, "duration_s": 60.0, "warmup_s": 10.0}


# --- the answer (pure) ------------------------------------------------------------------------


def meets(values_s: Sequence[float | None], target_s: float, *, every_seed: bool) -> bool:
    """Whether a (workers, preemption) point meets the target: every seed's tail <=
    target (a seed without a value fails), or the median over the seeds does."""
    if not values_s:
        return False
    if every_seed:
        return all(v is not None and v <= target_s for v in values_s)
    s = summarize(values_s)
    # A seed without a value is one that measured nothing: the median cannot vouch for it.
    return s.n == len(values_s) and s.median <= target_s


def smallest_meeting(tails_by_workers: Mapping[int, Sequence[float | None]], target_s: float,
                     *, every_seed: bool = True) -> int | None:
    """The smallest worker count that meets the target (`meets`) and from which every
    larger count swept meets it too; None if the largest does not. A count that meets
    while a larger one misses was a lucky draw, not capacity to plan on."""
    answer = None
    for workers in sorted(tails_by_workers, reverse=True):
        if not meets(tails_by_workers[workers], target_s, every_seed=every_seed):
            break
        answer = workers
    return answer


def tail_s(tier: Mapping[str, Any]) -> float | None:
    """A run's tier TTFT tail: the p99, or the max where it had fewer than 200 samples
    (bench.harness.MIN_P99_SAMPLES; the max is the stricter); None without samples."""
    p99 = tier.get("ttft_p99_s")
    return p99 if p99 is not None else tier.get("ttft_max_s")


def tails(runs: Sequence[Mapping[str, Any]], tier: str, preemption: str) -> dict[int, list]:
    """{workers: [the tier's TTFT tail of each seed's run]} for one preemption setting."""
    out: dict[int, list] = {}
    for r in sorted(runs, key=lambda r: (r["workers"], r["seed"])):
        if r["preemption"] == preemption:
            out.setdefault(r["workers"], []).append(tail_s(r["tiers"][tier]))
    return out


def answers(runs: Sequence[Mapping[str, Any]], tier: str, target_s: float) -> dict[str, dict]:
    """{"on"|"off": {"every_seed": workers|None, "median": workers|None}}."""
    out = {}
    for p in PREEMPTION:
        t = tails(runs, tier, p)
        if t:
            out[p] = {"every_seed": smallest_meeting(t, target_s, every_seed=True),
                      "median": smallest_meeting(t, target_s, every_seed=False)}
    return out


# --- one run (a child process) ----------------------------------------------------------------


class AfterWarmup:
    """A `fleetsim.records.Sink` that passes on only what belongs to requests arriving
    at or after `warmup_s` (first tokens and finishes by their arrival, rejections and
    preemptions by their time). Token windows and fleet samples pass whole: their
    readers skip the warm-up windows themselves (`run_one`)."""

    def __init__(self, inner: Any, warmup_s: float) -> None:
        self.inner, self.warmup_s = inner, warmup_s
        self.on_tokens, self.sample = inner.on_tokens, inner.sample

    def on_rejected(self, tenant: int, t_s: float, code: str) -> None:
        if t_s >= self.warmup_s:
            self.inner.on_rejected(tenant, t_s, code)

    def on_first_token(self, tenant: int, t_s: float, ttft_s: float) -> None:
        if t_s - ttft_s >= self.warmup_s:
            self.inner.on_first_token(tenant, t_s, ttft_s)

    def on_finished(self, tenant: int, t_s: float, e2e_s: float, ttft_s: float,
                    output_tokens: int, preemptions: int, worker_ttft_s: float = 0.0,
                    client_s: float = 0.0) -> None:
        if t_s - e2e_s >= self.warmup_s:
            self.inner.on_finished(tenant, t_s, e2e_s, ttft_s, output_tokens, preemptions,
                                   worker_ttft_s, client_s)

    def on_preempted(self, tenant: int, t_s: float) -> None:
        if t_s >= self.warmup_s:
            self.inner.on_preempted(tenant, t_s)

    def on_recomputed(self, tenant: int, t_s: float, num_tokens: int) -> None:
        if t_s >= self.warmup_s:
            self.inner.on_recomputed(tenant, t_s, num_tokens)


@dataclass(frozen=True)
class Point:
    """One run of the sweep."""

    workers: int
    preemption: str  # "on" | "off"
    seed: int
    workload: str
    duration_s: float
    warmup_s: float
    slots: int
    step_model: str


def _tier_stats(t: Mapping[str, Any]) -> dict[str, Any]:
    ttft = t["ttft_s"]
    return {"ttft_n": ttft["n"], "ttft_p50_s": ttft["p50"], "ttft_p99_s": ttft["p99"],
            "ttft_max_s": ttft["max"], "finished": t["finished"], "rejected": t["rejected"],
            "rejected_by_code": t["rejected_by_code"], "preemptions": t["preemptions"]}


def _after(xs: Sequence[float], starts_s: Sequence[float], lo_s: float, hi_s: float) -> list:
    return [x for x, t in zip(xs, starts_s, strict=True) if lo_s <= t < hi_s]


def run_one(p: Point) -> dict[str, Any]:
    """Simulate one point as `fairlane simulate` would and return its figures."""
    import msgspec

    from fleetsim.cli import tuned_gc
    from fleetsim.fleet import Fleet, FleetSettings
    from fleetsim.recorder import Recorder
    from fleetsim.workload import load_workload

    wl = load_workload(p.workload)
    wl.seed, wl.duration_s = p.seed, p.duration_s
    cfg = wl.scheduler_config
    if p.preemption == "off":
        cfg.preemption = msgspec.structs.replace(cfg.preemption, enabled=False)
    settings = FleetSettings(num_workers=p.workers, max_num_seqs=p.slots,
                             step_model=p.step_model)
    recorder = Recorder(wl.tenants, p.duration_s)
    fleet = Fleet(cfg, wl.tenants, AfterWarmup(recorder, p.warmup_s), settings)
    with tuned_gc():
        t0 = time.perf_counter()
        fleet.run(wl.arrivals(), p.duration_s)
        wall_s = time.perf_counter() - t0
    s = recorder.summary()
    measured_s = p.duration_s - p.warmup_s
    win = s["windows"]
    # Windows wholly after the warm-up and before the end (a run's last window may be
    # partial: the recorder divides by the full window).
    full = [t for t in win["start_s"] if t + s["window_s"] <= p.duration_s]
    tput = _after(win["throughput_tok_s"][:len(full)], full, p.warmup_s, p.duration_s)
    samp = s["samples"]
    running = _after(samp["running"], samp["t_s"], p.warmup_s, p.duration_s)
    return {
        "workers": p.workers, "preemption": p.preemption, "seed": p.seed,
        "wall_s": round(wall_s, 2), "arrivals": fleet.num_arrivals,
        "tiers": {name: _tier_stats(t) for name, t in s["by_tier"].items()},
        "throughput_tok_s": sum(tput) / len(tput) if tput else None,
        "preemptions_per_s": s["pool"]["preemptions"] / measured_s,
        "rejected": s["pool"]["rejected"],
        "busy_fraction": (sum(running) / len(running) / (p.workers * p.slots)
                          if running else None),
    }


def sweep(points: Sequence[Point], jobs: int) -> list[dict[str, Any]]:
    """Every point, `jobs` processes at a time (one fresh process per run: its memory
    and GC start clean), the most loaded fleets (fewest workers: the slowest runs)
    first so the last runs to finish are short ones."""
    order = sorted(points, key=lambda p: (p.workers, p.preemption, p.seed))
    runs = []
    with ProcessPoolExecutor(max_workers=jobs, max_tasks_per_child=1) as pool:
        for i, r in enumerate(pool.map(run_one, order)):
            print(f"[{i + 1}/{len(order)}] {r['workers']} workers, preemption "
                  f"{r['preemption']}, seed {r['seed']}: {r['wall_s']:.1f} s wall",
                  file=sys.stderr, flush=True)
            runs.append(r)
    return runs


# --- the report -------------------------------------------------------------------------------


def _fmt_s(values: Sequence[float | None]) -> str:
    s = summarize(values)
    return s.fmt(3 if s.n and s.median < 10 else 1)


def tail_label(runs: Sequence[Mapping[str, Any]], tier: str) -> str:
    """"p99", or "max" when any run had too few samples for a p99 (harness rule)."""
    return "max" if any(r["tiers"][tier]["ttft_p99_s"] is None for r in runs) else "p99"


def point_rows(runs: Sequence[Mapping[str, Any]], paid: str, free: str,
               target_s: float) -> list[list[str]]:
    """One row per (workers, preemption): medians (min–max) over the seeds."""
    groups: dict[tuple[int, str], list] = {}
    for r in runs:
        groups.setdefault((r["workers"], r["preemption"]), []).append(r)
    rows = []
    for (workers, pre), rs in sorted(groups.items(),
                                     key=lambda kv: (PREEMPTION.index(kv[0][1]), kv[0][0])):
        paid_tails = [tail_s(r["tiers"][paid]) for r in rs]
        rows.append([
            str(workers), pre,
            _fmt_s([r["tiers"][paid]["ttft_p50_s"] for r in rs]),
            tail_label(rs, paid) + " " + _fmt_s(paid_tails),
            tail_label(rs, free) + " " + _fmt_s([tail_s(r["tiers"][free]) for r in rs]),
            summarize(r["throughput_tok_s"] for r in rs).fmt(0),
            summarize(r["preemptions_per_s"] for r in rs).fmt(2),
            summarize(r["rejected"] for r in rs).fmt(0),
            summarize(100 * r["busy_fraction"] for r in rs if r["busy_fraction"] is not None
                      ).fmt(0, "%"),
            summarize(r["wall_s"] for r in rs).fmt(1),
            "yes" if meets(paid_tails, target_s, every_seed=True) else
            "median only" if meets(paid_tails, target_s, every_seed=False) else "no"])
    return rows


def answer_lines(ans: Mapping[str, Mapping[str, int | None]], paid: str, target_s: float,
                 swept: Sequence[int]) -> list[str]:
    def say(w: int | None) -> str:
        return f"**{w} workers**" if w is not None else (
            f"**none of the counts swept** (up to {max(swept)})")
    return [f"- preemption {p}: {say(a['every_seed'])} keep {paid} TTFT p99 <= "
            f"{target_s:g} s in every seed; by the median over seeds: {say(a['median'])}"
            for p, a in ans.items()]


def report(data: Mapping[str, Any]) -> str:
    runs, paid, free = data["runs"], data["paid_tier"], data["free_tier"]
    header = ["workers", "preemption", f"{paid} TTFT p50 s", f"{paid} TTFT tail s",
              f"{free} TTFT tail s", "output tok/s", "preemptions/s", "rejections",
              "busy slots", "wall s", "meets"]
    lines = ["## Answer", "", *answer_lines(data["answer"], paid, data["target_s"],
                                             data["workers"]), "",
             "## Sweep", "", "| " + " | ".join(header) + " |",
             "|" + "|".join(["---:", "---"] + ["---:"] * (len(header) - 3) + ["---"]) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in
              point_rows(runs, paid, free, data["target_s"])]
    lines += ["", f"Plot: `{data['plot']}`." if data.get("plot") else "",
              f"Sweep wall time: {fmt_num(data['wall_s'] / 60, 1)} min with "
              f"{data['jobs']} processes."]
    return "\n".join(lines)


def how_to_read(a: argparse.Namespace, paid: str, free: str) -> str:
    lines = [
        f"Simulated (`fleetsim`, virtual time) runs of `{a.workload_rel}`: {a.duration_s:g} "
        f"simulated s each, {a.slots} slots per worker, step model `{a.step_model}`; requests "
        f"arriving in the first {a.warmup_s:g} s are left out (the empty fleet's warm-up).",
        f"Every cell is the median (min–max) over {a.seeds} workload seeds, the same seeds "
        "at each worker count.",
        "*tail*: the TTFT p99, or \"max\" where a run had fewer than 200 requests of the "
        "tier. A request still waiting for its first token at the end is in no TTFT figure, "
        "so an overloaded point's tail is a lower bound (it fails the target anyway).",
        "*output tok/s*: tokens generated per simulated second after the warm-up; "
        "*preemptions/s*: fleet preemptions ordered for fairness (the pool caps them, "
        "`max_per_s`, 20 by default); *rejections*: requests refused or shed, all tiers "
        "(mostly tenants' own `max_queued`); *busy slots*: mean running sequences / slots.",
        f"*meets*: {paid} p99 <= {a.target_s:g} s in every seed (\"median only\": by the "
        "median). The answer counts a worker count only if every larger count swept meets "
        f"the target too. {free} (the lowest tier) is shown for what that answer leaves it.",
        f"*wall s*: one run's wall clock ({a.jobs} runs at a time share the machine).",
    ]
    return "\n\n".join(lines)


def _axes() -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise RuntimeError("the plot needs matplotlib: pip install 'fairlane[sim]'") from exc
    # As fleetsim.report: a Figure on its own Agg canvas, no pyplot global state.
    fig = Figure(figsize=(11, 5.5), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots()


def plot(data: Mapping[str, Any], path: Path) -> Path:
    """TTFT tail vs workers: per tier and preemption setting, the median over seeds with
    the min–max band; the target line; each setting's every-seed answer marked."""
    fig, ax = _axes()
    runs, paid, target_s = data["runs"], data["paid_tier"], data["target_s"]
    colors = {paid: "tab:blue", data["free_tier"]: "tab:orange"}
    for tier, color in colors.items():
        for pre, style in zip(PREEMPTION, ("-", "--"), strict=True):
            stats = [(w, summarize(v)) for w, v in tails(runs, tier, pre).items()]
            stats = [(w, s) for w, s in stats if s.n]
            if not stats:
                continue
            xs = [w for w, _ in stats]
            ax.plot(xs, [s.median for _, s in stats], style, marker="o", color=color,
                    label=f"{tier}, preemption {pre}")
            ax.fill_between(xs, [s.lo for _, s in stats], [s.hi for _, s in stats],
                            color=color, alpha=0.12 if pre == "on" else 0.06)
    ax.axhline(target_s, color="red", ls=":", lw=1.5, label=f"target {target_s:g} s")
    for pre, mark in zip(PREEMPTION, ("*", "P"), strict=True):
        w = data["answer"].get(pre, {}).get("every_seed")
        if w is None:
            continue
        # On the paid line itself (median), so the two settings' marks do not overlap.
        y = summarize(tails(runs, paid, pre)[w]).median
        ax.axvline(w, color="black", ls="-" if pre == "on" else "--", lw=0.8, alpha=0.5)
        ax.plot([w], [y], marker=mark, ms=13, color="black", ls="none",
                label=f"answer, preemption {pre}: {w} workers")
    ax.set(yscale="log", xlabel=f"workers ({data['slots']} slots each)",
           ylabel="TTFT p99 (s), simulated",
           title=f"{data['workload']}: TTFT p99 per tier (median, min–max over "
                 f"{data['seeds']} seeds)")
    ax.set_xticks(data["workers"])
    ax.grid(True, which="both", alpha=0.3)
    fig.legend(loc="outside right upper", fontsize="small")  # off the lines and marks
    fig.savefig(path, dpi=100)
    return path


# --- command line -----------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", type=Path, default=WORKLOAD, help="workload YAML")
    ap.add_argument("--workers", default=None, help=f"worker counts (default {DEFAULT_WORKERS})")
    ap.add_argument("--seeds", type=int, default=None, help="workload seeds per point (5)")
    ap.add_argument("--first-seed", type=int, default=1)
    ap.add_argument("--duration-s", type=float, default=None,
                    help="simulated seconds per run (default: the workload's duration_s)")
    ap.add_argument("--warmup-s", type=float, default=None,
                    help="leave out requests arriving before this (default 30)")
    ap.add_argument("--slots", type=int, default=32, help="batch slots per worker")
    ap.add_argument("--step-model", default="default")
    ap.add_argument("--target-s", type=float, default=TARGET_S, help="paid TTFT p99 target")
    ap.add_argument("--paid-tier", default=None, help="default: the workload's highest tier")
    ap.add_argument("--free-tier", default=None, help="default: the workload's lowest tier")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                    help="runs at a time, one process each")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--stem", default="capacity_plan",
                    help="results file names: STEM.md, STEM.json, STEM.png")
    ap.add_argument("--quick", action="store_true",
                    help="~1-minute smoke: 3 worker counts, 2 seeds, 60 simulated s")
    a = ap.parse_args(argv)
    base = QUICK if a.quick else {"workers": DEFAULT_WORKERS, "seeds": 5, "duration_s": None,
                                  "warmup_s": 30.0}
    for key, value in base.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    try:
        a.worker_counts = sorted({int(w) for w in str(a.workers).split(",") if w.strip()})
    except ValueError:
        ap.error(f"--workers: comma-separated whole numbers, got {a.workers!r}")
    if not a.worker_counts or min(a.worker_counts) < 1 or a.seeds < 1 or a.jobs < 1:
        ap.error("--workers needs counts >= 1, --seeds and --jobs >= 1")
    if a.slots < 1:
        ap.error(f"--slots must be >= 1, got {a.slots}")
    from fleetsim.cli import not_positive

    bad = not_positive((("--duration-s", a.duration_s), ("--target-s", a.target_s)))
    if bad:
        ap.error(bad)
    return a


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    from fleetsim.processes import WorkloadError
    from fleetsim.workload import load_workload
    from gpu_worker.sim.step_model import StepModelError, load_step_model

    try:  # fail here, not in 70 children
        wl = load_workload(a.workload)
        load_step_model(a.step_model)
    except (OSError, WorkloadError, StepModelError, ValueError) as exc:
        raise SystemExit(f"capacity_plan.py: {exc}") from None
    a.duration_s = wl.duration_s if a.duration_s is None else a.duration_s
    if not 0 <= a.warmup_s < a.duration_s:
        raise SystemExit("--warmup-s must be in [0, duration)")
    try:  # the results' directory: found unwritable now, not after the sweep
        a.out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SystemExit(f"capacity_plan.py: --out-dir {a.out_dir}: {exc}") from None
    tiers = wl.tenants.tiers
    paid, free = a.paid_tier or tiers[0], a.free_tier or tiers[-1]
    if {paid, free} - set(tiers):
        raise SystemExit(f"--paid-tier / --free-tier must be among the workload's {tiers}")
    path = a.workload.resolve()
    a.workload_rel = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    meta = RunMeta.here(["bench/capacity_plan.py", *(sys.argv[1:] if argv is None else argv)])
    points = [Point(w, p, a.first_seed + k, str(path), a.duration_s, a.warmup_s, a.slots,
                    a.step_model)
              for w in a.worker_counts for p in PREEMPTION for k in range(a.seeds)]
    print(f"{len(points)} runs ({len(a.worker_counts)} worker counts x 2 x {a.seeds} seeds), "
          f"{a.duration_s:g} simulated s each, {a.jobs} at a time", file=sys.stderr)
    t0 = time.perf_counter()
    runs = sweep(points, a.jobs)
    data = {"workload": a.workload_rel, "paid_tier": paid, "free_tier": free,
            "target_s": a.target_s, "workers": a.worker_counts, "seeds": a.seeds,
            "duration_s": a.duration_s, "warmup_s": a.warmup_s, "slots": a.slots,
            "step_model": a.step_model, "jobs": a.jobs,
            "wall_s": round(time.perf_counter() - t0, 1),
            "answer": answers(runs, paid, a.target_s), "runs": runs}
    png = a.out_dir / f"{a.stem}.png"
    a.out_dir.mkdir(parents=True, exist_ok=True)
    data["plot"] = str(plot(data, png).name)
    md, js = write_results(a.out_dir / f"{a.stem}.md", TITLE, report(data), data, meta,
                           how_to_read(a, paid, free))
    print("\n".join(answer_lines(data["answer"], paid, a.target_s, a.worker_counts)))
    print(f"wrote {md}, {js}, {png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
