"""bench/render_ingest.py on small hand-made results of bench/bench_ingest.py: rates per
rep, ratios paired within a rep, the note on ingest + dispatch vs ingest alone, the
table, the Summary row and the results markdown."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest

from bench import render_ingest as ri
from bench.harness import RunMeta, RunRecord, write_results
from bench.render_common import RenderError, Results

pytestmark = pytest.mark.unit

N = 1000
SETUP = {"n": N, "batch": 256, "pullers": 4, "max_items": 36, "reps": 3, "warmup_n": 100,
         "num_tenants": 50, "body_bytes": 435, "nats_version": "v2.15.1",
         "clock": "time.perf_counter", "variants": list(ri.VARIANTS),
         "loadavg_start": [0.5, 0.4, 0.3], "loadavg_end": [0.6, 0.4, 0.3], "bench_s": 30.0}

# (variant, rep) -> elapsed s for N = 1,000. Rates: fetch-held 10,000 / 8,000 / 12,500;
# ingest 5,000 / 4,000 / 8,000 (÷ fetch-held: 0.50 / 0.50 / 0.64); ingest-dispatch
# 2,500 / 2,000 (its rep 2 failed; ÷ fetch-held 0.25 / 0.25, ÷ ingest 0.50 / 0.50).
ELAPSED = {
    "publish-sync": (0.5, 0.5, 0.5),
    "publish-async": (0.05, 0.05, 0.05),
    "fetch-held": (0.1, 0.125, 0.08),
    "fetch-ack": (0.2, 0.2, 0.2),
    "ingest": (0.2, 0.25, 0.125),
    "ingest-dispatch": (0.4, 0.5, None),
}


def _metrics(variant: str, elapsed: float) -> dict:
    m = {"n": N, "elapsed_s": elapsed, "rate": N / elapsed}
    if variant.startswith("fetch"):
        m["fetches"] = 4
    if variant == "ingest-gc-default":  # 80 µs CPU per request, GC 20% of the window
        m |= {"cpu_s": 0.08, "gc_pause_s": elapsed / 5, "gc_collections": [900, 90, 9]}
    if variant == "ingest-dispatch-gc-default":  # 150 µs, GC 16%
        m |= {"cpu_s": 0.15, "gc_pause_s": elapsed * 0.16, "gc_collections": [1200, 120, 12]}
    if variant == "ingest":  # 50 µs CPU per request, GC 10% of the window
        m |= {"cpu_s": 0.05, "gc_pause_s": elapsed / 10, "gc_collections": [12, 1, 0],
              "start_s": 0.007, "queued_at_end": N}
    if variant == "ingest-dispatch":  # 100 µs, GC 5%
        m |= {"cpu_s": 0.1, "gc_pause_s": elapsed / 20, "gc_collections": [15, 1, 0],
              "pulls": 30, "duplicates": 0, "queued_at_end": 0, "in_flight_at_end": N}
    return m


def _records(elapsed: dict = ELAPSED) -> list[RunRecord]:
    """Interleaved as the harness runs them: order reversed every other repetition."""
    out = []
    for rep in range(3):
        variants = [v for v in ri.VARIANTS if v in elapsed]  # an older file: fewer
        order = variants if rep % 2 == 0 else variants[::-1]
        for v in order:
            e = elapsed[v][rep]
            if e is None:
                out.append(RunRecord(v, rep, len(out), {}, "RuntimeError('puller')"))
            else:
                out.append(RunRecord(v, rep, len(out), _metrics(v, e), elapsed_s=1.0))
    return out


def _data(records: list[RunRecord]) -> dict:
    data = {"setup": SETUP, "warmup": [], "records": [asdict(r) for r in records]}
    data["note"] = ri.note_for(data)
    return data


def _results(tmp_path: Path, records: list[RunRecord], stem: str = ri.STEM) -> Results:
    """Written the way bench/bench_ingest.py writes them, read the way the renderer does."""
    meta = RunMeta("python bench/bench_ingest.py", "abc1234", "2030-01-02T03:04:05Z", "test")
    write_results(tmp_path / f"{stem}.md", "ingest", "body", _data(records), meta)
    return Results(tmp_path, "res")


# --- figures -------------------------------------------------------------------------------


def test_rates_per_rep_and_ratios_paired_within_a_rep():
    recs = _records()
    assert ri.rates(recs, "fetch-held") == pytest.approx([10_000, 8_000, 12_500])
    assert ri.ratios(recs, "ingest") == pytest.approx([0.5, 0.5, 0.64])
    # rep 2 of ingest-dispatch failed: two pairs, not its rep 1 against rep 2's raw fetch.
    assert ri.ratios(recs, "ingest-dispatch") == pytest.approx([0.25, 0.25])
    assert ri.ratios(recs, "ingest-dispatch", "ingest") == pytest.approx([0.5, 0.5])


def test_a_rate_that_is_not_n_over_elapsed_is_refused():
    recs = _records()
    recs[0].metrics["rate"] *= 1.5
    with pytest.raises(RenderError, match="publish-sync rep 0: rate is not n / elapsed_s"):
        ri.records_of({"records": [asdict(r) for r in recs]})
    with pytest.raises(RenderError, match="no successful run"):
        ri.records_of({"records": [asdict(RunRecord("ingest", 0, 0, {}, "boom"))]})


def test_note_explains_ingest_dispatch_below_ingest_alone():
    note = ri.note_for(_data(_records()))
    assert note.startswith("ingest + dispatch ÷ ingest alone, paired per repetition: "
                           "0.50× (0.50–0.50). The dispatcher's process spent 50 µs of CPU "
                           "per request ingesting alone and 100 µs with dispatch; "
                           "garbage-collector pauses took 10.0% and 5.0% of the timed window")
    assert note.endswith(ri.BELOW_INGEST)


def test_note_flags_ingest_dispatch_above_ingest_alone():
    faster = dict(ELAPSED, **{"ingest-dispatch": (0.1, 0.1, None)})
    note = ri.note_for(_data(_records(faster)))
    assert "paired per repetition: 2.25× (2.00–2.50)" in note
    assert note.endswith(ri.ABOVE_INGEST)


# --- rendering -----------------------------------------------------------------------------


def test_benchmarks_table(tmp_path):
    res = _results(tmp_path, _records(), "ing")
    out = ri.KINDS["ingest"](res, ["ing"], "old table\n")
    assert out.startswith("*Generated by `python bench/render_benchmarks.py` from "
                          "[`ing.json`](res/ing.json) (commit abc1234, 2030-01-02T03:04:05Z)")
    assert "N = 1,000 requests per run (50 tenants, one tier, 435 B bodies" in out
    lines = out.splitlines()
    assert ("| raw pull `fetch(256)`, messages held un-acked (what the dispatcher does) | first "
            "fetch call → N-th message received | 10,000 (8,000–12,500) | 1 (the reference) "
            "| 3 |") in lines
    assert ("| **dispatcher ingest** (decode, validate, admit, queue, hold), no workers | "
            "dispatcher's first fetch call → N-th request queued | 5,000 (4,000–8,000) | "
            "0.50× (0.50–0.64) | 3 |") in lines
    assert ("| dispatcher ingest + dispatch to 4 concurrent pulls of 36 (a peer process) | "
            "dispatcher's first fetch call → peer holds N distinct requests | 2,250 "
            "(2,000–2,500) | 0.25× (0.25–0.25) | 2 |") in lines
    assert "- **dispatcher ingest ÷ raw fetch (held): 0.50× (0.50–0.64)**" in lines
    assert "Note: ingest + dispatch ÷ ingest alone" in out
    assert "old table" not in out
    with pytest.raises(RenderError, match="one results file"):
        ri.KINDS["ingest"](res, ["a", "b"], "")


def test_summary_row(tmp_path):
    row = ri.SUMMARY_ROWS["ingest"](_results(tmp_path, _records()))
    assert row == [
        "dispatcher ingest ÷ raw nats-py pull fetch (same server, fetch batch 256, "
        "N = 1,000, one clock)",
        "**0.50× (0.50–0.64)** over 3 paired reps (ingest + dispatch: 0.25× (0.25–0.25), "
        "2 reps)",
        "—", "[ingest](res/ingest.md) (abc1234, 2030-01-02)"]


def test_summary_row_needs_the_raw_fetch(tmp_path):
    recs = [r for r in _records() if r.variant != "fetch-held"]
    with pytest.raises(RenderError, match=r"no successful run of \['fetch-held'\]"):
        ri.SUMMARY_ROWS["ingest"](_results(tmp_path, recs))


def test_report_lists_every_run_in_run_order():
    md = ri.report(_data(_records()))
    rows = [ln for ln in md.splitlines() if ln.startswith("| ") and ln[2].isdigit()]
    assert len(rows) == 18
    assert [r.split(" | ")[2] for r in rows[:6]] == [f"`{v}`" for v in ri.VARIANTS
                                                     if "gc-default" not in v]
    assert rows[4] == ("| 0 | 4 | `ingest` | 0.200 | 5,000 | 20 ms (12/1/0) | "
                       "queued_at_end=1,000, CPU 50 µs/request, start() 7 ms |")
    assert "| 2 | 17 | ingest-dispatch | failed: RuntimeError('puller') |" in rows[17]
    assert "- ingest-dispatch rep 2: RuntimeError('puller')" in md


# --- the dispatcher's GC setting against Python's default ------------------------------------

# ingest under Python's default GC: 4,000 / 3,200 / 4,000 (the setting: 1.25× / 1.25× / 2.0×);
# ingest + dispatch: 2,000 / 1,600 / failed (1.25× / 1.25×).
WITH_GC_DEFAULT = dict(ELAPSED, **{"ingest-gc-default": (0.25, 0.3125, 0.25),
                                   "ingest-dispatch-gc-default": (0.5, 0.625, 0.5)})


def test_the_gc_setting_is_paired_against_python_default_per_rep(tmp_path):
    recs = _records(WITH_GC_DEFAULT)
    assert ri.gc_gain(recs, "ingest") == pytest.approx([1.25, 1.25, 2.0])
    assert ri.gc_gain(recs, "ingest-dispatch") == pytest.approx([1.25, 1.25])
    data = _data(recs)
    assert data["note"].endswith(
        "Under Python's default GC settings (collect every 700 net allocations) the same "
        "took 80 and 150 µs of CPU per request, with GC pauses 20.0% and 16.0% of the window.")
    out = ri.KINDS["ingest"](_results(tmp_path, recs, "ing"), ["ing"], "")
    lines = out.splitlines()
    assert ("- the dispatcher's GC setting ÷ Python's default, requests/s paired per "
            "repetition: ingest 1.25× (1.25–2.00), ingest + dispatch 1.25× (1.25–1.25)") in lines
    assert ("| dispatcher ingest (decode, validate, admit, queue, hold), no workers, Python's "
            "default GC settings | dispatcher's first fetch call → N-th request queued | "
            "4,000 (3,200–4,000) | 0.40× (0.32–0.40) | 3 |") in lines
    row = ri.SUMMARY_ROWS["ingest"](_results(tmp_path, recs))
    assert row[1].endswith("; the dispatcher's GC setting ÷ Python's default: ingest 1.25× "
                           "(1.25–2.00), ingest + dispatch 1.25× (1.25–1.25)")

def test_an_older_file_without_the_gc_rows_renders_without_their_line():
    assert not any("GC setting" in ln for ln in ri.ratio_lines(_records()))
    assert "Python's default GC" not in ri.note_for(_data(_records()))
