"""Measure a GPU's decode-step and prefill times for a 7B Llama and write a step model.

    python bench/calibrate_gpu.py --out-dir OUT [--commit SHA] [--name h200_llama7b_torch]

Runs where a CUDA GPU and PyTorch are (the `device` machines; no vLLM there, nothing
else from this repo imported, so it runs with the image's python3 and torch alone).
The simulator's `default` step model is hand-picked; this one is measured.

The model: Llama-2-7B's shapes (32 layers, hidden 4096, 32 heads of 128, MLP 11008,
vocabulary 32000), bf16, random weights (times do not depend on the values). It is a
plain PyTorch decoder, not vLLM: per layer RMSNorm, fused QKV GEMM, rotary, the step's
K/V written into a contiguous per-sequence cache, `scaled_dot_product_attention` over
the cache, output GEMM, RMSNorm, fused gate/up GEMM, SiLU, down GEMM; then the final
norm, the LM head and an argmax (greedy sampling). Decode steps are captured in a CUDA
graph per shape and replayed (vLLM decodes through CUDA graphs too), so host launch
overhead is not in the figures; vLLM's paged-attention and fused kernels are not in
them either, so read the result as "this GPU's memory and matrix speed for this
model", not as vLLM's own step time.

- **decode**: for each (running sequences n, context c) a step decodes one token for
  n sequences each holding c tokens of KV: median of `--reps` graph replays timed with
  CUDA events, after warm-ups;
- **prefill**: one forward pass over a batch of prompts (causal attention, the K/V
  written), for single prompts of several lengths and a few batches: median of reps;
- **fit**: ``step_ms = base + per_seq * n + per_kv_token * n * c`` by least squares
  (a negative coefficient is dropped and the rest refitted), and
  ``prefill_ms = c0 + tokens / prefill_tokens_per_s``;
- **KV capacity**: as vLLM sizes it, ``gpu_memory_utilization`` (0.9) of the GPU's
  memory minus the weights and a 2 GiB activation reserve, over 0.5 MiB per token.

Writes OUT/<name>.json (the step model, `gpu_worker.sim.step_model`'s format version
1) and OUT/calibrate_gpu.{md,json} (every sample, the fit's error per sample, the
machine). About a minute of GPU time on an H100/H200.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

LAYERS, HIDDEN, HEADS, HEAD_DIM, MLP, VOCAB = 32, 4096, 32, 128, 11008, 32000
# (running sequences, context tokens each): up to 65,536 KV tokens (32 GiB), so an
# 80 GB H100 holds the largest with the weights.
DECODE_POINTS = ((1, 128), (1, 2048), (8, 512), (8, 2048), (32, 128), (32, 512),
                 (32, 2048), (64, 256), (64, 1024), (128, 128), (128, 512), (256, 128),
                 (256, 256))
PREFILL_POINTS = ((1, 128), (1, 512), (1, 1024), (1, 2048), (4, 512), (8, 256))
KV_BYTES_PER_TOKEN = 2 * LAYERS * HEADS * HEAD_DIM * 2  # K and V, bf16
GPU_MEMORY_UTILIZATION = 0.9
ACTIVATION_RESERVE_BYTES = 2 * 1024**3


class Shape:
    def __init__(self, tiny: bool) -> None:
        if tiny:  # a CPU smoke test of the code path, not a measurement
            self.layers, self.hidden, self.heads, self.head_dim = 2, 256, 4, 64
            self.mlp, self.vocab = 512, 1000
        else:
            self.layers, self.hidden, self.heads, self.head_dim = (
                LAYERS, HIDDEN, HEADS, HEAD_DIM)
            self.mlp, self.vocab = MLP, VOCAB


class Llama:
    """Random-weight decoder of `shape`; `step` decodes one token for a batch."""

    def __init__(self, shape: Shape, device: torch.device, dtype: torch.dtype) -> None:
        self.s, self.device, self.dtype = shape, device, dtype
        s = shape

        def w(*dims: int) -> torch.Tensor:
            return torch.empty(*dims, device=device, dtype=dtype).normal_(0.0, 0.02)

        self.layers = [{
            "n1": torch.ones(s.hidden, device=device, dtype=dtype),
            "qkv": w(s.hidden, 3 * s.hidden), "o": w(s.hidden, s.hidden),
            "n2": torch.ones(s.hidden, device=device, dtype=dtype),
            "gu": w(s.hidden, 2 * s.mlp), "down": w(s.mlp, s.hidden),
        } for _ in range(s.layers)]
        self.norm = torch.ones(s.hidden, device=device, dtype=dtype)
        self.embed = w(s.vocab, s.hidden)
        self.head = w(s.hidden, s.vocab)
        self.weight_bytes = sum(t.numel() * t.element_size() for layer in self.layers
                                for t in layer.values()) + 2 * self.embed.numel() * 2

    @staticmethod
    def _rms(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        if hasattr(F, "rms_norm"):  # one kernel where torch has it
            return F.rms_norm(x, (x.shape[-1],), weight=g, eps=1e-5)
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * g

    def _cos_sin(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary tables for positions `pos`, once per forward (not per layer: each
        small kernel costs microseconds, and a step runs ~20 per layer)."""
        d = self.s.head_dim
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=pos.device).float() / d))
        ang = pos.float()[:, None] * inv[None, :]
        emb = torch.cat((ang, ang), dim=-1)[None, :, None, :]  # [1, t, 1, d]
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    @staticmethod
    def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rot * sin

    def caches(self, n: int, c: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        s = self.s
        return [(torch.zeros(n, s.heads, c, s.head_dim, device=self.device, dtype=self.dtype),
                 torch.zeros(n, s.heads, c, s.head_dim, device=self.device, dtype=self.dtype))
                for _ in range(s.layers)]

    def forward(self, tokens: torch.Tensor, caches: list, start: int) -> torch.Tensor:
        """tokens [b, t] at positions start..start+t-1; K/V written into `caches`
        there; attention over positions 0..start+t-1 (causal within the t)."""
        s = self.s
        b, t = tokens.shape
        cos, sin = self._cos_sin(torch.arange(start, start + t, device=tokens.device))
        x = self.embed[tokens]  # [b, t, hidden]
        for layer, (kc, vc) in zip(self.layers, caches, strict=True):
            h = (self._rms(x, layer["n1"]) @ layer["qkv"]).view(b, t, 3 * s.heads, s.head_dim)
            qk = self._rotary(h[:, :, :2 * s.heads], cos, sin)  # q and k in one go
            q, k, v = qk[:, :, :s.heads], qk[:, :, s.heads:], h[:, :, 2 * s.heads:]
            kc[:, :, start:start + t] = k.transpose(1, 2)
            vc[:, :, start:start + t] = v.transpose(1, 2)
            end = start + t
            a = F.scaled_dot_product_attention(q.transpose(1, 2), kc[:, :, :end], vc[:, :, :end],
                                               is_causal=t > 1 and start == 0)
            x = x + a.transpose(1, 2).reshape(b, t, s.hidden) @ layer["o"]
            g, u = (self._rms(x, layer["n2"]) @ layer["gu"]).chunk(2, dim=-1)
            x = x + (F.silu(g) * u) @ layer["down"]
        logits = self._rms(x[:, -1], self.norm) @ self.head
        return logits.argmax(-1)


def _time_ms(fn, reps: int, cuda: bool) -> list[float]:
    out = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1000)
    return out


def measure_decode(model: Llama, n: int, c: int, reps: int, cuda: bool) -> list[float]:
    """Step times (ms) for n sequences decoding at context c (CUDA graph replays)."""
    caches = model.caches(n, c + 1)
    tok = torch.zeros(n, 1, dtype=torch.long, device=model.device)

    def step() -> torch.Tensor:
        return model.forward(tok, caches, c)

    if cuda:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        samples = _time_ms(graph.replay, reps, cuda)
        del graph
    else:
        step()
        samples = _time_ms(step, reps, cuda)
    caches.clear()  # the tensors go (the closures keep the list)
    if cuda:
        torch.cuda.empty_cache()
    return samples


def measure_prefill(model: Llama, b: int, p: int, reps: int, cuda: bool) -> list[float]:
    caches = model.caches(b, p)
    tok = torch.randint(0, model.s.vocab, (b, p), device=model.device)

    def run() -> torch.Tensor:
        return model.forward(tok, caches, 0)

    for _ in range(2):
        run()
    if cuda:
        torch.cuda.synchronize()
    samples = _time_ms(run, reps, cuda)
    caches.clear()  # the tensors go (the closures keep the list)
    if cuda:
        torch.cuda.empty_cache()
    return samples


def _summary(ms: list[float]) -> dict:
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms),
            "samples_ms": [round(x, 4) for x in ms]}


def lstsq(rows: list[list[float]], ys: list[float], names: list[str]) -> dict[str, float]:
    """Least squares with non-negative coefficients: a negative one is dropped (0) and
    the rest refitted."""
    keep = list(range(len(names)))
    while True:
        a = torch.tensor([[r[i] for i in keep] for r in rows], dtype=torch.float64)
        y = torch.tensor(ys, dtype=torch.float64)[:, None]
        coef = torch.linalg.lstsq(a, y).solution[:, 0].tolist()
        neg = [i for i, v in zip(keep, coef, strict=True) if v < 0]
        if not neg:
            out = dict.fromkeys(names, 0.0)
            out.update({names[i]: v for i, v in zip(keep, coef, strict=True)})
            return out
        keep.remove(neg[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--name", default="")
    ap.add_argument("--commit", default="unknown", help="the repo's commit (no .git there)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test of the code path")
    a = ap.parse_args()
    cuda = torch.cuda.is_available() and not a.tiny
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    gpu = torch.cuda.get_device_name(0) if cuda else "cpu (tiny smoke test)"
    name = a.name or ("tiny_smoke" if a.tiny else
                      "_".join(gpu.lower().replace("nvidia", "").split()[:1]) + "_llama7b_torch")
    t_start = time.monotonic()
    model = Llama(Shape(a.tiny), device, dtype)
    decode_points = DECODE_POINTS if not a.tiny else ((1, 16), (4, 32), (8, 64), (16, 16))
    prefill_points = PREFILL_POINTS if not a.tiny else ((1, 16), (1, 64), (2, 32))
    reps = a.reps if not a.tiny else 3
    decode = []
    for n, c in decode_points:
        ms = measure_decode(model, n, c, reps, cuda)
        decode.append({"num_running": n, "context_tokens": c, "kv_tokens": n * c,
                       **_summary(ms)})
        print(f"decode n={n} c={c}: {decode[-1]['median_ms']:.3f} ms", file=sys.stderr)
    prefill = []
    for b, p in prefill_points:
        ms = measure_prefill(model, b, p, reps, cuda)
        prefill.append({"num_prompts": b, "prompt_tokens": p, "tokens": b * p,
                        **_summary(ms)})
        print(f"prefill {b}x{p}: {prefill[-1]['median_ms']:.3f} ms", file=sys.stderr)
    fit = lstsq([[1.0, d["num_running"], d["kv_tokens"]] for d in decode],
                [d["median_ms"] for d in decode], ["base", "per_seq", "per_kv_token"])
    pf = lstsq([[1.0, p["tokens"]] for p in prefill], [p["median_ms"] for p in prefill],
               ["c0", "per_token"])
    for d in decode:
        d["fit_ms"] = fit["base"] + fit["per_seq"] * d["num_running"] + \
            fit["per_kv_token"] * d["kv_tokens"]
        d["fit_error"] = (d["fit_ms"] - d["median_ms"]) / d["median_ms"]
    for p in prefill:
        p["fit_ms"] = pf["c0"] + pf["per_token"] * p["tokens"]
        p["fit_error"] = (p["fit_ms"] - p["median_ms"]) / p["median_ms"]
    total = torch.cuda.get_device_properties(0).total_memory if cuda else 8 * 1024**3
    kv_bytes = GPU_MEMORY_UTILIZATION * total - model.weight_bytes - ACTIVATION_RESERVE_BYTES
    per_token = 2 * model.s.layers * model.s.heads * model.s.head_dim * (2 if cuda else 4)
    kv_tokens_total = max(16, int(kv_bytes // per_token) // 16 * 16)
    machine = (f"{gpu}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
               f"{platform.node()}, Python {platform.python_version()}")
    command = "python bench/calibrate_gpu.py " + shlex.join(sys.argv[1:])
    step_model = {
        "format_version": 1, "name": name, "measured": not a.tiny,
        "measured_on": f"{gpu}; plain PyTorch {torch.__version__} decoder with CUDA "
                       "graphs (bench/calibrate_gpu.py), Llama-2-7B shapes, bf16, random "
                       "weights; not vLLM",
        "command": command,
        "notes": (f"Measured at commit {a.commit}. Decode fit over {len(decode)} (batch, "
                  f"context) points, worst error {max(abs(d['fit_error']) for d in decode):.1%}; "
                  f"prefill fit over {len(prefill)} points (fixed cost {pf['c0']:.2f} ms not "
                  "modelled: the step model adds prefill time per token). KV capacity as "
                  f"vLLM sizes it: {GPU_MEMORY_UTILIZATION} of {total / 1024**3:.0f} GiB minus "
                  f"{model.weight_bytes / 1024**3:.1f} GiB of weights and a 2 GiB reserve, "
                  "0.5 MiB per token. Step times are this PyTorch decoder's, not vLLM's "
                  "(no paged attention or fused kernels); max_num_seqs is vLLM's default."),
        "max_num_seqs": a.max_num_seqs, "kv_block_size_tokens": 16,
        "kv_tokens_total": kv_tokens_total,
        "prefill_tokens_per_s": round(1000.0 / pf["per_token"], 1),
        "step_base_ms": round(fit["base"], 4),
        "step_per_seq_ms": round(fit["per_seq"], 6),
        "step_per_kv_token_ms": round(fit["per_kv_token"], 9),
    }
    meta = {"command": command, "commit": a.commit,
            "date_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "machine": machine}
    a.out_dir.mkdir(parents=True, exist_ok=True)
    (a.out_dir / f"{name}.json").write_text(json.dumps(step_model, indent=2) + "\n")
    data = {"step_model": step_model, "decode": decode, "prefill": prefill,
            "decode_fit": fit, "prefill_fit": pf, "reps": reps,
            "wall_s": round(time.monotonic() - t_start, 1)}
    (a.out_dir / "calibrate_gpu.json").write_text(
        json.dumps({"meta": meta, "data": data}, indent=1) + "\n")
    lines = [f"# GPU step times for the simulator: {gpu}", "",
             f"- command: `{command}`", f"- commit: {a.commit}",
             f"- date (UTC): {meta['date_utc']}", f"- machine: {machine}", "",
             "Llama-2-7B shapes, bf16, random weights, a plain PyTorch decoder (decode "
             "steps replayed from CUDA graphs), not vLLM. Median (min–max) of "
             f"{reps} timed repetitions per point (CUDA events).", "",
             "| running | context | KV tokens | step ms | fit ms | fit error |",
             "|---:|---:|---:|---:|---:|---:|"]
    for d in decode:
        lines.append(f"| {d['num_running']} | {d['context_tokens']:,} | {d['kv_tokens']:,} "
                     f"| {d['median_ms']:.3f} ({d['min_ms']:.3f}–{d['max_ms']:.3f}) "
                     f"| {d['fit_ms']:.3f} | {d['fit_error']:+.1%} |")
    lines += ["", "| prompts × tokens | tokens | forward ms | fit ms | fit error |",
              "|---|---:|---:|---:|---:|"]
    for p in prefill:
        lines.append(f"| {p['num_prompts']} × {p['prompt_tokens']:,} | {p['tokens']:,} "
                     f"| {p['median_ms']:.3f} ({p['min_ms']:.3f}–{p['max_ms']:.3f}) "
                     f"| {p['fit_ms']:.3f} | {p['fit_error']:+.1%} |")
    lines += ["", f"Fit: step_ms = {fit['base']:.3f} + {fit['per_seq']:.5f} × running + "
                  f"{fit['per_kv_token'] * 1e6:.3f}e-6 × KV tokens; prefill "
                  f"{1000.0 / pf['per_token']:,.0f} tokens/s (+ {pf['c0']:.2f} ms per "
                  f"forward, not modelled); KV capacity {kv_tokens_total:,} tokens.", ""]
    (a.out_dir / "calibrate_gpu.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
