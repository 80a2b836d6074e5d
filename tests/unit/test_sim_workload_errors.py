"""The simulator's workload validation: every error names its field path
(fleetsim.workload / processes; the rest is in test_sim_workload.py)."""

from __future__ import annotations

import pytest

from fleetsim.workload import WorkloadError, workload_from_dict

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

FIXED32 = {"dist": "fixed", "value": 32}


def cls(name: str = "a", **kw) -> dict:
    return {"name": name, "arrival": {"process": "poisson", "rate_per_s": 1},
            "prompt_tokens": FIXED32, "output_tokens": {"dist": "fixed", "value": 100}, **kw}


def doc(*classes: dict, **kw) -> dict:
    return {"duration_s": 100, "seed": 1, **kw, "classes": list(classes)}

def mutate(path: str, value) -> dict:
    d = doc(cls("a", tier="free", count=2), cls("b", tier="free"),
            tiers=[{"name": "paid"}, {"name": "free"}], pool={"policy": "drr"})
    *parents, last = path.split(".")
    node = d
    for p in parents:
        node = node[int(p)] if p.isdigit() else node[p]
    if value is KeyError:
        del node[last]
    else:
        node[int(last) if last.isdigit() else last] = value
    return d


DIST_ERRORS = [
    ({"dist": "zipf"}, "output_tokens.dist", "unknown distribution 'zipf'"),
    ({"value": 3}, "output_tokens.dist", "required"),
    ({"dist": "fixed", "value": 0}, "output_tokens.value", "must be >= 1"),
    ({"dist": "fixed", "value": 2.5}, "output_tokens.value", "expected an integer"),
    ({"dist": "fixed"}, "output_tokens.value", "required"),
    ({"dist": "fixed", "value": 3, "max": 9}, "output_tokens.max", "unknown field"),
    ({"dist": "uniform", "min": 10, "max": 5}, "output_tokens.max", "must be >= min"),
    ({"dist": "lognormal", "mean": 0, "sigma": 1}, "output_tokens.mean", "must be > 0"),
    ({"dist": "lognormal", "mean": 9, "sigma": -1}, "output_tokens.sigma", "must be >= 0"),
    ({"dist": "lognormal", "mean": 9, "sigma": 1, "min": 5, "max": 2}, "output_tokens.max",
     "must be >= min"),
    ({"dist": "normal", "mean": 9, "std": float("nan")}, "output_tokens.std", "finite"),
    ({"dist": "choice", "values": []}, "output_tokens.values", "non-empty list"),
    ({"dist": "choice", "values": [1, 0]}, "output_tokens.values[1]", "must be >= 1"),
    ({"dist": "choice", "values": [1, 2], "weights": [1]}, "output_tokens.weights",
     "list of 2"),
    ({"dist": "choice", "values": [1, 2], "weights": [0, 0]}, "output_tokens.weights",
     "not all be 0"),
    ({"dist": "choice", "values": [1, 2], "weights": [1, -1]}, "output_tokens.weights[1]",
     "must be >= 0"),
    ({"dist": "empirical", "samples": "abc"}, "output_tokens.samples", "non-empty list"),
    ("long", "output_tokens", "expected a mapping"),
]
PROCESS_ERRORS = [
    ({"process": "hawkes"}, "arrival.process", "unknown process 'hawkes'"),
    ({"rate_per_s": 1}, "arrival.process", "required"),
    ({"process": "poisson", "rate_per_s": -1}, "arrival.rate_per_s", "must be >= 0"),
    ({"process": "poisson", "rate_per_s": True}, "arrival.rate_per_s", "expected a number"),
    ({"process": "poisson"}, "arrival.rate_per_s", "required"),
    ({"process": "poisson", "rate_per_s": 1, "on_s": 3}, "arrival.on_s", "unknown field"),
    ({"process": "burst", "at_s": 1, "count": 0}, "arrival.count", "must be >= 1"),
    ({"process": "burst", "at_s": -1, "count": 1}, "arrival.at_s", "must be >= 0"),
    ({"process": "burst", "at_s": 1, "count": 1, "every_s": 0}, "arrival.every_s",
     "must be > 0"),
    ({"process": "burst", "at_s": 1, "count": 1, "every_s": 1, "spread_s": 2},
     "arrival.spread_s", "must be <= every_s"),
    ({"process": "burst", "at_s": 1, "count": 1, "rate_per_s": -2}, "arrival.rate_per_s",
     "must be >= 0"),
    ({"process": "on_off", "rate_per_s": 1, "on_s": 0, "off_s": 1}, "arrival.on_s",
     "must be > 0"),
    ({"process": "on_off", "rate_per_s": 1, "on_s": 1, "off_s": -1}, "arrival.off_s",
     "must be >= 0"),
    ({"process": "diurnal", "rate_per_s": 1, "amplitude": 1.5}, "arrival.amplitude",
     "must be <= 1"),
    ({"process": "diurnal", "rate_per_s": 1, "amplitude": -0.1}, "arrival.amplitude",
     "must be >= 0"),
    ({"process": "diurnal", "rate_per_s": 1, "amplitude": 0.5, "period_s": 0},
     "arrival.period_s", "must be > 0"),
    ({"process": ["poisson"]}, "arrival.process", "unknown process"),
    (None, "arrival", "required"),
]


@pytest.mark.parametrize(("mutation", "path", "message"), [
    (("durations", 5), "durations", "unknown field"),
    (("duration_s", KeyError), "duration_s", "required"),
    (("duration_s", 0), "duration_s", "must be > 0"),
    (("seed", "x"), "seed", "expected an integer"),
    (("classes", []), "classes", "non-empty list"),
    (("classes", KeyError), "classes", "required"),
    (("classes.0", "a"), "classes[0]", "expected a mapping"),
    (("classes.0.rate", 3), "classes[0].rate", "unknown field"),
    (("classes.0.name", "a b"), "classes[0].name", "is invalid"),
    (("classes.0.name", KeyError), "classes[0].name", "required"),
    (("classes.1.name", "a"), "classes[1].name", "duplicate class 'a'"),
    (("classes.1.name", "a-1"), "classes[1].name", "also a tenant of an earlier class"),
    (("classes.0.name", "x" * 63), "classes[0].name", "too long for 2 tenants"),
    (("classes.0.count", 0), "classes[0].count", "must be >= 1"),
    (("classes.0.count", 1.5), "classes[0].count", "expected an integer"),
    (("classes.0.tier", "gold"), "classes[0].tier", "unknown tier 'gold'"),
    (("classes.0.weight", 0), "classes[0].weight", "must be > 0"),
    (("classes.0.max_concurrent", -1), "classes[0].max_concurrent", "must be > 0"),
    (("classes.0.max_queued", "many"), "classes[0].max_queued", "expected `int | null`"),
    (("classes.0.max_tokens", 0), "classes[0].max_tokens", "must be >= 1"),
    (("classes.0.max_tokens", 5000), "classes[0].max_tokens", "pool's max_tokens (4096)"),
    (("classes.0.prompt_tokens", {"dist": "fixed", "value": 40_000}),
     "classes[0].prompt_tokens", "max_prompt_tokens (32768)"),
    (("classes.0.prompt_tokens", KeyError), "classes[0].prompt_tokens", "required"),
    (("pool.bogus", 1), "pool", "unknown field `bogus`"),  # as the tenants file says it
    (("pool.policy", "lottery"), "pool.policy", "invalid enum value 'lottery'"),
    (("pool.quantum", 0), "pool.quantum", "must be > 0"),
    (("pool.preemption", {"max_per_s": 0}), "pool.preemption.max_per_s", "must be > 0"),
    (("pool", [1]), "pool", "expected a mapping"),
    (("tiers", [{"name": "free"}, {"name": "free"}]), "tiers[1].name", "duplicate tier"),
    (("tiers", [{"name": "paid", "floor_share": 0.7}, {"name": "free", "floor_share": 0.7}]),
     "tiers", "sum to <= 1"),
    (("tiers", "free"), "tiers", "expected a list"),
    *[(("classes.0.output_tokens", spec), f"classes[0].{path}", msg)
      for spec, path, msg in DIST_ERRORS],
    *[(("classes.0.arrival", spec), f"classes[0].{path}", msg)
      for spec, path, msg in PROCESS_ERRORS],
])
def test_validation_errors_name_the_field(mutation, path, message):
    data = mutate(*mutation)
    with pytest.raises(WorkloadError) as info:
        workload_from_dict(data, source="w.yaml")
    e = info.value
    assert isinstance(e, ValueError)
    assert e.path == path, str(e)
    assert message in e.detail, str(e)
    assert str(e).startswith(f"w.yaml: {path}: ")


def test_the_unmutated_document_is_valid():
    assert len(workload_from_dict(mutate("seed", 2)).tenants) == 3


def test_not_a_mapping_at_the_top():
    with pytest.raises(WorkloadError, match="expected a mapping, got a list"):
        workload_from_dict([1])
