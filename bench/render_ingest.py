"""The dispatcher's ingest rate vs raw nats-py: the figures, the results markdown and
BENCHMARKS.md's table and Summary row, from the JSON bench/bench_ingest.py writes
({"meta", "data": {"setup": {...}, "warmup": [RunRecord, ...], "records": [RunRecord,
...], "note": str}}, a record's metrics being ``{"n", "elapsed_s", "rate", ...}``).

Every rate is N ÷ elapsed seconds on one clock, per (variant, repetition); reported as
the median (min–max) over repetitions. Ratios to the raw fetch are paired within a
repetition (the two ran back to back), then median (min–max). Pure: no fleet, no
clock."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

from bench.bench_vllm_report import paired, per_rep
from bench.harness import RunRecord, by_variant, fmt_num, summarize
from bench.render_common import (
    RenderError,
    Results,
    failed_run_lines,
    fmt_sum,
    measured_records,
    median,
    one_results_file,
    row_source,
    sources_line,
    table,
)

STEM = "ingest"
RAW = "fetch-held"  # the client's limit the dispatcher is compared with
GC_DEFAULT = "-gc-default"  # a dispatcher variant under the interpreter's GC settings
VARIANTS = ("publish-sync", "publish-async", "fetch-held", "fetch-ack", "ingest",
            f"ingest{GC_DEFAULT}", "ingest-dispatch", f"ingest-dispatch{GC_DEFAULT}")
# variant -> (what it is, what is timed)
LABELS = {
    "publish-sync": ("raw JetStream `publish`, awaited one by one",
                     "first publish → last ack received"),
    "publish-async": ("raw JetStream `publish_async`, acks gathered per 1,000",
                      "first publish → last ack received"),
    "fetch-held": ("raw pull `fetch({batch})`, messages held un-acked (what the dispatcher "
                   "does)", "first fetch call → N-th message received"),
    "fetch-ack": ("raw pull `fetch({batch})` + ack each",
                  "first fetch call → last ack flushed"),
    "ingest": ("**dispatcher ingest** (decode, validate, admit, queue, hold), no workers",
               "dispatcher's first fetch call → N-th request queued"),
    "ingest-dispatch": ("dispatcher ingest + dispatch to {pullers} concurrent pulls of "
                        "{max_items} (a peer process)",
                        "dispatcher's first fetch call → peer holds N distinct requests"),
}
for _v in ("ingest", "ingest-dispatch"):  # the same, under the interpreter's GC settings
    LABELS[f"{_v}{GC_DEFAULT}"] = (LABELS[_v][0].replace("**", "")
                                   + ", Python's default GC settings", LABELS[_v][1])


# --- figures ---------------------------------------------------------------------------------


def records_of(data: dict) -> list[RunRecord]:
    """The measured records (`measured_records`), each run's rate checked against its
    count and time."""
    records = measured_records(data, STEM)
    for r in records:
        if r.error is None and abs(r.metrics["rate"] * r.metrics["elapsed_s"]
                                   - r.metrics["n"]) > 1e-6 * r.metrics["n"]:
            raise RenderError(f"{r.variant} rep {r.rep}: rate is not n / elapsed_s")
    return records


def rate(m: dict[str, Any]) -> float:
    return m["rate"]


def rates(records: Sequence[RunRecord], variant: str) -> list[float]:
    """The variant's requests/s of every successful repetition, in repetition order."""
    reps = per_rep(records, variant, rate)
    return [reps[r] for r in sorted(reps)]


def ratios(records: Sequence[RunRecord], num: str, den: str = RAW) -> list[float]:
    """num ÷ den requests/s, per repetition where both ran."""
    return paired(records, num, den, rate, operator.truediv)


def variants_in(records: Sequence[RunRecord]) -> list[str]:
    groups = by_variant(records)
    return [v for v in VARIANTS if v in groups]


def fmt_ratio(values: Sequence[float]) -> str:
    """"0.87× (0.80–0.93)"."""
    s = summarize(values)
    if s.n == 0:
        return "n/a"
    return s.fmt(2, "×")


def per_run(records: Sequence[RunRecord], variant: str, fn) -> list[float]:
    """fn(metrics) of the variant's successful runs that recorded what fn reads."""
    out = []
    for r in by_variant(records).get(variant, []):
        try:
            out.append(fn(r.metrics))
        except KeyError:
            continue
    return out


def gc_share(m: dict[str, Any]) -> float:
    """The garbage collector's pauses ÷ the timed window (in-process dispatcher runs)."""
    return m["gc_pause_s"] / m["elapsed_s"]


def cpu_us_per_request(m: dict[str, Any]) -> float:
    """The dispatcher's process CPU per request, µs (in-process dispatcher runs)."""
    return m["cpu_s"] / m["n"] * 1e6


# Why ingest + dispatch is below ingest alone (cProfile of both, bench_ingest --profile).
BELOW_INGEST = (
    "Dispatching is more work on the same event loop, not a separate stage running beside "
    "ingest: answering the pulls selects, encodes and publishes every request again and "
    "updates its metrics; and, in this bench only, each preemption check walks every "
    "request in flight, which here grows to N because the peer never reports a request "
    "started or finished (real workers keep it at their slots).")
ABOVE_INGEST = (
    "Above ingest alone, which the work says it should not be (dispatching adds work to "
    "the same event loop): read the per-run table (CPU per request, GC) before using "
    "this row.")


def note_for(data: dict) -> str:
    """What the ingest-dispatch row means beside ingest alone (bench/bench_ingest.py
    stores it in the JSON; the tables print it)."""
    records = records_of(data)
    if not {"ingest", "ingest-dispatch"} <= set(variants_in(records)):
        return ""
    both = ratios(records, "ingest-dispatch", "ingest")
    cpu = [summarize(per_run(records, v, cpu_us_per_request)).median
           for v in ("ingest", "ingest-dispatch")]
    gcs = [summarize(per_run(records, v, gc_share)).median * 100
           for v in ("ingest", "ingest-dispatch")]
    return (f"ingest + dispatch ÷ ingest alone, paired per repetition: {fmt_ratio(both)}. "
            f"The dispatcher's process spent {fmt_num(cpu[0], 0)} µs of CPU per request "
            f"ingesting alone and {fmt_num(cpu[1], 0)} µs with dispatch; garbage-collector "
            f"pauses took {fmt_num(gcs[0], 1)}% and {fmt_num(gcs[1], 1)}% of the timed "
            f"window (medians over repetitions). "
            + (ABOVE_INGEST if median(both) > 1 else BELOW_INGEST)
            + gc_default_note(records))


def gc_default_note(records: Sequence[RunRecord]) -> str:
    """CPU and GC of the dispatcher under Python's default GC settings, if measured."""
    old = [f"ingest{GC_DEFAULT}", f"ingest-dispatch{GC_DEFAULT}"]
    if not set(old) <= set(variants_in(records)):
        return ""
    cpu = [summarize(per_run(records, v, cpu_us_per_request)).median for v in old]
    gcs = [summarize(per_run(records, v, gc_share)).median * 100 for v in old]
    return (f" Under Python's default GC settings (collect every 700 net allocations) the "
            f"same took {fmt_num(cpu[0], 0)} and {fmt_num(cpu[1], 0)} µs of CPU per "
            f"request, with GC pauses {fmt_num(gcs[0], 1)}% and {fmt_num(gcs[1], 1)}% of "
            f"the window.")


# --- tables ----------------------------------------------------------------------------------


def setup_text(setup: dict[str, Any]) -> str:
    s = setup
    return (f"N = {s['n']:,} requests per run ({s['num_tenants']} tenants, one tier, "
            f"{s['body_bytes']} B bodies + Nats-Msg-Id/reply headers), fetch batch "
            f"{s['batch']}; one nats-server {s.get('nats_version', '?')} (loopback, JetStream "
            f"file storage, production stream config), a fresh stream per run; uvloop. "
            f"{s['reps']} repetitions, every variant once per repetition, the order reversed "
            f"every other one, after an untimed warm-up repetition of {s['warmup_n']:,} "
            f"requests. Requests/s = N ÷ the time between the two events named, on one "
            f"clock (`{s.get('clock', 'time.perf_counter')}`).")


def label(variant: str, setup: dict[str, Any]) -> tuple[str, str]:
    what, timed = LABELS.get(variant, (variant, "?"))
    return what.format(**setup), timed


def rates_table(records: Sequence[RunRecord], setup: dict[str, Any]) -> str:
    rows = []
    for v in variants_in(records):
        what, timed = label(v, setup)
        xs = rates(records, v)
        rows.append([what, timed, fmt_sum(xs, digits=0),
                     "1 (the reference)" if v == RAW else fmt_ratio(ratios(records, v)),
                     len(xs)])
    header = ["what", "timed from → to", "requests/s", "÷ raw fetch (paired per rep)", "reps"]
    return table(header, "llrrr", rows)


def ratio_lines(records: Sequence[RunRecord]) -> list[str]:
    lines = [f"- **dispatcher ingest ÷ raw fetch (held): "
             f"{fmt_ratio(ratios(records, 'ingest'))}**",
             f"- dispatcher ingest + dispatch ÷ raw fetch (held): "
             f"{fmt_ratio(ratios(records, 'ingest-dispatch'))}"]
    if f"ingest{GC_DEFAULT}" in variants_in(records):
        lines.append(f"- the dispatcher's GC setting ÷ Python's default, requests/s paired per "
                     f"repetition: ingest {fmt_ratio(gc_gain(records, 'ingest'))}, ingest + "
                     f"dispatch {fmt_ratio(gc_gain(records, 'ingest-dispatch'))}")
    return lines


def gc_gain(records: Sequence[RunRecord], variant: str) -> list[float]:
    """`variant` ÷ the same under Python's default GC settings, per repetition."""
    return ratios(records, variant, f"{variant}{GC_DEFAULT}")


def run_rows(records: Sequence[RunRecord]) -> str:
    """Every (variant, repetition) in run order: what the summaries are made of."""
    rows = []
    for r in sorted(records, key=lambda r: r.position):
        if r.error is not None:
            rows.append([r.rep, r.position, r.variant, f"failed: {r.error}", "", "", ""])
            continue
        m = r.metrics
        extra = [f"{k}={m[k]:,}" for k in ("fetches", "pulls", "duplicates", "queued_at_end",
                                          "in_flight_at_end")
                 if k in m]
        if "cpu_s" in m:
            extra.append(f"CPU {cpu_us_per_request(m):.0f} µs/request")
        if "start_s" in m:
            extra.append(f"start() {m['start_s'] * 1000:.0f} ms")
        gc_txt = (f"{m['gc_pause_s'] * 1000:.0f} ms ({'/'.join(map(str, m['gc_collections']))})"
                  if "gc_pause_s" in m else "—")
        rows.append([r.rep, r.position, f"`{r.variant}`", f"{m['elapsed_s']:.3f}",
                     f"{m['rate']:,.0f}", gc_txt, ", ".join(extra)])
    header = ["rep", "#", "variant", "elapsed s", "requests/s",
              "GC pauses (gen 0/1/2 collections)", "detail"]
    return table(header, "rrlrrrl", rows)


HOW_TO_READ = """\
Requests/s is N ÷ the elapsed time between the two events in the "timed" column, on one
clock, for every row; each row is the median (min–max) over repetitions that ran every
variant back to back. "÷ raw fetch" pairs a variant with the raw pull fetch (messages
held un-acked) of the same repetition. The publish rows are the producer side's limit,
the fetch rows the consumer side's: what nats-py itself manages on this machine."""


def report(data: dict) -> str:
    """The results markdown's body (bench.harness.write_results adds the header)."""
    records, setup = records_of(data), data["setup"]
    lines = [setup_text(setup), "", rates_table(records, setup), "", *ratio_lines(records)]
    if data.get("note"):
        lines += ["", f"Note: {data['note']}"]
    lines += ["", f"loadavg at start {setup.get('loadavg_start')}, at end "
              f"{setup.get('loadavg_end')}; measured part (with warm-up) "
              f"{setup.get('bench_s', 0):.0f} s.", "", "## Every run", "", run_rows(records)]
    return "\n".join(lines + failed_run_lines(data)) + "\n"


# --- BENCHMARKS.md ---------------------------------------------------------------------------


def ingest_kind(res: Results, args: list[str], _old: str) -> str:
    """`<!-- generated: ingest STEM -->`: the setup, the rates table, the ratios, the note."""
    data = one_results_file(res, "ingest", args)
    records = records_of(data)
    parts = [sources_line(res, args), setup_text(data["setup"]),
             rates_table(records, data["setup"]), "\n".join(ratio_lines(records))]
    if data.get("note"):
        parts.append(f"Note: {data['note']}")
    return "\n\n".join(parts)


def summary_ingest(res: Results) -> list[str]:
    data = res.load(STEM).get("data", {})
    records = measured_records(data, STEM, [RAW, "ingest", "ingest-dispatch"])
    ing, both = ratios(records, "ingest"), ratios(records, "ingest-dispatch")
    claim = (f"dispatcher ingest ÷ raw nats-py pull fetch (same server, fetch batch "
             f"{data['setup']['batch']}, N = {data['setup']['n']:,}, one clock)")
    measured = (f"**{fmt_ratio(ing)}** over {len(ing)} paired reps (ingest + dispatch: "
                f"{fmt_ratio(both)}, {len(both)} reps)")
    if f"ingest{GC_DEFAULT}" in variants_in(records):
        measured += (f"; the dispatcher's GC setting ÷ Python's default: ingest "
                     f"{fmt_ratio(gc_gain(records, 'ingest'))}, ingest + dispatch "
                     f"{fmt_ratio(gc_gain(records, 'ingest-dispatch'))}")
    return [claim, measured, "—", row_source(res, STEM)]


KINDS = {"ingest": ingest_kind}
SUMMARY_ROWS = {"ingest": summary_ingest}
