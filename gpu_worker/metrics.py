"""Prometheus metrics of one GPU worker (DESIGN.md section 7b), prefix ``fairlane_worker_``.

The worker shell calls three hooks, all on its event loop and all cheap:

- `WorkerMetrics.on_event` for every event it publishes (`Started`, `Finished`,
  `Preempted`, `Requeue`): requests by tenant and tier, TTFT and end-to-end
  histograms per tier, preemptions, requeues;
- `WorkerMetrics.on_usage` for every metering record it publishes to ``FL_USAGE``:
  prompt / completion / cached prompt tokens and KV-token-seconds by tenant. These are
  the tenant's metered figures, the same numbers `fairlane usage` adds up: a preempted
  or migrated request is counted once, by the worker that finishes it (its record
  covers the whole request);
- `WorkerMetrics.observe` on each heartbeat, with the `EngineLoad` it reports anyway:
  the gauges (running, waiting, KV tokens), and what the engine counts by itself,
  read duck-typed so that any engine may offer it (see `_engine_counters`).

Engine figures, the same names from either engine (an engine without one leaves
that series at 0):

- ``num_preemptions`` -> ``fairlane_worker_engine_kv_preemptions_total``: sequences the
  engine evicted from its batch when KV ran out (recompute-style);
- ``num_recomputed_tokens`` -> ``_engine_recomputed_tokens_total``: tokens prefilled
  again (after such a preemption, or for a continuation) that the prefix cache no
  longer held;
- ``num_prefix_cache_hit_tokens`` / ``num_prefix_cache_queried_tokens`` ->
  ``_engine_prefix_cache_hit_tokens_total`` / ``_queried_tokens_total`` (their ratio
  is the hit rate);
- ``steps``, records with a ``step_ms`` -> ``fairlane_worker_engine_step_seconds``.

The simulator (`gpu_worker.sim.engine.SimEngine`) counts them in its batch model: its
step time is the *simulated* one (what the modelled GPU would take; wall time is that ×
``--time-scale``) and its prefix cache is modelled for re-prefills only (a fresh
prompt never hits it). `gpu_worker.vllm_engine.VllmEngine` reads vLLM's own figures
through a stat logger (`gpu_worker.vllm_stats`): its iteration time, its preemption
count and its prefix-cache queries and hits, for every prefill.

Tenant label cardinality is bounded (`fairlane.metrics_labels.TenantLabels`, shared
with the dispatcher and the streamer): a worker exposes at most
``--metrics-max-tenants`` tenant label values; a tenant idle for
``--metrics-tenant-idle-s`` loses its series (their figures stay in ``FL_USAGE``),
and while the bound is full, further tenants are counted under ``tenant="_other"``.

Each `WorkerMetrics` has its own registry (several workers in one test process do not
collide); `serve_http` exposes it with the process collectors, as the dispatcher does.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)

from fairlane.looplag import LAG_BUCKETS, LAG_HELP
from fairlane.metrics_labels import TenantLabels
from fairlane.protocol import EngineLoad, Finished, Preempted, Requeue, Started, Usage

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class WorkerMetrics:
    """A worker's series and its tenant bound; see the module docstring."""

    def __init__(self, settings: Any, registry: CollectorRegistry | None = None) -> None:
        self.settings = settings
        self.registry = registry if registry is not None else CollectorRegistry()
        self.tenants = TenantLabels(getattr(settings, "metrics_max_tenants", 1000),
                                    getattr(settings, "metrics_tenant_idle_s", 600.0))
        self._seen: dict[str, int] = {}  # engine counters already added to our counters
        self._last_step: object = None  # the newest engine step record already observed
        r = self.registry
        tt = ["tenant", "tier"]
        self.info = Gauge("fairlane_worker_info", "This worker: always 1; labels say which",
                          ["worker_id", "pool", "engine"], registry=r)
        self.info.labels(getattr(settings, "worker_id", ""), getattr(settings, "pool", ""),
                         getattr(settings, "engine", "")).set(1)
        self.started = Counter("fairlane_worker_requests_started_total",
                               "Requests that produced their first token on this worker "
                               "(continuations included)", tt, registry=r)
        self.finished = Counter("fairlane_worker_requests_finished_total",
                                "Requests that finished normally on this worker", tt,
                                registry=r)
        self.failed = Counter("fairlane_worker_requests_failed_total",
                              "Requests that ended with an error on this worker, by code",
                              [*tt, "code"], registry=r)
        self.preempted = Counter("fairlane_worker_requests_preempted_total",
                                 "Requests this worker stopped and handed back as a "
                                 "continuation, on the dispatcher's order", tt, registry=r)
        self.requeued = Counter("fairlane_worker_requests_requeued_total",
                                "Unstarted requests handed back to the dispatcher, by reason",
                                ["reason"], registry=r)
        self.pulls = Counter("fairlane_worker_pulls_total",
                             "Pulls (requests for work) this worker sent: kind=new, or "
                             "kind=replacement when a slot freed while a pull sent with "
                             "no slot free waited", ["kind"], registry=r)
        self.pull_failures = Counter("fairlane_worker_pull_failures_total",
                                     "Pulls that got no answer (no dispatcher, a timeout, "
                                     "a reconnect)", registry=r)
        self.prompt_tokens = Counter("fairlane_worker_prompt_tokens_total",
                                     "Prompt tokens of metered requests (FL_USAGE records)",
                                     ["tenant"], registry=r)
        self.completion_tokens = Counter("fairlane_worker_completion_tokens_total",
                                         "Completion tokens of metered requests (FL_USAGE "
                                         "records; a continuation's record covers the whole "
                                         "request)", ["tenant"], registry=r)
        self.cached_tokens = Counter("fairlane_worker_cached_prompt_tokens_total",
                                     "Prompt tokens served from the prefix cache, of metered "
                                     "requests", ["tenant"], registry=r)
        self.kv_token_seconds = Counter("fairlane_worker_kv_token_seconds_total",
                                        "KV-cache token-seconds of metered requests",
                                        ["tenant"], registry=r)
        self.ttft = Histogram("fairlane_worker_ttft_seconds",
                              "From this worker accepting a request to its first token "
                              "(queue wait excluded; continuations excluded)", ["tier"],
                              buckets=TTFT_BUCKETS, registry=r)
        self.e2e = Histogram("fairlane_worker_e2e_seconds",
                             "From this worker accepting a request to its last token, for "
                             "requests that finished normally", ["tier"],
                             buckets=E2E_BUCKETS, registry=r)
        self.running = Gauge("fairlane_worker_running_seqs", "Sequences in the engine's batch",
                             registry=r)
        self.waiting = Gauge("fairlane_worker_waiting_seqs",
                             "Sequences queued inside the engine (accepted, not in the batch)",
                             registry=r)
        self.max_num_seqs = Gauge("fairlane_worker_max_num_seqs", "The engine's batch cap",
                                  registry=r)
        self.in_flight = Gauge("fairlane_worker_in_flight_requests",
                               "Requests accepted by this worker and not yet ended", registry=r)
        self.kv_used = Gauge("fairlane_worker_kv_tokens_used", "KV-cache tokens in use",
                             registry=r)
        # Not "_total": that suffix is for counters (promtool's lint).
        self.kv_total = Gauge("fairlane_worker_kv_tokens_capacity", "KV-cache capacity in tokens",
                              registry=r)
        self.tenants_tracked = Gauge("fairlane_worker_metric_tenants",
                                     "Tenants with their own label value on this worker "
                                     "(at most --metrics-max-tenants)", registry=r)
        self.loop_lag = Histogram("fairlane_worker_event_loop_lag_seconds", LAG_HELP,
                                  buckets=LAG_BUCKETS, registry=r)  # fairlane.looplag
        self.engine_steps = Histogram("fairlane_worker_engine_step_seconds",
                                      "Engine step time (vLLM: its iteration time; "
                                      "simulator: simulated seconds)",
                                      buckets=STEP_BUCKETS, registry=r)
        self.engine_counters = {
            "num_preemptions": Counter(
                "fairlane_worker_engine_kv_preemptions_total",
                "Sequences the engine evicted from its batch when KV ran out (recomputed later)",
                registry=r),
            "num_recomputed_tokens": Counter(
                "fairlane_worker_engine_recomputed_tokens_total",
                "Tokens the engine prefilled again (after a KV preemption or for a "
                "continuation) that its prefix cache no longer held", registry=r),
            "num_prefix_cache_hit_tokens": Counter(
                "fairlane_worker_engine_prefix_cache_hit_tokens_total",
                "Prompt tokens the engine's prefix cache served instead of a prefill "
                "computing them (simulator: re-prefills only)", registry=r),
            "num_prefix_cache_queried_tokens": Counter(
                "fairlane_worker_engine_prefix_cache_queried_tokens_total",
                "Prompt tokens the engine looked up in its prefix cache (hits / queried: "
                "the hit rate; simulator: re-prefills only)", registry=r),
        }

    # --- serving ----------------------------------------------------------------------

    def serve_http(self) -> None:
        """Serve ``/metrics`` on ``--metrics-port`` (no-op when 0), in a daemon thread."""
        port = getattr(self.settings, "metrics_port", 0)
        if not port:
            return
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            self.registry.register(collector)
        start_http_server(port, addr=getattr(self.settings, "metrics_host", "127.0.0.1"),
                          registry=self.registry)

    # --- hooks --------------------------------------------------------------------------

    def _tenant(self, tenant: str, metric: Any, *rest: str) -> Any:
        return self.tenants.child(metric, tenant, *rest)

    def on_event(self, evt: object, r: Any = None) -> None:
        """A worker event was published; `r` is the request's `InFlight` if any."""
        if isinstance(evt, Requeue):
            self.requeued.labels(evt.reason or "unknown").inc()
            return
        if r is None:
            return
        req = r.item.request
        if isinstance(evt, Started):
            self._tenant(req.tenant, self.started, req.tier).inc()
            if not evt.resumed and r.first_token_s:
                self.ttft.labels(req.tier).observe(max(0.0, r.first_token_s - r.accepted_s))
        elif isinstance(evt, Finished):
            if evt.error is None:
                self._tenant(req.tenant, self.finished, req.tier).inc()
                if evt.usage is not None:
                    self.e2e.labels(req.tier).observe(evt.usage.e2e_ms / 1000)
            else:
                self._tenant(req.tenant, self.failed, req.tier, evt.error.code.value).inc()
        elif isinstance(evt, Preempted):
            self._tenant(req.tenant, self.preempted, req.tier).inc()

    def on_usage(self, usage: Usage) -> None:
        """A metering record is being published to FL_USAGE."""
        self._tenant(usage.tenant, self.prompt_tokens).inc(usage.prompt_tokens)
        self._tenant(usage.tenant, self.completion_tokens).inc(usage.completion_tokens)
        self._tenant(usage.tenant, self.cached_tokens).inc(usage.cached_prompt_tokens)
        self._tenant(usage.tenant, self.kv_token_seconds).inc(max(0.0, usage.kv_token_seconds))

    def observe(self, load: EngineLoad, worker: Any = None) -> None:
        """Refresh the gauges (from the heartbeat's `load`) and the engine's counters."""
        self.running.set(load.num_running)
        self.waiting.set(load.num_waiting)
        self.max_num_seqs.set(load.max_num_seqs)
        self.kv_used.set(load.kv_tokens_used)
        self.kv_total.set(load.kv_tokens_total)
        if worker is not None:
            self.in_flight.set(len(getattr(worker, "_reqs", ())))
            self._observe_engine(getattr(worker, "engine", None))
        self.tenants.expire()
        self.tenants_tracked.set(len(self.tenants))

    def _observe_engine(self, engine: Any) -> None:
        for name, counter in self.engine_counters.items():
            value = getattr(engine, name, None)
            if isinstance(value, int):
                delta = value - self._seen.get(name, 0)
                if delta > 0:
                    counter.inc(delta)
                self._seen[name] = value
        steps = getattr(engine, "steps", None)  # a deque of records with a step_ms
        if not steps:
            return
        new = []
        for rec in reversed(steps):  # newest first, back to the last one observed
            if rec is self._last_step:
                break
            new.append(rec)
        self._last_step = steps[-1]
        for rec in new:
            self.engine_steps.observe(getattr(rec, "step_ms", 0.0) / 1000)
