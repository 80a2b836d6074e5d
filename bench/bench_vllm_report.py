"""The figures and markdown of bench/bench_vllm.py, and the same figures for
BENCHMARKS.md (bench/render_vllm.py renders them from the JSON): pure functions over
`bench.harness.RunRecord`s, no engine, no clock.

A record is one (variant, repetition); its metrics are
``{"loaded": PHASE, "light": PHASE}``, a PHASE being ``{"wall_s", "output_tokens",
"tok_s", "ttft_ms": [...], "e2e_ms": [...], ...}`` with one sample per request.
Comparisons are paired: fleet and direct of the SAME repetition (they ran back to back),
then the median (min–max) over repetitions. Tails pool a variant's samples over the
repetitions and are a p99 only from >= 200 of them (`bench.harness.p99`), else the max.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

from bench.common import quantile
from bench.harness import MIN_P99_SAMPLES, RunRecord, by_variant, collect, fmt_tail, summarize
from bench.render_common import digits_for, fmt_sig, fmt_sum, table

VARIANTS = ("direct", "fleet", "sim-direct", "sim-fleet")
LOADS = ("loaded", "light")
TARGET_THROUGHPUT_RATIO = 0.95  # fleet ÷ direct output tok/s (BENCHMARKS.md Summary)

Metric = Callable[[dict[str, Any]], float]


# --- per-repetition figures -------------------------------------------------------------


def tok_s(m: dict[str, Any]) -> float:
    return m["loaded"]["tok_s"]


def p50_of(load: str, key: str = "ttft_ms") -> Metric:
    """The median of one phase's per-request samples (`key`) of a record's metrics."""
    return lambda m: quantile(m[load][key], 0.50)


def per_rep(records: Sequence[RunRecord], variant: str, metric: Metric) -> dict[int, float]:
    """repetition -> `metric` of the variant's successful record in it."""
    return {r.rep: metric(r.metrics) for r in by_variant(records).get(variant, [])}


def paired(records: Sequence[RunRecord], num: str, den: str, metric: Metric,
           op: Callable[[float, float], float]) -> list[float]:
    """op(num's metric, den's metric) for every repetition where both variants ran."""
    a, b = per_rep(records, num, metric), per_rep(records, den, metric)
    return [op(a[rep], b[rep]) for rep in sorted(a.keys() & b.keys())]


def _div(a: float, b: float) -> float:
    return a / b if b else float("nan")


def throughput_ratios(records: Sequence[RunRecord], num: str = "fleet",
                      den: str = "direct") -> list[float]:
    """num ÷ den output tok/s per repetition: the headline, fleet ÷ direct."""
    return paired(records, num, den, tok_s, _div)


def ttft_p50_ratios(records: Sequence[RunRecord], num: str, den: str,
                    load: str = "loaded") -> list[float]:
    return paired(records, num, den, p50_of(load), _div)


def overheads_ms(records: Sequence[RunRecord], num: str = "fleet", den: str = "direct",
                 load: str = "light") -> list[float]:
    """num − den TTFT p50 per repetition (ms): the fleet's light-load overhead."""
    return paired(records, num, den, p50_of(load), operator.sub)


# --- pooled tails -----------------------------------------------------------------------


def pooled(records: Sequence[RunRecord], variant: str, load: str,
           key: str = "ttft_ms") -> list[float]:
    """Every request's `key` sample of the variant's `load` phase, over all repetitions."""
    return [x for xs in collect(records, variant, f"{load}.{key}") for x in xs]


def tail_overhead(records: Sequence[RunRecord], num: str = "fleet", den: str = "direct",
                  load: str = "light") -> tuple[str, float, int, int]:
    """(label, num's pooled tail − den's, num's samples, den's samples): label "p99"
    when both pools hold >= MIN_P99_SAMPLES, else "max" (both sides' max: a p99 of one
    and the max of the other would not be the same statistic)."""
    a, b = pooled(records, num, load), pooled(records, den, load)
    if not a or not b:
        return "max", float("nan"), len(a), len(b)
    if min(len(a), len(b)) >= MIN_P99_SAMPLES:
        return "p99", quantile(a, 0.99) - quantile(b, 0.99), len(a), len(b)
    return "max", max(a) - max(b), len(a), len(b)


# --- formatting ---------------------------------------------------------------------------


def fmt_signed(values: Sequence[float], unit: str = " ms") -> str:
    """Median over repetitions with its sign, then the range: "+3.1 ms (+2.5 to +4.0)"."""
    s = summarize(values)
    if s.n == 0:
        return "n/a"
    d = digits_for(s.median)
    med = f"{s.median:+.{d}f}{unit}"
    return med if s.n == 1 else f"{med} ({s.lo:+.{d}f} to {s.hi:+.{d}f})"


def fmt_ratio(values: Sequence[float]) -> str:
    """Ratios over repetitions to three decimals: "0.931 (0.880–0.970)"."""
    return fmt_sum(values, digits=3)


def fmt_tail_overhead(records: Sequence[RunRecord], num: str = "fleet",
                      den: str = "direct") -> str:
    label, v, n_num, n_den = tail_overhead(records, num, den)
    if v != v:  # NaN: a side has no samples
        return f"{label} n/a"
    return f"{label} {v:+.1f} ms (pooled, {n_num} / {n_den} samples)"


def pairs_txt(num_pairs: int, reps: int) -> str:
    """"6 interleaved repetitions", or "5 of 6 interleaved repetitions (a side failed in
    the others)"."""
    if num_pairs == reps:
        return f"{reps} interleaved repetitions"
    return f"{num_pairs} of {reps} interleaved repetitions (a side failed in the others)"


def variants_in(records: Sequence[RunRecord]) -> list[str]:
    groups = by_variant(records)
    return [v for v in VARIANTS if v in groups]


def num_reps(records: Sequence[RunRecord]) -> int:
    return len({r.rep for r in records if r.error is None})


def variant_table(records: Sequence[RunRecord]) -> str:
    """Per variant and load: output tok/s, TTFT p50, TTFT p99 (or max), e2e p50 —
    median (min–max) over repetitions; the tail pooled over them."""
    rows = []
    for v in variants_in(records):
        for load in LOADS:
            ttft = pooled(records, v, load)
            # fmt_tail writes "max=…" itself when the pool is under 200 samples.
            tail_txt = fmt_tail(ttft, digits_for(max(ttft) if ttft else None))
            rows.append([
                v, load,
                fmt_sum(per_rep(records, v, tok_s).values(), digits=0) if load == "loaded"
                else "—",
                fmt_sum(per_rep(records, v, p50_of(load)).values()),
                tail_txt,
                fmt_sum(per_rep(records, v, p50_of(load, "e2e_ms")).values()),
                f"{len(ttft):,}",
            ])
    header = ["variant", "load", "output tok/s", "TTFT p50 ms", "TTFT p99 ms",
              "e2e p50 ms", "TTFT samples (pooled)"]
    return table(header, "llrrrrr", rows)


def figure_lines(records: Sequence[RunRecord]) -> list[str]:
    """The paired comparisons under the table, as markdown bullets."""
    reps = num_reps(records)
    thr = throughput_ratios(records)
    lines = [
        f"- **fleet ÷ direct output tok/s: {fmt_ratio(thr)}** — median (min–max) over "
        f"{pairs_txt(len(thr), reps)}; per repetition: " + ", ".join(f"{x:.3f}" for x in thr),
        f"- light-load TTFT overhead, fleet − direct: p50 {fmt_signed(overheads_ms(records))}"
        f" per repetition; {fmt_tail_overhead(records)}",
    ]
    sims = [(s, v) for s, v in (("sim-direct", "direct"), ("sim-fleet", "fleet"))
            if s in variants_in(records) and v in variants_in(records)]
    for s, v in sims:
        lines.append(
            f"- simulator ÷ vLLM ({s} ÷ {v}): output tok/s "
            f"{fmt_ratio(throughput_ratios(records, s, v))}, loaded TTFT p50 "
            f"{fmt_ratio(ttft_p50_ratios(records, s, v))}; light TTFT p50 "
            f"{fmt_signed(overheads_ms(records, s, v))}")
    return lines


def run_rows(records: Sequence[RunRecord]) -> str:
    """Every (variant, repetition) in run order: what the summaries are made of."""
    rows = []
    for r in sorted(records, key=lambda r: r.position):
        if r.error is not None:
            rows.append([r.rep, r.position, r.variant, f"failed: {r.error}"] + [""] * 8)
            continue
        ld, lt = r.metrics["loaded"], r.metrics["light"]
        cores = ld["cpu_engine_s"] / ld["wall_s"] if ld["wall_s"] else float("nan")
        rows.append([
            r.rep, r.position, r.variant, f"{ld['tok_s']:,.0f}",
            fmt_sig(quantile(ld["ttft_ms"], 0.5)), fmt_sig(quantile(ld["e2e_ms"], 0.5)),
            f"{ld['mean_running']:.1f}", f"{ld['mean_in_engine']:.1f} / {ld['max_in_engine']}",
            f"{cores:.2f}", f"{ld['cpu_main_s']:.1f}", f"{ld['cpu_nats_s']:.1f}",
            fmt_sig(quantile(lt["ttft_ms"], 0.5)),
        ])
    header = ["rep", "#", "variant", "tok/s", "TTFT p50 ms", "e2e p50 ms", "mean batch",
              "in engine mean / max", "engine-core cores", "CPU s main", "CPU s nats",
              "light TTFT p50 ms"]
    return table(header, "rrlrrrrrrrrr", rows)


HOW_TO_READ = """\
Variants `direct` (vLLM's `generate` called in this process) and `fleet` (producer →
nats → dispatcher → worker → the same engine), and the simulator's `sim-direct` /
`sim-fleet`, run interleaved: every repetition runs each variant once, the order
reversed on every other repetition. Each run is the loaded workload (all requests
submitted at once) then the light one (one request at a time). Direct keeps at most
`max_num_seqs + prefetch_seqs` requests in the engine (a semaphore), the bound the
worker keeps through the fleet, so both sides see the same queue depth; TTFT counts
from submit, queueing included, on both sides. Ratios and differences are paired
(fleet and direct of the same repetition), then median (min–max) over repetitions. A
tail is a p99 only over >= 200 pooled samples, else "max=". The CPU layout line says
whether vLLM's processes had a core to themselves (`--engine-cpus`, the default: as the
model has a GPU to itself on a GPU host) or shared every core with the fleet's
processes, which then take their CPU from the model's. The simulator's steps are
sleeps on this process's event loop, which in `sim-fleet` also runs the dispatcher, worker and client:
their CPU work lengthens every simulated step (the real engine steps in a process of its
own), so `sim-fleet` reads low when this process is short of CPU; `sim-direct` ÷
`direct` is the fidelity figure."""


def setup_lines(setup: dict[str, Any]) -> list[str]:
    s = setup
    return [
        f"- engine: one `VllmEngine` (max_num_seqs {s['max_num_seqs']}, max_model_len "
        f"{s['max_model_len']}, prefix caching off) shared by every vLLM run; worker "
        f"prefetch_seqs {s['prefetch_seqs']}; direct bound {s['direct_bound'] or 'none'} "
        f"requests in the engine; `SimEngine` `vllm_cpu_tiny`, time_scale 1.0",
        f"- loaded: {s['requests']} requests × ({s['prompt_tokens']} prompt + exactly "
        f"{s['max_tokens']} output tokens), submitted at once; tok/s = output tokens / "
        f"(first submit → last token)",
        f"- light: {s['light_requests']} requests one at a time per run "
        f"({s['light_prompt_tokens']} prompt + {s['light_max_tokens']} output tokens)",
        f"- CPU layout: {s.get('cpu_layout', 'shared (not recorded: before --engine-cpus)')}",
        f"- simulator step model: {s.get('step_model', 'not recorded')}",
        f"- {s['reps']} repetitions of {', '.join(s['variants'])}, order reversed every "
        f"other repetition, after {s['warmup']}",
    ]


def report(records: Sequence[RunRecord], warmup: Sequence[RunRecord],
           setup: dict[str, Any]) -> str:
    """The results markdown's body (bench.harness.write_results adds the header)."""
    failed = [r for r in list(records) + list(warmup) if r.error is not None]
    lines = [
        *setup_lines(setup),
        f"- machine detail: {setup.get('machine_detail', '?')}; loadavg at start "
        f"{setup.get('loadavg_start')}, at end {setup.get('loadavg_end')}; engine started "
        f"in {setup.get('engine_start_s', 0):.0f} s; measured part {setup.get('bench_s', 0):.0f} s",
        "", "## Summary", "", variant_table(records), "", *figure_lines(records), "",
        "## Every run", "", run_rows(records), "",
        "`in engine`: requests submitted to the engine and not finished (running + "
        "waiting), sampled every 10 ms; `engine-core cores`: CPU seconds of vLLM's child "
        "processes per wall second of the loaded phase (0 for the simulator).",
    ]
    if failed:
        lines += ["", "## Failed runs", ""]
        lines += [f"- {r.variant} rep {r.rep}: {r.error}" for r in failed]
    return "\n".join(lines) + "\n"
