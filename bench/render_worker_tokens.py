"""The worker's token path across commits (bench/bench_worker_tokens.py): the results
markdown and BENCHMARKS.md's block, from its JSON ({"meta", "data": {"base_commit",
"engines": {ENGINE: {"step_model", "streams"}}, "records": [RunRecord, ...], ...}}, a
record's variant being `ENGINE:VARIANT`). Per engine and variant: each figure's
median (min–max) over repetitions. Pure: no fleet, no clock."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench.harness import RunRecord
from bench.render_common import (
    Results,
    failed_run_lines,
    fmt_sum,
    measured_records,
    one_results_file,
    one_stem,
    row_source,
    sources_line,
    table,
)

STEM = "worker_tokens"
TITLE = "The worker's token path: CPU per token and how soon tokens leave, across commits"
VARIANT_LABELS = {
    "base": "base commit's worker, coalesce_ms 5",
    "now": "this commit's worker, coalesce_ms 5 (default)",
    "now-c0": "this commit's worker, coalesce_ms 0 (every token at once)",
}
# (metric key, column header, unit)
FIGURES = (
    ("tokens_per_s", "tokens/s", ""),
    ("chunks_per_token", "chunks per token", ""),
    ("worker_cpu_us_per_token", "worker CPU per token, µs", ""),
    ("worker_cores", "worker cores", ""),
    ("second_token_gap_ms_p50", "second-token gap p50, ms", ""),
    ("tpot_ms_p50", "TPOT p50, ms", ""),
    ("machine_busy_frac", "machine busy", ""),
)
HOW_TO_READ = """\
One worker process (`gpu_worker --engine sim --time-scale 1.0`) streams a closed loop of
requests (256 output tokens each) through a real nats-server and dispatcher to a producer
client; only the worker differs between variants: `base` runs the worker of the base
commit (its tree unpacked from git), `now` this commit's, `now-c0` this commit's with
coalescing off (the floor). Per run, over a window after a warm-up on the same load:
the worker's CPU (utime + stime) per token delivered, its cores, tokens/s and chunks
per token at the client, the second-token gap (a request's second token's arrival
minus its first's: a step, plus any time the worker held the token) and TPOT. Each
cell is the median (min–max) over repetitions; variants interleaved, the order
reversed every other repetition."""


def figures_of(records: Sequence[RunRecord], name: str) -> dict[str, list[Any]]:
    """Each figure's per-repetition values of one `ENGINE:VARIANT`, successful runs."""
    ok = [r for r in records if r.variant == name and r.error is None]
    return {key: [r.metrics.get(key) for r in sorted(ok, key=lambda r: r.rep)]
            for key, _, _ in FIGURES}


def result_table(data: dict, records: Sequence[RunRecord]) -> str:
    rows = []
    for engine, e in data.get("engines", {}).items():
        for variant, label in VARIANT_LABELS.items():
            figs = figures_of(records, f"{engine}:{variant}")
            n = len(figs["tokens_per_s"])
            rows.append([f"`{e['step_model']}`, {e['streams']} streams", f"`{variant}`: {label}",
                         n, *(fmt_sum(figs[key], unit) for key, _, unit in FIGURES)])
    header = ["engine", "worker", "reps", *(h for _, h, _ in FIGURES)]
    return table(header, "llr" + "r" * len(FIGURES), rows)


def setup_line(data: dict) -> str:
    return (f"Base commit {data.get('base_commit')}; outputs {data.get('output_tokens')} "
            f"tokens, prompts {data.get('prompt_tokens')}; warm-up {data.get('warmup_s'):g} s, "
            f"window {data.get('window_s'):g} s; {data.get('reps')} repetitions.")


def report(data: dict) -> str:
    """The results markdown's body."""
    records = measured_records(data, STEM)
    out = ["## Results", "", setup_line(data), "", result_table(data, records)]
    notes = data.get("notes") or []
    if notes:
        out += ["", "## Notes", "", *(f"- {n}" for n in notes)]
    return "\n".join(out + failed_run_lines(data))


def worker_tokens_kind(res: Results, args: list[str], _old: str) -> str:
    """`<!-- generated: worker-tokens STEM -->`: the setup and the table."""
    data = one_results_file(res, "worker-tokens", args)
    records = measured_records(data, one_stem("worker-tokens", args))
    return "\n\n".join([sources_line(res, args), setup_line(data),
                        result_table(data, records)])


def summary_worker_tokens(res: Results) -> list[str]:
    """Per engine: the base commit's worker against this one's, at coalesce_ms 5."""
    data = res.load(STEM).get("data", {})
    records = measured_records(data, STEM)
    parts = []
    for engine, e in data.get("engines", {}).items():
        base = figures_of(records, f"{engine}:base")
        now = figures_of(records, f"{engine}:now")
        parts.append(
            f"`{e['step_model']}`, {e['streams']} streams: worker CPU per token "
            f"{fmt_sum(base['worker_cpu_us_per_token'])} → "
            f"**{fmt_sum(now['worker_cpu_us_per_token'])} µs**, second-token gap p50 "
            f"{fmt_sum(base['second_token_gap_ms_p50'])} → "
            f"{fmt_sum(now['second_token_gap_ms_p50'])} ms")
    return [f"§1 the worker's token path: its CPU per streamed token and its second token's "
            f"gap, base commit {data.get('base_commit')}'s worker → this one's "
            "(coalesce_ms 5, closed loop of 256-token requests, sim engine in real time)",
            "; ".join(parts), "—", row_source(res, STEM)]


KINDS = {"worker-tokens": worker_tokens_kind}
SUMMARY_ROWS = {"worker-tokens": summary_worker_tokens}
