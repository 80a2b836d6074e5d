"""bench/bench_worker_tokens.py end to end on a real fleet (nats-server, a dispatcher,
one simulated worker), its base worker run from a `git archive` of a commit: every
variant's run measures tokens and the worker's CPU, and the results file says which
commit the base was."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.harness import short_rev

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def test_the_bench_compares_a_commits_worker_with_this_ones(tmp_path):
    # HEAD as the base: any clone has it (a shallow one too).
    out = tmp_path / "wt.md"
    proc = subprocess.run(
        [sys.executable, "bench/bench_worker_tokens.py", "--base", "HEAD", "--engines",
         "default", "--reps", "1", "--warmup-s", "1", "--window-s", "3", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.with_suffix(".json").read_text())["data"]
    assert data["base_commit"] == short_rev("HEAD")
    runs = {r["variant"]: r for r in data["records"]}
    assert set(runs) == {"default:base", "default:now", "default:now-c0"}
    for r in runs.values():
        m = r["metrics"]
        assert r["error"] is None and m["errors"] == []
        assert m["tokens"] > 500 and m["worker_cpu_us_per_token"] > 0
        assert 0.5 < m["chunks_per_token"] <= 1.0  # ~13 ms steps: one token per chunk
    assert "| `default`, 32 streams | `base`" in out.read_text()
