"""Scheduler core cost per decision: the figures, the results markdown's tables and
BENCHMARKS.md's §2 table and Summary row, from the JSON bench/bench_scheduler.py
writes ({"meta", "data": {"setup": {...}, "records": [bench.harness.RunRecord as a
dict: "variant", "rep", "position", "error", "elapsed_s", "metrics": {"column",
"policy", "tenants", "decisions", "warmup_decisions", "requests", "us_per_decision",
"us_per_submit"}}], "memory", "noisy_neighbour", "weights", "load_avg", "wall_s"}}).

A cell of the decision table is the median (min–max) over the repetitions of that
(column, tenant count), each repetition's figure being the mean µs per `select(1)` over
its timed decisions. Pure: no fleet, no clock; the bench's own markdown is rendered by
the same functions."""

from __future__ import annotations

from dataclasses import dataclass

from bench.harness import Summary, fmt_num, summarize
from bench.render_common import (
    RenderError,
    Results,
    one_results_file,
    row_source,
    sources_line,
    table,
)

STEM = "scheduler"  # the Summary row's results file
BLOCKED = "drr-blocked"
COLUMNS = ("fifo", "drr", "vtc", BLOCKED)  # the decision table's policy columns
LABELS = {"fifo": "fifo", "drr": "drr", "vtc": "vtc",
          BLOCKED: "drr, half the tenants quota-blocked"}
FLAT_COLUMN = "drr"  # the Summary row's policy
# "Flat" as a verdict: the median cost at the largest tenant count at most this many
# times the median at the smallest. An O(n) scan would be 10,000x from 10 to 100,000
# tenants; 2x leaves room for cache effects of a 10,000x bigger working set.
FLAT_MAX_RATIO = 2.0
US_DIGITS = 2  # µs per decision are 5-20: two decimals show a 1% change


# --- runs ------------------------------------------------------------------------------------


def ok_records(data: dict) -> list[dict]:
    """The successful runs, in run order."""
    return sorted((r for r in data.get("records", []) if r.get("error") is None),
                  key=lambda r: r["position"])


def failed_records(data: dict) -> list[dict]:
    return [r for r in data.get("records", []) if r.get("error") is not None]


def sizes_of(data: dict) -> list[int]:
    """The tenant counts, smallest first (from the setup: a count whose every run
    failed still gets its row)."""
    sizes = sorted(data.get("setup", {}).get("sizes") or
                   {r["metrics"]["tenants"] for r in ok_records(data)})
    if not sizes:
        raise RenderError("no tenant counts in the results")
    return sizes


def per_rep(data: dict, column: str, tenants: int, key: str = "us_per_decision") -> list[float]:
    """`key` of every successful run of (column, tenants), in repetition order."""
    runs = [r for r in ok_records(data)
            if r["metrics"]["column"] == column and r["metrics"]["tenants"] == tenants]
    return [r["metrics"][key] for r in sorted(runs, key=lambda r: r["rep"])]


def cell_summary(data: dict, column: str, tenants: int,
                 key: str = "us_per_decision") -> Summary:
    return summarize(per_rep(data, column, tenants, key))


def _fmt_us(s: Summary) -> str:
    return s.fmt(US_DIGITS)


# --- the flatness verdict --------------------------------------------------------------------


@dataclass(frozen=True)
class Flatness:
    """drr's cost per decision at the smallest and the largest tenant count."""

    small_n: int
    large_n: int
    small: Summary
    large: Summary

    @property
    def ratio(self) -> float:
        """Largest ÷ smallest, of the medians."""
        return self.large.median / self.small.median

    @property
    def verdict(self) -> str:
        return "met" if self.ratio <= FLAT_MAX_RATIO else "missed"


def flatness(data: dict, column: str = FLAT_COLUMN) -> Flatness:
    sizes = sizes_of(data)
    if len(sizes) < 2:
        raise RenderError(f"one tenant count ({sizes[0]:,}): nothing to call flat")
    small, large = (cell_summary(data, column, n) for n in (sizes[0], sizes[-1]))
    for n, s in ((sizes[0], small), (sizes[-1], large)):
        if s.n == 0:
            raise RenderError(f"no successful {column} run at {n:,} tenants")
    return Flatness(sizes[0], sizes[-1], small, large)


# --- tables ----------------------------------------------------------------------------------


def setup_text(data: dict) -> str:
    """What is timed, said with the figures."""
    s = data["setup"]
    failed = failed_records(data)
    fail = (f" {len(failed)} of {len(data['records'])} runs failed and are left out."
            if failed else "")
    return (
        f"Pure scheduler core (no NATS, no engine), every tenant backlogged (requests "
        f"submitted round robin over the tenants, all 100-token prompts and outputs). Timed "
        f"(`time.perf_counter`, GC off): a loop of {s['decisions']:,} `select(1)` calls on "
        f"one scheduler, after {s['warmup_decisions']:,} untimed ones on the same scheduler; "
        f"a run's figure is the loop's time ÷ its decisions (loop overhead included). "
        f"*{LABELS[BLOCKED]}*: drr with every tenant limited to one request in flight; "
        f"whenever more than half the tenants have one, the oldest is finished "
        f"(`on_finished`, inside the timed loop), so parked tenants keep coming back. "
        f"*µs/submit*: drr, the whole backlog's `submit` calls timed together ÷ their "
        f"count. Median (min–max) over {s['reps']} repetitions; every (policy, tenant "
        f"count) runs once per repetition, a fresh scheduler each time, the order "
        f"reversed every other repetition.{fail}")


def decision_table(data: dict) -> str:
    """Tenant counts × policies: µs per decision; drr's µs per submit last."""
    rows = []
    for n in sizes_of(data):
        rows.append([f"{n:,}", *(_fmt_us(cell_summary(data, c, n)) for c in COLUMNS),
                     _fmt_us(cell_summary(data, "drr", n, "us_per_submit"))])
    header = ["tenants", *(f"{LABELS[c]} µs/decision" for c in COLUMNS), "drr µs/submit"]
    return table(header, "r" * len(header), rows)


def flat_line(data: dict) -> str:
    f = flatness(data)
    return (f"**Flat (drr at {f.large_n:,} tenants ≤ {FLAT_MAX_RATIO:g}× drr at "
            f"{f.small_n:,}, medians): {f.verdict}** — {_fmt_us(f.small)} → "
            f"{_fmt_us(f.large)} µs, ratio {f.ratio:.2f}.")


def memory_table(data: dict) -> str:
    m = data["memory"]
    rows = [[r["policy"], f"{m['queued']:,}", f"{m['tenants']:,}",
             fmt_num(r["core_b_per_request"], 0), fmt_num(r["incl_b_per_request"], 0)]
            for r in m["rows"]]
    header = ["policy", "queued", "tenants", "core overhead B/request",
              "incl. QueuedRequest B/request"]
    return table(header, "lrrrr", rows)


def noisy_table(data: dict) -> str:
    rows = [[r["policy"], fmt_num(r["b_mean_ms"], 0), fmt_num(r["b_max_ms"], 0),
             fmt_num(r["a_mean_ms"], 0), fmt_num(r["makespan_ms"], 0)]
            for r in data["noisy_neighbour"]["rows"]]
    header = ["policy", "B mean wait ms", "B max wait ms", "A mean wait ms", "makespan ms"]
    return table(header, "lrrrr", rows)


def weights_table(data: dict) -> str:
    w = data["weights"]["weights"]
    ideal = "/".join(f"{x / sum(w):.3f}" for x in w)
    rows = [[r["policy"], *(f"{x:.3f}" for x in r["shares"]), ideal, f"{r['jain']:.4f}"]
            for r in data["weights"]["rows"]]
    header = ["policy", *(f"w={x} share" for x in w), "ideal", "Jain (weight-normalised)"]
    return table(header, "l" + "r" * (len(header) - 1), rows)


def runs_table(data: dict) -> str:
    """Every run in run order (failed ones with their error)."""
    rows = []
    for r in sorted(data.get("records", []), key=lambda r: r["position"]):
        m = r.get("metrics") or {}
        rows.append([r["position"] + 1, r["rep"], r["variant"],
                     fmt_num(m.get("us_per_decision"), 3), fmt_num(m.get("us_per_submit"), 3),
                     f"{m['decisions']:,}" if "decisions" in m else "—",
                     r["error"] or ""])
    header = ["#", "rep", "variant", "µs/decision", "µs/submit", "timed decisions", "error"]
    return table(header, "rrlrrrl", rows)


def report(data: dict) -> str:
    """The results markdown's body (below bench.harness.results_header)."""
    nn, w = data["noisy_neighbour"], data["weights"]
    load = data.get("load_avg") or [[None], [None]]
    return "\n\n".join([
        "## Cost per decision (`select(1)`), every tenant backlogged", setup_text(data),
        decision_table(data), flat_line(data),
        "## Core memory per queued request (tracemalloc, one run: deterministic)",
        memory_table(data),
        f"## Noisy neighbour: A bursts {nn['burst']:,}, B sends {nn['small']} at "
        f"{nn['b_at_ms']:g} ms ({nn['slots']} slots, {nn['service_ms']:g} ms per request, "
        "simulated time: deterministic, one run)", noisy_table(data),
        f"## Weighted shares {':'.join(map(str, w['weights']))}, all continuously "
        f"backlogged ({w['decisions']:,} decisions, tokens cost, deterministic prompt "
        "sizes, one run)", weights_table(data),
        "## Runs", runs_table(data),
        f"Load average (1 min) before / after: {fmt_num(load[0][0], 2)} / "
        f"{fmt_num(load[1][0], 2)}; wall {fmt_num(data.get('wall_s'), 0)} s."])


# --- BENCHMARKS.md ---------------------------------------------------------------------------


def scheduler_kind(res: Results, args: list[str], _old: str) -> str:
    """`<!-- generated: scheduler STEM -->`: what is timed, the table, the verdict."""
    data = one_results_file(res, "scheduler", args)
    return "\n\n".join([sources_line(res, args), setup_text(data), decision_table(data),
                        flat_line(data)])


def summary_scheduler(res: Results) -> list[str]:
    data = res.load(STEM).get("data", {})
    f = flatness(data)
    claim = (f"scheduler cost per decision, {f.small_n:,} → {f.large_n:,} tenants "
             f"({FLAT_COLUMN}, pure core, every tenant backlogged, `select(1)`)")
    measured = (f"**{_fmt_us(f.small)} → {_fmt_us(f.large)} µs** (ratio {f.ratio:.2f}; "
                f"{data['setup']['reps']} interleaved reps)")
    target = f"flat: largest ≤ {FLAT_MAX_RATIO:g}× smallest — {f.verdict}"
    return [claim, measured, target, row_source(res, STEM)]


KINDS = {"scheduler": scheduler_kind}
SUMMARY_ROWS = {"scheduler": summary_scheduler}
