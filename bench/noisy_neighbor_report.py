"""The markdown report of bench/noisy_neighbor.py: one table per scenario, the goals
checked against the drr row, and the problems seen. Pure formatting of the results
that `bench.noisy_neighbor.run_policy` collected."""

from __future__ import annotations

import datetime as dt
import os
import platform
from pathlib import Path

from bench.common import quantile


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def f0(x: float) -> str:
    return "n/a" if x != x else f"{x:,.0f}"


def f1(x: float) -> str:
    return "n/a" if x != x else f"{x:,.1f}"


def report(res: dict[str, dict], args, cmd: str, notes: list[str], wall_s: float, *,
           prompt_tokens: int, weighted: dict[str, float], equal: dict[str, float]) -> str:
    L: list[str] = []
    p = L.append
    slots = args.workers * args.max_num_seqs
    step_ms = 8.0 * args.time_scale
    p("# fairlane fleet benchmark: noisy neighbour and weighted shares (real fleet)\n")
    p(f"- command: `{cmd}`")
    p(f"- date: {dt.datetime.now().astimezone().isoformat(timespec='seconds')}")
    p(f"- machine: nproc={os.cpu_count()}, CPU: {cpu_model()}, python {platform.python_version()}"
      f", {platform.system()} {platform.release()} (CPU shared with other jobs: compare "
      "ratios within this run, not absolute numbers across runs)")
    p(f"- fleet per policy: 1 nats-server (shared, loopback), 1 dispatcher process "
      f"(fresh per policy), {args.workers} sim workers × max_num_seqs {args.max_num_seqs} "
      f"(+prefetch_seqs {args.prefetch_seqs}; rows `drr-pN` use prefetch_seqs N) = "
      f"{slots} batch slots; step model `default`, "
      f"time_scale {args.time_scale} (decode step ≈ {step_ms:.1f} ms wall at small batch)")
    lengths = (f"exactly {args.max_tokens}" if args.fixed_lengths else
               f"uniform in [{args.max_tokens // 2}, {args.max_tokens * 3 // 2}] (mean "
               f"{args.max_tokens}; set as expected_output_tokens, which the simulator honours)")
    p(f"- requests: {prompt_tokens} prompt tokens, output tokens {lengths}; pool cost_model `tokens` "
      f"(prompt×1 + output×2, ≈ {prompt_tokens + 2 * args.max_tokens} per request, "
      "estimated at dispatch, trued up on finish), "
      f"DRR quantum {args.quantum:g}")
    p("- TTFT = client-side monotonic time from `submit()` call to first chunk read")
    p(f"- total wall time {wall_s:.0f} s\n")

    p(f"## 1. Noisy neighbour: A bursts {args.burst:,}, then B sends 5 (same tier, weight 1:1)\n")
    p("B alone = 5 requests from B on the idle fleet (measured just before the burst on the "
      "same dispatcher; 'after' = again after the burst was cleared).\n")
    p("| policy | B alone p50 ms | B alone p99 ms | B p50 ms (with A) | B p99 ms (with A) "
      "| B p99 / B-alone p99 | A publish s | A done before cut-off | A req/s | A TTFT p50 ms "
      "| errors |")
    p("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for pol, r in res.items():
        if "noisy" not in r:
            p(f"| {pol} | failed: {r.get('error', '?')} |")
            continue
        a, n = r["alone"]["b_ttft"], r["noisy"]
        ratio = quantile(n["b_ttft"], 0.99) / quantile(a, 0.99) if a and n["b_ttft"] else float("nan")
        errs = n["b_err"] + n["a_err"] + r["alone"]["b_err"]
        p(f"| {pol} | {f1(quantile(a, .5))} | {f1(quantile(a, .99))} | {f1(quantile(n['b_ttft'], .5))} | "
          f"{f1(quantile(n['b_ttft'], .99))} | {ratio:.2f}× | {n['publish_s']:.1f} | "
          f"{n['a_done']:,} / {args.burst:,} | {f0(n['a_rate'])} | {f0(n['a_ttft_p50'])} | "
          f"{len(errs)} {sorted(set(errs)) if errs else ''} |")
    p("")
    if "drr" in res and "noisy" in res["drr"]:
        a = res["drr"]["alone"]["b_ttft"] + res["drr"]["alone_after"]["b_ttft"]
        b = res["drr"]["noisy"]["b_ttft"]
        ratio = quantile(b, .99) / quantile(a, .99)
        p(f"**Target** B p99 under drr ≤ 1.5× B alone: drr p99 {f1(quantile(b, .99))} ms vs "
          f"alone p99 {f1(quantile(a, .99))} ms (10 samples, before+after) = {ratio:.2f}× → "
          f"{'PASS' if ratio <= 1.5 else 'FAIL'}\n")
    p("B alone, per policy, before / after the burst (p50/p99 ms): " + "; ".join(
        f"{pol} {f1(quantile(r['alone']['b_ttft'], .5))}/{f1(quantile(r['alone']['b_ttft'], .99))} → "
        f"{f1(quantile(r['alone_after']['b_ttft'], .5))}/{f1(quantile(r['alone_after']['b_ttft'], .99))}"
        for pol, r in res.items() if "alone" in r) + "\n")

    p("B's TTFT split (p50 of each part, ms; server-side parts from the final chunk's "
      "`Usage`): dispatcher queue = ingest → dispatch (`queue_ms`); worker = accept → first "
      "token (`ttft_ms`, includes waiting in the engine behind prefetched work and the "
      "prefill step); rest = client TTFT − both (publish + JetStream ack, dispatcher fetch, "
      "WorkBatch reply, chunk coalescing ≤ coalesce_ms 5, relay to the client).\n")
    p("| policy | case | n | client TTFT | dispatcher queue | worker | rest |")
    p("|---|---|---:|---:|---:|---:|---:|")
    for pol, r in res.items():
        for case, key in (("alone", "alone"), ("with A", "noisy"), ("alone after", "alone_after")):
            b = r.get(key, {}).get("b_parts")
            if b:
                p(f"| {pol} | {case} | {b['n']} | {f1(b['client'])} | {f1(b['queue'])} | "
                  f"{f1(b['worker'])} | {f1(b['rest'])} |")
    p("")

    for key, title, weights in (("weighted", "weights 1:2:4", weighted),
                                ("equal", "equal weights, 4 tenants", equal)):
        p(f"## 2{'a' if key == 'weighted' else 'b'}. Backlogged tenants, {title}\n")
        p(f"{args.outstanding} closed-loop clients per tenant (≫ {slots} + "
          f"{args.workers * args.prefetch_seqs} slots); warm-up {args.warmup_s:g} s, window "
          f"{args.window_s:g} s. Share = completion tokens streamed in the window (equal "
          "request shapes, so = share of `tokens` cost).\n")
        p("| policy | " + " | ".join(f"{k} (w={w}) share / target" for k, w in weights.items())
          + " | max rel. err | Jain (weight-norm.) | completion tok/s | vs fifo | "
          "TTFT p50 ms per tenant | min held by dispatcher | errors |")
        p("|---|" + "---:|" * len(weights) + "---:|---:|---:|---:|---|---:|---|")
        base = res.get("fifo", {}).get(key, {}).get("tok_per_s")
        for pol, r in res.items():
            if key not in r:
                continue
            b = r[key]
            rel = max(abs(b["shares"][k] - b["target"][k]) / b["target"][k] for k in weights)
            vs = f"{b['tok_per_s'] / base * 100:.1f}%" if base else "n/a"
            p(f"| {pol} | " + " | ".join(
                f"{b['shares'][k]:.3f} / {b['target'][k]:.3f}" for k in weights)
              + f" | {rel * 100:.1f}% | {b['jain']:.4f} | {f0(b['tok_per_s'])} | {vs} | "
              + "/".join(f0(b["ttft_p50"][k]) for k in weights)
              + f" | {b['min_held']} | {len(b['errors'])} {sorted(set(b['errors'])) or ''} |")
        p("")
        if "drr" in res and key in res["drr"]:
            b = res["drr"][key]
            rel = max(abs(b["shares"][k] - b["target"][k]) / b["target"][k] for k in weights)
            goals = [f"share within ±3% of target (relative): max {rel * 100:.1f}% → "
                     f"{'PASS' if rel <= 0.03 else 'FAIL'}"]
            if key == "equal":
                goals.append(f"Jain ≥ 0.99: {b['jain']:.4f} → "
                             f"{'PASS' if b['jain'] >= 0.99 else 'FAIL'}")
            if base:
                thr = b["tok_per_s"] / base
                goals.append(f"throughput ≥ 97% of fifo: {thr * 100:.1f}% → "
                             f"{'PASS' if thr >= 0.97 else 'FAIL'}")
            p("**drr goals**: " + "; ".join(goals) + "\n")

    p("## Problems seen\n")
    for n in notes:
        p(f"- {n}")
    for pol, r in res.items():
        probs = r.get("log_problems", [])
        if probs:
            p(f"- {pol}: {len(probs)} warning/error log lines; first ones:")
            for line in probs[:5]:
                p(f"  - `{line}`")
    if not notes and not any(r.get("log_problems") for r in res.values()):
        p("- none (no warnings/errors in any process log, every run settled)")
    return "\n".join(L) + "\n"
