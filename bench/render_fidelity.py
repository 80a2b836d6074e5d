"""The simulator-fidelity comparison (issue 12, item 5): fleetsim vs the real fleet on
the same arrivals, from the JSON bench/fidelity.py writes ({"meta", "data": {"runs":
[{"variant": "SCENARIO:sim" | "SCENARIO:sim-constant" | "SCENARIO:real" |
"SCENARIO:real-shared", "rep", "metrics": {"classes": {CLASS: {...}}}}], "scenarios",
"network_ms", ...}}). `sim` is the simulator as calibrated now (a measured hop and
the clients' legs), `sim-constant`, where run, as calibrated before (one constant on
every message); `real` is the real fleet with one client process per traffic class,
`real-shared`, run only when asked for, the same with one client for every class
(the earlier rig).

Pure: the relative errors, the tail each comparison may use, the verdicts and the
tables. bench/fidelity.py writes its results markdown with the same functions, so the
results file and BENCHMARKS.md cannot disagree.

    <!-- generated: fidelity STEM -->        the table, per scenario x class x metric
    <!-- generated: fidelity-split STEM -->  where the TTFT goes, sim vs real (diagnostic)
    <!-- row:fidelity -->                     the Summary row (bench/results/fidelity.json)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.fidelity_texts import CONSTANT_TEXT, GC_TEXT, SHARED_TEXT, SPLIT_TEXT
from bench.harness import MIN_P99_SAMPLES, Summary, summarize
from bench.render_common import (
    RenderError,
    Results,
    fmt_sig,
    one_results_file,
    row_source,
    sources_line,
    table,
)

TOLERANCE = 0.10  # issue 12: TTFT p50/p99 and throughput within 10% (Vidur: < 9%)
ALL = "all"  # the pseudo-class of every request of a scenario
SIM, SIM_CONSTANT, REAL, REAL_SHARED = "sim", "sim-constant", "real", "real-shared"
REAL_GC = "real-gc-default"  # the real fleet, its workers under Python's default GC


@dataclass(frozen=True)
class Metric:
    key: str  # in a class's metrics; "ttft_tail" picks p99 or max (`tail_label`)
    label: str
    judged: bool  # counts toward the verdict (else a diagnostic: where a gap comes from)


METRICS = (
    Metric("ttft_p50_ms", "TTFT p50, ms", True),
    Metric("ttft_tail", "TTFT p99, ms", True),
    Metric("tokens_per_s", "output tokens/s", True),
    Metric("e2e_p50_ms", "end-to-end p50, ms", True),
    Metric("tpot_p50_ms", "TPOT p50, ms (diagnostic)", False),
)


def rel_err(sim: float | None, real: float | None) -> float:
    """(sim - real) / real: the simulator's error with the real fleet as the truth;
    NaN when either is missing or the real value is 0."""
    if sim is None or real is None or real == 0 or math.isnan(sim) or math.isnan(real):
        return math.nan
    return (sim - real) / real


def tail_label(counts: Sequence[int]) -> str:
    """"p99" when every run compared has at least MIN_P99_SAMPLES TTFTs, else "max":
    one label for all repetitions of a row, so sim and real (and the repetitions'
    median) always compare like with like."""
    return "p99" if counts and min(counts) >= MIN_P99_SAMPLES else "max"


def value(m: dict[str, Any], key: str, tail: str = "p99") -> float | None:
    """One metric of one class of one run; `ttft_tail` is the p99 or the max."""
    if key == "ttft_tail":
        key = "ttft_p99_ms" if tail == "p99" else "ttft_max_ms"
    v = m.get(key)
    return None if v is None else float(v)


def verdict(err: Summary, tolerance: float = TOLERANCE) -> str:
    """"met" when the median relative error over repetitions is within the tolerance."""
    if err.n == 0 or math.isnan(err.median):
        return "n/a"
    return "met" if abs(err.median) <= tolerance else "missed"


@dataclass(frozen=True)
class Row:
    scenario: str
    cls: str
    metric: Metric
    tail: str
    sim: Summary
    real: Summary
    err: Summary

    @property
    def verdict(self) -> str:
        return verdict(self.err) if self.metric.judged else "diagnostic"

    @property
    def short(self) -> str:
        """The metric in a few words (the Summary row)."""
        if self.metric.key == "ttft_tail":
            return f"TTFT {self.tail}"
        return self.metric.label.split(",")[0]

    @property
    def label(self) -> str:
        if self.metric.key == "ttft_tail" and self.tail == "max":
            return "TTFT max (< 200 samples: no p99), ms"
        return self.metric.label


def pairs(runs: list[dict], scenario: str, real: str = REAL,
          sim: str = SIM) -> list[tuple[dict, dict]]:
    """(`sim`, `real` variant) class metrics of each repetition where both runs succeeded."""
    by: dict[tuple[int, str], dict] = {}
    for r in runs:
        scen, _, variant = str(r.get("variant", "")).partition(":")
        if scen == scenario and not r.get("error"):
            by[(r["rep"], variant)] = r["metrics"]["classes"]
    reps = sorted({rep for rep, _ in by})
    return [(by[(rep, sim)], by[(rep, real)]) for rep in reps
            if (rep, sim) in by and (rep, real) in by]


def compare(runs: list[dict], scenario: str, classes: Sequence[str],
            real: str = REAL, sim: str = SIM) -> list[Row]:
    """One row per class x metric with a value on either side (a class with no
    requests arriving in the window has no TTFT, only its throughput)."""
    ps = pairs(runs, scenario, real, sim)
    rows = []
    for cls in [*classes, ALL]:
        both = [(s[cls], r[cls]) for s, r in ps if cls in s and cls in r]
        tail = tail_label([m.get("n_ttft", 0) for pair in both for m in pair])
        for metric in METRICS:
            sims = [value(s, metric.key, tail) for s, _ in both]
            reals = [value(r, metric.key, tail) for _, r in both]
            if all(v is None for v in sims + reals):
                continue
            errs = [rel_err(s, r) for s, r in zip(sims, reals, strict=True)]
            rows.append(Row(scenario, cls, metric, tail, summarize(sims), summarize(reals),
                            summarize(errs)))
    return rows


def all_rows(data: dict, real: str = REAL, sim: str = SIM) -> list[Row]:
    runs = data.get("runs", [])
    return [row for name, scen in data.get("scenarios", {}).items()
            for row in compare(runs, name, scen.get("classes", []), real, sim)]


# --- text ---------------------------------------------------------------------------------


def fmt_pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x * 100:+.1f}%"


def fmt_err(err: Summary) -> str:
    """Median relative error, then the range over repetitions: "+4.2% (-1.0 to +8.3)"."""
    if err.n == 0:
        return "n/a"
    if err.n == 1:
        return fmt_pct(err.median)
    return f"{fmt_pct(err.median)} ({err.lo * 100:+.1f} to {err.hi * 100:+.1f})"


def fmt_value(s: Summary) -> str:
    """Median over repetitions (three significant figures)."""
    return fmt_sig(s.median) if s.n else "n/a"


def fmt_verdict(row: Row) -> str:
    v = row.verdict
    return {"met": f"within {TOLERANCE:.0%}", "missed": "**missed**"}.get(v, v)


def fleet_sizes(data: dict) -> str:
    """"4", or "2 and 4" for a run over several fleet sizes (`--workers 2,4`)."""
    workers = data.get("workers")
    if isinstance(workers, list):
        return f"{', '.join(map(str, workers[:-1]))} and {workers[-1]}" \
            if len(workers) > 1 else str(workers[0])
    return str(workers)


def calibration(net: dict) -> str:
    """How the simulator's delays were chosen: a measured hop and the clients' legs
    (runs from 2026-11-30 on), one constant on every message (before), or --network-ms."""
    if net.get("source") != "calibrated":
        return f"`network_ms` {fmt_sig(net.get('value'))} (given by --network-ms)"
    if "client_ms" not in net:
        return (f"`network_ms` {fmt_sig(net.get('value'))} (calibrated: idle real TTFT p50 "
                f"{fmt_sig(net.get('real_idle_ttft_p50_ms'))} ms − simulated "
                f"{fmt_sig(net.get('sim_idle_ttft_p50_ms'))} ms)")
    legs = sorted(net["client_ms"])
    return (f"`network_ms` {fmt_sig(net.get('value'))} (measured: a core-NATS round trip "
            f"÷ 2, median of {net.get('hop_n')}) and the clients' legs, each request "
            f"drawing one of the {len(legs)} idle probes' real TTFT − simulated (p50 "
            f"{fmt_sig(legs[len(legs) // 2])}, {fmt_sig(legs[0])} to {fmt_sig(legs[-1])} ms); "
            f"`sim-constant`: `network_ms` {fmt_sig(net.get('constant_ms'))} on every message "
            f"(idle real TTFT p50 {fmt_sig(net.get('real_idle_ttft_p50_ms'))} − simulated "
            f"{fmt_sig(net.get('sim0_idle_ttft_p50_ms'))} ms)")


def setup_line(data: dict) -> str:
    """The fleet, the simulator's calibrated delays and how they were chosen, the reps."""
    net = data.get("network_ms", {})
    runs = data.get("runs", [])
    compared = min((len(pairs(runs, name)) for name in data.get("scenarios", {})), default=0)
    reps = len({r["rep"] for r in runs})
    failed = sum(1 for r in runs if r.get("error"))
    windows = "; ".join(f"{name} [{s['warmup_s']:g}, {s['duration_s']:g}) s"
                        for name, s in data.get("scenarios", {}).items())
    return (f"{fleet_sizes(data)} workers × {data.get('max_num_seqs')} slots, prefetch "
            f"{data.get('prefetch_seqs')}, step model `{data.get('step_model')}`; simulator "
            f"{calibration(net)}; {compared} of {reps} "
            f"repetitions compared ({failed} runs failed), sim and real interleaved; values are medians over repetitions, the error is "
            f"(sim − real) ÷ real per repetition, median (min to max); measurement windows "
            f"(arrivals, warm-up dropped): {windows}.")


def comparison_table(data: dict, real: str = REAL, sim: str = SIM) -> str:
    header = ["scenario", "class", "metric", sim, real, "error, median (range)",
              "verdict"]
    rows = [[r.scenario, r.cls, r.label, fmt_value(r.sim), fmt_value(r.real), fmt_err(r.err),
             fmt_verdict(r)] for r in all_rows(data, real, sim)]
    table_text = table(header, "lllrrrl", rows)
    main = real == REAL and sim == SIM
    return setup_line(data) + "\n\n" + table_text if main else table_text


SPLIT_LABELS = {  # bench/fidelity_obs.py's parts of a TTFT
    "queue": "dispatcher queue (ingest to dispatch)",
    "worker": "worker (dispatch received to first token)",
    "messages": "messages (the rest: publish, JetStream, dispatch, ack, token)",
}


def split_table(data: dict, real: str = REAL) -> str:
    """Where the TTFT goes, per scenario, class and part: sim and real p50 and p99,
    each the median over the repetitions compared (requests finished unpreempted)."""
    runs, rows = data.get("runs", []), []
    for name, scen in data.get("scenarios", {}).items():
        ps = pairs(runs, name, real)
        for cls in [*scen.get("classes", []), ALL]:
            both = [(sm[cls], rm[cls]) for sm, rm in ps
                    if sm.get(cls, {}).get("n_split") and rm.get(cls, {}).get("n_split")]
            if not both:
                continue
            n = min(m["n_split"] for pair in both for m in pair)
            sims, reals = [s for s, _ in both], [r for _, r in both]
            for part, label in SPLIT_LABELS.items():
                cells = [fmt_value(summarize(m.get(f"{part}_{q}_ms") for m in side))
                         for q in ("p50", "p99") for side in (sims, reals)]
                rows.append([name, cls, label, *cells, f"{n:,}"])
    if not rows:
        return ""
    header = ["scenario", "class", "part of the TTFT", "sim p50, ms", f"{real} p50, ms",
              "sim p99, ms", f"{real} p99, ms", "requests per run, min"]
    return table(header, "lllrrrrr", rows)


def _cores(cpu: dict[str, float]) -> str:
    workers = sum(v for k, v in cpu.items() if k.startswith("worker"))
    # The load generator: this process and its client processes ("clients"; older
    # results have only "bench", the one process that was all of it).
    return " / ".join(fmt_sig(x) for x in (workers, cpu.get("dispatcher"), cpu.get("nats"),
                                           cpu.get("clients", cpu.get("bench"))))


def diagnostics_table(data: dict) -> str:
    """Per run: how busy the fleet was, and whether the real one had the CPU it needed
    (a starved worker steps slower than its model; a late generator skews arrivals)."""
    rows = []
    for r in sorted(data.get("runs", []), key=lambda r: r["position"]):
        d = r.get("metrics", {}).get("diag", {})
        allm = r.get("metrics", {}).get("classes", {}).get(ALL, {})
        scen, _, variant = r["variant"].partition(":")
        cpu = d.get("cpu_cores", {})
        if r.get("error"):
            extra = f"failed: {r['error'][:120]}"
        elif variant in (SIM, SIM_CONSTANT):
            extra = f"{d.get('wall_s')} s wall, {d.get('preemptions')} preemptions"
        else:
            extra = f"{d.get('errors', 0)} errors, {len(d.get('log_problems', []))} log problems"
        busy = cpu.get("machine_busy_frac")
        rows.append([scen, r["rep"], variant, fmt_sig(d.get("busy_slots_mean")),
                     allm.get("censored", "n/a"), _cores(cpu) if cpu else "—",
                     f"{busy:.0%}" if busy is not None else "—",
                     f"{fmt_sig(d.get('lag_p50_ms'))} / {fmt_sig(d.get('lag_max_ms'))}"
                     if variant not in (SIM, SIM_CONSTANT) else "—", extra])
    header = ["scenario", "rep", "variant", "busy slots, mean", "censored",
              "CPU cores: workers / dispatcher / nats / load generator", "machine busy",
              "generator lag p50 / max, ms", "notes"]
    return table(header, "lrlrrrrrl", rows)


# The variants reported beside the judged sim vs real, when a run has them: (variant,
# heading, what it is, the (real, sim) pair its table compares).
SIDE_SECTIONS = (
    (SIM_CONSTANT, "## The simulator as calibrated before (sim-constant)", CONSTANT_TEXT,
     (REAL, SIM_CONSTANT)),
    (REAL_SHARED, "## Sim vs real with one shared client (the earlier rig)", SHARED_TEXT,
     (REAL_SHARED, SIM)),
    (REAL_GC, "## Sim vs real with Python's default collector in the workers", GC_TEXT,
     (REAL_GC, SIM)),
)


def report(data: dict) -> str:
    """The results markdown's body (bench/fidelity.py)."""
    parts = ["## Sim vs real", "", comparison_table(data)]
    split = split_table(data)
    if split:
        parts += ["", "## Where the TTFT goes (diagnostic)", "", SPLIT_TEXT, "", split]
    variants = {str(r.get("variant", "")).partition(":")[2] for r in data.get("runs", [])}
    for variant, heading, text, (real, sim) in SIDE_SECTIONS:
        if variant in variants:
            parts += ["", heading, "", text, "", comparison_table(data, real, sim)]
    parts += ["", "## Runs", "", diagnostics_table(data)]
    notes = data.get("notes") or []
    if notes:
        parts += ["", "## Notes", "", *[f"- {n}" for n in notes]]
    return "\n".join(parts) + "\n"


def fidelity_table(res: Results, args: list[str], _old: str) -> str:
    """`<!-- generated: fidelity STEM -->`: sim vs real per scenario, class and metric."""
    data = one_results_file(res, "fidelity", args)
    if not data.get("runs"):
        raise RenderError(f"{args[0]}.json has no runs")
    return sources_line(res, args) + "\n\n" + comparison_table(data)


def fidelity_split(res: Results, args: list[str], _old: str) -> str:
    """`<!-- generated: fidelity-split STEM -->`: where the TTFT goes, sim vs real."""
    data = one_results_file(res, "fidelity-split", args)
    split = split_table(data)
    if not split:
        raise RenderError(f"{args[0]}.json has no TTFT split (runs before 7c19e47 kept none)")
    return sources_line(res, args) + "\n\n" + SPLIT_TEXT + "\n\n" + split


def headline(rows: list[Row]) -> tuple[int, int, list[Row]]:
    """(judged rows within the tolerance, judged rows, the missed ones worst first)."""
    judged = [r for r in rows if r.metric.judged and r.verdict != "n/a"]
    missed = sorted((r for r in judged if r.verdict == "missed"),
                    key=lambda r: -abs(r.err.median))
    return len(judged) - len(missed), len(judged), missed


STEM = "fidelity"


def summary_fidelity(res: Results) -> list[str]:
    data = res.load(STEM).get("data", {})
    met, n, missed = headline(all_rows(data))
    worst = ", ".join(f"{r.scenario}/{r.cls} {r.short} {fmt_pct(r.err.median)}"
                      for r in missed[:4])
    measured = f"**{met} of {n}** within {TOLERANCE:.0%}" + (
        f"; missed: {worst}" + (f" (+{len(missed) - 4} more)" if len(missed) > 4 else "")
        if missed else "")
    scen = " + ".join(data.get("scenarios", {}))
    return [f"§9 simulator fidelity: fleetsim vs the real fleet ({fleet_sizes(data)} workers "
            f"× {data.get('max_num_seqs')} slots, real NATS, sim workers), same arrivals "
            f"({scen}): TTFT p50/p99, output tokens/s, e2e p50 per class",
            measured, f"≤ {TOLERANCE:.0%} each" + (" — missed" if missed else " — met"),
            row_source(res, STEM)]


WORKERS_STEM = "fidelity_workers"


def by_fleet_size(data: dict) -> dict[int, list[Row]]:
    """A `--workers 2,4` run's rows per fleet size (each scenario records its own);
    RenderError for a run over one size."""
    runs = data.get("runs", [])
    out: dict[int, list[Row]] = {}
    for name, scen in data.get("scenarios", {}).items():
        size = scen.get("workers", data.get("workers"))
        out.setdefault(size, []).extend(compare(runs, name, scen.get("classes", [])))
    if len(out) < 2:
        raise RenderError("needs a run over several fleet sizes (--workers 2,4)")
    return dict(sorted(out.items()))


def base_scenario(row: Row) -> str:
    """`light@4w` -> `light`: the scenario whatever the fleet size."""
    return row.scenario.split("@")[0]


def summary_fidelity_workers(res: Results) -> list[str]:
    """The same scenarios at several fleet sizes in one run: the verdict per size."""
    data = res.load(WORKERS_STEM).get("data", {})
    try:
        sizes = by_fleet_size(data)
    except RenderError as exc:
        raise RenderError(f"{WORKERS_STEM}.json: {exc}") from None
    parts = []
    for size, rows in sizes.items():
        met, n, missed = headline(rows)
        worst = ", ".join(f"{base_scenario(r)}/{r.cls} {r.short} "
                          f"{fmt_pct(r.err.median)}" for r in missed[:3])
        parts.append(f"{size} workers: **{met} of {n}**" + (f" (missed: {worst})" if worst
                                                             else ""))
    return [f"§9 simulator fidelity against the load on this machine: the same scenarios at "
            f"{fleet_sizes(data)} workers, interleaved in one run",
            "; ".join(parts), f"≤ {TOLERANCE:.0%} each (a diagnostic of the rig: the "
            "headline is the row above)", row_source(res, WORKERS_STEM)]


def sizes_table(data: dict) -> str:
    """Each judged figure's error at each fleet size of a `--workers 2,4` run, side by
    side: scenario, class, metric, then per size the error (median, range) and verdict."""
    sizes = by_fleet_size(data)
    keyed: dict[tuple[str, str, str], dict[int, Row]] = {}
    for size, rows in sizes.items():
        for r in rows:
            if r.metric.judged:
                keyed.setdefault((base_scenario(r), r.cls, r.label), {})[size] = r
    out = []
    for (scen, cls, label), per in keyed.items():
        cells = []
        for size in sizes:
            r = per.get(size)
            cells.append("n/a" if r is None else f"{fmt_err(r.err)} {fmt_verdict(r)}")
        out.append([scen, cls, label, *cells])
    header = ["scenario", "class", "metric", *(f"error at {k} workers" for k in sizes)]
    return table(header, "lll" + "r" * len(sizes), out)


def fidelity_sizes(res: Results, args: list[str], _old: str) -> str:
    """`<!-- generated: fidelity-sizes STEM -->`: the error per fleet size, side by side."""
    data = one_results_file(res, "fidelity-sizes", args)
    return "\n\n".join([sources_line(res, args), setup_line(data), sizes_table(data)])


KINDS = {"fidelity": fidelity_table, "fidelity-split": fidelity_split,
         "fidelity-sizes": fidelity_sizes}
SUMMARY_ROWS = {"fidelity": summary_fidelity, "fidelity-workers": summary_fidelity_workers}
