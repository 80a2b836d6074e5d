"""Fleet simulator speed: BENCHMARKS.md's §9 scale table and Summary row, from the JSON
bench/bench_simulate_scale.py writes ({"meta", "data": {"runs": [{"workers",
"tenants", "slots", "load_target", "duration_s", "simulated_s", "stopped_early",
"wall_s", "cpu_s", "sim_s_per_wall_s", "steady_sim_s_per_wall_s", "hour_wall_s",
"hour_extrapolated", "peak_rss_mib", "arrivals", "arrivals_per_wall_s",
"busy_fraction", "ttft_p50_s", "ttft_p99_s", "checkpoints", "variant", ...}],
"load_avg", "args"}}); a run without "variant" is an interpreted one (files before the
compiled variant).

One run per scale and variant: the simulator is deterministic (the same arrivals, first
tokens and finishes every run), so only the wall time varies, and it is reported from
one run. Variants: `interpreted` (`fairlane simulate`) and `compiled` (`--compiled`, the
same modules compiled with mypyc).
The table has the columns of bench/results/simulate_scale.md's (the same text:
tests/unit/test_render_scale.py compares it with bench_simulate_scale.report). Pure:
no fleet, no clock."""

from __future__ import annotations

from bench.harness import fmt_num
from bench.render_common import (
    RenderError,
    Results,
    one_results_file,
    row_source,
    sources_line,
    table,
)

STEM = "simulate_scale"  # the Summary row's results file
TARGET_SCALE = (1000, 100_000)  # issue 12: workers, tenants
TARGET_WALL_S = 600.0  # one simulated hour in under 10 minutes
SECOND_SCALE = (100, 10_000)  # the Summary row's second figure
HEADER = ["workers x tenants", "variant", "simulated s", "wall s", "cpu s", "sim-s / wall-s", "steady",
          "hour, wall", "peak RSS MiB", "requests", "req / wall-s", "busy", "TTFT p50 / p99 s"]


# --- per run ---------------------------------------------------------------------------------


def runs_of(data: dict) -> list[dict]:
    runs = data.get("runs") or []
    if not runs:
        raise RenderError("no runs in the results")
    return runs


def variant_of(r: dict) -> str:
    return r.get("variant") or "interpreted"


def find_runs(data: dict, scale: tuple[int, int]) -> list[dict]:
    """The runs of (workers, tenants), one per variant (the last of each), in run order."""
    last = {variant_of(r): r for r in runs_of(data) if (r["workers"], r["tenants"]) == scale}
    return sorted(last.values(), key=runs_of(data).index)


def find_run(data: dict, scale: tuple[int, int], variant: str | None = None) -> dict | None:
    """The run of (workers, tenants) in `variant`, or the fastest variant's; None if none."""
    hits = [r for r in find_runs(data, scale) if variant in (None, variant_of(r))]
    return min(hits, key=lambda r: r["hour_wall_s"]) if hits else None


def scale_name(r: dict, times: str = "x") -> str:
    return f"{r['workers']:,} {times} {r['tenants']:,}"


def hour_text(r: dict) -> str:
    """The wall time of one simulated hour, "(extrapolated)" where the run was shorter
    or stopped early."""
    return fmt_num(r["hour_wall_s"] / 60, 1) + " min" + (
        " (extrapolated)" if r["hour_extrapolated"] else "")


def target_verdict(r: dict) -> str:
    return "met" if r["hour_wall_s"] <= TARGET_WALL_S else "missed"


# --- tables ----------------------------------------------------------------------------------


def table_row(r: dict) -> list[str]:
    sim = fmt_num(r["simulated_s"], 0) + (" (stopped)" if r["stopped_early"] else "")
    return [scale_name(r), variant_of(r), sim, fmt_num(r["wall_s"]), fmt_num(r["cpu_s"]),
            fmt_num(r["sim_s_per_wall_s"], 2), fmt_num(r["steady_sim_s_per_wall_s"], 2),
            hour_text(r), fmt_num(r["peak_rss_mib"]), f"{r['arrivals']:,}",
            fmt_num(r["arrivals_per_wall_s"], 0),
            f"{fmt_num(100 * (r['busy_fraction'] or 0), 0)}%",
            f"{fmt_num(r['ttft_p50_s'], 3)} / {fmt_num(r['ttft_p99_s'], 3)}"]


def scale_table(runs: list[dict]) -> str:
    """One row per scale and variant, in run order."""
    return table(HEADER, "ll" + "r" * (len(HEADER) - 2), [table_row(r) for r in runs])


def setup_text(data: dict) -> str:
    runs = runs_of(data)
    slots = sorted({r["slots"] for r in runs})
    loads = sorted({r["load_target"] for r in runs})
    variants = sorted({variant_of(r) for r in runs})
    return (
        f"One run per scale and variant ({', '.join(variants)}; the simulator is "
        f"deterministic: only the wall time varies); *compiled* is `fairlane simulate "
        f"--compiled` (the same modules compiled with mypyc, `fleetsim.compiled`); "
        f"bench/workloads/scale.yaml's mix scaled to each size, "
        f"{'/'.join(map(str, slots))} slots per worker, arrival rates for "
        f"{'/'.join(f'{x:.0%}' for x in loads)} of the slots busy, drr, preemption on. "
        f"*wall s*: `Fleet.run` alone (`perf_counter`); *cpu s*: its process time; "
        f"*steady*: sim-s per wall-s from 10 simulated s on; *hour, wall*: measured where "
        f"the row ran the hour, else extrapolated from the steady rate; *busy*: mean "
        f"running ÷ slots; peak RSS: the child process's own.")


def target_line(data: dict) -> str:
    """The verdict, one line per variant run at the target scale."""
    runs = find_runs(data, TARGET_SCALE)
    if not runs:
        raise RenderError(f"no {TARGET_SCALE[0]:,} x {TARGET_SCALE[1]:,} run in the results")
    return "\n\n".join(
        f"**Target ({scale_name(r, '×')} × one simulated hour in < {TARGET_WALL_S / 60:g} "
        f"min), {variant_of(r)}: {target_verdict(r)}** — {hour_text(r)}, "
        f"{fmt_num(r['hour_wall_s'] / TARGET_WALL_S, 1)}× the target." for r in runs)


# --- BENCHMARKS.md ---------------------------------------------------------------------------


def scale_kind(res: Results, args: list[str], _old: str) -> str:
    """`<!-- generated: simulate-scale STEM -->`: setup, the table, the target verdict."""
    data = one_results_file(res, "simulate-scale", args)
    return "\n\n".join([sources_line(res, args), setup_text(data), scale_table(runs_of(data)),
                        target_line(data)])


def summary_scale(res: Results) -> list[str]:
    data = res.load(STEM).get("data", {})
    r = find_run(data, TARGET_SCALE)
    if r is None:
        raise RenderError(f"no {TARGET_SCALE[0]:,} x {TARGET_SCALE[1]:,} run in {STEM}.json")
    how = (f"extrapolated from {fmt_num(r['simulated_s'], 0)} simulated s"
           if r["hour_extrapolated"] else "measured")
    measured = (f"**{fmt_num(r['sim_s_per_wall_s'], 2)} sim-s per wall-s** {variant_of(r)} "
                f"(an hour ≈ {fmt_num(r['hour_wall_s'] / 60, 1)} min, {how})")
    for other in find_runs(data, TARGET_SCALE):
        if other is not r:
            measured += (f"; {variant_of(other)}: {fmt_num(other['sim_s_per_wall_s'], 2)} "
                         f"(an hour ≈ {fmt_num(other['hour_wall_s'] / 60, 1)} min)")
    second = find_run(data, SECOND_SCALE, variant_of(r))
    if second is not None:
        measured += (f"; {scale_name(second, '×')}: {fmt_num(second['sim_s_per_wall_s'], 1)} "
                     f"(an hour in {hour_text(second)})")
    verdict = target_verdict(r)
    target = f"< {TARGET_WALL_S / 60:g} min — {verdict}" + (
        f" ({fmt_num(r['hour_wall_s'] / TARGET_WALL_S, 1)}×)" if verdict == "missed" else "")
    claim = (f"§9 fleet simulator: {r['workers']:,} workers × {r['tenants']:,} tenants × 1 "
             "simulated hour")
    return [claim, measured, target, row_source(res, STEM)]


KINDS = {"simulate-scale": scale_kind}
SUMMARY_ROWS = {"simulate-scale": summary_scale}
