"""Dispatcher memory per queued request: the figures, the results markdown's tables and
BENCHMARKS.md's table and Summary row, from the JSON bench/bench_dispatcher_memory.py
writes ({"meta", "data": {"workload": {...}, "runs": [{"mode": "rss" | "heap", "rep",
"num_requests", "<rss|heap>_{before,idle,full}_<kib|bytes>", "queued", "fill_s"}],
"load_avg", "wall_s", "args"}}).

RSS runs (tracemalloc off) and heap runs (tracemalloc on) are separate processes and
separate figures: nothing here combines a number of one with a number of the other.
Each figure is the median (min–max) over its runs (bench.harness.summarize). Pure: no
fleet, no clock; the bench's own markdown is rendered by the same functions."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from bench.harness import Summary, fmt_num, summarize
from bench.render_common import (
    RenderError,
    Results,
    digits_for,
    one_results_file,
    row_source,
    sources_line,
    table,
)

RSS, HEAP = "rss", "heap"
MODES = (RSS, HEAP)
STEM = "dispatcher_memory"  # the Summary row's results file
KIB, MIB = 1024, 2**20


# --- per run ---------------------------------------------------------------------------------


def _bytes(run: dict, stage: str) -> int:
    """A run's reading at `stage` (before / idle / full) in bytes: RSS runs store KiB,
    heap runs bytes."""
    if run["mode"] == RSS:
        return run[f"rss_{stage}_kib"] * KIB
    if run["mode"] == HEAP:
        return run[f"heap_{stage}_bytes"]
    raise RenderError(f"unknown run mode {run['mode']!r} (known: {MODES})")


def per_request_bytes(run: dict) -> float:
    """Growth from the idle dispatcher to all requests queued, per queued request: the
    backlog's marginal cost, the dispatcher's start-up memory left out."""
    return (_bytes(run, "full") - _bytes(run, "idle")) / run["num_requests"]


def backlog_mib(run: dict) -> float:
    return (_bytes(run, "full") - _bytes(run, "idle")) / MIB


def startup_mib(run: dict) -> float:
    """What starting the dispatcher (nothing queued yet) grew the reading by."""
    return (_bytes(run, "idle") - _bytes(run, "before")) / MIB


def runs_of(data: dict, mode: str) -> list[dict]:
    """The runs of one mode, in repetition order; each must have queued every request
    (a partial backlog would understate the per-request figure)."""
    runs = sorted((r for r in data.get("runs", []) if r.get("mode") == mode),
                  key=lambda r: r["rep"])
    if not runs:
        raise RenderError(f"no {mode} runs in the results")
    for r in runs:
        if r["queued"] < r["num_requests"]:
            raise RenderError(f"{mode} run {r['rep']} queued {r['queued']:,} of "
                              f"{r['num_requests']:,} requests")
    return runs


# --- over runs -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Figures:
    """Each figure over the runs of one mode only."""

    rss_per_request_bytes: Summary  # tracemalloc off: the headline
    heap_per_request_bytes: Summary  # tracemalloc on, separate runs
    rss_backlog_mib: Summary
    heap_backlog_mib: Summary
    rss_startup_mib: Summary  # dispatcher started, nothing queued (RSS runs)
    fill_s: Summary  # publisher start to all queued (RSS runs: tracing slows the others)


def _over(runs: list[dict], fn: Callable[[dict], float]) -> Summary:
    return summarize(fn(r) for r in runs)


def figures(data: dict) -> Figures:
    rss, heap = runs_of(data, RSS), runs_of(data, HEAP)
    return Figures(_over(rss, per_request_bytes), _over(heap, per_request_bytes),
                   _over(rss, backlog_mib), _over(heap, backlog_mib),
                   _over(rss, startup_mib), _over(rss, lambda r: r["fill_s"]))


def _fmt_bytes(s: Summary) -> str:
    return s.fmt(0, " B")


def _fmt_kb(s: Summary) -> str:
    """A per-request Summary in bytes as KB (1,000 bytes), median (min–max); two
    decimals, or runs 8 bytes apart would read as a 0.1 KB spread."""
    return Summary(s.median / 1000, s.lo / 1000, s.hi / 1000, s.n).fmt(2, " KB")


def _fmt_mib(s: Summary) -> str:
    return s.fmt(digits_for(s.median), " MiB")


# --- tables ----------------------------------------------------------------------------------


def workload_text(data: dict) -> str:
    w = data["workload"]
    return (f"Workload: {w['num_requests']:,} requests queued over {w['num_tenants']:,} "
            f"tenants (one tier, {w['policy']}), {w['prompt_chars']:,}-character ASCII "
            f"prompts, max_tokens {w['max_tokens']}; no workers, so every request waits "
            "queued with its JetStream message held un-acked; published by a separate "
            "process into a dispatcher started on an empty stream.")


def memory_table(data: dict) -> str:
    """The figures: RSS (tracemalloc off) and heap (tracemalloc on), separate runs."""
    f = figures(data)
    n = data["workload"]["num_requests"]
    rows = [
        ["**RSS growth** per queued request", "VmRSS, tracemalloc off; a fresh process per run",
         f"**{_fmt_bytes(f.rss_per_request_bytes)}**", _fmt_mib(f.rss_backlog_mib),
         f.rss_per_request_bytes.n],
        ["Python heap growth per queued request",
         "tracemalloc on, runs of their own (RSS not read)",
         _fmt_bytes(f.heap_per_request_bytes), _fmt_mib(f.heap_backlog_mib),
         f.heap_per_request_bytes.n],
        ["dispatcher started, nothing queued: RSS growth", "VmRSS, tracemalloc off (the RSS runs)",
         "—", _fmt_mib(f.rss_startup_mib), f.rss_startup_mib.n],
    ]
    header = ["measure", "method", "per queued request", f"total for {n:,} requests", "runs"]
    return table(header, "llrrr", rows)


def runs_table(data: dict) -> str:
    """Every run's readings in run order, in MiB (RSS runs: VmRSS; heap runs: traced)."""
    rows = []
    for i, r in enumerate(data.get("runs", [])):
        what = "RSS (tracemalloc off)" if r["mode"] == RSS else "heap (tracemalloc on)"
        rows.append([i + 1, what, r["rep"],
                     *(fmt_num(_bytes(r, s) / MIB, 1) for s in ("before", "idle", "full")),
                     fmt_num(per_request_bytes(r), 0), f"{r['queued']:,}",
                     fmt_num(r["fill_s"], 1)])
    header = ["#", "run", "rep", "before dispatcher MiB", "idle MiB", "all queued MiB",
              "per queued request B", "queued", "publish → all queued s"]
    return table(header, "rlrrrrrrr", rows)


def report(data: dict) -> str:
    """The results markdown's body (below bench.harness.results_header)."""
    f = figures(data)
    load = data.get("load_avg") or [[None], [None]]
    return "\n\n".join([
        workload_text(data), memory_table(data),
        f"All {data['workload']['num_requests']:,} queued {fmt_num(f.fill_s.median, 1)} s "
        f"({fmt_num(f.fill_s.lo, 1)}–{fmt_num(f.fill_s.hi, 1)}) after the publisher started "
        "(RSS runs).",
        "## Runs", runs_table(data),
        f"Load average (1 min) before / after: {fmt_num(load[0][0], 2)} / "
        f"{fmt_num(load[1][0], 2)}; wall {fmt_num(data.get('wall_s'), 0)} s."])


# --- BENCHMARKS.md ---------------------------------------------------------------------------


def memory_kind(res: Results, args: list[str], _old: str) -> str:
    """`<!-- generated: dispatcher-memory STEM -->`: the workload and the figures."""
    data = one_results_file(res, "dispatcher-memory", args)
    return "\n\n".join([sources_line(res, args), workload_text(data), memory_table(data)])


def summary_memory(res: Results) -> list[str]:
    data = res.load(STEM).get("data", {})
    f, w = figures(data), data["workload"]
    claim = (f"dispatcher memory per queued request ({w['num_requests']:,} queued over "
             f"{w['num_tenants']:,} tenants, {w['prompt_chars']:,}-char prompts, held un-acked)")
    rss, heap = f.rss_per_request_bytes, f.heap_per_request_bytes
    measured = (f"**{_fmt_kb(rss)} RSS** (tracemalloc off, {rss.n} runs); Python heap "
                f"{_fmt_kb(heap)} (tracemalloc on, {heap.n} separate runs)")
    return [claim, measured, "—", row_source(res, STEM)]


KINDS = {"dispatcher-memory": memory_kind}
SUMMARY_ROWS = {"dispatcher-memory": summary_memory}
