"""The request path's TTFT overhead at light load: the figures, the results markdown and
BENCHMARKS.md's table and Summary row, from the JSON bench/bench_path.py writes
({"meta", "data": {"setup": {...}, "warmup": [RunRecord, ...], "records": [RunRecord,
...]}}, a record's metrics being ``{"ttft_ms": [one sample per request]}``).

Per variant: the TTFT p50 of each repetition, then median (min–max) over repetitions;
the p99 from the samples pooled over repetitions (a p99 only from >= 200 of them,
else "max="). Overhead = variant − `direct`, paired within a repetition (they ran back
to back) for the p50, pooled for the p99. Pure: no fleet, no clock."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

from bench.bench_vllm_report import fmt_signed, paired, per_rep
from bench.common import quantile
from bench.harness import MIN_P99_SAMPLES, RunRecord, by_variant, collect, fmt_tail
from bench.render_common import (
    Results,
    digits_for,
    failed_run_lines,
    fmt_sum,
    measured_records,
    one_results_file,
    row_source,
    sources_line,
    table,
)

STEM = "path"
BASE = "direct"  # what every overhead is measured against
HEADLINE = "procs"  # the production shape: separate processes, default coalesce_ms
VARIANTS = ("direct", "inproc", "inproc-c0", "procs", "procs-c0")
LABELS = {
    "direct": "SimEngine called directly (in the bench process)",
    "inproc": "dispatcher + worker in the bench process, coalesce_ms 5 (default)",
    "inproc-c0": "dispatcher + worker in the bench process, coalesce_ms 0",
    "procs": "dispatcher + worker as separate processes, coalesce_ms 5 (production shape)",
    "procs-c0": "dispatcher + worker as separate processes, coalesce_ms 0",
}


# --- figures ---------------------------------------------------------------------------------


def ttft_p50(m: dict[str, Any]) -> float:
    return quantile(m["ttft_ms"], 0.50)


def p50s(records: Sequence[RunRecord], variant: str) -> list[float]:
    """The variant's TTFT p50 of every successful repetition, in repetition order."""
    reps = per_rep(records, variant, ttft_p50)
    return [reps[r] for r in sorted(reps)]


def pooled(records: Sequence[RunRecord], variant: str) -> list[float]:
    """Every request's TTFT of the variant, over all repetitions."""
    return [x for xs in collect(records, variant, "ttft_ms") for x in xs]


def overheads_p50(records: Sequence[RunRecord], variant: str, base: str = BASE) -> list[float]:
    """variant − base TTFT p50 (ms), per repetition where both ran."""
    return paired(records, variant, base, ttft_p50, operator.sub)


def tail_overhead(records: Sequence[RunRecord], variant: str,
                  base: str = BASE) -> tuple[str, float, int, int]:
    """(label, variant's pooled tail − base's, variant's samples, base's samples): "p99"
    when both pools hold >= MIN_P99_SAMPLES, else "max" on both sides (a p99 minus a
    max would compare two different statistics)."""
    a, b = pooled(records, variant), pooled(records, base)
    if not a or not b:
        return "max", math.nan, len(a), len(b)
    if min(len(a), len(b)) >= MIN_P99_SAMPLES:
        return "p99", quantile(a, 0.99) - quantile(b, 0.99), len(a), len(b)
    return "max", max(a) - max(b), len(a), len(b)


def signed(v: float) -> str:
    return "n/a" if math.isnan(v) else f"{v:+.{digits_for(v)}f}"


def tail_cell(records: Sequence[RunRecord], variant: str, base: str = BASE) -> str:
    """The pooled tail overhead as a table cell: "+12.3", or "max=+12.3" when a pool
    held fewer than 200 samples."""
    label, v, _, _ = tail_overhead(records, variant, base)
    return signed(v) if label == "p99" else f"max={signed(v)}"


def tail_text(records: Sequence[RunRecord], variant: str, base: str = BASE) -> str:
    """"p99 +12.3 ms (pooled, 300 / 300 samples)", or "max ..." with fewer samples."""
    label, v, n_a, n_b = tail_overhead(records, variant, base)
    return f"{label} {signed(v)} ms (pooled, {n_a:,} / {n_b:,} samples)"


def variants_in(records: Sequence[RunRecord]) -> list[str]:
    groups = by_variant(records)
    return [v for v in VARIANTS if v in groups]


def num_reps(records: Sequence[RunRecord]) -> int:
    return len({r.rep for r in records})


# --- tables ----------------------------------------------------------------------------------


def setup_text(setup: dict[str, Any]) -> str:
    s = setup
    return (f"One request at a time (closed loop), `max_tokens={s['max_tokens']}`: the time "
            f"to the FIRST token of a short request, not throughput. Simulator step model "
            f"`{s['step_model']}` at time_scale {s['time_scale']:g}; nats-server "
            f"{s.get('nats_version', '?')} on loopback; uvloop. {s['reps']} repetitions × "
            f"{s['per_rep']} requests per variant, every variant once per repetition, the "
            f"order reversed every other repetition, after a warm-up of {s['warmup']} "
            f"requests per variant (not counted). TTFT on one clock "
            f"(`{s.get('clock', 'time.perf_counter')}`): from just before the producer's "
            "`submit()` to its first chunk; `direct` from `generate()` to the first delta.")


def variant_table(records: Sequence[RunRecord]) -> str:
    """Per variant: TTFT p50 (median (min–max) over repetitions), the pooled p99, and
    the overhead vs `direct` at both."""
    rows = []
    for v in variants_in(records):
        ttft = pooled(records, v)
        base = v == BASE
        rows.append([
            f"`{v}`", LABELS.get(v, v),
            fmt_sum(p50s(records, v), digits=2),
            fmt_tail(ttft, 2),
            "—" if base else fmt_signed(overheads_p50(records, v), unit=""),
            "—" if base else tail_cell(records, v),
            f"{len(ttft):,}",
        ])
    header = ["variant", "what", "TTFT p50 ms", "TTFT p99 ms (pooled)",
              "overhead p50 ms (paired per rep)", "overhead p99 ms (pooled)", "samples"]
    return table(header, "llrrrrr", rows)


def run_rows(records: Sequence[RunRecord]) -> str:
    """Every (variant, repetition) in run order: what the summaries are made of."""
    rows = []
    for r in sorted(records, key=lambda r: r.position):
        if r.error is not None:
            rows.append([r.rep, r.position, r.variant, f"failed: {r.error}", "", "", ""])
            continue
        xs = r.metrics["ttft_ms"]
        rows.append([r.rep, r.position, f"`{r.variant}`", len(xs),
                     f"{quantile(xs, 0.5):.2f}", f"{max(xs):.2f}",
                     f"{r.elapsed_s:.1f}"])
    header = ["rep", "#", "variant", "requests", "TTFT p50 ms", "TTFT max ms", "run s"]
    return table(header, "rrlrrrr", rows)


def headline_line(records: Sequence[RunRecord], variant: str = HEADLINE) -> str:
    ovh = overheads_p50(records, variant)
    return (f"**`{variant}` − `{BASE}`: p50 {fmt_signed(ovh)}** (median (min–max) over "
            f"{len(ovh)} paired repetitions); {tail_text(records, variant)}")


HOW_TO_READ = """\
Each variant's TTFT p50 is taken per repetition, then reported as the median (min–max)
over repetitions; its p99 pools every repetition's samples (a p99 only from >= 200
samples, else "max="). The overhead p50 is variant − `direct` within the same
repetition (they ran back to back), then median (min–max); the overhead p99 is the
pooled p99 of the variant minus that of `direct`. `max_tokens` is small: these are
short-request latency figures (time to the first token), not throughput."""


def report(data: dict) -> str:
    """The results markdown's body (bench.harness.write_results adds the header)."""
    records, setup = measured_records(data, STEM), data["setup"]
    lines = [setup_text(setup), "", variant_table(records), "", "- " + headline_line(records),
             "- fleet start-up (not timed in the TTFTs): "
             + ", ".join(f"`{k}` {v:.1f} s" for k, v in setup.get("start_s", {}).items()),
             f"- loadavg at start {setup.get('loadavg_start')}, at end "
             f"{setup.get('loadavg_end')}; measured part {setup.get('bench_s', 0):.0f} s",
             "", "## Every run", "", run_rows(records)]
    return "\n".join(lines + failed_run_lines(data)) + "\n"


# --- BENCHMARKS.md ---------------------------------------------------------------------------


def path_kind(res: Results, args: list[str], _old: str) -> str:
    """`<!-- generated: path STEM -->`: the setup, the per-variant table, the headline."""
    data = one_results_file(res, "path", args)
    records = measured_records(data, STEM)
    return "\n\n".join([sources_line(res, args), setup_text(data["setup"]),
                        variant_table(records), headline_line(records)])


def summary_path(res: Results) -> list[str]:
    data = res.load(STEM).get("data", {})
    records = measured_records(data, STEM, [BASE, HEADLINE])
    claim = (f"path TTFT overhead at light load, one request at a time, max_tokens "
             f"{data['setup']['max_tokens']} (producer → NATS → dispatcher → sim worker as "
             "separate processes, vs the SimEngine called directly)")
    ovh = overheads_p50(records, HEADLINE)
    measured = (f"TTFT p50 **{fmt_signed(ovh)}** (median (min–max) over {len(ovh)} paired "
                f"reps); {tail_text(records, HEADLINE)}")
    return [claim, measured, "—", row_source(res, STEM)]


KINDS = {"path": path_kind}
SUMMARY_ROWS = {"path": summary_path}
