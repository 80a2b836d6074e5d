"""Every benchmark fleet that overrides `bench.fleet.Fleet._spawn` still takes what the
base passes it: the tree a process runs from (`source`, for the `base-...` variants).
A subclass whose `_spawn(name, args)` fell behind that signature broke
`bench/preemption.py` in every run (`TypeError` at the first worker); this spawns a
trivial process through each override, as `Fleet.start` does."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.fleet import REPO, Fleet
from bench.preemption_fleet import PFleet
from bench.preemption_vllm_proc import DispatcherProc, WorkerProc

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


@pytest.mark.parametrize("cls", [Fleet, PFleet, WorkerProc, DispatcherProc])
def test_each_fleets_spawn_takes_the_source_tree(cls, tmp_path: Path):
    fleet = cls(nats_url="nats://127.0.0.1:1", prefix="t", tenants_yaml="", policy="drr",
                log_dir=tmp_path)
    proc = fleet._spawn("probe", ["json.tool", "--help"], REPO)
    assert proc.wait(timeout=20) == 0
    assert fleet.procs[-1] == ("probe", proc)
    assert b"json.tool" in (tmp_path / "probe.log").read_bytes()
