"""bench/preemption_floor.py: the least a prober behind a full batch waits, any scheduler."""

from __future__ import annotations

import math
import random

import pytest

from bench.preemption_floor import batch_delay_ms, floor_samples, floor_tail
from gpu_worker.sim.batch import BatchCore, Seq
from gpu_worker.sim.step_model import load_step_model

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

MODEL = load_step_model("default")


def test_batch_delay_of_the_default_model():
    step_ms, delta_ms = batch_delay_ms(MODEL, 32, 32)
    # 8 ms + 0.1 ms x 32 sequences + 0.25 us x 1,024 KV tokens (the 32 prompts).
    assert step_ms == pytest.approx(8 + 3.2 + 0.256)
    # In that batch the probe's prefill step is 31 sequences and 992 KV tokens longer
    # than alone: 3.1 ms + 0.248 ms.
    assert delta_ms == pytest.approx(3.1 + 0.248)


def test_samples_lie_between_the_bounds_and_repeat():
    alone = [18.0, 19.5, 25.0]
    xs = floor_samples(alone, 12.0, 3.0, n=5_000, seed=3)
    assert len(xs) == 5_000
    assert min(xs) >= 18.0 + 3.0
    assert max(xs) <= 25.0 + 12.0 + 3.0
    assert xs == floor_samples(alone, 12.0, 3.0, n=5_000, seed=3)


def test_tail_of_a_constant_alone_is_a_whole_step_later():
    step_ms, delta_ms = batch_delay_ms(MODEL, 32, 32)
    p99 = floor_tail([20.0] * 300, MODEL, 32, 32)
    assert p99 == pytest.approx(20.0 + 0.99 * step_ms + delta_ms, abs=0.1)
    assert floor_tail([20.0] * 300, MODEL, 32, 32, q=0.5) == pytest.approx(
        20.0 + 0.5 * step_ms + delta_ms, abs=0.2)


def test_no_alone_samples_no_floor():
    assert math.isnan(floor_tail([], MODEL, 32, 32))


@pytest.mark.parametrize("seed", range(5))
def test_the_simulators_engine_never_beats_the_floor(seed):
    """The floor is a lower bound of the simulated engine's own physics: a probe that
    reaches a full batch mid-step gets its first token no sooner than the same probe on
    an idle engine plus the rest of that step plus `delta_ms`."""
    rng = random.Random(seed)
    step_ms, delta_ms = batch_delay_ms(MODEL, 32, 32)
    lone = BatchCore(MODEL, max_num_seqs=32)
    lone.add(Seq("p", 0, 32, 100, ("s", "p")))
    lone_ttft = lone.step_ms(lone.schedule())  # its prefill step on an idle engine
    for _ in range(20):
        core = BatchCore(MODEL, max_num_seqs=32)
        for i in range(32):
            core.add(Seq(f"a{i}", 10, 32, 400, ("s", f"a{i}")))
        # Run the flood for a while (its KV grows), then a probe arrives mid-step.
        for _ in range(rng.randint(1, 200)):
            core.advance_step(core.step_ms(core.schedule()))
        first_step_ms = core.step_ms(core.schedule())
        f = rng.random()
        core.advance_step(first_step_ms)  # the step in progress when the probe arrives
        probe = Seq("p", 0, 32, 100, ("s", "p"))
        core.release(core.running[-1])
        core.add(probe)
        prefill = core.schedule()
        assert probe in core.last_admitted
        ttft = (1 - f) * first_step_ms + core.step_ms(prefill)
        assert ttft >= lone_ttft + (1 - f) * step_ms + delta_ms - 1e-9
