"""The figures of bench/preemption_vllm.py, pure (no engine, no clock): its results
markdown and BENCHMARKS.md's Summary row (bench/render_preemption_vllm.py) compute them
here alike.

A record is one (variant, repetition) whose metrics hold B's TTFTs in ms: ``alone``
(the first repetition(s) only: B on the idle engine) and ``during`` (A's burst queued),
and ``preemptions_per_s``. The ratio per repetition is the p99 during (the max where
under 200 samples) ÷ the p99 alone pooled over the alone repetitions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bench.common import quantile
from bench.harness import RunRecord, Summary, collect, ratio, summarize, tail

VARIANTS = ("drr", "drr+preempt")
TARGET_RATIO = 1.5  # issue 10: B's TTFT p99 during ÷ alone


def tail_ms(xs: Sequence[float]) -> float:
    """The p99 from >= 200 samples, else the max; NaN for none (`harness.tail`)."""
    return tail(xs)[1]


@dataclass(frozen=True)
class VariantFigures:
    alone: list[float]  # pooled over the alone repetitions
    alone_tail: float  # NaN without alone samples
    during: list[list[float]]  # per repetition
    p50s: Summary
    tails: Summary
    ratios: Summary
    preemptions_per_s: Summary


def variant_figures(records: Sequence[RunRecord], variant: str) -> VariantFigures:
    alone = [x for xs in collect(records, variant, "alone") if xs for x in xs]
    during = [xs for xs in collect(records, variant, "during") if xs]
    a_tail = tail_ms(alone)
    return VariantFigures(
        alone=alone, alone_tail=a_tail, during=during,
        p50s=summarize(quantile(xs, 0.5) for xs in during),
        tails=summarize(tail_ms(xs) for xs in during),
        ratios=summarize(ratio(tail_ms(xs), a_tail) for xs in during),
        preemptions_per_s=summarize(collect(records, variant, "preemptions_per_s")),
    )
