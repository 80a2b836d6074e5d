"""Fleet simulator speed: BENCHMARKS.md's §9 scale table and Summary row, from the JSON
bench/bench_simulate_scale.py writes ({"meta", "data": {"runs": [{"workers",
"tenants", "slots", "load_target", "duration_s", "simulated_s", "stopped_early",
"wall_s", "cpu_s", "sim_s_per_wall_s", "steady_sim_s_per_wall_s", "hour_wall_s",
"hour_extrapolated", "peak_rss_mib", "arrivals", "arrivals_per_wall_s",
"busy_fraction", "ttft_p50_s", "ttft_p99_s", "checkpoints", "variant", "rep", ...}],
"load_avg", "args"}}); a run without "variant" is an interpreted one (files before the
compiled variant), one without "rep" the only repetition (files before `--reps`).

The runs of one scale and variant (its repetitions) make one row: the simulator is
deterministic (the same arrivals, first tokens and finishes every run), so the
simulation's columns come from the first repetition (marked "differs" if another
disagrees), and the times are the median with the min–max over the repetitions.
Variants: `interpreted` (`fairlane simulate`) and `compiled` (`--compiled`, the same
modules compiled with mypyc).
The table has the columns of bench/results/simulate_scale.md's (the same text:
bench_simulate_scale.report calls `scale_table` and `target_line`). Pure: no fleet,
no clock."""

from __future__ import annotations

from bench.harness import fmt_num, summarize
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
HEADER = ["workers x tenants", "variant", "reps", "simulated s", "wall s", "cpu s",
          "sim-s / wall-s", "steady", "hour, wall", "peak RSS MiB", "requests", "req / wall-s",
          "busy", "TTFT p50 / p99 s"]


# --- per scale and variant: its repetitions ---------------------------------------------------


def runs_of(data: dict) -> list[dict]:
    runs = data.get("runs") or []
    if not runs:
        raise RenderError("no runs in the results")
    return runs


def variant_of(r: dict) -> str:
    return r.get("variant") or "interpreted"


def groups_of(runs: list[dict]) -> list[list[dict]]:
    """The runs grouped by (workers, tenants, variant), in order of first appearance;
    within a group, in run order (its repetitions)."""
    out: dict[tuple[int, int, str], list[dict]] = {}
    for r in runs:
        out.setdefault((r["workers"], r["tenants"], variant_of(r)), []).append(r)
    return list(out.values())


def find_runs(data: dict, scale: tuple[int, int]) -> list[list[dict]]:
    """The groups (one per variant) of (workers, tenants), in run order."""
    return [g for g in groups_of(runs_of(data)) if (g[0]["workers"], g[0]["tenants"]) == scale]


def hour_s(g: list[dict]) -> float:
    """The median wall time of one simulated hour over the group's repetitions."""
    return summarize(r["hour_wall_s"] for r in g).median


def find_run(data: dict, scale: tuple[int, int], variant: str | None = None) -> list[dict] | None:
    """The group of (workers, tenants) in `variant`, or the fastest variant's (median
    hour); None if none."""
    hits = [g for g in find_runs(data, scale) if variant in (None, variant_of(g[0]))]
    return min(hits, key=hour_s) if hits else None


def scale_name(r: dict, times: str = "x") -> str:
    return f"{r['workers']:,} {times} {r['tenants']:,}"


def med(g: list[dict], key: str, digits: int = 1, scale: float = 1.0) -> str:
    """The median of `key` over the repetitions, then (min–max) when there are several."""
    return summarize(r[key] * scale for r in g).fmt(digits)


def hour_text(g: list[dict]) -> str:
    """The wall time of one simulated hour (median, range), "(extrapolated)" where the
    runs were shorter or stopped early."""
    return med(g, "hour_wall_s", 1, 1 / 60) + " min" + (
        " (extrapolated)" if any(r["hour_extrapolated"] for r in g) else "")


def target_verdict(g: list[dict]) -> str:
    return "met" if hour_s(g) <= TARGET_WALL_S else "missed"


def _same(g: list[dict], text: str, *keys: str) -> str:
    """`text` (from the first repetition), flagged if another repetition simulated
    something else (the simulator is deterministic: it should not)."""
    first = [g[0][k] for k in keys]
    return text if all([r[k] for k in keys] == first for r in g) else f"{text} (differs)"


# --- tables ----------------------------------------------------------------------------------


def table_row(g: list[dict]) -> list[str]:
    r = g[0]
    sim = fmt_num(r["simulated_s"], 0) + (
        " (stopped)" if any(x["stopped_early"] for x in g) else "")
    return [scale_name(r), variant_of(r), str(len(g)), _same(g, sim, "simulated_s"),
            med(g, "wall_s"), med(g, "cpu_s"), med(g, "sim_s_per_wall_s", 2),
            med(g, "steady_sim_s_per_wall_s", 2), hour_text(g), med(g, "peak_rss_mib"),
            _same(g, f"{r['arrivals']:,}", "arrivals"), med(g, "arrivals_per_wall_s", 0),
            _same(g, f"{fmt_num(100 * (r['busy_fraction'] or 0), 0)}%", "busy_fraction"),
            _same(g, f"{fmt_num(r['ttft_p50_s'], 3)} / {fmt_num(r['ttft_p99_s'], 3)}",
                  "ttft_p50_s", "ttft_p99_s")]


def scale_table(runs: list[dict]) -> str:
    """One row per scale and variant (its repetitions), in run order."""
    return table(HEADER, "lll" + "r" * (len(HEADER) - 3), [table_row(g) for g in groups_of(runs)])


# Results files from `fleetsim.pools` on (runs carry "pools"): what their times cover.
POOLS_TEXT = (
    "*-poolsK*: the fleet split into K pools, one dispatcher each (`fairlane simulate "
    "--pools K`), one process per pool side by side: another fleet, so its latency and "
    "busy columns are its own; *wall s*: building the pools' fleets, the run and merging "
    "the pools' recorders (`perf_counter`); *cpu s*: the pools' process time, summed; ")


BASE_PREFIX = "base-"  # a variant run from the --base commit's simulator
ALT_PREFIX = "alt-"  # a variant run by the --alt-python interpreter


def _python(r: dict) -> str:
    how = "its libpython a shared library" if r["libpython_shared"] else \
        "the interpreter linked into the executable"
    return f"`{r['python_executable']}` (Python {r['python']}, {how})"


def python_text(runs: list[dict]) -> str:
    """Which interpreter ran the rows, when some ran under --alt-python."""
    alt = [r for r in runs if variant_of(r).startswith(ALT_PREFIX) and "python" in r]
    own = [r for r in runs if not variant_of(r).startswith(ALT_PREFIX) and "python" in r]
    if not alt or not own:
        return ""
    return (f"*alt-...*: the same variant run by {_python(alt[0])}, the others by "
            f"{_python(own[0])}, interleaved; ")


def setup_text(data: dict) -> str:
    runs = runs_of(data)
    slots = sorted({r["slots"] for r in runs})
    loads = sorted({r["load_target"] for r in runs})
    variants = sorted({variant_of(r) for r in runs})
    reps = sorted({len(g) for g in groups_of(runs)})
    return (
        f"{'/'.join(map(str, reps))} repetition{'' if reps == [1] else 's'} per scale and variant "
        f"({', '.join(variants)}), run interleaved, the variants' order alternated; times "
        f"are the median (min–max), the simulation's columns the same every repetition "
        f"(the simulator is deterministic); *compiled* is `fairlane simulate "
        f"--compiled` (the same modules compiled with mypyc, `fleetsim.compiled`); "
        f"bench/workloads/scale.yaml's mix scaled to each size, "
        f"{'/'.join(map(str, slots))} slots per worker, arrival rates for "
        f"{'/'.join(f'{x:.0%}' for x in loads)} of the slots busy, drr, preemption on. "
        + (POOLS_TEXT if any("pools" in r for r in runs) else
           "*wall s*: `Fleet.run` alone (`perf_counter`); *cpu s*: its process time; ")
        + (f"*base-...*: the same variant from commit {data['base_commit']} (`--base`), "
           "run from its tree in the same run, interleaved; "
           if data.get("base_commit") else "")
        + python_text(runs)
        + "*steady*: sim-s per wall-s from 10 simulated s on; *hour, wall*: measured where "
        "the row ran the hour, else extrapolated from the steady rate; *busy*: mean "
        "running ÷ slots; peak RSS: the child process's own"
        + (", plus each pool process's peak." if any(r.get("pools", 1) > 1 for r in runs)
           else "."))



def target_line(data: dict) -> str:
    """The verdict, one line per variant run at the target scale (on the median)."""
    groups = find_runs(data, TARGET_SCALE)
    if not groups:
        raise RenderError(f"no {TARGET_SCALE[0]:,} x {TARGET_SCALE[1]:,} run in the results")
    return "\n\n".join(
        f"**Target ({scale_name(g[0], '×')} × one simulated hour in < {TARGET_WALL_S / 60:g} "
        f"min), {variant_of(g[0])}: {target_verdict(g)}** — {hour_text(g)}, "
        f"{fmt_num(hour_s(g) / TARGET_WALL_S, 1)}× the target (median of {len(g)})."
        for g in groups)


# --- BENCHMARKS.md ---------------------------------------------------------------------------


def scale_kind(res: Results, args: list[str], _old: str) -> str:
    """`<!-- generated: simulate-scale STEM -->`: setup, the table, the target verdict."""
    data = one_results_file(res, "simulate-scale", args)
    return "\n\n".join([sources_line(res, args), setup_text(data), scale_table(runs_of(data)),
                        target_line(data)])


def summary_scale(res: Results) -> list[str]:
    data = res.load(STEM).get("data", {})
    # The headline is the fleet the target names, one pool, this code (not a --base
    # commit's) under the bench's own interpreter: its fastest variant.
    one_pool = [g for g in find_runs(data, TARGET_SCALE) if "-pools" not in variant_of(g[0])
                and not variant_of(g[0]).startswith((BASE_PREFIX, ALT_PREFIX))]
    g = min(one_pool, key=hour_s) if one_pool else None
    if g is None:
        raise RenderError(f"no {TARGET_SCALE[0]:,} x {TARGET_SCALE[1]:,} run in {STEM}.json")
    r = g[0]
    how = (f"extrapolated from {fmt_num(r['simulated_s'], 0)} simulated s"
           if any(x["hour_extrapolated"] for x in g) else "measured")
    measured = (f"**{med(g, 'sim_s_per_wall_s', 2)} sim-s per wall-s** {variant_of(r)}, "
                f"median of {len(g)} (an hour ≈ {med(g, 'hour_wall_s', 1, 1 / 60)} min, {how})")
    for other in find_runs(data, TARGET_SCALE):
        if variant_of(other[0]) != variant_of(r):
            measured += (f"; {variant_of(other[0])}: {med(other, 'sim_s_per_wall_s', 2)} "
                         f"(an hour ≈ {med(other, 'hour_wall_s', 1, 1 / 60)} min)")
    second = find_run(data, SECOND_SCALE, variant_of(r))
    if second is not None:
        measured += (f"; {scale_name(second[0], '×')}: "
                     f"{med(second, 'sim_s_per_wall_s', 1)} (an hour in {hour_text(second)})")
    verdict = target_verdict(g)
    target = f"< {TARGET_WALL_S / 60:g} min — {verdict}" + (
        f" ({fmt_num(hour_s(g) / TARGET_WALL_S, 1)}×)" if verdict == "missed" else "")
    claim = (f"§9 fleet simulator: {r['workers']:,} workers × {r['tenants']:,} tenants × 1 "
             "simulated hour")
    return [claim, measured, target, row_source(res, STEM)]


# The whole hour as two pools, five times under each interpreter (the row below the one
# pool's): this machine's pyenv Python, the tests' own, and Debian's python3.11.
POOLS_STEMS = ("simulate_scale_pools_hour5", "simulate_scale_pools_hour_alt5")


def summary_scale_pools(res: Results) -> list[str]:
    """The target's hour as two pools, one process each: measured or extrapolated, per
    interpreter; met only where every results file's median is."""
    parts, verdicts, first = [], [], None
    for stem in POOLS_STEMS:
        groups = find_runs(res.load(stem).get("data", {}), TARGET_SCALE)
        if not groups:
            raise RenderError(f"no {TARGET_SCALE[0]:,} x {TARGET_SCALE[1]:,} run in {stem}.json")
        first = first or groups[0][0]
        for g in groups:
            r = g[0]
            whole = "the whole hour" if not any(x["hour_extrapolated"] for x in g) else \
                "extrapolated"
            parts.append(f"Python {r.get('python', '?')} (`{r.get('python_executable', '?')}`): "
                         f"**{med(g, 'hour_wall_s', 1, 1 / 60)} min**, {whole}, median of "
                         f"{len(g)}")
            verdicts.append(target_verdict(g))
    verdict = "met" if all(v == "met" for v in verdicts) else "missed"
    assert first is not None  # POOLS_STEMS is not empty
    k = first.get("pools", 2)
    return [f"§9 fleet simulator: the same hour as {k} pools of {first['workers'] // k:,} "
            f"workers and {first['tenants'] // k:,} tenants, one dispatcher and one process each "
            f"(`--pools {k}`, compiled)",
            "; ".join(parts), f"< {TARGET_WALL_S / 60:g} min — {verdict} (as one pool: "
            "missed, row above)", ", ".join(row_source(res, s) for s in POOLS_STEMS)]


KINDS = {"simulate-scale": scale_kind}
SUMMARY_ROWS = {"simulate-scale": summary_scale, "simulate-scale-pools": summary_scale_pools}
