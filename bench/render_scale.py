"""Fleet simulator speed: BENCHMARKS.md's §9 scale table and Summary row, from the JSON
bench/bench_simulate_scale.py writes ({"meta", "data": {"runs": [{"workers",
"tenants", "slots", "load_target", "duration_s", "simulated_s", "stopped_early",
"wall_s", "cpu_s", "sim_s_per_wall_s", "steady_sim_s_per_wall_s", "hour_wall_s",
"hour_extrapolated", "peak_rss_mib", "arrivals", "arrivals_per_wall_s",
"busy_fraction", "ttft_p50_s", "ttft_p99_s", "checkpoints", ...}], "load_avg",
"args"}}).

One run per scale: the simulator is deterministic (the same arrivals, first tokens and
finishes every run), so only the wall time varies, and it is reported from one run.
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
HEADER = ["workers x tenants", "simulated s", "wall s", "cpu s", "sim-s / wall-s", "steady",
          "hour, wall", "peak RSS MiB", "requests", "req / wall-s", "busy", "TTFT p50 / p99 s"]


# --- per run ---------------------------------------------------------------------------------


def runs_of(data: dict) -> list[dict]:
    runs = data.get("runs") or []
    if not runs:
        raise RenderError("no runs in the results")
    return runs


def find_run(data: dict, scale: tuple[int, int]) -> dict | None:
    """The run of (workers, tenants); the last one if the file has several."""
    hits = [r for r in runs_of(data) if (r["workers"], r["tenants"]) == scale]
    return hits[-1] if hits else None


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
    return [scale_name(r), sim, fmt_num(r["wall_s"]), fmt_num(r["cpu_s"]),
            fmt_num(r["sim_s_per_wall_s"], 2), fmt_num(r["steady_sim_s_per_wall_s"], 2),
            hour_text(r), fmt_num(r["peak_rss_mib"]), f"{r['arrivals']:,}",
            fmt_num(r["arrivals_per_wall_s"], 0),
            f"{fmt_num(100 * (r['busy_fraction'] or 0), 0)}%",
            f"{fmt_num(r['ttft_p50_s'], 3)} / {fmt_num(r['ttft_p99_s'], 3)}"]


def scale_table(runs: list[dict]) -> str:
    """One row per scale, in run order."""
    return table(HEADER, "l" + "r" * (len(HEADER) - 1), [table_row(r) for r in runs])


def setup_text(data: dict) -> str:
    runs = runs_of(data)
    slots = sorted({r["slots"] for r in runs})
    loads = sorted({r["load_target"] for r in runs})
    return (
        f"One run per scale (the simulator is deterministic: only the wall time varies); "
        f"bench/workloads/scale.yaml's mix scaled to each size, "
        f"{'/'.join(map(str, slots))} slots per worker, arrival rates for "
        f"{'/'.join(f'{x:.0%}' for x in loads)} of the slots busy, drr, preemption on. "
        f"*wall s*: `Fleet.run` alone (`perf_counter`); *cpu s*: its process time; "
        f"*steady*: sim-s per wall-s from 10 simulated s on; *hour, wall*: measured where "
        f"the row ran the hour, else extrapolated from the steady rate; *busy*: mean "
        f"running ÷ slots; peak RSS: the child process's own.")


def target_line(data: dict) -> str:
    r = find_run(data, TARGET_SCALE)
    if r is None:
        raise RenderError(f"no {TARGET_SCALE[0]:,} x {TARGET_SCALE[1]:,} run in the results")
    return (f"**Target ({scale_name(r, '×')} × one simulated hour in < "
            f"{TARGET_WALL_S / 60:g} min): {target_verdict(r)}** — {hour_text(r)}, "
            f"{fmt_num(r['hour_wall_s'] / TARGET_WALL_S, 1)}× the target.")


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
    measured = (f"**{fmt_num(r['sim_s_per_wall_s'], 2)} sim-s per wall-s** (an hour ≈ "
                f"{fmt_num(r['hour_wall_s'] / 60, 1)} min, {how})")
    second = find_run(data, SECOND_SCALE)
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
