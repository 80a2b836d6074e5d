"""The dispatcher core's CPU on a simulated pool (bench/dispatcher_core_load.py): the
results markdown, BENCHMARKS.md's table and Summary row, from the JSON it writes
({"meta", "data": {"runs": [{"workers", "tenants", "rep", "requests_per_s",
"core_pct_of_a_core", "core_us_per_request", "core_share_of_run", "core_s_by_call",
"calls", "wall_s", "cpu_s", ...}], ...}}). Median (min–max) over repetitions.
Pure: no fleet, no clock."""

from __future__ import annotations

from bench.render_common import (
    RenderError,
    Results,
    fmt_sum,
    median,
    one_results_file,
    one_stem,
    row_source,
    sources_line,
    table,
)

STEM = "dispatcher_core_load"
TITLE = "The dispatcher core's CPU on a simulated pool (does one dispatcher keep up?)"
HOW_TO_READ = """\
One row per scale (`workers x tenants`: bench/workloads/scale.yaml's mix scaled to it,
32 slots per worker, ~80% busy, outputs 128-384 tokens, drr, preemption on), measured
from 10 simulated s to the end. The dispatcher's scheduling core (`PoolCore`,
interpreted, as the dispatcher runs it) is timed at each of its entry points while the
fleet simulator runs it (`fairlane simulate --time-dispatcher`). *core, % of a core*:
the core's seconds per simulated second, i.e. the share of one CPU core of this
machine the core alone would need to serve that pool in real time. It is a lower
bound on a dispatcher's CPU: its shell's work per message (JetStream, msgspec, NATS,
metrics) comes on top. *µs per request*: core seconds ÷ requests arrived. *of the
run*: the core's share of the simulation's own time. *by entry point*: median share of
the core's time. Median (min–max) over repetitions."""

TOP = 4  # entry points shown per row


def _runs(data: dict) -> dict[tuple[int, int], list[dict]]:
    runs = data.get("runs") or []
    if not runs:
        raise RenderError(f"{STEM}.json has no run")
    by_scale: dict[tuple[int, int], list[dict]] = {}
    for r in runs:
        by_scale.setdefault((r["workers"], r["tenants"]), []).append(r)
    return dict(sorted(by_scale.items()))


def _by_call(runs: list[dict]) -> str:
    names = runs[0]["core_s_by_call"]
    share = {n: median(r["core_s_by_call"][n] / r["core_s"] for r in runs) for n in names}
    top = sorted((n for n in names if share[n] > 0), key=lambda n: -share[n])[:TOP]
    return ", ".join(f"`{n}` {share[n]:.0%}" for n in top)


def scale_rows(data: dict) -> str:
    rows = []
    for (w, t), runs in _runs(data).items():
        rows.append([
            f"{w:,} x {t:,}", str(len(runs)),
            fmt_sum((r["requests_per_s"] for r in runs), digits=0),
            fmt_sum(r["core_pct_of_a_core"] for r in runs),
            fmt_sum(r["core_us_per_request"] for r in runs),
            fmt_sum((100 * r["core_share_of_run"] for r in runs), "%"),
            _by_call(runs),
            fmt_sum((r["cpu_s"] / r["wall_s"] for r in runs), digits=3),
        ])
    return table(["workers x tenants", "reps", "requests / s", "core, % of a core",
                  "core µs per request", "core, % of the run", "by entry point (median)",
                  "cpu ÷ wall"], "lrrrrrlr", rows)


def results_body(data: dict) -> str:
    return scale_rows(data)


def load_kind(res: Results, args: list[str], _old: str) -> str:
    """`<!-- generated: dispatcher-core-load STEM -->`."""
    data = one_results_file(res, "dispatcher-core-load", args)
    return "\n\n".join([sources_line(res, [one_stem("dispatcher-core-load", args)]),
                        scale_rows(data)])


def summary_row(res: Results) -> list[str]:
    data = res.load(STEM).get("data", {})
    by_scale = _runs(data)
    parts = [f"{w:,} × {t:,}: {fmt_sum(r['core_pct_of_a_core'] for r in runs)}% of a core "
             f"({fmt_sum(r['core_us_per_request'] for r in runs)} µs per request, "
             f"{len(runs)} reps)" for (w, t), runs in by_scale.items()]
    return ["§9 the dispatcher's scheduling core alone, timed while the simulator runs it "
            "(interpreted, as the dispatcher does): CPU to serve the pool in real time",
            "; ".join(parts), "— (a lower bound on one dispatcher's CPU; the shell's work "
            "per message comes on top)", row_source(res, STEM)]


KINDS = {"dispatcher-core-load": load_kind}
SUMMARY_ROWS = {"dispatcher-core-load": summary_row}
