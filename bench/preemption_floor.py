"""The floor under a quiet prober's TTFT behind a full batch, whatever the scheduler.

An engine that batches continuously (vLLM, and the simulator that models it) runs one
step at a time and admits new work only between steps; while any sequence runs, a step
is running. So a probe that reaches a full, busy engine waits, however it got its slot
(a preemption, a slot kept free, a finish just then):

1. for the step in progress to end: uniform on [0, one decode step of the full batch)
   for an arrival at a random moment;
2. then for its prefill step, which is batched with the other sequences' decodes and so
   longer than the same prefill on an idle engine by `delta_ms`.

On an idle fleet the probe pays none of that. Its TTFT during a burst is therefore at
least its TTFT alone plus U(0, step) + delta. `floor_tail` draws that sum, with the
"alone" samples of the same run as the rest of the path (publish, dispatch, network,
the lone prefill step), and returns its quantile: what the ratio "p99 during ÷ p99
alone" could be at best on this engine and this machine. It is a lower bound:

- the step is the smallest a full batch can take (its KV holds the flood's prompts
  only; real decode steps also read the tokens generated so far, and some carry other
  requests' prefills, both longer);
- the rest of the path is taken as on the idle fleet (during a burst the dispatcher,
  the broker and the machine are busier, never idler);
- the two parts are drawn independently.

Pure: no I/O. `bench/preemption_report.py` prints it beside the measured ratio.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from bench.common import quantile
from gpu_worker.sim.step_model import StepModel


def batch_delay_ms(model: StepModel, num_seqs: int, prompt_tokens: int) -> tuple[float, float]:
    """(step_ms, delta_ms) on a full batch of `num_seqs` holding `prompt_tokens` each:
    the decode step in progress when the probe arrives, and how much longer the probe's
    prefill step of `prompt_tokens` is in that batch than on an idle engine."""
    kv = num_seqs * prompt_tokens  # the least KV a full batch holds: the prompts
    step_ms = model.step_ms(num_seqs, kv)
    batched_ms = model.step_ms(num_seqs, kv, prompt_tokens)
    lone_ms = model.step_ms(1, prompt_tokens, prompt_tokens)
    return step_ms, batched_ms - lone_ms


def floor_samples(alone_ms: Sequence[float], step_ms: float, delta_ms: float,
                  n: int = 20_000, seed: int = 0) -> list[float]:
    """`n` draws of alone + U(0, step_ms) + delta_ms (module docstring)."""
    if not alone_ms:
        return []
    rng = random.Random(seed)
    choice, uniform = rng.choice, rng.random
    return [choice(alone_ms) + uniform() * step_ms + delta_ms for _ in range(n)]


def floor_tail(alone_ms: Sequence[float], model: StepModel, num_seqs: int,
               prompt_tokens: int, q: float = 0.99) -> float:
    """The `q` quantile of the floor's draws (NaN without alone samples)."""
    step_ms, delta_ms = batch_delay_ms(model, num_seqs, prompt_tokens)
    xs = floor_samples(alone_ms, step_ms, delta_ms)
    return quantile(xs, q) if xs else float("nan")
