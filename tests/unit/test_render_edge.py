"""bench/render_edge.py on small hand-made results of bench/bench_streamer.py and
bench/bench_cluster.py: paired ratios and differences, pooled and per-round tails (a p99
only from >= 200 samples), BENCHMARKS.md's tables and the Summary rows."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from bench import render_edge as re_
from bench.harness import RunMeta, RunRecord, write_results
from bench.render_common import RenderError, Results

pytestmark = pytest.mark.unit

META = RunMeta("python bench/bench_x.py", "abc1234", "2030-01-02T03:04:05Z", "test")

# --- streamer fixture ------------------------------------------------------------------------

STREAMER_SETUP = {"clients": 8, "tokens": 5000, "rate": 200.0, "seconds": 3.0,
                  "client_procs": 1, "reps": 3, "variants": ["raw", "streamer"], "cpus": 2,
                  "warmup": "one untimed run of each variant on the measured workload",
                  "loadavg_start": [0.5, 0.4, 0.3], "loadavg_end": [0.6, 0.4, 0.3],
                  "bench_s": 60.0}


def _lat(body: float, top: float, n: int = 100) -> list[float]:
    """n samples: n - 1 at `body` (the p50) and one at `top` (the max)."""
    return [body] * (n - 1) + [top]


def _sm(tps: float, lat: list[float], cpu: float | None = None) -> dict:
    thr = {"tokens": 40_000, "wall_s": 40_000 / tps, "tokens_per_s": tps}
    if cpu is not None:
        thr["streamer_cpu"] = cpu
    return {"throughput": thr, "latency": {"tokens": len(lat), "wall_s": 3.0,
                                           "tokens_per_s": len(lat) / 3.0, "lat_ms": lat,
                                           "chunks": 600}}


def _streamer_records(n: int = 100) -> list[RunRecord]:
    # In run order (reversed every other repetition); rep 2's streamer run failed, so
    # rep 2 gives no ratio and no added p50, but its raw run still counts on its own.
    return [
        RunRecord("raw", 0, 0, _sm(100_000, _lat(0.5, 1.0, n))),
        RunRecord("streamer", 0, 1, _sm(30_000, _lat(1.0, 2.2, n), 0.8)),
        RunRecord("streamer", 1, 2, _sm(48_000, _lat(1.2, 4.0, n), 0.9)),
        RunRecord("raw", 1, 3, _sm(120_000, _lat(0.4, 2.0, n))),
        RunRecord("raw", 2, 4, _sm(110_000, _lat(0.6, 0.9, n))),
        RunRecord("streamer", 2, 5, {}, "RuntimeError('socket closed')"),
    ]


def _streamer_data(n: int = 100) -> dict:
    return {"setup": STREAMER_SETUP, "warmup": [],
            "records": [asdict(r) for r in _streamer_records(n)]}


# --- cluster fixture -------------------------------------------------------------------------

CLUSTER_SETUP = {"reps": 3, "variants": ["1-node", "3-node"], "workers": 2,
                 "light_requests": 200, "load_requests": 1500, "concurrency": 64,
                 "time_scale": 0.02, "warmup_light": 20, "warmup_load": 300, "cpus": 2,
                 "loadavg_start": [1.0, 1.0, 1.0], "loadavg_end": [1.1, 1.0, 1.0],
                 "bench_s": 55.0}


def _ttft(p50: float, tail: float, n: int = 200) -> list[float]:
    """Three quarters of the samples at `p50`, one at 10 × `tail` (the max), the rest at
    `tail`: with 200 samples the p50 and the p99 exactly, and a max that is neither."""
    k = n * 3 // 4
    return [p50] * k + [tail] * (n - k - 1) + [tail * 10]


def _cm(size: int, rps: float, p50: float, tail: float, n: int) -> dict:
    return {"size": size, "req_per_s": rps, "load_requests": 1500, "load_wall_s": 1500 / rps,
            "ttft_ms": _ttft(p50, tail, n)}


def _cluster_data(n: int = 200, failed_rep: int | None = None) -> dict:
    rows = [("1-node", 0, 3000, 2.0, 3.0), ("3-node", 0, 1800, 4.0, 6.0),
            ("3-node", 1, 1400, 4.4, 7.48), ("1-node", 1, 2800, 2.2, 3.4),
            ("1-node", 2, 3200, 1.8, 2.6), ("3-node", 2, 1600, 4.5, 6.5)]
    recs = []
    for pos, (variant, rep, rps, p50, tail) in enumerate(rows):
        size = 1 if variant == "1-node" else 3
        if variant == "3-node" and rep == failed_rep:
            recs.append(RunRecord(variant, rep, pos, {}, "TimeoutError()"))
        else:
            recs.append(RunRecord(variant, rep, pos, _cm(size, rps, p50, tail, n)))
    return {"setup": CLUSTER_SETUP, "warmup": [], "records": [asdict(r) for r in recs]}


def _results(tmp_path: Path, stem: str, data: dict, report) -> Results:
    """Written the way the benches write them, read the way the renderer does."""
    write_results(tmp_path / f"{stem}.md", stem, report(data), data, META)
    return Results(tmp_path, "res")


# --- streamer ------------------------------------------------------------------------------


def test_streamer_figures_pair_per_repetition_and_pool_the_tail():
    f = re_.streamer_figures(_streamer_data())
    raw, ws = f.tokens_per_s["raw"], f.tokens_per_s["streamer"]
    assert (raw.median, raw.lo, raw.hi, raw.n) == (110_000, 100_000, 120_000, 3)
    assert (ws.median, ws.lo, ws.hi, ws.n) == (39_000, 30_000, 48_000, 2)
    r = f.throughput_ratio  # 0.30 and 0.40; rep 2 has no streamer run, so no ratio
    assert (r.median, r.lo, r.hi, r.n) == (pytest.approx(0.35), 0.3, 0.4, 2)
    assert (f.added_p50_ms.median, f.added_p50_ms.n) == (pytest.approx(0.65), 2)
    assert f.p50_ms["raw"].median == 0.5 and f.p50_ms["streamer"].median == pytest.approx(1.1)
    assert f.cpu.median == pytest.approx(0.85)
    # Pooled: raw 300 samples -> p99 0.603, streamer 200 -> 1.21 (linear interpolation).
    assert f.tail_ms["raw"] == re_.Tail("p99", pytest.approx(0.603), 300)
    assert f.tail_ms["streamer"] == re_.Tail("p99", pytest.approx(1.21), 200)
    assert f.added_tail_ms.label == "p99"
    assert f.added_tail_ms.value == pytest.approx(0.607)
    assert (f.pairs, f.reps) == (2, 3)


def test_streamer_tail_is_a_max_under_200_samples_on_either_side():
    # 60 per run: raw pools 180, streamer 120 -> no p99 on either side; both maxima.
    f = re_.streamer_figures(_streamer_data(60))
    assert f.tail_ms["raw"] == re_.Tail("max", 2.0, 180)
    assert f.tail_ms["streamer"] == re_.Tail("max", 4.0, 120)
    assert (f.added_tail_ms.label, f.added_tail_ms.value) == ("max", 2.0)
    table = re_.streamer_table(_streamer_data(60))
    assert "| tokens/s | p50 ms | max ms (< 200 samples) |" in table
    assert "| max=2.000 |" in table


def test_streamer_tail_is_a_max_on_both_sides_when_one_side_is_short():
    # 70 per run: raw pools 210 (enough for a p99), streamer 140 (not): a p99 beside a
    # max would not compare, so both sides give their max.
    f = re_.streamer_figures(_streamer_data(70))
    assert f.tail_ms["raw"] == re_.Tail("max", 2.0, 210)
    assert (f.added_tail_ms.label, f.added_tail_ms.value) == ("max", 2.0)


def test_streamer_table_and_summary_rows(tmp_path):
    res = _results(tmp_path, "streamer", _streamer_data(), re_.streamer_report)
    out = re_.KINDS["streamer"](res, ["streamer"], "old table\n")
    lines = out.splitlines()
    assert lines[0].startswith("*Generated by `python bench/render_benchmarks.py` from "
                               "[`streamer.json`](res/streamer.json) (commit abc1234, "
                               "2030-01-02T03:04:05Z)")
    assert "| raw core NATS (publisher → subscriber) | 110,000 (100,000–120,000) | 0.500 " \
           "(0.400–0.600) | 0.603 |" in lines
    assert "| through the streamer to websocket clients | 39,000 (30,000–48,000) | 1.100 " \
           "(1.000–1.200) | 1.210 |" in lines
    assert "| **added by the streamer** | **0.35× (0.30–0.40)** | **+0.650 (+0.500 to " \
           "+0.800)** | **+0.607** |" in lines
    assert "2 of 3 interleaved repetitions (a side failed in the others)" in out
    assert "old table" not in out
    assert re_.SUMMARY_ROWS["streamer-throughput"](res) == [
        "tokens/s the streamer relays to 8 websocket clients vs raw core NATS (one token per "
        "chunk, loopback)",
        "39,000 (30,000–48,000) vs 110,000 (100,000–120,000) tokens/s: **0.35× (0.30–0.40)** "
        "over 2 of 3 interleaved repetitions (a side failed in the others); streamer at 85% "
        "(80–90) of a core",
        "—", "[streamer](res/streamer.md) (abc1234, 2030-01-02)"]
    assert re_.SUMMARY_ROWS["streamer-latency"](res) == [
        "per-token latency added by the streamer (1,600 tokens/s over 8 streams)",
        "**+0.65 ms (+0.50 to +0.80) p50** per rep; p99 +0.61 ms (pooled, 200 / 300 samples)",
        "—", "[streamer](res/streamer.md) (abc1234, 2030-01-02)"]
    with pytest.raises(RenderError, match="one results file"):
        re_.KINDS["streamer"](res, [], "")


def test_streamer_report_lists_every_run_and_the_failure():
    md = re_.streamer_report(_streamer_data())
    rows = [line for line in md.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r.split(" | ")[2] for r in rows] == ["raw", "streamer", "streamer", "raw", "raw"]
    assert rows[1] == "| 0 | 2 | streamer | 30,000 | 1.33 | 80% | 1.000 | 2.200 | 100 |"
    assert "- streamer rep 2: RuntimeError('socket closed')" in md


def test_streamer_without_a_successful_variant_is_an_error():
    data = _streamer_data()
    data["records"] = [r for r in data["records"] if r["variant"] == "raw"]
    with pytest.raises(RenderError, match=r"no successful run of \['streamer'\]"):
        re_.streamer_figures(data)


# --- cluster -------------------------------------------------------------------------------


def test_cluster_figures_are_paired_per_round():
    f = re_.cluster_figures(_cluster_data())
    thr = f.ratios["throughput"]  # 0.6, 0.5, 0.5
    assert (thr.median, thr.lo, thr.hi, thr.n) == (0.5, 0.5, 0.6, 3)
    assert f.ratios["ttft_p50"].median == pytest.approx(2.0)
    assert f.ratios["ttft_p50"].hi == pytest.approx(2.5)
    assert f.ratios["ttft_tail"].median == pytest.approx(2.2)  # 7.48 / 3.4
    assert f.per_variant["throughput"]["1-node"].median == 3000
    assert f.per_variant["ttft_tail"]["3-node"].hi == 7.48
    assert f.tail_label == "p99"


def test_cluster_table_and_summary_row(tmp_path):
    res = _results(tmp_path, "cluster", _cluster_data(), re_.cluster_report)
    out = re_.KINDS["cluster"](res, ["cluster"], "")
    lines = out.splitlines()
    assert lines[0].startswith("*Generated by `python bench/render_benchmarks.py` from "
                               "[`cluster.json`](res/cluster.json) (commit abc1234,")
    assert "| throughput, requests/s | 3,000 (2,800–3,200) | 1,600 (1,400–1,800) | " \
           "0.50 (0.50–0.60) |" in lines
    assert "| light-load TTFT p50, ms | 2.0 (1.8–2.2) | 4.4 (4.0–4.5) | 2.00 (2.00–2.50) |" \
        in lines
    assert "| light-load TTFT p99, ms (per round) | 3.0 (2.6–3.4) | 6.5 (6.0–7.5) | " \
           "2.20 (2.00–2.50) |" in lines
    assert "200 sequential requests" in out and "3 round(s)" in out
    assert re_.SUMMARY_ROWS["cluster-cost"](res) == [
        "§8 3-node NATS cluster (R3) ÷ one node, same run, 3 rounds: throughput; light-load "
        "TTFT p50; p99 (per round)",
        "0.50× (0.50–0.60); 2.00× (2.00–2.50); 2.20× (2.00–2.50)",
        "—", "[cluster](res/cluster.md) (abc1234, 2030-01-02)"]
    with pytest.raises(RenderError, match="one results file"):
        re_.KINDS["cluster"](res, ["a", "b"], "")


def test_cluster_tail_is_a_max_when_a_round_has_under_200_samples():
    data = _cluster_data(n=100)
    f = re_.cluster_figures(data)
    assert f.tail_label == "max"
    assert "| light-load TTFT max, ms (per round; < 200 samples, no p99) |" \
        in re_.cluster_table(data)
    md = re_.cluster_report(data)
    assert "| 0 | 1 | 1-node | 3,000 | 0.50 | 2.00 | max=30.00 | 100 |" in md
    assert f.per_variant["ttft_tail"]["1-node"].median == 30.0  # every round's max


def test_cluster_failed_round_gives_no_ratio(tmp_path):
    data = _cluster_data(failed_rep=2)
    f = re_.cluster_figures(data)
    assert f.ratios["throughput"].n == 2 and (f.pairs, f.reps) == (2, 3)
    assert f.per_variant["throughput"]["1-node"].n == 3  # its own figure keeps rep 2
    res = _results(tmp_path, "cluster", data, re_.cluster_report)
    assert "2 of 3 rounds (a side failed in the others)" in \
        re_.SUMMARY_ROWS["cluster-cost"](res)[0]
    assert "- 3-node rep 2: TimeoutError()" in (tmp_path / "cluster.md").read_text()


def test_results_json_carries_the_run_metadata_and_raw_numbers(tmp_path):
    _results(tmp_path, "cluster", _cluster_data(), re_.cluster_report)
    doc = json.loads((tmp_path / "cluster.json").read_text())
    assert doc["meta"]["commit"] == "abc1234" and doc["meta"]["machine"] == "test"
    assert len(doc["data"]["records"][0]["metrics"]["ttft_ms"]) == 200
