"""The simulator's workloads (fleetsim.workload / processes): arrival processes,
length distributions, the scheduler config, FL_USAGE replay, and scale. Validation
errors: test_sim_workload_errors.py."""

from __future__ import annotations

import copy
import itertools
import math
import random
import time
import tracemalloc
from collections import Counter
from pathlib import Path

import msgspec
import pytest

from fairlane.poolconfig import PreemptionConfig, TenantConfig
from fairlane.protocol import Usage
from fairlane.tenants import resolve_pool_config, tenants_from_dict
from fleetsim.processes import parse_dist
from fleetsim.workload import (
    WorkloadError,
    from_usage,
    load_workload,
    workload_from_dict,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

ROOT = Path(__file__).resolve().parents[2]
FIXED32 = {"dist": "fixed", "value": 32}


def cls(name: str = "a", arrival: dict | None = None, **kw) -> dict:
    return {"name": name, "arrival": arrival or {"process": "poisson", "rate_per_s": 1},
            "prompt_tokens": FIXED32, "output_tokens": {"dist": "fixed", "value": 100}, **kw}


def doc(*classes: dict, duration_s: float = 100, seed: int = 1, **kw) -> dict:
    return {"duration_s": duration_s, "seed": seed, **kw, "classes": list(classes) or [cls()]}


def arrivals_of(w) -> list:
    return list(w.arrivals())


def assert_close(actual: float, expected: float, rel: float) -> None:
    assert abs(actual - expected) <= rel * expected, (actual, expected)


# --- arrival processes ---


def test_poisson_rate_is_per_tenant_and_tenants_are_uniform():
    w = workload_from_dict(doc(cls("p", {"process": "poisson", "rate_per_s": 2.5}, count=8),
                               duration_s=1000))
    xs = arrivals_of(w)
    assert w.expected_requests() == pytest.approx(8 * 2.5 * 1000)
    assert_close(len(xs), 20_000, 0.03)  # sd ~0.7%
    per_tenant = Counter(a.tenant for a in xs)
    assert sorted(per_tenant) == list(range(8))
    for n in per_tenant.values():
        assert_close(n, 2_500, 0.08)
    gaps = [b.t_s - a.t_s for a, b in itertools.pairwise(xs)]
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 20, rel=0.03)  # exponential gaps
    assert min(gaps) >= 0


def test_burst_round_robin_repeats_and_background():
    w = workload_from_dict(doc(
        cls("b", {"process": "burst", "at_s": 5, "count": 4, "every_s": 10}, count=3),
        duration_s=35))
    xs = arrivals_of(w)
    assert len(xs) == w.expected_requests() == 3 * 4 * 3  # bursts at 5, 15, 25
    assert sorted({a.t_s for a in xs}) == [5.0, 15.0, 25.0]
    assert [a.tenant for a in xs[:6]] == [0, 1, 2, 0, 1, 2]  # tenants interleaved
    assert Counter(a.tenant for a in xs) == {0: 12, 1: 12, 2: 12}

    spread = workload_from_dict(doc(
        cls("b", {"process": "burst", "at_s": 5, "count": 5, "spread_s": 1}, count=2),
        duration_s=5.55))  # the end cuts the spread burst after 6 of 10
    ts = [a.t_s for a in spread.arrivals()]
    assert ts == pytest.approx([5.0, 5.1, 5.2, 5.3, 5.4, 5.5])
    assert spread.expected_requests() == 6

    bg = workload_from_dict(doc(
        cls("b", {"process": "burst", "at_s": 50, "count": 1000, "rate_per_s": 2}, count=2),
        duration_s=2000))
    xs = arrivals_of(bg)
    assert [a.t_s for a in xs] == sorted(a.t_s for a in xs)
    assert sum(1 for a in xs if a.t_s == 50.0) == 2000
    assert bg.expected_requests() == 2000 + 2 * 2 * 2000
    assert_close(len(xs) - 2000, 8000, 0.05)


def test_burst_past_the_end_sends_nothing():
    w = workload_from_dict(doc(cls("b", {"process": "burst", "at_s": 100, "count": 5}),
                               duration_s=100))
    assert arrivals_of(w) == [] and w.expected_requests() == 0


def test_on_off_rate_and_each_tenant_only_sends_while_on():
    on_s, off_s, period_s = 3.0, 7.0, 10.0
    w = workload_from_dict(doc(
        cls("o", {"process": "on_off", "rate_per_s": 5, "on_s": on_s, "off_s": off_s},
            count=20), duration_s=2000))
    xs = arrivals_of(w)
    assert w.expected_requests() == pytest.approx(20 * 5 * 0.3 * 2000)
    assert_close(len(xs), 60_000, 0.03)
    by_tenant: dict[int, list[float]] = {}
    for a in xs:
        by_tenant.setdefault(a.tenant, []).append(a.t_s % period_s)
    assert len(by_tenant) == 20
    phases = []
    for residues in by_tenant.values():
        assert_close(len(residues), 3000, 0.1)
        # All of a tenant's arrivals lie in one window of on_s per period: the largest
        # circular gap between its residues is at least off_s.
        r = sorted(residues)
        gaps = [b - a for a, b in itertools.pairwise(r)] + [r[0] + period_s - r[-1]]
        assert max(gaps) >= off_s - 1e-6
        phases.append(r[(gaps.index(max(gaps)) + 1) % len(r)])
    # Phases are spread over the period, not all in step.
    assert max(phases) - min(phases) > period_s / 2


def test_on_off_single_tenant_phase_depends_on_seed():
    def first_arrival(seed: int) -> float:
        w = workload_from_dict(doc(
            cls("o", {"process": "on_off", "rate_per_s": 50, "on_s": 10, "off_s": 90}),
            duration_s=100, seed=seed))
        return next(w.arrivals()).t_s

    assert len({round(first_arrival(s)) for s in range(8)}) > 3


def test_on_off_without_off_time_is_poisson():
    w = workload_from_dict(doc(
        cls("o", {"process": "on_off", "rate_per_s": 1, "on_s": 5, "off_s": 0}, count=7),
        duration_s=2000))
    assert_close(len(arrivals_of(w)), 14_000, 0.04)


def test_diurnal_rate_follows_the_sine():
    period_s, amp = 100.0, 0.8
    w = workload_from_dict(doc(
        cls("d", {"process": "diurnal", "rate_per_s": 10, "amplitude": amp,
                  "period_s": period_s}, count=2), duration_s=10_000))
    xs = arrivals_of(w)
    assert w.expected_requests() == pytest.approx(2 * 10 * 10_000)
    assert_close(len(xs), 200_000, 0.02)
    rising = sum(1 for a in xs if a.t_s % period_s < period_s / 2)  # sin > 0
    # Mean rate over the positive half is (1 + 2A/pi), over the other (1 - 2A/pi).
    assert rising / (len(xs) - rising) == pytest.approx(
        (1 + 2 * amp / math.pi) / (1 - 2 * amp / math.pi), rel=0.03)


def test_diurnal_expected_over_a_partial_period_and_phase():
    spec = {"process": "diurnal", "rate_per_s": 40, "amplitude": 1, "period_s": 1000,
            "phase_s": 100}
    w = workload_from_dict(doc(cls("d", spec), duration_s=300))
    # 40 * integral over [0, 300) of 1 + sin(2 pi (t + 100) / 1000)
    w_rad = 2 * math.pi / 1000
    exact = 40 * (300 + (math.cos(w_rad * 100) - math.cos(w_rad * 400)) / w_rad)
    assert w.expected_requests() == pytest.approx(exact)
    counts = [len(arrivals_of(workload_from_dict(doc(cls("d", spec), duration_s=300, seed=s))))
              for s in range(5)]
    assert_close(sum(counts) / 5, exact, 0.02)


def test_diurnal_phase_spread_over_a_period_flattens_the_class():
    w = workload_from_dict(doc(
        cls("d", {"process": "diurnal", "rate_per_s": 1, "amplitude": 1, "period_s": 100,
                  "phase_spread_s": 100}, count=1000), duration_s=200))
    xs = arrivals_of(w)
    assert w.expected_requests() == pytest.approx(1000 * 200)
    halves = Counter(a.t_s % 100 < 50 for a in xs)
    assert_close(halves[True], halves[False], 0.03)


# --- order, determinism ---


def mixed(seed: int = 3) -> dict:
    return doc(
        cls("p", {"process": "poisson", "rate_per_s": 3}, count=5),
        cls("b", {"process": "burst", "at_s": 10, "count": 50, "every_s": 30}, count=2),
        cls("o", {"process": "on_off", "rate_per_s": 2, "on_s": 5, "off_s": 10}, count=9),
        cls("d", {"process": "diurnal", "rate_per_s": 1, "amplitude": 0.5, "period_s": 60},
            count=4),
        duration_s=120, seed=seed)


def test_arrivals_are_time_ordered_inside_the_window_and_indexed_by_class():
    w = workload_from_dict(mixed())
    xs = arrivals_of(w)
    assert xs and all(0 <= a.t_s < 120 for a in xs)
    assert all(a.t_s <= b.t_s for a, b in itertools.pairwise(xs))
    # Tenants of class i are first_tenant .. first_tenant + count - 1, in file order.
    assert [(c.name, c.first_tenant, c.num_tenants) for c in w.classes] == [
        ("p", 0, 5), ("b", 5, 2), ("o", 7, 9), ("d", 16, 4)]
    assert w.tenants.names[:7] == ["p-0", "p-1", "p-2", "p-3", "p-4", "b-0", "b-1"]
    assert {a.tenant for a in xs} == set(range(20))
    # Same-time arrivals of different classes come in class order.
    at_10 = [a.tenant for a in xs if a.t_s == 10.0]
    assert len(at_10) == 100 and set(at_10) == {5, 6}


def test_deterministic_for_a_seed_and_fresh_per_call():
    w = workload_from_dict(mixed())
    first = [(a.t_s, a.tenant, a.prompt_tokens, a.output_tokens) for a in w.arrivals()]
    again = [(a.t_s, a.tenant, a.prompt_tokens, a.output_tokens) for a in w.arrivals()]
    other = [(a.t_s, a.tenant, a.prompt_tokens, a.output_tokens)
             for a in workload_from_dict(mixed()).arrivals()]
    assert first == again == other
    reseeded = [(a.t_s, a.tenant) for a in workload_from_dict(mixed(seed=4)).arrivals()]
    assert reseeded != [(t, k) for t, k, *_ in first]
    w.seed, w.duration_s = 4, 60.0  # overridden after loading (the CLI's --seed)
    assert [(a.t_s, a.tenant) for a in w.arrivals()] == [x for x in reseeded if x[0] < 60]


def test_a_class_stream_does_not_depend_on_the_other_classes():
    alone = workload_from_dict(doc(cls("p", count=3), duration_s=200))
    both = workload_from_dict(doc(cls("x", count=5), cls("p", count=3), duration_s=200))
    p_alone = [(a.t_s, a.tenant) for a in alone.arrivals()]
    p_both = [(a.t_s, a.tenant - 5) for a in both.arrivals() if a.tenant >= 5]
    assert p_alone == p_both


# --- lengths ---


@pytest.mark.parametrize(("spec", "lo", "hi", "mean"), [
    ({"dist": "fixed", "value": 7}, 7, 7, 7),
    ({"dist": "uniform", "min": 128, "max": 384}, 128, 384, 256),
    ({"dist": "lognormal", "mean": 256, "sigma": 0.5}, 1, None, 256),
    ({"dist": "lognormal", "mean": 256, "sigma": 1.0, "min": 16, "max": 512}, 16, 512, None),
    ({"dist": "normal", "mean": 100, "std": 10}, 1, None, 100),
    ({"dist": "normal", "mean": 5, "std": 10, "max": 20}, 1, 20, None),
    ({"dist": "choice", "values": [10, 20, 30], "weights": [1, 0, 3]}, 10, 30, 25),
    ({"dist": "choice", "values": [10, 30]}, 10, 30, 20),
    ({"dist": "empirical", "samples": [1, 2, 3, 10]}, 1, 10, 4),
])
def test_distribution_bounds_and_means(spec, lo, hi, mean):
    d = parse_dist(spec, "<t>", "x")
    rng = random.Random(7)
    xs = [d.draw(rng) for _ in range(40_000)]
    assert all(isinstance(x, int) for x in xs[:100])
    assert min(xs) >= lo
    if hi is not None:
        assert max(xs) <= hi and d.upper == hi
    else:
        assert d.upper is None
    if mean is not None:
        assert sum(xs) / len(xs) == pytest.approx(mean, rel=0.02)
    if spec["dist"] == "choice" and "weights" in spec:
        assert 20 not in xs  # weight 0


def test_max_tokens_defaults_to_the_output_bound_capped_by_the_pool():
    w = workload_from_dict(doc(
        cls("u", output_tokens={"dist": "uniform", "min": 1, "max": 300}),
        cls("l", output_tokens={"dist": "lognormal", "mean": 100, "sigma": 1}),
        cls("m", max_tokens=50), pool={"max_tokens": 1000}))
    assert [c.max_tokens for c in w.classes] == [300, 1000, 50]
    assert workload_from_dict(doc(cls("l", output_tokens={
        "dist": "lognormal", "mean": 100, "sigma": 1}))).classes[0].max_tokens == 4096


# --- the scheduler config ---


def test_scheduler_config_is_what_a_dispatcher_builds_from_the_same_tenants_file():
    tiers = [{"name": "gold", "floor_share": 0.5, "aging_ms": 10, "engine_priority": 0},
             {"name": "free", "aging_ms": 300, "engine_priority": 10}]
    pool = {"policy": "vtc", "cost_model": "tokens", "quantum": 544, "max_queued_total": 77,
            "preemption": {"preempt_after_ms": 123, "max_per_s": 4}}
    w = workload_from_dict(doc(
        cls("big", tier="gold", weight=4, max_concurrent=3, max_kv_tokens=9000),
        cls("small", count=3, max_queued=5), tiers=tiers, pool=pool))
    tenants = {"big": {"tier": "gold", "weight": 4, "max_concurrent": 3, "max_kv_tokens": 9000}}
    tenants.update({f"small-{i}": {"tier": "free", "max_queued": 5} for i in range(3)})
    expected = resolve_pool_config(
        tenants_from_dict({"tiers": tiers, "pools": {"p": pool}, "tenants": tenants}), "p")
    assert w.scheduler_config == expected
    assert w.scheduler_config.preemption == PreemptionConfig(preempt_after_ms=123, max_per_s=4)
    assert w.scheduler_config.tenants["small-2"] == TenantConfig(
        "small-2", tier="free", max_queued=5)
    t = w.tenants
    assert t.tiers == ["gold", "free"] and t.names == ["big", "small-0", "small-1", "small-2"]
    assert t.tier_of == [0, 1, 1, 1] and t.weight_of == [4.0, 1.0, 1.0, 1.0]


def test_defaults_one_standard_tier_and_the_pool_defaults():
    w = workload_from_dict(doc())
    cfg = w.scheduler_config
    assert [t.name for t in cfg.tiers] == ["standard"] and cfg.policy == "drr"
    assert cfg.cost_model == "requests" and cfg.tenants["a"].tier == "standard"
    assert w.seed == 1 and w.duration_s == 100.0


def test_load_workload_files(tmp_path):
    p = tmp_path / "w.yaml"
    p.write_text("duration_s: 10\nclasses:\n  - {name: a, arrival: {process: poisson, "
                 "rate_per_s: 1}, prompt_tokens: {dist: fixed, value: 1}, "
                 "output_tokens: {dist: fixed, value: 1}}\n")
    w = load_workload(p)
    assert w.source == str(p) and w.tenants.names == ["a"] and w.seed == 0
    assert load_workload(doc()).tenants.names == ["a"]  # a dict is accepted too
    p.write_text("duration_s: 10\nduration_s: 20\n")
    with pytest.raises(WorkloadError, match="duplicate key"):
        load_workload(p)
    p.write_text("duration_s: [\n")
    with pytest.raises(WorkloadError, match="invalid YAML"):
        load_workload(p)
    with pytest.raises(WorkloadError, match="cannot read"):
        load_workload(tmp_path / "missing.yaml")


# --- FL_USAGE replay ---


def usage(request_id: str, tenant: str, tier: str, ts_ms: int, **kw) -> Usage:
    return Usage(request_id=request_id, tenant=tenant, pool="default", tier=tier, ts_ms=ts_ms,
                 **kw)


def write_usage(path: Path, records: list[Usage]) -> Path:
    path.write_bytes(b"".join(msgspec.json.encode(r) + b"\n" for r in records))
    return path


USAGE = [
    usage("r1", "acme", "paid", 10_000, e2e_ms=2_000.0, queue_ms=500, prompt_tokens=10,
          completion_tokens=100, finish_reason="length"),
    usage("r2", "hobby", "free", 9_000, e2e_ms=1_000.0, prompt_tokens=20,
          completion_tokens=50, finish_reason="stop"),
    usage("r3", "acme", "paid", 20_000, e2e_ms=1_000.0, queue_ms=1_000, prompt_tokens=30,
          completion_tokens=0, finish_reason="abort"),
    usage("r1", "acme", "paid", 10_000, e2e_ms=2_000.0, queue_ms=500, prompt_tokens=10,
          completion_tokens=100, finish_reason="length"),  # the same record again
    usage("r1", "acme", "paid", 30_000, e2e_ms=1_000.0, prompt_tokens=10,
          completion_tokens=7, finish_reason="stop", attempt=1),  # a client's retry
]


def test_from_usage_round_trip(tmp_path):
    w = from_usage(write_usage(tmp_path / "u.jsonl", USAGE))
    xs = arrivals_of(w)
    names = w.tenants.names
    got = [(a.t_s, names[a.tenant], a.prompt_tokens, a.output_tokens, a.max_tokens)
           for a in xs]
    assert got == [
        (0.0, "acme", 10, 100, 100),  # starts at 10,000 - 2,000 - 500 = 7,500 ms
        (0.5, "hobby", 20, 50, 116),  # a natural stop: max_tokens 2 x 50 + 16
        (10.5, "acme", 30, 1, 1),
        (21.5, "acme", 10, 7, 30),
    ]
    assert w.duration_s == pytest.approx(22.5)  # to the last finish
    assert w.expected_requests() == 4
    assert w.tenants.tiers == ["free", "paid"]  # alphabetical without a list
    assert w.tenants.tier_of[names.index("acme")] == 1
    cfg = w.scheduler_config
    assert [t.name for t in cfg.tiers] == ["free", "paid"]
    assert cfg.tenants["acme"] == TenantConfig("acme", tier="paid")
    assert arrivals_of(w) == xs  # repeatable
    w.duration_s = 10.5  # shortened by the caller: arrivals and the count follow
    assert [a.t_s for a in w.arrivals()] == [0.0, 0.5] and w.expected_requests() == 2


def test_from_usage_tiers_order_and_pool(tmp_path):
    path = write_usage(tmp_path / "u.jsonl", USAGE)
    w = from_usage(path, tiers=[{"name": "paid", "floor_share": 0.5}, "free", "extra"],
                   pool={"policy": "vtc", "cost_model": "tokens"})
    assert w.tenants.tiers == ["paid", "free", "extra"]
    assert w.scheduler_config.tiers[0].floor_share == 0.5
    assert w.scheduler_config.policy == "vtc" and w.scheduler_config.cost_model == "tokens"
    assert w.tenants.tier_of[w.tenants.names.index("hobby")] == 1
    with pytest.raises(WorkloadError, match="tier 'free' is not listed"):
        from_usage(path, tiers=["paid"])
    with pytest.raises(WorkloadError, match="pool.policy"):
        from_usage(path, pool={"policy": "lottery"})


def test_from_usage_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(msgspec.json.encode(USAGE[0]) + b"\n\n{\"tenant\": 3}\n")
    with pytest.raises(WorkloadError) as info:
        from_usage(bad)
    assert info.value.path == "line 3" and "not a Usage record" in info.value.detail
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(WorkloadError, match="no Usage records"):
        from_usage(empty)
    with pytest.raises(WorkloadError, match="cannot read"):
        from_usage(tmp_path / "missing.jsonl")


# --- scale ---


def big(count: int = 100_000) -> dict:
    return doc(
        cls("s", {"process": "on_off", "rate_per_s": 0.5, "on_s": 30, "off_s": 300},
            count=count, weight=2, max_concurrent=4,
            output_tokens={"dist": "lognormal", "mean": 256, "sigma": 0.6, "max": 2048}),
        cls("d", {"process": "diurnal", "rate_per_s": 0.05, "amplitude": 0.5,
                  "period_s": 600, "phase_spread_s": 600}, count=count),
        cls("p", {"process": "poisson", "rate_per_s": 0.01}, count=count),
        tiers=[{"name": "pro", "floor_share": 0.3}, {"name": "free"}], duration_s=3600)


def test_100k_tenant_classes_build_fast():
    t0 = time.perf_counter()
    w = workload_from_dict(big())
    assert time.perf_counter() - t0 < 2.0 * 3  # three classes of 100,000
    t0 = time.perf_counter()
    one = workload_from_dict(big(100_000) | {"classes": big()["classes"][:1]})
    assert time.perf_counter() - t0 < 2.0
    assert len(one.scheduler_config.tenants) == len(one.tenants) == 100_000
    assert one.scheduler_config.tenants["s-99999"].weight == 2.0
    assert one.scheduler_config.tenants["s-99999"].max_concurrent == 4
    assert len(w.tenants) == 300_000 and w.tenants.names[-1] == "p-99999"


def test_arrivals_use_memory_bounded_by_classes_not_tenants():
    w = workload_from_dict(big())
    it = w.arrivals()
    tracemalloc.start()
    try:
        n = sum(1 for _ in itertools.islice(it, 100_000))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert n == 100_000
    # Per-tenant state for 300,000 tenants would be >= 2.4 MB even as one float each.
    assert peak < 200_000, peak


# --- the example workloads ---


def test_example_noisy_neighbor():
    w = load_workload(ROOT / "bench" / "workloads" / "noisy_neighbor.yaml")
    cfg = w.scheduler_config
    assert (cfg.policy, cfg.cost_model, cfg.quantum) == ("drr", "tokens", 544)
    assert w.tenants.names == ["noisy", "quiet"] and w.duration_s == 120
    xs = arrivals_of(w)
    noisy = [a for a in xs if a.tenant == 0]
    assert len(noisy) == 10_000 and {a.t_s for a in noisy} == {5.0}
    assert_close(len(xs) - 10_000, 1200, 0.15)  # quiet: Poisson 10/s
    for a in xs:
        c = w.classes[a.tenant]
        assert a.prompt_tokens == 32 and a.output_tokens <= c.output_tokens.upper
        assert a.max_tokens == c.max_tokens


def test_example_scale():
    t0 = time.perf_counter()
    w = load_workload(ROOT / "bench" / "workloads" / "scale.yaml")
    assert time.perf_counter() - t0 < 2.0
    assert len(w.tenants) == 100_000 and w.tenants.tiers == ["enterprise", "pro", "free"]
    assert w.duration_s == 3600
    rate_per_s = w.expected_requests() / w.duration_s
    assert 5_500 <= rate_per_s <= 6_500
    first = list(itertools.islice(w.arrivals(), 50_000))
    assert_close(len(first) / first[-1].t_s, rate_per_s, 0.1)
    mean_output = sum(min(a.output_tokens, a.max_tokens) for a in first) / len(first)
    assert 230 <= mean_output <= 270
    # ~13.5 ms decode steps, and each of a worker's admissions (~6/s) stalls its batch
    # for a ~30 ms prefill: ~4.3 s per request per slot on 32,000 slots, ~80% busy
    # (bench/bench_simulate_scale.py measures it).
    slot_s = mean_output * 0.0135 / (1 - rate_per_s / 1000 * 0.030)
    assert 0.7 <= rate_per_s * slot_s / 32_000 <= 0.9
    weights = {w.tenants.weight_of[i] for i in range(len(w.tenants))}
    assert weights <= {1.0, 2.0, 3.0, 4.0} and len(weights) >= 3


def test_the_document_is_not_mutated():
    d = mixed()
    before = copy.deepcopy(d)
    workload_from_dict(d)
    assert d == before
