"""The simulator's statistics (fleetsim.recorder) and its report (report.py)."""

from __future__ import annotations

import json
import math
import sys
import tracemalloc

import numpy as np
import pytest

from fleetsim.histogram import QUANTILES, LogHist, min_samples
from fleetsim.recorder import Recorder
from fleetsim.records import TenantTable
from fleetsim.report import compare_table, fmt_quantile, write_report

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

TIERS = ["enterprise", "pro", "free"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def table(n: int, tiers: list[str] = TIERS) -> TenantTable:
    t = TenantTable(tiers=list(tiers))
    for i in range(n):
        t.add(f"t{i}", i % len(tiers))
    return t


def finish(rec: Recorder, tenant: int, t_s: float, ttft_s: float, e2e_s: float,
           output_tokens: int = 10, preemptions: int = 0) -> None:
    """One whole request as the fleet reports it."""
    rec.on_first_token(tenant, t_s - e2e_s + ttft_s, ttft_s)
    rec.on_tokens(tenant, t_s - e2e_s + ttft_s, t_s, output_tokens)
    rec.on_finished(tenant, t_s, e2e_s, ttft_s, output_tokens, preemptions)


# --- percentiles --------------------------------------------------------------------------


@pytest.mark.parametrize("growth", [1.01, 1.05])
def test_percentiles_from_histogram_within_a_bucket_of_numpy(growth):
    rng = np.random.default_rng(7)
    values_s = rng.lognormal(mean=math.log(0.05), sigma=1.2, size=200_000)
    h = LogHist(1, 1e-4, 3600.0, growth)
    h.add(np.zeros(len(values_s), dtype=np.int64), values_s)
    stats = h.stats(0)
    assert stats["n"] == len(values_s)
    assert stats["max"] == values_s.max() and stats["min"] == values_s.min()
    assert stats["mean"] == pytest.approx(values_s.mean())
    for name, q in QUANTILES.items():
        exact = float(np.percentile(values_s, 100 * q))
        assert abs(stats[name] / exact - 1) <= growth - 1, (name, stats[name], exact)


def test_recorder_percentiles_per_tier_pool_and_detail_tenant():
    rng = np.random.default_rng(3)
    n = 20_000
    ttft_s = rng.lognormal(math.log(0.2), 1.0, n)
    tenants = rng.integers(0, 6, n)
    rec = Recorder(table(6), duration_s=100.0, max_tenant_detail=6, flush_every=4096)
    for i in range(n):
        finish(rec, int(tenants[i]), 1.0 + i * 0.005, float(ttft_s[i]), float(ttft_s[i]) + 0.5)
    s = rec.summary()
    exact = float(np.percentile(ttft_s, 99))
    assert abs(s["pool"]["ttft_s"]["p99"] / exact - 1) <= 0.01
    tier0 = ttft_s[tenants % 3 == 0]
    assert s["by_tier"]["enterprise"]["ttft_s"]["n"] == len(tier0)
    assert abs(s["by_tier"]["enterprise"]["ttft_s"]["p50"] / np.median(tier0) - 1) <= 0.01
    t4 = ttft_s[tenants == 4]
    assert abs(s["detail_tenants"]["t4"]["ttft_s"]["p90"] / np.percentile(t4, 90) - 1) <= 0.05
    # TPOT = (e2e - ttft) / (tokens - 1) = 0.5 / 9 for every request.
    assert s["pool"]["tpot_s"]["p50"] == pytest.approx(0.5 / 9, rel=1e-6)


def test_tail_needs_enough_samples_else_max():
    assert min_samples(0.99) == 200 and min_samples(0.999) == 2000 and min_samples(0.5) == 1
    h = LogHist(2, 1e-4, 3600.0, 1.01)
    h.add(np.zeros(199, dtype=np.int64), np.linspace(0.01, 1.99, 199))
    h.add(np.ones(200, dtype=np.int64), np.linspace(0.01, 2.0, 200))
    few, enough = h.stats(0), h.stats(1)
    assert few["p99"] is None and few["p50"] is not None
    assert enough["p99"] is not None and enough["p999"] is None
    assert fmt_quantile(few, "p99", 1e3) == "max=1,990.0"
    assert not fmt_quantile(enough, "p99", 1e3).startswith("max=")
    assert fmt_quantile({"n": 0}, "p99") == "n/a"


def test_one_token_answers_have_no_tpot_and_bad_values_are_skipped():
    rec = Recorder(table(3), duration_s=10.0)
    rec.on_finished(0, 1.0, 0.5, 0.5, 1, 0)
    rec.on_first_token(1, 1.0, math.nan)
    s = rec.summary()
    assert s["pool"]["finished"] == 1
    assert s["pool"]["tpot_s"]["n"] == 0 and s["pool"]["ttft_s"]["n"] == 0
    assert s["pool"]["e2e_s"]["n"] == 1


# --- tokens, shares, counters ---------------------------------------------------------------


def test_tokens_spread_evenly_across_windows():
    rec = Recorder(table(3), duration_s=40.0, window_s=10.0)
    rec.on_tokens(0, 5.0, 25.0, 20)  # 5 s, 10 s and 5 s in windows 0, 1 and 2
    rec.on_tokens(1, 12.0, 12.0, 7)  # an instant lands whole in its window
    w = rec.summary()["windows"]
    assert w["tokens_by_tier"]["enterprise"] == pytest.approx([5.0, 10.0, 5.0, 0.0])
    assert w["tokens_by_tier"]["pro"] == pytest.approx([0.0, 7.0, 0.0, 0.0])
    assert w["throughput_tok_s"] == pytest.approx([0.5, 1.7, 0.5, 0.0])


def test_token_spreading_conserves_tokens_and_grows_past_duration():
    rng = np.random.default_rng(11)
    rec = Recorder(table(30), duration_s=100.0, window_s=7.0, flush_every=1000)
    total = 0
    for _ in range(5000):
        start = float(rng.uniform(0, 140))  # some past duration_s: the windows grow
        n = int(rng.integers(1, 500))
        rec.on_tokens(int(rng.integers(0, 30)), start, start + float(rng.exponential(20)), n)
        total += n
    s = rec.summary()
    by_tier = s["windows"]["tokens_by_tier"]
    assert sum(sum(v) for v in by_tier.values()) == pytest.approx(total)
    assert s["pool"]["tokens_generated"] == pytest.approx(total)
    assert len(s["windows"]["start_s"]) > math.ceil(100 / 7)


def test_shares_sum_to_one_in_every_window_with_traffic():
    rng = np.random.default_rng(5)
    rec = Recorder(table(9), duration_s=100.0, window_s=10.0, max_tenant_detail=9)
    for _ in range(3000):
        start = float(rng.uniform(0, 60))  # windows 6..9 stay empty
        rec.on_tokens(int(rng.integers(0, 9)), start, min(start + 3.0, 59.9), 30)
    shares = rec.shares_by_window()
    sums = shares.sum(axis=1)
    assert sums[:6] == pytest.approx(np.ones(6))
    assert sums[6:] == pytest.approx(np.zeros(4))
    s = rec.summary()
    per_tenant = np.array(list(s["windows"]["share_by_tenant"].values())).sum(axis=0)
    assert per_tenant[:6] == pytest.approx(np.ones(6))  # all 9 tenants are detail tenants
    assert sum(s["by_tier"][t]["share"] for t in TIERS) == pytest.approx(1.0)


def test_counters_rejections_and_preemptions_per_tier_and_tenant():
    rec = Recorder(table(6), duration_s=10.0, max_tenant_detail=2, detail_tenants=["t5"])
    for i in range(6):
        finish(rec, i, 5.0, 0.1, 1.0, output_tokens=10 + i, preemptions=i % 2)
    rec.on_rejected(0, 1.0, "throttled")
    rec.on_rejected(3, 1.0, "queue_full")
    rec.on_rejected(3, 2.0, "queue_full")
    rec.on_rejected(5, 2.0, "throttled")
    rec.on_preempted(5, 3.0)
    rec.on_recomputed(5, 3.5, 30)  # resumed, then KV-preempted and admitted again
    rec.on_recomputed(5, 4.0, 10)
    s = rec.summary()
    ent = s["by_tier"]["enterprise"]  # t0, t3
    assert ent["finished"] == 2 and ent["output_tokens"] == 10 + 13
    assert ent["rejected"] == 3 and ent["rejected_by_code"] == {"throttled": 1, "queue_full": 2}
    assert s["pool"]["rejected_by_code"] == {"throttled": 2, "queue_full": 2}
    assert s["pool"]["preempted_requests"] == 3  # t1, t3, t5 were preempted once each
    assert list(s["detail_tenants"]) == ["t5", "t3"]  # named first, then the busiest
    t5 = s["detail_tenants"]["t5"]
    assert (t5["preemptions"], t5["recomputed_tokens"], t5["tier"]) == (1, 40, "free")
    assert t5["rejected_by_code"] == {"throttled": 1}
    assert s["top_tenants"][0]["finished"] == 1 and len(s["top_tenants"]) == 6


def test_detail_slots_go_to_named_then_busiest_tenants():
    rec = Recorder(table(100), duration_s=10.0, max_tenant_detail=3, detail_tenants=["t42"])
    for i in range(100):
        for _ in range(1 + (i == 7) * 50 + (i == 9) * 20):
            finish(rec, i, 5.0, 0.1, 1.0)
    assert list(rec.summary()["detail_tenants"]) == ["t42", "t7", "t9"]
    with pytest.raises(ValueError, match="not in the tenant table"):
        Recorder(table(3), duration_s=1.0, detail_tenants=["nobody"])


def test_samples_are_downsampled_to_the_point_budget():
    rec = Recorder(table(3), duration_s=100.0, max_sample_points=50)
    for i in range(30_000):  # every 10 ms for 300 s: three times the duration
        rec.sample(i * 0.01, [1, 2, i % 2 * 6], running=10, busy_workers=4)
    s = rec.summary()["samples"]
    assert 0 < len(s["t_s"]) <= 50
    assert s["queued_by_tier"]["pro"] == pytest.approx([2.0] * len(s["t_s"]))
    assert s["queued_by_tier"]["free"] == pytest.approx([3.0] * len(s["t_s"]))
    assert s["t_s"] == sorted(s["t_s"]) and s["t_s"][-1] > 290
    assert set(s["running"]) == {10.0} and set(s["busy_workers"]) == {4.0}


# --- memory and serialisation ---------------------------------------------------------------

MEMORY_BOUND_BYTES = 64 * 2**20


@pytest.mark.timeout(180)
def test_memory_is_bounded_and_independent_of_request_count():
    """1,000,000 finished requests over 100,000 tenants: the peak traced memory stays
    under MEMORY_BOUND_BYTES (~30 MB measured: per-tenant arrays of 100,000 + the
    batch buffers), and the second 800,000 requests add next to nothing."""
    tenants = table(100_000)  # the caller's, not the recorder's: made before tracing
    tracemalloc.start()
    try:
        rec = Recorder(tenants, duration_s=3600.0)
        for i in range(200_000):
            rec.on_finished((i * 7919) % 100_000, i * 0.0036, 1.0 + i % 97 * 0.01,
                            0.01 + i % 89 * 0.001, 50 + i % 13, i % 5 == 0)
        rec.flush()
        after_200k, _ = tracemalloc.get_traced_memory()
        for i in range(200_000, 1_000_000):
            rec.on_finished((i * 7919) % 100_000, i * 0.0036, 1.0 + i % 97 * 0.01,
                            0.01 + i % 89 * 0.001, 50 + i % 13, i % 5 == 0)
        summary = rec.summary()
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert summary["pool"]["finished"] == 1_000_000
    assert peak < MEMORY_BOUND_BYTES, f"peak {peak / 2**20:.1f} MiB"
    assert current - after_200k < 4 * 2**20, "memory grew with the number of requests"


def test_summary_is_json_serialisable():
    rec = Recorder(table(12), duration_s=30.0, max_tenant_detail=4)
    rec.summary()  # empty: no NaN, no numpy types
    for i in range(500):
        finish(rec, i % 12, 1.0 + i * 0.05, 0.02 + (i % 7) * 0.01, 0.8)
        rec.sample(i * 0.05, [i % 3, 0, 1], running=5, busy_workers=2)
    rec.on_rejected(3, 2.0, "throttled")
    s = rec.summary()
    assert json.loads(json.dumps(s, allow_nan=False)) == s
    assert json.dumps(Recorder(table(2), duration_s=1.0).summary(), allow_nan=False)


# --- report --------------------------------------------------------------------------------


def small_summary() -> dict:
    rng = np.random.default_rng(2)
    rec = Recorder(table(20), duration_s=60.0, window_s=5.0, max_tenant_detail=4)
    for i in range(3000):
        t_s = 1.0 + i * 0.02
        finish(rec, int(rng.integers(0, 20)), t_s, float(rng.lognormal(-3, 1)), 1.0 + t_s / 60,
               output_tokens=int(rng.integers(2, 100)))
        if i % 10 == 0:
            rec.sample(t_s, [i % 5, i % 3, i % 7], running=20, busy_workers=3)
    rec.on_rejected(2, 3.0, "queue_full")
    return rec.summary()


def test_write_report_writes_markdown_json_and_three_pngs(tmp_path):
    summary = small_summary()
    paths = write_report(summary, tmp_path / "out", title="sim test",
                         command="fairlane simulate --workers 3",
                         extra_meta={"workers": 3, "wall_s": 2.0})
    names = sorted(p.name for p in paths)
    assert names == sorted(["simulate.md", "simulate.json", "shares.png", "ttft_cdf.png",
                            "queue_depth.png"])
    for p in paths:
        assert p.parent == tmp_path / "out" and p.stat().st_size > 0
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == PNG_SIGNATURE
    md = (tmp_path / "out" / "simulate.md").read_text()
    assert md.startswith("# sim test\n")
    for line in ("- command: `fairlane simulate --workers 3`", "- commit: ", "- date (UTC): ",
                 "- machine: ", "## Per tier", "## Detail tenants", "| **all** |",
                 f"| sim seconds per wall second | {summary['end_s'] / 2.0:,.2f} |",
                 "![shares](shares.png)"):
        assert line in md, line
    data = json.loads((tmp_path / "out" / "simulate.json").read_text())
    assert data["summary"] == summary
    assert data["meta"]["workers"] == 3 and data["meta"]["command"].startswith("fairlane")


def test_write_report_without_matplotlib(tmp_path, monkeypatch):
    summary = small_summary()
    paths = write_report(summary, tmp_path, command="x", plots=False)
    assert [p.name for p in paths] == ["simulate.md", "simulate.json"]
    assert "## Plots" not in paths[0].read_text()
    for mod in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(RuntimeError, match=r"fairlane\[sim\]"):
        write_report(summary, tmp_path / "p", command="x")
    assert (tmp_path / "p" / "simulate.md").exists()  # written before the plots


def test_compare_table_keeps_column_order_and_right_aligns_numbers():
    rows = [{"variant": "drr", "p99 ms": 12.345, "requests": 1200, "tail": "max=3.0"},
            {"variant": "fifo", "p99 ms": None, "requests": 5, "note": "a|b"}]
    md = compare_table(rows)
    lines = md.splitlines()
    assert lines[0] == "| variant | p99 ms | requests | tail | note |"
    assert lines[1] == "|---|---:|---:|---:|---|"
    assert lines[2] == "| drr | 12.35 | 1,200 | max=3.0 | n/a |"
    assert lines[3] == "| fifo | n/a | 5 | n/a | a\\|b |"
    assert compare_table(rows, columns=["requests", "variant"], digits=0).splitlines()[0] \
        == "| requests | variant |"


@pytest.mark.parametrize(("duration_s", "window_s", "message"), [
    (float("nan"), 10.0, "must be finite numbers > 0, got nan and 10"),
    (60.0, float("inf"), "must be finite numbers > 0, got 60 and inf"),
    (60.0, 0.0, "must be finite numbers > 0, got 60 and 0"),
    # The window tables would be 3.6e7 rows x (tiers + 64) doubles: refused up front.
    (3600.0, 1e-4, r"36,000,000 windows, more than 100,000: use a window of at least 0\.0361 s"),
    # 3600 / 0.036 is 100,000.00000000001 in floating point: 100,001 rows.
    (3600.0, 0.036, "100,001 windows"),
])
def test_windows_the_recorder_cannot_hold_are_refused(duration_s, window_s, message):
    with pytest.raises(ValueError, match=message):
        Recorder(table(3), duration_s, window_s)
    Recorder(table(3), 3600.0, 0.0361)  # what the message proposes fits
