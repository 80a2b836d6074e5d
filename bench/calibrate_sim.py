"""Calibrate the simulator's step-time model against vLLM-CPU on the tiny test model.

    python bench/calibrate_sim.py [--out gpu_worker/sim/step_models/vllm_cpu_tiny.json]

Starts one real vLLM engine (through `gpu_worker.vllm_engine.VllmEngine`, so adapter
overhead is included) on the tiny random-weight Llama from tests/vllm, then

* decode: for several (batch size B, prompt length L) points runs B identical-length
  requests together and measures the time per engine step once all B are decoding
  and before any finishes (wall time / tokens of one request over that window), with
  the KV tokens in use at the window's midpoint;
* prefill: times-to-first-token for single prompts of several lengths and for a
  few concurrent batches, fitting ``t = c + prompt_tokens / prefill_tokens_per_s``.

The engine runs on a core of its own (`--engine-cpus`, bench/cpu_layout.py), the layout
bench/bench_vllm.py compares the simulator with it in. Then it fits
``step_ms = base + per_seq * B + per_kv_token * kv_tokens`` by non-negative least squares
and writes the step model (format in `gpu_worker.sim.step_model`) with the raw samples.
Prefix caching is off so repeated prompts are really prefilled. Bounded: about 1-2 minutes on two cores.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import platform
import sys
import tempfile
import time
import uuid
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.cpu_layout import (  # noqa: E402
    add_engine_cpus_arg,
    describe,
    engine_cpus_of,
    isolate_engine,
    omp_bind,
)

DEFAULT_OUT = ROOT / "gpu_worker" / "sim" / "step_models" / "vllm_cpu_tiny.json"
MAX_NUM_SEQS = 32
MAX_MODEL_LEN = 2048
DECODE_TOKENS = 40
BATCH_SIZES = (1, 4, 8, 16, 32)
PROMPT_LENS = (32, 512, 1536)
PREFILL_SINGLE = (128, 512, 1024, 2000)
PREFILL_BATCHES = ((4, 1024), (8, 1024), (16, 512))


def _item(prompt_len: int, max_tokens: int, salt: int):
    from fairlane.protocol import InferenceRequest, SamplingParams, WorkItem

    # Distinct ids per request, deterministic per (length, salt); in vocab (< 512).
    ids = [((i * 31 + salt * 17) % 500) + 1 for i in range(prompt_len)]
    req = InferenceRequest(
        request_id=f"cal-{uuid.uuid4().hex[:12]}",
        tenant="calibration",
        pool="cpu",
        tier="std",
        reply_to="_INBOX.cal",
        prompt_token_ids=ids,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=1.0),
    )
    return WorkItem(request=req)


async def _run_one(engine, item, log: list[tuple[float, int]]) -> None:
    """Consume one stream, logging (time, total output tokens) per delta."""
    async for d in engine.generate(item):
        log.append((time.monotonic(), d.num_output_tokens))


async def measure_decode(engine, batch: int, prompt_len: int) -> dict:
    logs: list[list[tuple[float, int]]] = [[] for _ in range(batch)]
    items = [_item(prompt_len, DECODE_TOKENS, salt=i) for i in range(batch)]
    await asyncio.gather(*(_run_one(engine, it, lg) for it, lg in zip(items, logs, strict=True)))
    t_all_decoding = max(lg[0][0] for lg in logs)
    t_first_done = min(lg[-1][0] for lg in logs)
    # Request 0's progress inside the window where all `batch` sequences decode.
    window = [(t, n) for t, n in logs[0] if t_all_decoding <= t <= t_first_done]
    if len(window) < 2 or window[-1][1] == window[0][1]:
        # Fall back to the request's whole decode phase.
        window = [logs[0][0], logs[0][-1]]
    (t0, n0), (t1, n1) = window[0], window[-1]
    step_ms = 1000.0 * (t1 - t0) / (n1 - n0)
    mid_generated = (n0 + n1) / 2
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "kv_tokens": round(batch * (prompt_len + mid_generated)),
        "step_ms": round(step_ms, 4),
        "steps_measured": n1 - n0,
    }


async def measure_prefill(engine, batch: int, prompt_len: int) -> dict:
    items = [_item(prompt_len, 1, salt=100 + i) for i in range(batch)]
    logs: list[list[tuple[float, int]]] = [[] for _ in range(batch)]
    t0 = time.monotonic()
    await asyncio.gather(*(_run_one(engine, it, lg) for it, lg in zip(items, logs, strict=True)))
    t_done = max(lg[0][0] for lg in logs)
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "prompt_tokens": batch * prompt_len,
        "seconds": round(t_done - t0, 5),
    }


def fit_step(samples: list[dict]) -> tuple[float, float, float]:
    import numpy as np
    from scipy.optimize import nnls

    a = np.array([[1.0, s["batch"], s["kv_tokens"]] for s in samples])
    b = np.array([s["step_ms"] for s in samples])
    # Scale columns so NNLS is well conditioned, then unscale.
    scale = a.max(axis=0)
    coef, _ = nnls(a / scale, b)
    coef = coef / scale
    return float(coef[0]), float(coef[1]), float(coef[2])


def fit_prefill(samples: list[dict]) -> tuple[float, float]:
    import numpy as np

    x = np.array([s["prompt_tokens"] for s in samples], dtype=float)
    y = np.array([s["seconds"] for s in samples])
    slope, intercept = np.polyfit(x, y, 1)
    if slope <= 0:  # degenerate: fall back to the overall rate
        return float(x.sum() / y.sum()), 0.0
    return float(1.0 / slope), float(intercept)


def describe_machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import torch
        import vllm

        versions = f"vllm {vllm.__version__}, torch {torch.__version__}"
    except ImportError:
        versions = "vllm ?"
    return (
        f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}; "
        f"{versions} (CPU build); tiny Llama (hidden 256, 4 heads, 2 layers, vocab 512, "
        f"fp32, random weights), enforce_eager, VLLM_CPU_KVCACHE_SPACE="
        f"{os.environ.get('VLLM_CPU_KVCACHE_SPACE')}"
    )


async def calibrate(command: str, engine_cpus: frozenset[int]) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # The same layout as bench/bench_vllm.py's, so the simulator is fitted to the engine
    # it is compared with there.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", omp_bind(engine_cpus))
    from gpu_worker.sim.step_model import StepModel
    from gpu_worker.vllm_engine import VllmEngine, VllmEngineConfig
    from tests.vllm.tiny_model import write_tiny_model

    model_dir = write_tiny_model(Path(tempfile.mkdtemp(prefix="tiny-llama-")), with_tokenizer=False)
    engine = VllmEngine(
        VllmEngineConfig(
            model=str(model_dir),
            max_num_seqs=MAX_NUM_SEQS,
            max_model_len=MAX_MODEL_LEN,
            dtype="float32",
            enforce_eager=True,
            load_format="dummy",
            skip_tokenizer_init=True,
            tenant_cache_salt=False,
            enable_prefix_caching=False,
        )
    )
    t_start = time.monotonic()
    await engine.start()
    print(f"engine started in {time.monotonic() - t_start:.1f}s", flush=True)
    isolate_engine(engine_cpus)
    layout = describe(engine_cpus, os.cpu_count() or 1)
    print(f"CPU layout: {layout}", flush=True)
    try:
        # Warm-up: first passes through oneDNN/attention paths are slow.
        await measure_decode(engine, 8, 256)
        await measure_prefill(engine, 1, 1024)

        decode = []
        for prompt_len in PROMPT_LENS:
            for batch in BATCH_SIZES:
                s = await measure_decode(engine, batch, prompt_len)
                print(f"decode {s}", flush=True)
                decode.append(s)
        prefill = []
        for prompt_len in PREFILL_SINGLE:
            prefill.append(await measure_prefill(engine, 1, prompt_len))
            print(f"prefill {prefill[-1]}", flush=True)
        for batch, prompt_len in PREFILL_BATCHES:
            prefill.append(await measure_prefill(engine, batch, prompt_len))
            print(f"prefill {prefill[-1]}", flush=True)
        kv_tokens_total = engine.kv_tokens_total
        block_size = engine._llm.vllm_config.cache_config.block_size
    finally:
        await engine.close()

    base_ms, per_seq_ms, per_kv_ms = fit_step(decode)
    prefill_rate, prefill_overhead_s = fit_prefill(prefill)
    residuals = [
        s["step_ms"] - (base_ms + per_seq_ms * s["batch"] + per_kv_ms * s["kv_tokens"])
        for s in decode
    ]
    rms = (sum(r * r for r in residuals) / len(residuals)) ** 0.5
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    model = StepModel(
        name="vllm_cpu_tiny",
        measured=True,
        measured_on=f"{describe_machine()}; {layout}",
        command=command,
        notes=(
            f"Measured {now} by bench/calibrate_sim.py against vLLM-CPU through "
            f"VllmEngine (adapter overhead included), prefix caching off. Decode step = "
            f"NNLS fit over {len(decode)} (batch, prompt length) points, decode window "
            f"where all sequences run; RMS residual {rms:.2f} ms. Prefill rate = 1/slope "
            f"of time-to-first-token vs prompt tokens over {len(prefill)} points "
            f"(fixed overhead {prefill_overhead_s * 1000:.1f} ms not modelled). A tiny "
            f"random model on 2 CPU cores: useful to check the simulator against a real "
            f"engine, not to predict GPU throughput."
        ),
        max_num_seqs=MAX_NUM_SEQS,
        kv_block_size_tokens=int(block_size),
        kv_tokens_total=int(kv_tokens_total),
        prefill_tokens_per_s=round(prefill_rate, 1),
        step_base_ms=round(base_ms, 4),
        step_per_seq_ms=round(per_seq_ms, 5),
        step_per_kv_token_ms=round(per_kv_ms, 8),
    )
    # The step model ignores unknown keys; keep the date and the raw samples with it.
    doc = msgspec.to_builtins(model)
    doc.update(
        date=now,
        fit_rms_ms=round(rms, 3),
        prefill_overhead_ms=round(prefill_overhead_s * 1000, 2),
        decode_samples=decode,
        prefill_samples=prefill,
    )
    return doc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    add_engine_cpus_arg(parser)
    args = parser.parse_args()
    engine_cpus = engine_cpus_of(parser, args)
    command = "python bench/calibrate_sim.py" + (
        f" --out {args.out}" if args.out != DEFAULT_OUT else ""
    ) + (f" --engine-cpus {args.engine_cpus}" if args.engine_cpus != "last" else "")
    doc = asyncio.run(calibrate(command, engine_cpus))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(msgspec.json.format(msgspec.json.encode(doc), indent=2) + b"\n")
    keys = ("step_base_ms", "step_per_seq_ms", "step_per_kv_token_ms", "prefill_tokens_per_s")
    print({k: doc[k] for k in keys}, f"rms {doc['fit_rms_ms']} ms", f"-> {args.out}")


if __name__ == "__main__":
    main()
