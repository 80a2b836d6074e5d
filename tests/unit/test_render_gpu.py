"""bench/render_gpu.py: the §9 GPU step-time tables on hand-made results files shaped
as bench/calibrate_gpu.py writes them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import render_gpu as rg
from bench.render_common import RenderError, Results

pytestmark = pytest.mark.unit


def _doc(gpu: str, name: str, step_ms: float, points=((1, 128), (32, 512))) -> dict:
    decode = [{"num_running": n, "context_tokens": c, "kv_tokens": n * c,
               "median_ms": step_ms + 0.1 * n, "fit_error": 0.031 if n == 1 else -0.002}
              for n, c in points]
    prefill = [{"num_prompts": 1, "prompt_tokens": 512, "tokens": 512, "median_ms": 15.0,
                "fit_error": 0.1}]
    model = {"name": name, "measured_on": f"NVIDIA {gpu}; plain PyTorch", "step_base_ms": 6.3357,
             "step_per_seq_ms": 0.0108, "step_per_kv_token_ms": 0.000166,
             "prefill_tokens_per_s": 39570.4, "kv_tokens_total": 116128}
    return {"meta": {"command": "python bench/calibrate_gpu.py", "commit": "0247794",
                     "date_utc": "2026-11-27T09:04:00Z", "machine": gpu},
            "data": {"step_model": model, "decode": decode, "prefill": prefill, "reps": 30}}


def _results(tmp_path: Path, docs: dict[str, dict]) -> Results:
    for stem, doc in docs.items():
        (tmp_path / f"{stem}.json").write_text(json.dumps(doc))
    return Results(tmp_path)


def test_tables_put_the_gpus_side_by_side(tmp_path):
    res = _results(tmp_path, {"a": _doc("H100 80GB HBM3", "h100_x", 6.2),
                              "b": _doc("H200", "h200_x", 5.0)})
    out = rg.gpu_kind(res, ["a", "b"], "")
    assert "| H100 80GB HBM3: step ms (fit error) | H200: step ms (fit error) |" in out
    assert "| 1 | 128 | 128 | 6.30 (+3%) | 5.10 (+3%) |" in out
    assert "| 32 | 512 | 16,384 | 9.40 (±0%) | 8.20 (±0%) |" in out
    assert "| `h100_x` | H100 80GB HBM3 | 6.34 | 0.0108 | 0.166 | 39,570 | 116,128 | 3.1% |" in out


def test_files_that_measured_different_points_are_refused(tmp_path):
    res = _results(tmp_path, {"a": _doc("H100", "h100_x", 6.2),
                              "b": _doc("H200", "h200_x", 5.0, points=((1, 128), (8, 512)))})
    with pytest.raises(RenderError, match="different decode points"):
        rg.gpu_kind(res, ["a", "b"], "")
