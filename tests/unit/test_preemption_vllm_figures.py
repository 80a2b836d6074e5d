"""bench/preemption_vllm_figures.py: the vLLM-CPU noisy-neighbour figures its results
markdown and BENCHMARKS.md's Summary row share."""

from __future__ import annotations

import math

import pytest

from bench.harness import RunRecord
from bench.preemption_vllm_figures import tail_ms, variant_figures

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


def rec(variant: str, rep: int, during: list[float], alone: list[float] | None = None,
        pre: float = 0.0) -> RunRecord:
    metrics = {"during": during, "preemptions_per_s": pre}
    if alone is not None:
        metrics["alone"] = alone
    return RunRecord(variant, rep, rep, metrics)


def test_the_tail_is_a_p99_only_from_200_samples():
    assert tail_ms([float(x) for x in range(1, 200)]) == 199.0  # 199 samples: the max
    xs = [float(x) for x in range(1, 201)]
    assert tail_ms(xs) == pytest.approx(198.01)  # interpolated p99
    assert math.isnan(tail_ms([]))


def test_each_repetitions_tail_is_divided_by_the_pooled_alone_tail():
    alone = [10.0] * 150 + [20.0] * 60  # 210 samples: p99 20
    records = [rec("drr+preempt", 0, [30.0] * 205, alone, pre=9.0),
               rec("drr+preempt", 1, [40.0] * 205, pre=11.0),
               rec("drr+preempt", 2, [30.0] * 200 + [100.0] * 5, pre=10.0),
               rec("drr", 0, [1000.0] * 205, alone)]
    f = variant_figures(records, "drr+preempt")
    assert f.alone_tail == pytest.approx(20.0)
    # Per repetition 30/20, 40/20 and 100/20: the p99 of 205 samples, 5 of them 100.
    assert (f.ratios.median, f.ratios.lo, f.ratios.hi, f.ratios.n) == (2.0, 1.5, 5.0, 3)
    assert f.p50s.median == 30.0 and f.preemptions_per_s.median == 10.0
    assert variant_figures(records, "drr").ratios.median == pytest.approx(50.0)


def test_no_alone_samples_make_the_ratio_unknown_not_zero():
    f = variant_figures([rec("drr", 0, [5.0] * 10)], "drr")
    assert math.isnan(f.alone_tail) and f.ratios.n == 0 and math.isnan(f.ratios.median)
