"""What batching adds to a quiet prober's TTFT behind a full batch, whatever the scheduler.

An engine that batches continuously (vLLM, and the simulator that models it) runs one
step at a time and admits new work only between steps; while any sequence runs, a step
is running. So a probe that reaches a full, busy engine waits, however it got its slot
(a preemption, a slot kept free, a finish just then):

1. for the step in progress to end: uniform on [0, one decode step of the full batch)
   for an arrival at a random moment;
2. then for its prefill step, which is batched with the other sequences' decodes and so
   longer than the same prefill on an idle engine by `delta_ms`.

On an idle engine the probe pays neither. `floor_tail` adds a draw of both to the
probe's TTFT samples on the idle fleet and returns the quantile of the sum: the ratio
"p99 during ÷ p99 alone" that batching alone predicts, with the scheduler adding
nothing. Its premises, and so where it applies:

- "alone" is an idle engine: true for a light prober (bench/preemption.py's L: ~2 of
  64 slots), not for one whose own requests keep the engine busy (B, E: ~30 slots
  alone, so their alone TTFT already pays part of the batching, and the estimate
  overstates what the burst adds: E measured 1.38 against 1.46 at 3b41b13);
- the step in progress is the smallest a full batch can take (its KV holds the prompts
  only; real decode steps also read the generated tokens' KV, and some carry other
  admissions' prefills, both longer), and the rest of the path is as on the idle fleet
  (during a burst the machine is busier, never idler): both make it an underestimate;
- the two parts are drawn independently; one 20 s alone window can catch a hiccup of
  the machine, which then sits in both numbers of the ratio.

So it is an estimate, not a bound on a measured ratio. Pure: no I/O.
`bench/preemption_report.py` prints it beside the light neighbour's measured ratio.
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
