"""Worker pieces without NATS: settings, the engine factory, per-request bookkeeping."""

from __future__ import annotations

import math

import pytest

from fairlane.protocol import ErrorCode, ErrorInfo, InferenceRequest, WorkItem
from fairlane.settings import load_settings
from gpu_worker.config import WorkerSettings
from gpu_worker.engine import GenerationDelta
from gpu_worker.engines import make_engine
from gpu_worker.inflight import InFlight
from gpu_worker.sim.engine import SimEngine

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


def test_settings_from_flags_and_env():
    s = load_settings(
        WorkerSettings,
        ["--max-num-seqs", "8", "--no-log-json", "--pool", "gpu-a"],
        env={"FAIRLANE_TIME_SCALE": "0.5", "FAIRLANE_MAX_NUM_SEQS": "4",
             "FAIRLANE_KV_CACHE_SPACE_GIB": "2"},
        prog="gpu_worker",
    )
    assert s.max_num_seqs == 8  # flag beats env
    assert s.time_scale == 0.5 and s.log_json is False and s.pool == "gpu-a"
    assert s.kv_cache_space_gib == 2.0
    assert s.worker_id  # defaults to <hostname>-<pid>


def test_settings_reject_unknown_engine():
    with pytest.raises(SystemExit):
        load_settings(WorkerSettings, ["--engine", "tpu"], env={}, prog="gpu_worker")


def test_make_engine_sim_uses_worker_settings():
    s = WorkerSettings(max_num_seqs=3, max_model_len=128, time_scale=0.0,
                       sim_kv_tokens_total=1600)
    engine = make_engine(s)
    assert isinstance(engine, SimEngine)
    assert engine.max_num_seqs == 3 and engine.max_model_len == 128
    load = engine.load()
    assert load.max_num_seqs == 3 and load.kv_tokens_total == 1600


def test_make_engine_vllm_needs_a_model():
    with pytest.raises(ValueError, match="model"):
        make_engine(WorkerSettings(engine="vllm"))


def _inflight(return_token_ids: bool = False) -> InFlight:
    req = InferenceRequest(request_id="r1", tenant="t", pool="p", tier="free",
                           reply_to="inbox.r1", prompt="hi", return_token_ids=return_token_ids)
    return InFlight(item=WorkItem(request=req, queue_ms=12), accepted_s=100.0)


def test_inflight_coalesces_and_numbers_chunks():
    r = _inflight(return_token_ids=True)
    assert r.add(GenerationDelta(text=" a", token_ids=[1], num_output_tokens=1), 100.5) is True
    assert r.add(GenerationDelta(text=" b", token_ids=[2], num_output_tokens=2), 100.6) is False
    assert r.first_token_s == 100.5
    c0 = r.take_chunk(now_s=100.6)
    assert (c0.seq, c0.text, c0.token_ids, c0.num_tokens) == (0, " a b", [1, 2], 2)
    assert r.buf_num_tokens == 0 and not c0.is_last
    last = GenerationDelta(text=" c", token_ids=[3], finish_reason="stop", num_prompt_tokens=1,
                           num_output_tokens=3, kv_token_seconds=0.25)
    r.add(last, 101.0)
    usage = r.usage("w1", "stop", now_s=102.0)
    c1 = r.take_chunk(finish_reason="stop", usage=usage)
    assert c1.seq == 1 and c1.is_last and c1.num_tokens == 1
    assert usage.completion_tokens == 3 and usage.prompt_tokens == 1 and usage.queue_ms == 12
    assert usage.ttft_ms == 500.0 and usage.e2e_ms == 2000.0 and usage.kv_token_seconds == 0.25


def test_inflight_holds_tokens_only_within_coalesce_of_its_last_chunk():
    """A rate limit per request, not a window each token waits out: due at once if
    nothing went out yet or the last chunk is coalesce_s old, else that much later."""
    r = _inflight()
    r.add(GenerationDelta(text=" a", token_ids=[1]), 100.0)
    assert r.flush_due_s(0.005) == -math.inf  # never sent: out at once
    r.take_chunk(now_s=100.0)
    r.add(GenerationDelta(text=" b", token_ids=[2]), 100.002)
    assert r.flush_due_s(0.005) == pytest.approx(100.005)  # 2 ms after: held 3 ms
    r.take_chunk(now_s=100.005)
    r.add(GenerationDelta(text=" c", token_ids=[3]), 100.020)
    assert r.flush_due_s(0.005) <= 100.020  # 15 ms after: out at once


def test_inflight_hides_token_ids_unless_asked_and_flags_stop():
    r = _inflight()
    r.add(GenerationDelta(text=" a", token_ids=[1]), 1.0)
    assert r.take_chunk().token_ids is None
    assert not r.stopping
    r.fail = ErrorInfo.of(ErrorCode.ENGINE_ERROR, "boom")
    assert r.stopping
    # an accounting-only delta (no tokens) does not start the request
    r2 = _inflight()
    assert r2.add(GenerationDelta(num_prompt_tokens=3), 1.0) is False and not r2.started
    assert r2.usage("w", "error").ttft_ms == 0.0
