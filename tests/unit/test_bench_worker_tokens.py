"""bench/bench_worker_tokens.py's figures and bench/render_worker_tokens.py's tables, on
small hand-made inputs."""

from __future__ import annotations

import json

import pytest

from bench.bench_worker_tokens import (
    Stream,
    parse_args,
    second_token_gap_ms,
    token_times,
    tpot_ms,
    window_figures,
)
from bench.render_common import RenderError, Results
from bench.render_worker_tokens import report, summary_worker_tokens, worker_tokens_kind

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def _stream(times_s: list[float], tokens: list[int]) -> Stream:
    return Stream(t_chunks=list(times_s), n_chunks=list(tokens))


def test_a_chunks_tokens_arrive_with_it():
    s = _stream([1.0, 1.02, 1.05], [1, 2, 1])
    assert token_times(s) == [1.0, 1.02, 1.02, 1.05]
    assert second_token_gap_ms(token_times(s)) == pytest.approx(20.0)
    assert tpot_ms(token_times(s)) == pytest.approx(50.0 / 3)


def test_the_second_token_gap_needs_a_token_after_it():
    """The last token rides on the final chunk whatever the coalescing: a two-token
    request tells nothing about holding."""
    assert second_token_gap_ms(token_times(_stream([1.0, 1.02], [1, 1]))) is None
    assert tpot_ms(token_times(_stream([1.0], [1]))) is None


def test_window_figures_count_what_arrives_inside_the_window():
    early = _stream([0.5, 1.5, 2.5], [1, 1, 1])  # first token before the window
    inside = _stream([2.0, 2.01, 2.03, 2.05], [1, 1, 2, 1])
    f = window_figures([early, inside, Stream()], 1.0, 3.0, cpu_s=0.01, busy_frac=0.5)
    assert f["tokens"] == 2 + 5 and f["chunks"] == 2 + 4
    assert f["tokens_per_s"] == pytest.approx(3.5)
    assert f["chunks_per_token"] == pytest.approx(6 / 7)
    assert f["worker_cpu_us_per_token"] == pytest.approx(1e4 / 7)
    assert f["worker_cores"] == pytest.approx(0.005)
    assert f["requests_timed"] == 1  # only `inside` had its first token in the window
    assert f["second_token_gap_ms_p50"] == pytest.approx(10.0)
    empty = window_figures([], 1.0, 2.0, cpu_s=0.0, busy_frac=None)
    assert empty["worker_cpu_us_per_token"] is None and empty["tpot_ms_p50"] is None


def test_args_refuse_unknown_engines_and_empty_windows():
    assert parse_args([]).engines == "default,h100"
    for bad in (["--engines", "tpu"], ["--window-s", "0"], ["--reps", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def _record(variant: str, rep: int, cpu_us: float, error: str | None = None) -> dict:
    metrics = {} if error else {
        "tokens_per_s": 2200.0, "chunks_per_token": 1.0, "worker_cpu_us_per_token": cpu_us,
        "worker_cores": cpu_us * 2200 / 1e6, "second_token_gap_ms_p50": 14.0,
        "tpot_ms_p50": 13.9, "machine_busy_frac": 0.4}
    return {"variant": variant, "rep": rep, "position": rep, "metrics": metrics,
            "error": error, "elapsed_s": 30.0}


def test_report_gives_each_variants_median_and_range(tmp_path):
    data = {"base_commit": "abc1234", "engines": {"default": {"step_model": "default",
                                                              "streams": 32}},
            "output_tokens": 256, "prompt_tokens": 32, "warmup_s": 8.0, "window_s": 20.0,
            "reps": 2, "notes": [],
            "records": [_record("default:base", 0, 60.0), _record("default:base", 1, 70.0),
                        _record("default:now", 0, 40.0),
                        _record("default:now", 1, 0.0, error="boom"),
                        _record("default:now-c0", 0, 38.0)]}
    body = report(data)
    assert "| `default`, 32 streams | `base`: base commit's worker" in body
    assert "65.0 (60.0–70.0)" in body  # median (min–max) of the base's two
    assert "now rep 1: boom" in body.replace("default:", "")  # the failed run is listed
    (tmp_path / "worker_tokens.json").write_text(json.dumps({
        "meta": {"command": "python bench/bench_worker_tokens.py", "commit": "def5678",
                 "date_utc": "2026-11-29T18:00:00Z", "machine": "nproc=2"}, "data": data}))
    (tmp_path / "worker_tokens.md").write_text("x")
    block = worker_tokens_kind(Results(tmp_path), ["worker_tokens"], "")
    assert "def5678" in block and "Base commit abc1234" in block
    row = summary_worker_tokens(Results(tmp_path))
    assert row[1] == ("`default`, 32 streams: worker CPU per token 65.0 (60.0–70.0) → "
                      "**40.0 µs**, second-token gap p50 14.0 (14.0–14.0) → 14.0 ms")
    with pytest.raises(RenderError):
        worker_tokens_kind(Results(tmp_path), [], "")
