"""bench/render_instructions.py: the instruction-count table from a results file."""

from __future__ import annotations

import pytest

from bench import render_instructions as ri

pytestmark = pytest.mark.unit


def _run(variant: str, instructions: int, sha: str = "abc", rep: int = 0) -> dict:
    return {"variant": variant, "rep": rep, "python": "3.11.7 (/py)", "instructions": instructions,
            "arrivals": 1000, "events": 8600, "summary_sha256": sha}


def test_each_variant_against_the_base_and_one_simulation():
    data = {"runs": [_run("base", 200_000_000), _run("now", 150_000_000),
                     _run("now", 150_400_000, rep=1)],
            "scale": "100x10000", "duration_s": 20.0, "base_commit": "abc1234"}
    text = ri.report(data)
    assert "| base | 3.11.7 (/py) | 1 | 200.0 | 200.0 k | +0.0% | 1,000 | abc |" in text
    assert "| now | 3.11.7 (/py) | 2 | 150.0–150.4 | 150.0 k | -25.0% | 1,000 | abc |" in text
    assert text.endswith("(one summary hash).")
    assert ri.setup_line(data).startswith("100 workers × 10,000 tenants, 20 simulated s")
    assert "commit abc1234" in ri.setup_line(data)


def test_different_simulations_are_flagged():
    data = {"runs": [_run("base", 200_000_000, "abc"), _run("now", 150_000_000, "def")],
            "scale": "10x100", "duration_s": 5.0, "base_commit": None}
    assert "**The runs' summaries differ (2 hashes): not the same simulation.**" in ri.report(data)
    assert "commit n/a" in ri.setup_line(data)
