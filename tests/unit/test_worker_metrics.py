"""The worker's Prometheus series (`gpu_worker.metrics`): hooks, tenant bound, exposition."""

from __future__ import annotations

import os
import shutil
import subprocess
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fairlane.metrics_labels import OTHER_TENANT, TenantLabels
from fairlane.protocol import (
    EngineLoad,
    ErrorCode,
    ErrorInfo,
    Finished,
    InferenceRequest,
    Preempted,
    Requeue,
    SamplingParams,
    Started,
    Usage,
    WorkItem,
)
from gpu_worker.inflight import InFlight
from gpu_worker.metrics import WorkerMetrics
from gpu_worker.sim.engine import SimEngine

pytestmark = [pytest.mark.unit, pytest.mark.timeout(20)]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _metrics(**kw) -> tuple[WorkerMetrics, CollectorRegistry]:
    reg = CollectorRegistry()
    s = SimpleNamespace(**{"worker_id": "w-1", "pool": "p", "engine": "sim", **kw})
    return WorkerMetrics(s, registry=reg), reg


def _inflight(tenant: str = "acme", tier: str = "paid", rid: str = "r1") -> InFlight:
    req = InferenceRequest(request_id=rid, tenant=tenant, pool="p", tier=tier,
                           reply_to=f"inbox.{rid}", prompt="hi")
    r = InFlight(item=WorkItem(request=req), accepted_s=10.0)
    r.first_token_s = 10.2
    return r


def _usage(tenant: str, prompt: int, completion: int, cached: int = 0) -> Usage:
    return Usage(request_id="r", tenant=tenant, pool="p", tier="paid", prompt_tokens=prompt,
                 completion_tokens=completion, cached_prompt_tokens=cached,
                 kv_token_seconds=1.5, e2e_ms=800.0)


def test_tenant_labels_are_bounded_and_idle_ones_give_way():
    clock = Clock()
    labels = TenantLabels(max_tenants=2, idle_s=60, clock=clock)
    assert labels.label("a") == "a" and labels.label("b") == "b"
    assert labels.label("c") == OTHER_TENANT  # full, nobody idle long enough
    clock.t += 30
    assert labels.label("a") == "a"  # seen again: now the most recent
    clock.t += 40  # b idle 70 s, a 40 s
    assert labels.label("c") == "c"  # b (least recent, idle) gave its place
    assert labels.label("b") == OTHER_TENANT
    clock.t += 100
    assert labels.expire() == 2 and len(labels) == 0
    assert TenantLabels(0, 60, clock).label("x") == OTHER_TENANT


def test_idle_tenant_series_are_removed_from_every_metric():
    m, reg = _metrics(metrics_max_tenants=2, metrics_tenant_idle_s=60)
    clock = Clock()
    m.tenants._clock = clock
    m.on_event(Started(request_id="r1", worker_id="w-1"), _inflight("acme"))
    m.on_usage(_usage("acme", 5, 7))
    m.on_usage(_usage("globex", 1, 1))
    m.on_usage(_usage("third", 2, 3))  # over the bound
    assert reg.get_sample_value("fairlane_worker_completion_tokens_total",
                                {"tenant": OTHER_TENANT}) == 3
    clock.t += 61
    m.observe(EngineLoad())
    assert reg.get_sample_value("fairlane_worker_completion_tokens_total",
                                {"tenant": "acme"}) is None
    assert reg.get_sample_value("fairlane_worker_requests_started_total",
                                {"tenant": "acme", "tier": "paid"}) is None
    assert reg.get_sample_value("fairlane_worker_metric_tenants") == 0
    # The overflow bucket stays: it is one series whatever the tenant count.
    assert reg.get_sample_value("fairlane_worker_completion_tokens_total",
                                {"tenant": OTHER_TENANT}) == 3


def test_events_and_usage_count_by_tenant_and_tier():
    m, reg = _metrics()
    r = _inflight("acme", "paid")
    m.on_event(Started(request_id="r1", worker_id="w-1"), r)
    m.on_event(Started(request_id="r1", worker_id="w-1", resumed=True), r)  # no TTFT
    usage = _usage("acme", 11, 22, cached=4)
    m.on_event(Finished(request_id="r1", worker_id="w-1", usage=usage), r)
    m.on_usage(usage)
    err = ErrorInfo.of(ErrorCode.CANCELLED, "request cancelled")
    m.on_event(Finished(request_id="r2", worker_id="w-1", error=err), _inflight("acme", "paid"))
    m.on_event(Preempted(request_id="r3", worker_id="w-1"), _inflight("globex", "free"))
    m.on_event(Requeue(request_id="r4", worker_id="w-1", reason="draining"))
    get = reg.get_sample_value
    tt = {"tenant": "acme", "tier": "paid"}
    assert get("fairlane_worker_requests_started_total", tt) == 2
    assert get("fairlane_worker_requests_finished_total", tt) == 1
    assert get("fairlane_worker_requests_failed_total", {**tt, "code": "cancelled"}) == 1
    assert get("fairlane_worker_requests_preempted_total",
               {"tenant": "globex", "tier": "free"}) == 1
    assert get("fairlane_worker_requests_requeued_total", {"reason": "draining"}) == 1
    assert get("fairlane_worker_prompt_tokens_total", {"tenant": "acme"}) == 11
    assert get("fairlane_worker_completion_tokens_total", {"tenant": "acme"}) == 22
    assert get("fairlane_worker_cached_prompt_tokens_total", {"tenant": "acme"}) == 4
    assert get("fairlane_worker_kv_token_seconds_total", {"tenant": "acme"}) == 1.5
    assert get("fairlane_worker_ttft_seconds_count", {"tier": "paid"}) == 1
    assert get("fairlane_worker_ttft_seconds_sum", {"tier": "paid"}) == pytest.approx(0.2)
    assert get("fairlane_worker_e2e_seconds_sum", {"tier": "paid"}) == pytest.approx(0.8)
    assert get("fairlane_worker_info", {"worker_id": "w-1", "pool": "p", "engine": "sim"}) == 1


async def test_engine_load_and_simulator_steps_are_observed():
    m, reg = _metrics()
    engine = SimEngine(max_num_seqs=4, kv_tokens_total=256, time_scale=0.0)
    await engine.start()
    try:
        for i in range(3):
            req = InferenceRequest(request_id=f"s{i}", tenant="t", pool="p", tier="paid",
                                   reply_to="x", prompt="hello " * 20,
                                   sampling=SamplingParams(max_tokens=40),
                                   expected_output_tokens=40)
            async for _ in engine.generate(WorkItem(request=req)):
                pass

        class W:
            _reqs = {"a": 1}

        W.engine = engine
        m.observe(engine.load(), W())
        steps = reg.get_sample_value("fairlane_worker_engine_step_seconds_count")
        assert steps == len(engine.steps) > 0
        m.observe(engine.load(), W())  # nothing new: nothing observed twice
        assert reg.get_sample_value("fairlane_worker_engine_step_seconds_count") == steps
        assert reg.get_sample_value("fairlane_worker_kv_tokens_capacity") == 256
        assert reg.get_sample_value("fairlane_worker_max_num_seqs") == 4
        assert reg.get_sample_value("fairlane_worker_in_flight_requests") == 1
        assert reg.get_sample_value("fairlane_worker_engine_kv_preemptions_total") == (
            engine.num_preemptions)
        # The simulator looks its prefix cache up on re-prefills only: hits + recomputed.
        hits = reg.get_sample_value("fairlane_worker_engine_prefix_cache_hit_tokens_total")
        assert hits == engine.num_prefix_cache_hit_tokens
        assert reg.get_sample_value(
            "fairlane_worker_engine_prefix_cache_queried_tokens_total") == (
            hits + engine.num_recomputed_tokens)
    finally:
        await engine.close()


def test_exposition_parses_and_passes_promtool_lint():
    m, reg = _metrics()
    r = _inflight()
    m.on_event(Started(request_id="r1", worker_id="w-1"), r)
    m.on_event(Finished(request_id="r1", worker_id="w-1", usage=_usage("acme", 1, 2)), r)
    m.on_usage(_usage("acme", 1, 2))
    m.observe(EngineLoad(num_running=1, max_num_seqs=8, kv_tokens_used=16,
                         kv_tokens_total=1024))
    text = generate_latest(reg).decode()
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"fairlane_worker_requests_started", "fairlane_worker_ttft_seconds",
            "fairlane_worker_running_seqs", "fairlane_worker_kv_tokens_used"} <= names
    assert all(n.startswith("fairlane_worker_") for n in names)
    promtool = shutil.which("promtool")
    if promtool is None:
        assert not os.environ.get("CI"), "promtool missing under CI (see .ci/run)"
        pytest.skip("promtool not installed (apt-get install prometheus)")
    out = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0 and not out.stdout.strip(), out.stdout + out.stderr
