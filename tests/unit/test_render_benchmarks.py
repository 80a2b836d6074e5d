"""bench/render_benchmarks.py: BENCHMARKS.md's generated tables agree with bench/results,
and the renderers on small synthetic results files."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import pytest

from bench import render_benchmarks as rb
from bench.harness import RunRecord
from bench.preemption_report import report as preemption_report
from bench.render_common import (
    RenderError,
    Results,
    digits_for,
    failed_run_lines,
    fmt_sig,
    fmt_sum,
    measured_records,
    one_stem,
    table,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_benchmarks_md_is_up_to_date_with_the_results_files(capsys):
    """The --check path: fails with the diff when a results file changed and nobody ran
    `python bench/render_benchmarks.py`, or a generated table was edited by hand."""
    rc = rb.main(["--check", "--doc", str(ROOT / "BENCHMARKS.md"),
                  "--results", str(ROOT / "bench" / "results")])
    out = capsys.readouterr()
    assert rc == 0, out.out + out.err
    assert len(rb.blocks((ROOT / "BENCHMARKS.md").read_text())) >= 7


# --- synthetic results files ------------------------------------------------------------


def _probe(ms: float, censored: bool = False) -> dict:
    return {"ttft_ms": ms, "censored": censored, "queue_ms": 0.0, "worker_ms": ms / 2,
            "preempted_for": False, "error": None, "n_out": 20, "request_id": "r"}


def _preemption_doc(during: dict[str, list[list[float]]], alone: list[float]) -> dict:
    """A bench/preemption.py JSON: scenario `light` only, one record per (variant, rep)."""
    records, pos = [], 0
    reps = max(len(v) for v in during.values())
    for rep in range(reps):
        for variant, per_rep in during.items():
            metrics = {"light": {"probes": [_probe(x) for x in per_rep[rep]],
                                 "preempted_events": 20, "probe_window_s": 10.0,
                                 "publish_s": 1.5}}
            if rep == 0:
                metrics["alone_L"] = {"probes": [_probe(x) for x in alone]}
            records.append({"variant": variant, "rep": rep, "position": pos,
                            "metrics": metrics, "error": None, "elapsed_s": 1.0})
            pos += 1
    return {"meta": {"command": "python bench/preemption.py", "commit": "abc1234",
                     "date_utc": "2030-01-02T03:04:05Z", "machine": "test"},
            "data": {"args": {"burst": 100, "tier_burst": 50, "light_out": [16, 48],
                              "probe_interval_s": 0.1},
                     "notes": [], "wall_s": 1.0, "records": records}}


def _write(tmp_path: Path, stem: str, doc: dict) -> None:
    (tmp_path / f"{stem}.json").write_text(json.dumps(doc))


def _render(tmp_path: Path, body: str) -> str:
    return rb.render(body, Results(tmp_path, "res"))


def test_isolation_table_from_a_synthetic_run(tmp_path):
    # drr+preempt: alone max 20 ms; during max 60 ms (too few samples for a p99) -> 3.0x.
    _write(tmp_path, "iso", _preemption_doc(
        {"drr": [[100, 200, 400]], "drr+preempt": [[30, 40, 60]]}, [10, 10, 10, 10, 20]))
    doc = ("intro prose\n\n<!-- generated: preemption-isolation iso light -->\n"
           "<!-- /generated -->\n\nmore prose\n")
    out = _render(tmp_path, doc)
    assert out.startswith("intro prose\n\n<!-- generated: preemption-isolation iso light -->\n")
    assert out.endswith("<!-- /generated -->\n\nmore prose\n")
    assert "[`iso.json`](res/iso.json) (commit abc1234, 2030-01-02T03:04:05Z)" in out
    row = next(line for line in out.splitlines() if line.startswith("| light neighbour"))
    assert row == ("| light neighbour: L (16–48-token outputs) probes behind A's 100 burst | "
                   "10.0 / max=20.0 | 40.0 | max=60.0 | **3.00** | 20.0 | ≤ 1.5 — **missed** |")
    assert _render(tmp_path, out) == out  # idempotent


def test_the_rendered_ratio_is_the_one_the_bench_report_prints(tmp_path):
    doc = _preemption_doc({"drr+preempt": [[30, 40, 60], [30, 40, 45]]}, [10, 20])
    _write(tmp_path, "iso", doc)
    out = _render(tmp_path, "<!-- generated: preemption-isolation iso light -->\n"
                            "<!-- /generated -->\n")
    # tails 60 and 45 ms over the alone tail 20 ms (max: too few samples for a p99)
    assert "| **2.62 (2.25–3.00)** |" in out
    records = [RunRecord(**r) for r in doc["data"]["records"]]
    args = argparse.Namespace(burst=100, tier_burst=50, light_out=[16, 48], probe_interval_s=0.1,
                              workers=2, max_num_seqs=32, prefetch_seqs=4, time_scale=1.0,
                              quantum=0.0, preempt_after_ms=None, min_run_ms=1000, max_per_s=20,
                              reps=2, variants="drr+preempt", alone_reps=1, probe_s=10,
                              alone_s=10, outstanding=10, warmup_s=1, window_s=10, quick=False)
    md = preemption_report(records, args, [], 1.0)
    assert "| **2.62 (2.25–3.00)** |" in md


def _backlogged(tps: float, shares: tuple[float, float, float], recomputed: float) -> dict:
    return {"tok_per_s": tps, "shares": dict(zip(("w1", "w2", "w4"), shares, strict=True)),
            "target": {"w1": 1 / 7, "w2": 2 / 7, "w4": 4 / 7}, "recomputed_pct": recomputed,
            "preemptions_per_s": 0.5, "errors": []}


def test_targets_table_checks_drr_preempt_against_the_targets(tmp_path):
    doc = _preemption_doc({"fifo": [[1000, 2000]], "drr+preempt": [[30, 40, 60]]}, [10, 20])
    for r in doc["data"]["records"]:
        r["metrics"]["backlogged"] = (
            _backlogged(1000.0, (1 / 3, 1 / 3, 1 / 3), 0.0) if r["variant"] == "fifo"
            else _backlogged(980.0, (0.15, 2 / 7, 4 / 7 - 0.15 + 1 / 7), 3.0))
    _write(tmp_path, "pre", doc)
    out = _render(tmp_path, "<!-- generated: preemption-targets pre -->\n<!-- /generated -->\n")
    lines = {line.split(" | ")[0]: line for line in out.splitlines() if line.startswith("| ")}
    light = lines["| light neighbour: L (16–48-token outputs) probes behind A's 100 burst, p99 "
                  "during ÷ alone"]
    assert "**3.00×**; p50 40.0 ms vs 15.0 alone; fifo 100×" in light and "**missed**" in light
    assert lines["| throughput with preemption ÷ fifo (backlogged 1:2:4)"].endswith(
        "| **0.980** | ≥ 0.97 | met |")
    assert lines["| recomputed tokens ÷ generated (backlogged)"].endswith(
        "| **3.00%**, 0.50 preemptions/s | ≤ 2% | **missed** |")
    assert "| 5.0% | ≤ 2% | **missed** |" in lines[
        "| 1:2:4 weighted shares, max relative error, preemption on"]


def test_shares_table_reports_token_and_dispatched_cost_errors_and_dry_tenants(tmp_path):
    from bench.render_preemption import summary_shares
    doc = _preemption_doc({"fifo": [[1000]], "drr": [[300]], "drr+preempt": [[30]]}, [10])
    for r in doc["data"]["records"]:
        r["metrics"] = {"backlogged": (
            _backlogged(1000.0, (1 / 3, 1 / 3, 1 / 3), 0.0) if r["variant"] == "fifo"
            else _backlogged(990.0, (0.15, 2 / 7, 4 / 7 - 0.15 + 1 / 7), 1.0))}
        b = r["metrics"]["backlogged"]
        # DRR charged 1:2:4 exactly; w4's queue was seen empty in the fifo run only.
        b["prom_delta"] = {"dispatched_cost/w1": 100.0, "dispatched_cost/w2": 200.0,
                           "dispatched_cost/w4": 400.0}
        b["min_queue_depth"] = {"w1": 5, "w2": 5, "w4": 0 if r["variant"] == "fifo" else 3}
    _write(tmp_path, "preemption_shares", doc)
    out = _render(tmp_path, "<!-- generated: preemption-shares preemption_shares -->\n"
                            "<!-- /generated -->\n")
    rows = {line.split(" | ")[0]: line for line in out.splitlines() if line.startswith("| ")}
    pre = rows["| drr+preempt"]
    assert "| 0.150 / 0.286 / 0.564 | **5.0%** | 0.0% | 0.990 |" in pre and pre.endswith("| yes |")
    assert rows["| fifo"].endswith("| ran dry: w4 |")
    row = summary_shares(Results(tmp_path, "res"))
    assert row[1].startswith("**5.0%** (drr 5.0%)") and "drr's dispatched cost: 0.0%" in row[1]
    assert row[2] == "≤ 2% — missed"


def _chaos_run(name: str, rep: int = 0, **kw) -> dict:
    run = {"scenario": name, "rep": rep, "fault": f"{name} fault", "submitted": 10,
           "completed": 10, "failed": {}, "lost": 0, "generated_twice": 0,
           "failed_but_billed": 0, "wrongly_failed": 0, "ok": True, "library_resumes": 0,
           "params": {"num_requests": 10}, "recovery_s": {"fault_to_next_started": 0.5,
                                                          "fault_to_all_answered": 9.0},
           "extra": {}, "checks": [{"name": "0 lost", "target": "0", "value": 0, "ok": True}]}
    run.update(kw)
    return run


def _chaos_doc(results: dict) -> dict:
    return {"command": "python bench/chaos.py", "commit": "def5678", "date": "2030-01-02 03:04 UTC",
            "machine": "test", "results": results}


def test_chaos_scenarios_table(tmp_path):
    told = [{"name": "victims' clients told (worker_lost or resumed) within 2 heartbeats",
             "target": "<= 2.0 s", "value": 0.5, "ok": True}]
    _write(tmp_path, "chaos", _chaos_doc({
        "worker_restart": [_chaos_run("worker_restart", recovery_s={"victims_told_max": 0.9,
                                                                    "victims_answered_max": 3.0},
                                      checks=told)],
        "something_new": [_chaos_run("something_new", completed=7, failed={"internal": 3},
                                     wrongly_failed=1)],
        "crashed": [{"scenario": "crashed", "rep": 0, "error": "Traceback ..."}],
    }))
    _write(tmp_path, "again", _chaos_doc({"worker_restart": [
        _chaos_run("worker_restart", rep=i, recovery_s={"victims_told_max": x,
                                                        "victims_answered_max": 2.0},
                   checks=told) for i, x in enumerate((0.4, 0.6, 0.5))]}))
    out = _render(tmp_path, "<!-- generated: chaos-scenarios chaos again -->\n<!-- /generated -->\n")
    rows = [line for line in out.splitlines() if line.startswith("| `") or "error" in line]
    assert rows[0] == ("| `worker_restart`: worker_restart fault | 10/10; again, 3 runs: 30/30 | 0 "
                       "| 0 | 0 | 0 | its clients told (and resumed elsewhere) **0.50 s "
                       "(0.40–0.60)** after the kill, 3 runs (target <= 2.0 s); their answers "
                       "complete 2 s after |")
    assert rows[1] == ("| `something_new`: something_new fault | 7/10 (3 `internal`) | 0 | 0 | 0 "
                       "| 1 | next Started 0.50 s after the fault, all answered 9 s after |")
    assert rows[2].startswith("| `crashed` | error: no run finished |")


def test_chaos_partition_table(tmp_path):
    extra = {"cut_node": "n3", "role": "leader", "leader_during": "n1", "caught_up_s": 0.2,
             "fault_to_first_new_dispatch_s": 12.34,
             "connections_on_cut_node": ["fairlane-dispatcher-default", "gpu_worker:worker-1"]}
    checks = [{"name": "n3's FL_REQUESTS and FL_USAGE state equals the other nodes'",
               "target": "equal", "value": {}, "ok": True}]
    _write(tmp_path, "part", _chaos_doc({"nats_partition_leader": [
        _chaos_run("nats_partition_leader", extra=extra, checks=checks,
                   finished_attempt_resumed=4)]}))
    out = _render(tmp_path, "<!-- generated: chaos-partition part -->\n<!-- /generated -->\n")
    assert "| run | on `n3` when cut |" in out
    assert ("| leader 1 | dispatcher, worker-1 | 10 | 0 | 0 | 0 | 0 | 4 | n1 | 12.3 s | 0.20 s "
            "| yes |") in out


def _churn_doc(sweep: bool, loads: list[int]) -> dict:
    cps = [{"tenants_arrived": n, "tenant_loads": lo, "policy_states": lo // 2,
            "policy_states_in_debt": 1, "tenant_label_sets": 3 * lo, "rss_mib": 50.4,
            "pass_ms": [1.0, 2.0, 3.0], "snapshot_ms": [5.0], "render_ms": [150.0, 160.0],
            "render_bytes": 3 * 2**20}
           for n, lo in zip((1_000, 10_000, 20_000), loads, strict=True)]
    return {"meta": {"command": "c", "commit": "c0ffee1", "date_utc": "2030-01-01T00:00:00Z",
                     "machine": "m"},
            "data": {"runs": [{"policy": "drr", "has_idle_sweep": sweep, "checkpoints": cps,
                               "wall_s": 1.0}]}}


def test_tenant_churn_table_labels_before_and_after(tmp_path):
    _write(tmp_path, "old", _churn_doc(False, [1_000, 10_000, 20_000]))
    _write(tmp_path, "new", _churn_doc(True, [1_000, 600, 600]))
    out = _render(tmp_path, "<!-- generated: tenant-churn drr old new -->\n<!-- /generated -->\n")
    assert "| before: 20,000 | 20,000 | 10,000 (1) | 60,000 | 50 | **2.00 (1.00–3.00)** | 5.00 " \
           "| **155 (150–160)** | **3.00 MiB** |" in out
    assert "| after: 10,000 | 600 | 300 (1) | 1,800 | 50 | 2.00 (1.00–3.00) |" in out
    with pytest.raises(RenderError, match="no run of policy 'vtc'"):
        _render(tmp_path, "<!-- generated: tenant-churn vtc old -->\n<!-- /generated -->\n")


def test_summary_keeps_typed_rows_and_generates_keyed_ones(tmp_path, monkeypatch):
    monkeypatch.setitem(rb.SUMMARY_ROWS, "demo", lambda res: ["claim", "1.0×", "≤ 2", "[f](f.md)"])
    typed = "| old claim | 5 | — | [x](x.md) (typed: no JSON results file) |"
    doc = ("<!-- generated: summary -->\n| claim | measured | target | file |\n|---|---|---|---|\n"
           f"{typed}\n| <!-- row:demo --> stale text | 9 | 9 | 9 |\n<!-- /generated -->\n")
    out = _render(tmp_path, doc)
    assert typed in out
    assert "| <!-- row:demo --> claim | 1.0× | ≤ 2 | [f](f.md) |" in out
    assert out.index(typed) < out.index("row:demo")
    with pytest.raises(RenderError, match="neither generated"):
        _render(tmp_path, doc.replace(" (typed: no JSON results file)", ""))
    with pytest.raises(RenderError, match="unknown Summary row key"):
        _render(tmp_path, doc.replace("row:demo", "row:nope"))


@pytest.mark.parametrize("doc, match", [
    ("<!-- generated: nope x -->\n<!-- /generated -->\n", "unknown kind"),
    ("<!-- generated: chaos-cluster a -->\ntext\n", "never closed"),
    ("<!-- /generated -->\n", "without a generated block open"),
    ("<!-- generated: chaos-cluster a -->\n<!-- generated: chaos-cluster b -->\n"
     "<!-- /generated -->\n", "opens inside"),
    ("<!-- generated: chaos-cluster missing -->\n<!-- /generated -->\n", "no results file"),
])
def test_marker_and_source_errors(tmp_path, doc, match):
    with pytest.raises(RenderError, match=match):
        _render(tmp_path, doc)


def test_main_rewrites_then_check_passes_and_a_hand_edit_fails(tmp_path, capsys):
    _write(tmp_path, "part", _chaos_doc({"nats_partition_follower": [
        _chaos_run("nats_partition_follower", extra={"role": "follower", "cut_node": "n2"})]}))
    md = tmp_path / "B.md"
    md.write_text("# B\n\n<!-- generated: chaos-partition part -->\n<!-- /generated -->\n\nend\n")
    args = ["--doc", str(md), "--results", str(tmp_path)]
    assert rb.main(["--check", *args]) == 1  # empty block: stale
    assert rb.main(args) == 0
    assert rb.main(["--check", *args]) == 0
    md.write_text(md.read_text().replace("| follower 1 |", "| follower 9 |"))
    capsys.readouterr()
    assert rb.main(["--check", *args]) == 1
    assert "-| follower 9 |" in capsys.readouterr().out
    md.write_text("<!-- generated: nope -->\n<!-- /generated -->\n")
    assert rb.main(["--check", *args]) == 2


def test_number_formatting():
    assert [digits_for(x) for x in (0.5, 9.99, 10.0, 99.9, 100.0, -250.0)] == [2, 2, 1, 1, 0, 0]
    assert fmt_sig(1234.5) == "1,234" and fmt_sig(None) == "n/a" and fmt_sig(0.5, "×") == "0.50×"
    assert fmt_sum([1.0, 2.0, 4.0], "×") == "2.00× (1.00–4.00)"
    assert fmt_sum([]) == "n/a" and fmt_sum([0.9871, 1.0], digits=3) == "0.994 (0.987–1.000)"
    assert table(["a", "b"], "lr", [["x|y", 1]]) == "| a | b |\n|---|---:|\n| x\\|y | 1 |"


def test_render_common_one_results_file_and_measured_records():
    with pytest.raises(RenderError, match="path takes one results file"):
        one_stem("path", ["a", "b"])
    assert one_stem("path", ["a"]) == "a"
    ok, bad = RunRecord("x", 0, 0, {}), RunRecord("y", 0, 1, {}, "boom")
    data = {"records": [asdict(ok), asdict(bad)], "warmup": [asdict(bad)]}
    assert [r.variant for r in measured_records(data, "s", ["x"])] == ["x", "y"]
    with pytest.raises(RenderError, match=r"s.json has no successful run of \['y'\]"):
        measured_records(data, "s", ["x", "y"])
    with pytest.raises(RenderError, match="s.json has no successful run"):
        measured_records({"records": [asdict(bad)]}, "s")
    assert failed_run_lines({"records": [asdict(ok)]}) == []
    assert failed_run_lines(data)[-2:] == ["- y rep 0: boom", "- y rep 0: boom"]
