"""bench/bench_simulate_scale.py with `--base`: the base-... variant runs the simulator
of a `git archive` of that commit, checked by its child, beside this checkout's, and
the results file names the commit. Interpreted (no mypyc build): the tree and the
environment are what is tested, the same for both kinds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.harness import short_rev

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_a_base_commits_simulator_runs_beside_this_ones(tmp_path):
    # HEAD as the base: any clone has it (a shallow one too).
    out = tmp_path / "scale.md"
    proc = subprocess.run(
        [sys.executable, "bench/bench_simulate_scale.py", "--scales", "10x100",
         "--duration-s", "5", "--variants", "base-interpreted,interpreted", "--base", "HEAD",
         "--reps", "2", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.with_suffix(".json").read_text())["data"]
    assert data["base_commit"] == short_rev("HEAD")
    # Interleaved, the order alternated; the same simulation either way (same commit).
    assert [r["variant"] for r in data["runs"]] == [
        "base-interpreted", "interpreted", "interpreted", "base-interpreted"]
    assert len({(r["arrivals"], r["events"], r["ttft_p99_s"]) for r in data["runs"]}) == 1
    assert f"the simulator of commit {short_rev('HEAD')} (`--base`)" in out.read_text()


def test_an_alt_interpreter_runs_its_variants(tmp_path):
    # This interpreter as the "other" one: what is tested is that the alt-... children
    # run under --alt-python and say so.
    out = tmp_path / "scale.md"
    proc = subprocess.run(
        [sys.executable, "bench/bench_simulate_scale.py", "--scales", "10x100",
         "--duration-s", "5", "--variants", "alt-interpreted,interpreted",
         "--alt-python", sys.executable, "--reps", "1", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(out.with_suffix(".json").read_text())["data"]["runs"]
    assert [r["variant"] for r in runs] == ["alt-interpreted", "interpreted"]
    assert {r["python_executable"] for r in runs} == {sys.executable}
    assert all(isinstance(r["libpython_shared"], bool) for r in runs)
