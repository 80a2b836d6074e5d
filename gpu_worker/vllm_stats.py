"""vLLM's own statistics, for `VllmEngine.load()` and the worker's ``/metrics``.

vLLM v1 has no public "current load" call: the scheduler lives in the engine-core
process and ships a `SchedulerStats` with every step's outputs to `AsyncLLM`, which
hands it (and an `IterationStats` of the outputs it processed) to its stat loggers.
vLLM's supported way in is a custom stat logger, a `StatLoggerBase` factory passed as
``AsyncLLM(stat_loggers=[...])``; `VllmStatsTap.factory` is one. It keeps:

- the latest running / waiting / KV-usage figures (`VllmEngine.load()`); they stop
  arriving when the engine goes idle, so `load()` combines them with its own
  in-flight count;
- counters, under the names the worker's metrics read from any engine
  (`gpu_worker.metrics`, ``_observe_engine``): ``num_preemptions`` (vLLM's own count,
  `IterationStats.num_preempted_reqs`, as its ``vllm:num_preemptions_total``),
  ``num_prefix_cache_queried_tokens`` / ``num_prefix_cache_hit_tokens`` (the scheduler's
  `PrefixCacheStats`, per step: fresh requests and re-prefills of preempted ones), and
  ``num_recomputed_tokens`` (a preempted request's re-prefill less its hits, plus what
  the adapter adds for continuations: `add_recomputed`);
- ``steps``: one `VllmStep` per engine iteration, its ``step_ms`` the iteration's
  elapsed time as vLLM measures it (`SchedulerIterationDetails.elapsed_ms`: from
  dispatching the batch to the model's output). vLLM attaches it only with
  ``enable_logging_iteration_details`` on, which the adapter sets; the text log it
  would also feed is vLLM's default logger, which the adapter turns off
  (``disable_log_stats``).

vLLM marks `SchedulerStats` and `IterationStats` as not stable interfaces: fields are
read defensively (`getattr` with a default), so a renamed one leaves its figure at 0
rather than breaking the engine; the `vllm` test tier checks they move. The GPU and
CPU builds share this code (pyproject pins vLLM's minor release).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True, eq=False)
class VllmStep:
    """One engine iteration (compared by identity: the worker's metrics find the ones
    they have not observed yet that way)."""

    step_ms: float


def _int(obj: Any, name: str) -> int:
    value = getattr(obj, name, 0)
    return int(value) if isinstance(value, int | float) else 0


class VllmStatsTap:
    """A per-engine vLLM stat logger's state; see the module docstring."""

    def __init__(self, step_log_size: int = 10_000) -> None:
        self.num_running = 0
        self.num_waiting = 0
        self.kv_cache_usage = 0.0
        self.updated_at = 0.0  # monotonic time of the latest SchedulerStats; 0: none yet
        self.num_preemptions = 0
        self.num_prefix_cache_queried_tokens = 0
        self.num_prefix_cache_hit_tokens = 0
        self.num_recomputed_tokens = 0
        self.steps: deque[VllmStep] = deque(maxlen=step_log_size)

    def factory(self, vllm_config: Any, engine_index: int = 0) -> Any:
        """vLLM's `PerEngineStatLoggerFactory`: a `StatLoggerBase` feeding this tap."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        tap = self

        class _Logger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
                tap.record(scheduler_stats, iteration_stats)

            def log_engine_initialized(self) -> None:
                pass

        return _Logger(vllm_config, engine_index)

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        """One batch of engine outputs: its `SchedulerStats` and `IterationStats`
        (either may be None)."""
        if iteration_stats is not None:
            self.num_preemptions += _int(iteration_stats, "num_preempted_reqs")
        if scheduler_stats is None:
            return
        self.num_running = _int(scheduler_stats, "num_running_reqs")
        self.num_waiting = _int(scheduler_stats, "num_waiting_reqs")
        self.kv_cache_usage = float(getattr(scheduler_stats, "kv_cache_usage", 0.0) or 0.0)
        self.updated_at = time.monotonic()
        cache = getattr(scheduler_stats, "prefix_cache_stats", None)
        if cache is not None:  # this step's lookups (vLLM resets them each time)
            hits, preempted_hits = _int(cache, "hits"), _int(cache, "preempted_hits")
            preempted_queries = _int(cache, "preempted_queries")
            self.num_prefix_cache_queried_tokens += _int(cache, "queries") + preempted_queries
            self.num_prefix_cache_hit_tokens += hits + preempted_hits
            self.num_recomputed_tokens += max(0, preempted_queries - preempted_hits)
        details = getattr(scheduler_stats, "iteration_details", None)
        if details is not None and not getattr(details, "is_dummy", False):
            self.steps.append(VllmStep(float(getattr(details, "elapsed_ms", 0.0) or 0.0)))

    def add_recomputed(self, num_tokens: int) -> None:
        """A continuation's re-prefill that the prefix cache did not serve (vLLM sees a
        continuation as a fresh request: only the adapter knows it is one)."""
        self.num_recomputed_tokens += max(0, num_tokens)
