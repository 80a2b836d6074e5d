"""The markdown report of bench/bench_vllm.py: the phase table, the fleet/direct and
simulator/vLLM ratios, and how to read them. Pure formatting."""

from __future__ import annotations

import datetime as dt
import os
import platform
import statistics
from typing import Any

from bench.common import quantile


def report(results: list[Any], command: str, machine: str, args, bench_s: float, *,
           max_num_seqs: int, max_model_len: int, ttft_prompt_tokens: int,
           ttft_max_tokens: int) -> str:
    """Markdown for `bench_vllm.run`'s phase results (`bench_vllm.PhaseResult`)."""
    by = {r.name: r for r in results}
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    n, p, m = args.requests, args.prompt_tokens, args.max_tokens
    lines = [
        "# vLLM-CPU: fleet overhead and simulator fidelity",
        "",
        f"- command: `{command}`",
        f"- date: {now}; measured part took {bench_s:.0f} s",
        f"- machine: {machine}; host {platform.node()}",
        f"- engine: one `VllmEngine` (max_num_seqs {max_num_seqs}, max_model_len "
        f"{max_model_len}, prefix caching off, detokenize on) shared by every vLLM phase; "
        f"worker prefetch_seqs {args.prefetch_seqs}, coalesce_ms 5; dispatcher policy drr; "
        f"nats-server on loopback; dispatcher, worker and client in one asyncio process "
        f"with vLLM's front end (the engine core is vLLM's own process)",
        f"- throughput workload: {n} requests, {p} prompt tokens each (distinct ids), "
        f"exactly {m} output tokens each (no EOS in the tiny model), all submitted at once; "
        f"TTFT/e2e measured from submit; tok/s = output tokens / (first submit -> last token)",
        f"- light load: {args.ttft_requests} requests one at a time, {ttft_prompt_tokens} "
        f"prompt tokens, {ttft_max_tokens} output tokens",
        "- simulator: `SimEngine` with step model `vllm_cpu_tiny`, time_scale 1.0, same "
        "workloads",
        "",
        "| phase | wall s | output tokens | tok/s | TTFT p50 ms | TTFT p99 ms | "
        "e2e p50 ms | e2e p99 ms | mean batch | CPU s main | CPU s engine core | "
        "CPU s nats-server |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(r.row() for r in results),
        "",
        "## Summary",
        "",
    ]
    for rnd in (1, 2):
        d, f = by[f"vLLM direct #{rnd}"], by[f"vLLM fleet #{rnd}"]
        lines.append(f"- throughput round {rnd}: fleet/direct = {f.tok_s / d.tok_s:.3f} "
                     f"({f.tok_s:,.0f} vs {d.tok_s:,.0f} tok/s)")
    for rnd in (1, 2):
        d, f = by[f"vLLM direct light #{rnd}"], by[f"vLLM fleet light #{rnd}"]
        lines.append(
            f"- light-load TTFT round {rnd}: fleet overhead p50 "
            f"{quantile(f.ttft_ms, 0.50) - quantile(d.ttft_ms, 0.50):+.1f} ms, p99 "
            f"{quantile(f.ttft_ms, 0.99) - quantile(d.ttft_ms, 0.99):+.1f} ms "
            f"(direct p50 {quantile(d.ttft_ms, 0.50):.1f} / p99 {quantile(d.ttft_ms, 0.99):.1f}; fleet "
            f"p50 {quantile(f.ttft_ms, 0.50):.1f} / p99 {quantile(f.ttft_ms, 0.99):.1f})")
    real_d = [by["vLLM direct #1"], by["vLLM direct #2"]]
    real_f = [by["vLLM fleet #1"], by["vLLM fleet #2"]]
    real_dl = [by["vLLM direct light #1"], by["vLLM direct light #2"]]

    def mean(f, rs):
        return statistics.fmean(f(r) for r in rs)

    for label, sim_r, reals in (
        ("direct", by["sim direct"], real_d),
        ("fleet", by["sim fleet"], real_f),
    ):
        rt = mean(lambda r: r.tok_s, reals)
        rttft = mean(lambda r: quantile(r.ttft_ms, 0.50), reals)
        re2e = mean(lambda r: quantile(r.e2e_ms, 0.50), reals)
        lines.append(
            f"- simulator vs vLLM ({label}, loaded): tok/s {sim_r.tok_s:,.0f} vs {rt:,.0f} "
            f"({sim_r.tok_s / rt:.2f}x); TTFT p50 {quantile(sim_r.ttft_ms, 0.50):.0f} vs "
            f"{rttft:.0f} ms ({quantile(sim_r.ttft_ms, 0.50) / rttft:.2f}x); e2e p50 "
            f"{quantile(sim_r.e2e_ms, 0.50):.0f} vs {re2e:.0f} ms "
            f"({quantile(sim_r.e2e_ms, 0.50) / re2e:.2f}x)")
    sl = by["sim direct light"]
    lines.append(
        f"- simulator vs vLLM (direct, light): TTFT p50 {quantile(sl.ttft_ms, 0.50):.1f} vs "
        f"{mean(lambda r: quantile(r.ttft_ms, 0.50), real_dl):.1f} ms; e2e p50 "
        f"{quantile(sl.e2e_ms, 0.50):.1f} vs {mean(lambda r: quantile(r.e2e_ms, 0.50), real_dl):.1f} ms")
    busy = [r for r in results if r.name.startswith("vLLM")]
    cores = ", ".join(f"{r.name} {r.cpu_engine_s / r.wall_s:.1f}" for r in busy)
    lines += [
        "",
        "## Reading it",
        "",
        "- `CPU s engine core` is the CPU time of vLLM's child processes (engine core and "
        "its worker; nats-server has its own column) during the phase. CPU-seconds per "
        f"wall-second (about the cores kept busy): {cores} (the machine reports "
        f"{os.cpu_count()} cores). Whatever else the fleet needs (nats-server, the "
        "dispatcher, worker and client in this process) competes with them for the same "
        "cores, and so do other jobs on a shared machine; direct phases need none of it. "
        "On a GPU host the engine's compute is off the CPU and this contention is absent.",
        "- `mean batch` is the engine's running sequences sampled every 10 ms.",
        "- Phases of the same kind differ run to run by 10-20% on a shared 2-core machine; "
        "compare the A/B pairs, not single numbers.",
    ]
    return "\n".join(lines) + "\n"
