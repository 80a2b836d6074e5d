"""bench/fidelity.py and bench/render_fidelity.py: the per-run numbers, the sim/real
comparison (relative errors, verdicts, p99 vs max by sample count) and the renderer,
on small hand-made inputs."""

from __future__ import annotations

import json
import math

import pytest

from bench.fidelity import (
    Bench,
    client_legs_from,
    fleet_settings,
    idle_probes,
    network_ms_from,
    parse_args,
    scenarios_of,
    sim_idle_ttft_ms,
    variants_of,
)
from bench.fidelity_load import Live, LoadGen, prompt_of
from bench.fidelity_obs import Observations, class_metrics, metrics_of, split_metrics
from bench.fidelity_real import cpu_usage, tenants_doc
from bench.fidelity_scenarios import SCENARIOS, load_scenario, scaled_doc
from bench.harness import summarize
from bench.render_common import RenderError, Results
from bench.render_fidelity import (
    compare,
    fidelity_sizes,
    fidelity_split,
    fidelity_table,
    fleet_sizes,
    headline,
    rel_err,
    report,
    split_table,
    summary_fidelity,
    summary_fidelity_workers,
    tail_label,
    verdict,
)
from fairlane.protocol import InferenceRequest, Usage
from fairlane.validation import estimate_prompt_tokens
from fleetsim.records import Arrival

pytestmark = pytest.mark.unit


# --- comparison -------------------------------------------------------------------------


def test_rel_err_is_relative_to_the_real_fleet():
    assert rel_err(110.0, 100.0) == pytest.approx(0.10)
    assert rel_err(90.0, 100.0) == pytest.approx(-0.10)
    assert math.isnan(rel_err(5.0, 0.0))
    assert math.isnan(rel_err(None, 100.0))
    assert math.isnan(rel_err(5.0, math.nan))


def test_verdict_judges_the_median_error_against_ten_percent():
    assert verdict(summarize([0.02, 0.10, -0.30])) == "met"  # median 0.02: the range may not
    assert verdict(summarize([-0.10])) == "met"
    assert verdict(summarize([-0.1001])) == "missed"
    assert verdict(summarize([0.12, 0.15, 0.01])) == "missed"
    assert verdict(summarize([math.nan])) == "n/a"


def test_tail_is_a_p99_only_when_every_run_has_200_samples():
    assert tail_label([200, 250, 900]) == "p99"
    assert tail_label([199, 250]) == "max"
    assert tail_label([]) == "max"


def test_metrics_report_p99_from_200_samples_and_the_max_always():
    ms = [i / 1000 for i in range(1, 201)]  # 1..200 ms
    m = metrics_of(200, ms, ms, [0.01] * 200, 1000.0, 10.0)
    assert m["ttft_p99_ms"] == pytest.approx(198.01)
    assert m["ttft_max_ms"] == pytest.approx(200.0)
    assert m["ttft_p50_ms"] == pytest.approx(100.5)
    assert m["tokens_per_s"] == pytest.approx(100.0)
    short = metrics_of(200, ms[:199], ms, [], 0.0, 10.0)
    assert short["ttft_p99_ms"] is None and short["ttft_max_ms"] == pytest.approx(199.0)
    assert short["censored"] == 1 and short["tpot_p50_ms"] is None


def test_observations_drop_the_warm_up_and_count_tokens_inside_the_window():
    obs = Observations(10.0, 20.0)
    for t in (5.0, 10.0, 19.9, 20.0):
        obs.arrival("a", t)
        obs.first_token("a", t, 0.05)
    obs.finished("a", 9.0, 3.0, 0.05, 100)  # arrived in the warm-up: not timed
    obs.finished("a", 12.0, 2.05, 0.05, 101)
    assert obs.arrived == {"a": 2} and obs.ttft_s == {"a": [0.05, 0.05]}
    assert obs.e2e_s == {"a": [2.05]} and obs.tpot_s["a"] == [pytest.approx(0.02)]
    obs.generated("a", 8.0, 12.0, 40)  # half of it inside
    obs.generated("a", 15.0, 15.0, 3)  # a real chunk: one instant
    obs.generated("a", 20.0, 20.0, 7)  # at the window's end: outside
    obs.generated("b", 0.0, 30.0, 30)  # spans the whole window: a third
    assert obs.tokens == {"a": pytest.approx(23.0), "b": pytest.approx(10.0)}
    m = class_metrics(obs, ["a", "b"])
    assert m["all"]["n_arrived"] == 2 and m["all"]["tokens_per_s"] == pytest.approx(3.3)
    assert m["b"]["ttft_p50_ms"] is None and m["b"]["tokens_per_s"] == pytest.approx(1.0)


def test_a_client_process_observations_add_up_to_one_run():
    whole, parts = Observations(10.0, 70.0), [Observations(10.0, 70.0), Observations(10.0, 70.0)]
    events = [("quiet", 12.0, 0.03, 2.0, 40), ("noisy", 20.0, 0.5, 9.0, 300),
              ("noisy", 5.0, 0.4, 8.0, 300), ("quiet", 30.0, 0.02, 1.0, 20)]
    for i, (cls, t, ttft, e2e, n) in enumerate(events):
        for obs in (whole, parts[i % 2]):
            obs.arrival(cls, t)
            obs.first_token(cls, t, ttft)
            obs.finished(cls, t, e2e, ttft, n)
            obs.generated(cls, t + ttft, t + e2e, n)
    merged = Observations(10.0, 70.0)
    for p in parts:
        merged.absorb(p)
    assert merged.arrived == whole.arrived
    for attr in ("ttft_s", "e2e_s", "tpot_s"):
        assert {k: sorted(v) for k, v in getattr(merged, attr).items()} == \
            {k: sorted(v) for k, v in getattr(whole, attr).items()}
    assert merged.tokens == pytest.approx(whole.tokens)
    with pytest.raises(ValueError):
        merged.absorb(Observations(0.0, 70.0))


def test_a_ttft_splits_into_queue_worker_and_the_messages_left_over():
    obs = Observations(10.0, 20.0)
    obs.ttft_split("a", 12.0, 0.040, 0.002, 0.030)
    obs.ttft_split("a", 5.0, 9.0, 0.0, 0.0)  # arrived in the warm-up: not counted
    other = Observations(10.0, 20.0)
    other.ttft_split("a", 15.0, 0.050, 0.0, 0.036)
    obs.absorb(other)
    m = split_metrics(obs.split_s["a"])
    assert m["n_split"] == 2 and m["queue_p50_ms"] == pytest.approx(1.0)
    assert m["worker_p50_ms"] == pytest.approx(33.0)
    assert m["messages_p50_ms"] == pytest.approx(11.0)  # (8 + 14) / 2
    assert m["messages_p99_ms"] is None  # < 200 requests: no p99
    many = split_metrics([(0.03, 0.0, 0.02)] * 250)
    assert many["messages_p99_ms"] == pytest.approx(10.0)
    assert class_metrics(obs, ["a"])["all"]["n_split"] == 2


def test_the_real_split_comes_from_usage_of_unpreempted_requests_only():
    obs = Observations(0.0, 10.0)
    gen = LoadGen(client=None, obs=obs)

    def live(t_s: float, attempt: int) -> Live:
        lv = Live("q", "t", "paid", Arrival(t_s, 0, 8, 8, 8), t_sub=100.0 + t_s,
                  t_first=100.0 + t_s + 0.030, t_done=100.0 + t_s + 0.2, num_tokens=8)
        lv.usage = Usage(request_id="r", tenant="t", pool="p", tier="paid", queue_ms=3,
                         ttft_ms=20.0, attempt=attempt)
        return lv

    gen.lives = [live(1.0, 0), live(2.0, 1)]  # the second was preempted: its usage is
    gen.report()  # its continuation's, not its first token's
    assert obs.split_s == {"q": [(pytest.approx(0.030), 0.003, 0.020)]}
    assert len(obs.ttft_s["q"]) == 2


def test_in_the_simulator_the_messages_are_network_ms():
    """Idle probes: no queue, and the one message on the way is network_ms."""
    from bench.fidelity import run_sim
    args = parse_args(["--quick"])
    wl, _ = load_scenario(SCENARIOS["light"], 2, 0)
    probes = idle_probes(4)
    obs = Observations(0.0, math.inf)
    run_sim(wl, probes, obs, fleet_settings(args, 3.0), probes[-1].t_s + 5.0)
    (split,) = obs.split_s.values()
    assert len(split) == 4
    for ttft, queue, worker in split:
        assert queue == pytest.approx(0.0, abs=1e-9)
        assert ttft - queue - worker == pytest.approx(0.003)
        assert worker > 0.005  # the prefill step, at least
    # With the clients' legs: the messages are the hop and the request's leg, the
    # dispatcher's queue still nothing.
    obs = Observations(0.0, math.inf)
    run_sim(wl, probes, obs, fleet_settings(args, 0.5, client_ms=(2.0, 4.0), seed=1),
            probes[-1].t_s + 5.0)
    (split,) = obs.split_s.values()
    msgs = {round((ttft - queue - worker) * 1000, 6) for ttft, queue, worker in split}
    assert msgs <= {2.5, 4.5} and all(q == pytest.approx(0.0, abs=1e-9) for _, q, _ in split)


def test_variants_are_sim_and_real_and_optionally_the_shared_client_rig():
    assert variants_of(parse_args([])) == ["sim", "sim-constant", "real"]
    assert variants_of(parse_args(["--variants", "real,sim,real-shared"])) == \
        ["real", "sim", "real-shared"]
    for bad in ("sim", "sim,real,real", "sim,real,fast", "sim-constant,real"):
        with pytest.raises(SystemExit):
            parse_args(["--variants", bad])
    # sim-constant is a calibration's: a given --network-ms has none to compare.
    assert variants_of(parse_args(["--network-ms", "1"])) == ["sim", "real"]
    with pytest.raises(SystemExit):
        parse_args(["--network-ms", "1", "--variants", "sim,sim-constant,real"])


def test_several_fleet_sizes_run_every_scenario_at_each_size():
    one = scenarios_of(parse_args(["--scenarios", "light"]))
    assert list(one) == ["light"] and one["light"].workers == 4  # the default keeps names
    both = scenarios_of(parse_args(["--workers", "2,4", "--quick"]))
    assert {k: s.workers for k, s in both.items()} == {
        "steady@2w": 2, "steady@4w": 4, "light@2w": 2, "light@4w": 4}
    assert all(s.name == k and s.duration_s == 30.0 for k, s in both.items())
    # The simulator gets the scenario's size; the calibration the largest.
    args = parse_args(["--workers", "2,4"])
    assert fleet_settings(args, 1.0, both["light@2w"].workers).num_workers == 2
    assert fleet_settings(args, 1.0).num_workers == 4
    for bad in ("0", "2,2", "two", ""):
        with pytest.raises(SystemExit):
            parse_args(["--workers", bad])
    assert fleet_sizes({"workers": [2, 4]}) == "2 and 4"
    assert fleet_sizes({"workers": [1, 2, 4]}) == "1, 2 and 4"
    assert fleet_sizes({"workers": 4}) == "4"


def test_network_ms_is_the_idle_p50_gap_and_never_negative():
    assert network_ms_from([15.0, 16.0, 40.0], [10.5, 10.5]) == pytest.approx(5.5)
    assert network_ms_from([9.0], [10.0]) == 0.0
    with pytest.raises(ValueError):
        network_ms_from([], [10.0])


def test_the_clients_legs_are_each_idle_probes_gap_and_never_negative():
    """Probe by probe (the spread kept), against the simulator's p50 (its idle TTFTs
    are one value: identical probes on an idle fleet)."""
    assert client_legs_from([15.0, 16.5, 40.0, 9.0], [10.5, 10.5, 10.5]) == \
        (4.5, 6.0, 29.5, 0.0)
    with pytest.raises(ValueError):
        client_legs_from([15.0], [])


def test_one_message_lies_on_the_simulators_idle_first_token_path():
    """The calibration's premise: network_ms adds itself once to an idle TTFT."""
    args = parse_args(["--quick"])
    wl, _ = load_scenario(SCENARIOS["light"], 2, 0)
    probes = idle_probes(4)
    base = sim_idle_ttft_ms(wl, probes, fleet_settings(args, 0.0))
    plus = sim_idle_ttft_ms(wl, probes, fleet_settings(args, 3.0))
    assert len(base) == 4
    assert [b - a for a, b in zip(base, plus, strict=True)] == [pytest.approx(3.0)] * 4


def test_scaling_a_workload_scales_only_the_named_classes():
    doc = {"classes": [{"name": "p", "arrival": {"process": "poisson", "rate_per_s": 2.0}},
                       {"name": "b", "arrival": {"process": "burst", "at_s": 5, "count": 7}},
                       {"name": "q", "arrival": {"process": "poisson", "rate_per_s": 10}}]}
    out = scaled_doc(doc, ("p", "b"), 1.5)
    assert [c["arrival"].get("rate_per_s", c["arrival"].get("count")) for c in out["classes"]] \
        == [3.0, 10, 10]
    assert doc["classes"][0]["arrival"]["rate_per_s"] == 2.0  # the input is not changed


def test_the_real_fleet_gets_the_simulators_tenants_and_prompt_lengths():
    wl, doc = load_scenario(SCENARIOS["steady"], 2, 0)
    t = tenants_doc(wl, doc)
    assert t["pools"]["default"] == doc["pool"] and t["tiers"] == doc["tiers"]
    assert t["tenants"]["ent"]["tier"] == "enterprise"
    assert set(t["tenants"]) == {"ent", "chat-0", "chat-1", "batch"}
    for n in (1, 32, 511):
        req = InferenceRequest(request_id="r", tenant="t", pool="p", tier="x", reply_to="i",
                               prompt=prompt_of(n))
        assert estimate_prompt_tokens(req) == n


def test_cpu_usage_in_cores():
    a = {"worker0": 1.0, "nats": 0.5, "bench": 2.0, "_busy": 100, "_total": 400, "_wall": 10.0}
    b = {"worker0": 3.0, "nats": 1.5, "bench": 3.0, "_busy": 300, "_total": 800, "_wall": 20.0}
    assert cpu_usage(a, b) == {"worker0": 0.2, "nats": 0.1, "bench": 0.1, "fleet": 0.3,
                               "clients": 0.1, "machine_busy_frac": 0.5}


def test_cpu_usage_counts_client_processes_as_load_not_fleet():
    a = {"worker0": 1.0, "bench": 2.0, "client:quiet": 0.0, "client:noisy": 1.0,
         "_busy": 0, "_total": 100, "_wall": 0.0}
    b = {"worker0": 2.0, "bench": 2.5, "client:quiet": 0.5, "client:noisy": 4.0,
         "_busy": 50, "_total": 200, "_wall": 10.0}
    cores = cpu_usage(a, b)
    assert cores["fleet"] == 0.1  # the worker alone
    assert cores["clients"] == 0.4  # 0.05 + 0.05 + 0.3


# --- a hand-made results file -------------------------------------------------------------


def _m(p50: float, tail: float, tps: float, n: int, e2e: float = 1000.0) -> dict:
    return {"n_arrived": n, "n_ttft": n, "n_e2e": n, "censored": 0, "ttft_p50_ms": p50,
            "ttft_p99_ms": tail if n >= 200 else None, "ttft_max_ms": tail + 50,
            "e2e_p50_ms": e2e, "tpot_p50_ms": 13.0, "tokens_per_s": tps}


def _run(variant: str, rep: int, pos: int, classes: dict, error: str | None = None) -> dict:
    return {"variant": variant, "rep": rep, "position": pos, "error": error, "elapsed_s": 1.0,
            "metrics": {} if error else {"classes": classes, "diag": {}}}


def _doc() -> dict:
    runs = [
        # rep 0: p50 +10% (sim 44 vs real 40), throughput -5%
        _run("steady:sim", 0, 0, {"a": _m(44, 90, 950, 300), "all": _m(44, 90, 950, 300)}),
        _run("steady:real", 0, 1, {"a": _m(40, 100, 1000, 300), "all": _m(40, 100, 1000, 300)}),
        # rep 1: p50 +20%; one real run with 150 TTFTs: the tail row compares maxima
        _run("steady:real", 1, 2, {"a": _m(40, 100, 1000, 150), "all": _m(40, 100, 1000, 300)}),
        _run("steady:sim", 1, 3, {"a": _m(48, 90, 1000, 300), "all": _m(48, 90, 1000, 300)}),
        # rep 2: the real run failed: rep 2 is not compared at all
        _run("steady:sim", 2, 4, {"a": _m(400, 900, 1, 300), "all": _m(400, 900, 1, 300)}),
        _run("steady:real", 2, 5, {}, error="RuntimeError('boom')"),
    ]
    return {"meta": {"command": "python bench/fidelity.py", "commit": "abc1234",
                     "date_utc": "2030-01-02T03:04:05Z", "machine": "test"},
            "data": {"workers": 2, "max_num_seqs": 32, "prefetch_seqs": 4,
                     "step_model": "default",
                     "network_ms": {"value": 5.0, "source": "calibrated",
                                    "real_idle_ttft_p50_ms": 15.8, "sim_idle_ttft_p50_ms": 10.8},
                     "scenarios": {"steady": {"warmup_s": 10, "duration_s": 70,
                                              "classes": ["a"]}},
                     "notes": [], "runs": runs}}


def test_compare_pairs_repetitions_and_labels_tails():
    rows = {(r.cls, r.metric.key): r for r in compare(_doc()["data"]["runs"], "steady", ["a"])}
    p50 = rows[("a", "ttft_p50_ms")]
    assert p50.err.n == 2 and p50.err.median == pytest.approx(0.15)
    assert (p50.err.lo, p50.err.hi) == (pytest.approx(0.10), pytest.approx(0.20))
    assert p50.verdict == "missed" and p50.sim.median == pytest.approx(46.0)
    tail = rows[("a", "ttft_tail")]
    assert tail.tail == "max" and tail.label.startswith("TTFT max")
    assert tail.err.median == pytest.approx((140 - 150) / 150)  # maxima: p99 + 50
    assert rows[("all", "ttft_tail")].tail == "p99"
    tps = rows[("a", "tokens_per_s")]
    assert tps.err.median == pytest.approx(-0.025) and tps.verdict == "met"
    assert rows[("a", "tpot_p50_ms")].verdict == "diagnostic"


def test_fidelity_table_and_summary_row_from_a_results_file(tmp_path):
    (tmp_path / "fidelity.json").write_text(json.dumps(_doc()))
    res = Results(tmp_path, "res")
    out = fidelity_table(res, ["fidelity"], "")
    assert "[`fidelity.json`](res/fidelity.json) (commit abc1234, 2030-01-02T03:04:05Z)" in out
    assert "`network_ms` 5.00 (calibrated: idle real TTFT p50 15.8 ms − simulated 10.8 ms)" in out
    assert "2 of 3 repetitions compared (1 runs failed)" in out
    assert ("| steady | a | TTFT p50, ms | 46.0 | 40.0 | +15.0% (+10.0 to +20.0) | **missed** |"
            in out)
    assert "| steady | a | output tokens/s | 975 | 1,000 | -2.5% (-5.0 to +0.0) | within 10% |" \
        in out
    met, n, missed = headline(compare(_doc()["data"]["runs"], "steady", ["a"]))
    assert (met, n) == (6, 8) and {r.cls for r in missed} == {"a", "all"}
    row = summary_fidelity(res)
    assert row[1].startswith("**6 of 8** within 10%; missed: steady/a TTFT p50 +15.0%, ")
    assert row[2] == "≤ 10% each — missed"
    assert row[3] == "[fidelity](res/fidelity.md) (abc1234, 2030-01-02)"
    assert "## Runs" in report(_doc()["data"])
    assert "shared client" not in report(_doc()["data"])


def test_the_ttft_split_table_compares_each_part_and_is_absent_without_data(tmp_path):
    doc = _doc()
    (tmp_path / "fidelity.json").write_text(json.dumps(doc))
    res = Results(tmp_path, "res")
    with pytest.raises(RenderError, match="no TTFT split"):
        fidelity_split(res, ["fidelity"], "")
    assert "Where the TTFT goes" not in report(doc["data"])
    parts = {"sim": (0.0, 20.0, 5.0), "real": (1.0, 22.0, 9.0)}
    for r in doc["data"]["runs"]:
        side = r["variant"].split(":")[1]
        for m in r["metrics"].get("classes", {}).values():
            q, w, msg = parts[side]
            m.update({"n_split": 250, "queue_p50_ms": q, "queue_p99_ms": q + 1,
                      "worker_p50_ms": w, "worker_p99_ms": w + 10,
                      "messages_p50_ms": msg, "messages_p99_ms": msg * 3})
    (tmp_path / "fidelity.json").write_text(json.dumps(doc))
    out = fidelity_split(Results(tmp_path, "res"), ["fidelity"], "")
    assert "| steady | a | messages (the rest: publish, JetStream, dispatch, ack, token) | " \
        "5.00 | 9.00 | 15.0 | 27.0 | 250 |" in out
    assert "| steady | all | worker (dispatch received to first token) | 20.0 | 22.0 |" in out
    assert split_table(doc["data"]) in report(doc["data"])


@pytest.mark.parametrize(("variant", "tail_ms", "key", "expected", "heading"), [
    # real-shared: the real fleet with one client for every class (the earlier rig)
    ("real-shared", 120, "ttft_p50_ms", 55.0, "## Sim vs real with one shared client"),
    # real-gc-default: its workers under Python's default garbage collector
    ("real-gc-default", 150, "ttft_tail", 150.0,
     "## Sim vs real with Python's default collector in the workers"),
])
def test_a_side_variant_is_reported_beside_not_instead_of_the_real_fleet(
        variant, tail_ms, key, expected, heading):
    """Compared with the same sim runs in a section of its own, between the judged
    comparison and the Runs table; the verdict stays sim vs real's."""
    data = _doc()["data"]
    data["runs"] += [
        _run(f"steady:{variant}", 0, 6, {"a": _m(50, tail_ms, 1000, 300),
                                         "all": _m(50, tail_ms, 1000, 300)}),
        _run(f"steady:{variant}", 1, 7, {"a": _m(60, tail_ms, 1000, 300),
                                         "all": _m(60, tail_ms, 1000, 300)}),
    ]
    # The judged comparison is still sim vs real.
    met, n, _ = headline(compare(data["runs"], "steady", ["a"]))
    assert (met, n) == (6, 8)
    side = {(r.cls, r.metric.key): r for r in compare(data["runs"], "steady", ["a"], variant)}
    assert side[("a", key)].real.median == pytest.approx(expected)
    text = report(data)
    assert heading in text
    assert text.index("## Sim vs real\n") < text.index(heading) < text.index("## Runs")
    assert f"| steady | 0 | {variant} |" in text  # its runs in the Runs table


def test_the_default_collector_variant_runs_its_workers_with_gc_young_objects_0(tmp_path):
    args = parse_args(["--variants", "sim,real,real-gc-default"])
    assert variants_of(args) == ["sim", "real", "real-gc-default"]
    bench = Bench(args, scenarios_of(args), "nats://127.0.0.1:1", None, tmp_path, "1")
    real, gc_default = bench.real_kwargs("p", 4), bench.real_kwargs("p", 4, "real-gc-default")
    assert real["spec"].gc_young_objects is None  # the worker's own default
    assert gc_default["spec"].gc_young_objects == 0
    assert real["prefix"] != gc_default["prefix"]  # its own subjects, streams and logs
    assert real["log_dir"] != gc_default["log_dir"]


def test_a_run_over_two_fleet_sizes_is_judged_per_size(tmp_path):
    """`--workers 2,4`: the same scenario at each size, its figures side by side and
    its Summary row counting each size on its own."""
    doc = _doc()
    runs = [r for r in doc["data"]["runs"] if r["rep"] < 2]
    good = {"a": _m(40, 100, 1000, 300), "all": _m(40, 100, 1000, 300)}  # sim = real
    big = [{**r, "variant": r["variant"].replace("steady", "steady@4w")} for r in runs]
    small = [{**r, "variant": r["variant"].replace("steady", "steady@2w"),
              "metrics": {"classes": good, "diag": {}}} for r in runs]
    scen = doc["data"]["scenarios"]["steady"]
    doc["data"].update(workers=[2, 4], runs=small + big, scenarios={
        "steady@2w": {**scen, "workers": 2}, "steady@4w": {**scen, "workers": 4}})
    (tmp_path / "fidelity_workers.json").write_text(json.dumps(doc))
    res = Results(tmp_path, "res")
    row = summary_fidelity_workers(res)
    assert row[1] == ("2 workers: **8 of 8**; 4 workers: **6 of 8** (missed: steady/a TTFT "
                      "p50 +15.0%, steady/all TTFT p50 +15.0%)")
    out = fidelity_sizes(res, ["fidelity_workers"], "")
    assert "2 and 4 workers × 32 slots" in out
    assert ("| steady | a | TTFT p50, ms | +0.0% (+0.0 to +0.0) within 10% | +15.0% (+10.0 to "
            "+20.0) **missed** |") in out
    one = _doc()
    (tmp_path / "fidelity_workers.json").write_text(json.dumps(one))
    res = Results(tmp_path, "res")  # a Results reads each file once
    with pytest.raises(RenderError, match="several fleet sizes"):
        summary_fidelity_workers(res)
    with pytest.raises(RenderError, match="several fleet sizes"):
        fidelity_sizes(res, ["fidelity_workers"], "")


def test_the_calibrated_hop_and_legs_and_the_earlier_model_are_reported(tmp_path):
    """Runs from 2026-11-30 on: a measured hop and the clients' legs in the setup line;
    `sim-constant` (the simulator as calibrated before) beside the judged `sim`, against
    the same real runs, not instead of it."""
    doc = _doc()
    data = doc["data"]
    data["network_ms"] = {"value": 0.12, "source": "calibrated", "hop_n": 200,
                          "client_ms": [4.0, 5.0, 5.5, 7.0], "constant_ms": 5.3,
                          "real_idle_ttft_p50_ms": 16.1, "sim0_idle_ttft_p50_ms": 10.8}
    data["runs"] += [
        _run("steady:sim-constant", 0, 6, {"a": _m(40, 100, 1000, 300),
                                           "all": _m(40, 100, 1000, 300)}),
        _run("steady:sim-constant", 1, 7, {"a": _m(40, 100, 1000, 300),
                                           "all": _m(40, 100, 1000, 300)}),
    ]
    (tmp_path / "fidelity.json").write_text(json.dumps(doc))
    out = fidelity_table(Results(tmp_path, "res"), ["fidelity"], "")
    assert ("`network_ms` 0.12 (measured: a core-NATS round trip ÷ 2, median of 200) and "
            "the clients' legs, each request drawing one of the 4 idle probes' real TTFT − "
            "simulated (p50 5.50, 4.00 to 7.00 ms); `sim-constant`: `network_ms` 5.30 on "
            "every message (idle real TTFT p50 16.1 − simulated 10.8 ms)") in out
    # The verdict stays sim's (sim-constant equals real here, sim does not).
    met, n, _ = headline(compare(data["runs"], "steady", ["a"]))
    assert (met, n) == (6, 8)
    const = {(r.cls, r.metric.key): r for r in compare(data["runs"], "steady", ["a"],
                                                       sim="sim-constant")}
    assert const[("a", "ttft_p50_ms")].err.median == 0.0
    text = report(data)
    assert text.index("## Sim vs real\n") < text.index("as calibrated before (sim-constant)") \
        < text.index("## Runs")
    assert "| steady | a | TTFT p50, ms | 40.0 | 40.0 | +0.0% (+0.0 to +0.0) |" in text
    assert "| steady | 0 | sim-constant |" in text  # its runs in the Runs table
