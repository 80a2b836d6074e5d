from __future__ import annotations

import asyncio
import json
import math

import pytest

from bench.harness import (
    MIN_P99_SAMPLES,
    RunMeta,
    RunRecord,
    by_variant,
    collect,
    command_line,
    dig,
    fmt_num,
    fmt_tail,
    format_commit,
    interleaved_order,
    p99,
    ratio,
    results_header,
    run_interleaved,
    summarize,
    tail,
    verdict,
    write_results,
)

pytestmark = pytest.mark.unit

META = RunMeta("python bench/x.py --quick", "abc1234 dirty", "2026-01-02T03:04:05Z", "nproc=2")


def test_interleaved_order_alternates():
    assert interleaved_order(["a", "b", "c"], 3) == [
        (0, "a"), (0, "b"), (0, "c"),
        (1, "c"), (1, "b"), (1, "a"),
        (2, "a"), (2, "b"), (2, "c"),
    ]


def test_interleaved_order_every_variant_once_per_rep():
    order = interleaved_order(["x", "y"], 4)
    for r in range(4):
        assert sorted(v for rep, v in order if rep == r) == ["x", "y"]
    assert interleaved_order(["x"], 0) == []


def test_interleaved_order_rejects_bad_input():
    with pytest.raises(ValueError):
        interleaved_order(["a", "a"], 1)
    with pytest.raises(ValueError):
        interleaved_order(["a"], -1)


def test_p99_needs_200_samples():
    assert MIN_P99_SAMPLES == 200
    assert p99([1.0] * 199) is None
    xs = [float(i) for i in range(200)]
    assert p99(xs) == pytest.approx(197.01)  # linear interpolation at 0.99 * 199


def test_tail_falls_back_to_max():
    assert tail([3.0, 1.0, 2.0]) == ("max", 3.0)
    label, v = tail([])
    assert label == "max" and math.isnan(v)
    xs = [float(i) for i in range(1000)]
    assert tail(xs) == ("p99", pytest.approx(989.01))


def test_fmt_tail():
    assert fmt_tail([1.0, 2.5]) == "max=2.5"
    assert fmt_tail([1.0] * 300) == "1.0"
    assert fmt_tail([]) == "max=n/a"


def test_summarize_median_and_range():
    s = summarize([3.0, 1.0, 2.0, None, math.nan])
    assert (s.median, s.lo, s.hi, s.n) == (2.0, 1.0, 3.0, 3)
    assert s.fmt(1) == "2.0 (1.0–3.0)"
    assert summarize([4.0, 1.0]).median == 2.5
    assert summarize([5.0]).fmt(0, " ms") == "5 ms"
    empty = summarize([])
    assert empty.n == 0 and empty.fmt() == "n/a"


def test_ratio_and_verdict():
    assert ratio(3.0, 2.0) == 1.5
    assert math.isnan(ratio(1.0, 0.0))
    assert math.isnan(ratio(None, 1.0))
    assert math.isnan(ratio(math.nan, 1.0))
    assert verdict(1.4, 1.5) == "met"
    assert verdict(1.6, 1.5) == "missed"
    assert verdict(0.98, 0.97, higher_is_better=True) == "met"
    assert verdict(0.96, 0.97, higher_is_better=True) == "missed"
    assert verdict(math.nan, 1.5) == "n/a"


def test_fmt_num():
    assert fmt_num(1234.567, 1) == "1,234.6"
    assert fmt_num(None) == "n/a"
    assert fmt_num(math.nan) == "n/a"
    assert fmt_num(math.inf) == "inf"


def test_format_commit():
    assert format_commit("abc1234\n", "") == "abc1234"
    assert format_commit("abc1234", " M bench/x.py\n") == "abc1234 dirty"
    assert format_commit("", "") == "unknown"
    # Results files a benchmark batch rewrote are not changes to the code that ran.
    assert format_commit("abc1234", " M bench/results/path.json\n") == "abc1234"
    assert format_commit("abc1234", " M bench/results/a.md\n M dispatcher/x.py\n") == \
        "abc1234 dirty"
    assert format_commit("abc1234", "R  bench/results/a.md -> bench/b.py\n") == "abc1234 dirty"


def test_command_line_quotes():
    assert command_line(["bench/p.py", "--quick", "a b"]) == "python bench/p.py --quick 'a b'"


def test_dig_and_collect():
    d = {"a": {"b": 2}}
    assert dig(d, "a.b") == 2
    assert dig(d, "a.c") is None
    assert dig(d, "x.y") is None
    recs = [RunRecord("v", 1, 3, {"a": {"b": 5}}), RunRecord("v", 0, 0, {"a": {"b": 4}}),
            RunRecord("v", 2, 6, {}, error="boom"), RunRecord("w", 0, 1, {"a": {}})]
    assert collect(recs, "v", "a.b") == [4, 5]  # rep order, failed run skipped
    assert collect(recs, "w", "a.b") == []
    assert [r.rep for r in by_variant(recs)["v"]] == [0, 1]


def test_run_interleaved_records_failures_and_goes_on():
    seen: list[tuple[str, int]] = []

    async def one(variant: str, rep: int) -> dict:
        seen.append((variant, rep))
        if variant == "b" and rep == 1:
            raise RuntimeError("boom")
        return {"x": rep}

    recs = asyncio.run(run_interleaved(["a", "b"], 2, one, log=lambda s: None))
    assert seen == [("a", 0), ("b", 0), ("b", 1), ("a", 1)]
    assert [r.position for r in recs] == [0, 1, 2, 3]
    failed = [r for r in recs if r.error]
    assert len(failed) == 1 and "boom" in failed[0].error and failed[0].variant == "b"


def test_results_header_has_metadata_first():
    text = results_header("Title", META, "Read the ratios.")
    lines = text.splitlines()
    assert lines[0] == "# Title"
    assert "- command: `python bench/x.py --quick`" in lines
    assert "- commit: abc1234 dirty" in lines
    assert "- date (UTC): 2026-01-02T03:04:05Z" in lines
    assert "- machine: nproc=2" in lines
    assert text.index("- command") < text.index("## How to read this") < text.index("Read the")


def test_write_results_writes_md_and_json(tmp_path):
    md, js = write_results(tmp_path / "out" / "r.md", "T", "| a |\n", {"x": math.nan, "y": [1, 2]},
                           META)
    assert md.read_text().startswith("# T\n")
    assert md.read_text().rstrip().endswith("| a |")
    assert js == tmp_path / "out" / "r.json"
    doc = json.loads(js.read_text())
    assert doc["meta"]["commit"] == "abc1234 dirty"
    assert doc["data"] == {"x": None, "y": [1, 2]}
