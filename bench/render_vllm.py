"""BENCHMARKS.md's real-engine table (section 3) and Summary rows, rendered from the JSON
bench/bench_vllm.py writes ({"meta", "data": {"setup", "warmup", "records": [RunRecord,
...]}}). The figures are bench/bench_vllm_report.py's, the ones the bench's own
markdown prints: per (variant, load) median (min–max) over repetitions, tails pooled
(a p99 only from >= 200 samples), fleet ÷ direct paired per repetition."""

from __future__ import annotations

from collections.abc import Sequence

from bench.bench_vllm_report import (
    TARGET_THROUGHPUT_RATIO,
    figure_lines,
    fmt_ratio,
    fmt_signed,
    fmt_tail_overhead,
    num_reps,
    overheads_ms,
    pairs_txt,
    setup_lines,
    throughput_ratios,
    ttft_p50_ratios,
    variant_table,
    variants_in,
)
from bench.harness import RunRecord, collect, verdict
from bench.render_common import (
    Results,
    fmt_sum,
    measured_records,
    median,
    one_stem,
    row_source,
    sources_line,
)

STEM = "vllm"  # --engine-cpus last: vLLM's processes on a core of their own
SHARED_STEM = "vllm_shared"  # --engine-cpus none
SIM_TOLERANCE = 0.10  # simulator ÷ vLLM, the fidelity target of issue 12


def _run(res: Results, stem: str, need: Sequence[str] = ()) -> tuple[list[RunRecord], dict]:
    """The measured records (`measured_records`) and the run's setup."""
    data = res.load(stem).get("data", {})
    return measured_records(data, stem, need), data.get("setup", {})


def vllm_table(res: Results, args: list[str], _old: str) -> str:
    """`<!-- generated: vllm STEM -->`: the setup, the per-variant table and the paired
    comparisons of one bench/bench_vllm.py run."""
    records, setup = _run(res, one_stem("vllm", args))
    return "\n".join([sources_line(res, args), "", *setup_lines(setup), "",
                      variant_table(records), "", *figure_lines(records)])


def summary_throughput(res: Results) -> list[str]:
    records, setup = _run(res, STEM, ["direct", "fleet"])
    thr = throughput_ratios(records)
    bound = setup.get("direct_bound") or "no"
    alone = str(setup.get("cpu_layout", "")).startswith("engine isolated")
    layout = ("vLLM's processes on a core of their own, as the model on a GPU host"
              if alone else "every process sharing every core")
    return [f"§3 output tokens/s through fairlane ÷ the same vLLM engine fed directly "
            f"(direct bounded to {bound} requests in the engine, the worker's bound; "
            f"{layout})",
            f"**{fmt_ratio(thr)}** over {pairs_txt(len(thr), num_reps(records))}",
            f"≥ {TARGET_THROUGHPUT_RATIO:g} — "
            f"{verdict(median(thr), TARGET_THROUGHPUT_RATIO, higher_is_better=True)}",
            row_source(res, STEM)]


def summary_shared(res: Results) -> list[str]:
    records, _ = _run(res, SHARED_STEM, ["direct", "fleet"])
    thr = throughput_ratios(records)
    direct = collect(records, "direct", "loaded.tok_s")
    return ["§3 the same, but every process shares both cores (a CPU-only host: the "
            "fleet's processes take their CPU from the model's)",
            f"{fmt_ratio(thr)} over {pairs_txt(len(thr), num_reps(records))}; direct's "
            f"own tok/s: {fmt_sum(direct)}",
            "— (a CPU-only host's figure; the row above is a GPU host's analogue)",
            row_source(res, SHARED_STEM)]


def summary_ttft(res: Results) -> list[str]:
    records, _ = _run(res, STEM, ["direct", "fleet"])
    return ["§3 TTFT overhead at light load on vLLM (fleet − direct)",
            f"p50 {fmt_signed(overheads_ms(records))} per rep; {fmt_tail_overhead(records)}",
            "—", row_source(res, STEM)]


def summary_sim(res: Results) -> list[str]:
    records, _ = _run(res, STEM, ["direct", "sim-direct"])
    direct = (throughput_ratios(records, "sim-direct", "direct"),
              ttft_p50_ratios(records, "sim-direct", "direct"))
    parts = [f"direct: tok/s {fmt_ratio(direct[0])}, TTFT p50 {fmt_ratio(direct[1])}"]
    if {"fleet", "sim-fleet"} <= set(variants_in(records)):
        parts.append(f"fleet: tok/s {fmt_ratio(throughput_ratios(records, 'sim-fleet', 'fleet'))}"
                     f", TTFT p50 {fmt_ratio(ttft_p50_ratios(records, 'sim-fleet', 'fleet'))}")
    ok = all(abs(median(r) - 1) <= SIM_TOLERANCE for r in direct)
    return ["§3 simulator (`vllm_cpu_tiny`) ÷ vLLM-CPU, same workload, loaded",
            "; ".join(parts),
            f"direct: tok/s and TTFT p50 within {SIM_TOLERANCE:.0%} (issue 12) — "
            f"{'met' if ok else 'missed'} (medians)", row_source(res, STEM)]


KINDS = {"vllm": vllm_table}
SUMMARY_ROWS = {"vllm-throughput": summary_throughput, "vllm-shared": summary_shared,
                "vllm-ttft": summary_ttft,
                "vllm-sim": summary_sim}
