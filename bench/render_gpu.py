"""GPU step times (bench/calibrate_gpu.py): BENCHMARKS.md's §9 tables and Summary row,
from the JSON it writes ({"meta", "data": {"step_model", "decode": [{"num_running",
"context_tokens", "kv_tokens", "median_ms", "min_ms", "max_ms", "fit_ms", "fit_error"}],
"prefill": [{"num_prompts", "prompt_tokens", "tokens", "median_ms", ...}],
"decode_fit", "prefill_fit", "reps"}}). Several GPUs side by side, one column each.
Pure: no GPU, no clock."""

from __future__ import annotations

from bench.render_common import RenderError, Results, row_source, sources_line, table

STEMS = ("calibrate_gpu_h100", "calibrate_gpu_h200")  # the Summary row's files


def _gpu(data: dict) -> str:
    return data["step_model"]["measured_on"].split(";")[0].replace("NVIDIA ", "")


def _ms(p: dict) -> str:
    err = p["fit_error"]
    return f"{p['median_ms']:.2f} ({'±0%' if abs(err) < 0.005 else f'{err:+.0%}'})"


def _points(datas: list[dict], key: str, ident: tuple[str, ...]) -> list[tuple]:
    points = [tuple(p[k] for k in ident) for p in datas[0][key]]
    for d in datas[1:]:
        if [tuple(p[k] for k in ident) for p in d[key]] != points:
            raise RenderError(f"the results files measured different {key} points")
    return points


def gpu_kind(res: Results, args: list[str], _old: str) -> str:
    """`<!-- generated: gpu-steps STEM [STEM ...] -->`: decode and prefill tables, the
    fitted step models."""
    if not args:
        raise RenderError("gpu-steps takes one or more results files")
    datas = [res.load(stem).get("data", {}) for stem in args]
    gpus = [_gpu(d) for d in datas]
    decode = _points(datas, "decode", ("num_running", "context_tokens"))
    rows = [[f"{n}", f"{c:,}", f"{n * c:,}",
             *(_ms(d["decode"][i]) for d in datas)] for i, (n, c) in enumerate(decode)]
    dec = table(["running", "context", "KV tokens", *(f"{g}: step ms (fit error)" for g in gpus)],
                "rrr" + "r" * len(gpus), rows)
    prefill = _points(datas, "prefill", ("num_prompts", "prompt_tokens"))
    rows = [[f"{b} × {p:,}", f"{b * p:,}", *(_ms(d["prefill"][i]) for d in datas)]
            for i, (b, p) in enumerate(prefill)]
    pre = table(["prompts × tokens", "tokens", *(f"{g}: forward ms (fit error)" for g in gpus)],
                "lr" + "r" * len(gpus), rows)
    fits = table(
        ["step model", "GPU", "step base ms", "per running seq ms", "per KV token µs",
         "prefill tokens/s", "KV capacity, tokens", "decode fit, worst error"],
        "llrrrrrr",
        [[f"`{d['step_model']['name']}`", g, f"{d['step_model']['step_base_ms']:.2f}",
          f"{d['step_model']['step_per_seq_ms']:.4f}",
          f"{d['step_model']['step_per_kv_token_ms'] * 1000:.3f}",
          f"{d['step_model']['prefill_tokens_per_s']:,.0f}",
          f"{d['step_model']['kv_tokens_total']:,}",
          f"{max(abs(p['fit_error']) for p in d['decode']):.1%}"]
         for d, g in zip(datas, gpus, strict=True)])
    reps = ", ".join(str(d["reps"]) for d in datas)
    setup = (f"Median of {reps} CUDA-event-timed repetitions per point; in brackets the "
             "fitted step model's error there. Decode: one step for `running` sequences "
             "holding `context` tokens each, replayed from a CUDA graph. Prefill: one "
             "forward pass (no graph: its fixed cost is launch overhead, which the step "
             "model does not carry; the tokens/s is the fit's slope).")
    return "\n\n".join([sources_line(res, args), setup, dec, pre, fits])


def summary_gpu(res: Results) -> list[str]:
    parts = []
    for stem in STEMS:
        d = res.load(stem).get("data", {})
        m = d["step_model"]
        at32 = next(p for p in d["decode"] if (p["num_running"], p["context_tokens"]) == (32, 512))
        parts.append(f"{_gpu(d)}: {m['step_base_ms']:.1f} ms + {m['step_per_seq_ms']:.3f} ms/seq "
                     f"+ {m['step_per_kv_token_ms'] * 1000:.3f} µs/KV token (32 × 512: "
                     f"{at32['median_ms']:.1f} ms), prefill {m['prefill_tokens_per_s']:,.0f} tok/s")
    return ["§9 GPU step times for the simulator: a 7B Llama's decode step and prefill, "
            "plain PyTorch with CUDA graphs (not vLLM), fitted to the step model",
            "; ".join(parts), "—",
            ", ".join(row_source(res, s) for s in STEMS)]


KINDS = {"gpu-steps": gpu_kind}
SUMMARY_ROWS = {"gpu-steps": summary_gpu}
