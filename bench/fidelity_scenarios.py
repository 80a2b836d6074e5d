"""The fidelity benchmark's scenarios (`bench/fidelity.py`): fleetsim workload files
whose load scales with the fleet's size, the same arrivals for the simulator and the
real fleet (seed = the repetition)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from fleetsim.workload import Workload, load_workload

ROOT = Path(__file__).resolve().parents[1]
REFERENCE_WORKERS = 2  # the fleet size the workload files' rates are written for


@dataclass(frozen=True)
class Scenario:
    name: str
    workload: str  # relative to the repository
    warmup_s: float  # arrivals before this are not measured (both variants)
    duration_s: float  # arrivals stop here: the window is [warmup_s, duration_s)
    drain_s: float  # after the last arrival, how long the window's requests may finish
    scaled_classes: tuple[str, ...]  # classes whose load scales with workers / 2
    workers: int = 0  # the fleet's size for this run (scenarios_of sets it from --workers)


SCENARIOS = {
    "steady": Scenario("steady", "bench/workloads/fidelity_steady.yaml", 10.0, 70.0, 15.0,
                       ("ent", "chat", "batch")),
    # The burst's first wave starts together and ends together: 12 s lets slots turn
    # over steadily before measuring (as bench/preemption.py's turnover_s).
    "light": Scenario("light", "bench/workloads/fidelity_light.yaml", 12.0, 60.0, 5.0,
                      ("noisy",)),
}
QUICK_DURATION_S = 30.0


def scaled_doc(doc: dict, classes: tuple[str, ...], factor: float) -> dict:
    """The workload document with the named classes' load times `factor` (a Poisson
    rate, a burst's count): the same utilisation on a different fleet size."""
    out = {**doc, "classes": [dict(c) for c in doc["classes"]]}
    for c in out["classes"]:
        if c["name"] not in classes or factor == 1:
            continue
        arrival = dict(c["arrival"])
        if "rate_per_s" in arrival:
            arrival["rate_per_s"] = arrival["rate_per_s"] * factor
        if "count" in arrival:
            arrival["count"] = max(1, round(arrival["count"] * factor))
        c["arrival"] = arrival
    return out


def load_scenario(s: Scenario, workers: int, seed: int) -> tuple[Workload, dict]:
    """(the workload, its scaled document); arrivals stop at the scenario's duration."""
    raw = yaml.safe_load((ROOT / s.workload).read_text(encoding="utf-8"))
    doc = scaled_doc(raw, s.scaled_classes, workers / REFERENCE_WORKERS)
    doc["duration_s"] = s.duration_s
    doc["seed"] = seed
    wl = load_workload(doc)
    return wl, doc


def class_of_tenants(wl: Workload) -> list[str]:
    """Tenant index -> its traffic class's name."""
    out: list[str] = []
    for c in wl.classes:
        out += [c.name] * c.num_tenants
    return out
