"""vLLM's own statistics reach the worker's /metrics (`gpu_worker.vllm_stats`).

The first test feeds vLLM's real stats classes to the stat logger the adapter
registers: it fails when a vLLM upgrade renames a field the tap reads (the tap itself
would silently read 0). The second runs the session's engine (conftest.vllm_engine)
and checks that step times, prefix-cache lookups and a continuation's recomputed
tokens move, and that `WorkerMetrics` exports them. KV preemptions cannot be provoked
here (1 GiB of KV for a 256-token model at 4 sequences never runs out): the first
test covers their counting.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from gpu_worker.metrics import WorkerMetrics
from gpu_worker.vllm_stats import VllmStatsTap
from tests.vllm.test_vllm_resume import PROMPT_IDS, collect, ids_of, resume, wait_idle

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(240)]

COUNTERS = ("num_preemptions", "num_recomputed_tokens", "num_prefix_cache_hit_tokens",
            "num_prefix_cache_queried_tokens")


def _counters(engine) -> dict[str, int]:
    return {name: getattr(engine, name) for name in COUNTERS}


def test_the_stat_logger_reads_vllms_own_stats_classes():
    from vllm.v1.metrics.stats import (
        IterationStats,
        PrefixCacheStats,
        SchedulerIterationDetails,
        SchedulerStats,
    )

    tap = VllmStatsTap()
    logger = tap.factory(SimpleNamespace(), 0)  # what AsyncLLM builds from the factory
    iteration = IterationStats()
    iteration.num_preempted_reqs = 2
    cache = PrefixCacheStats(requests=1, queries=300, hits=128, preempted_requests=1,
                             preempted_queries=200, preempted_hits=128)
    details = SchedulerIterationDetails(iteration_index=7, num_ctx_requests=1,
                                        num_ctx_tokens=300, num_generation_requests=2,
                                        num_generation_tokens=2, elapsed_ms=12.5)
    logger.record(SchedulerStats(num_running_reqs=3, num_waiting_reqs=1, kv_cache_usage=0.25,
                                 prefix_cache_stats=cache, iteration_details=details),
                  iteration)
    dummy = SchedulerIterationDetails(iteration_index=8, num_ctx_requests=0, num_ctx_tokens=0,
                                      num_generation_requests=0, num_generation_tokens=0,
                                      elapsed_ms=3.0, is_dummy=True)
    logger.record(SchedulerStats(iteration_details=dummy), None)  # a DP filler: no step
    logger.record(None, None)

    assert tap.num_preemptions == 2
    assert tap.num_prefix_cache_queried_tokens == 500
    assert tap.num_prefix_cache_hit_tokens == 256
    assert tap.num_recomputed_tokens == 200 - 128  # the preempted request's re-prefill
    assert [s.step_ms for s in tap.steps] == [12.5]
    assert (tap.num_running, tap.num_waiting) == (0, 0)  # the latest stats: the empty one
    assert tap.updated_at > 0


async def test_engine_counters_move_and_reach_the_workers_metrics(vllm_engine, make_item):
    before = _counters(vllm_engine)
    last_step = vllm_engine.steps[-1] if vllm_engine.steps else None
    # Two full 128-token blocks of prompt, twice under one salt: the second run's
    # first block comes from the prefix cache (only full blocks are cached).
    ids = [(i * 41) % 500 + 1 for i in range(200)]
    for _ in range(2):
        await collect(vllm_engine, make_item(prompt_token_ids=ids, max_tokens=3,
                                             cache_salt="metrics-salt"))
    # A continuation under a cold salt: all of prompt + generated is computed again.
    k = 5
    item = make_item(prompt_token_ids=PROMPT_IDS, max_tokens=k, temperature=0.0,
                     cache_salt="metrics-warm")
    first = ids_of(await collect(vllm_engine, item))
    item.request.sampling.max_tokens = k + 3
    cold = await collect(vllm_engine, resume(item, first, cache_salt="metrics-cold"))
    await wait_idle(vllm_engine)

    after = _counters(vllm_engine)
    moved = {name: after[name] - before[name] for name in COUNTERS}
    assert moved["num_prefix_cache_queried_tokens"] >= 2 * len(ids) + len(PROMPT_IDS)
    assert moved["num_prefix_cache_hit_tokens"] >= 128
    assert moved["num_recomputed_tokens"] >= cold[-1].num_recomputed_tokens == (
        len(PROMPT_IDS) + k)
    assert moved["num_preemptions"] == 0  # never short of KV here
    steps = list(vllm_engine.steps)
    new_steps = steps[steps.index(last_step) + 1:] if last_step is not None else steps
    # At least one step per generated token (prefill steps give the first ones).
    assert len(new_steps) >= 2 * 3 + k + 3
    assert all(0 < s.step_ms < 30_000 for s in new_steps)

    # The worker's metrics read the same names from this engine as from the simulator.
    reg = CollectorRegistry()
    metrics = WorkerMetrics(SimpleNamespace(worker_id="w", pool="p", engine="vllm"), reg)
    metrics.observe(vllm_engine.load(), SimpleNamespace(engine=vllm_engine, _reqs={}))
    get = reg.get_sample_value
    assert get("fairlane_worker_engine_step_seconds_count") == len(vllm_engine.steps)
    assert get("fairlane_worker_engine_prefix_cache_hit_tokens_total") == (
        after["num_prefix_cache_hit_tokens"])
    assert get("fairlane_worker_engine_prefix_cache_queried_tokens_total") == (
        after["num_prefix_cache_queried_tokens"])
    assert get("fairlane_worker_engine_recomputed_tokens_total") == after["num_recomputed_tokens"]
    assert get("fairlane_worker_engine_kv_preemptions_total") == after["num_preemptions"]
    assert get("fairlane_worker_kv_tokens_capacity") == vllm_engine.kv_tokens_total > 0
