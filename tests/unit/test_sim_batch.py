"""BatchCore (gpu_worker.sim.batch): a run of steps at once equals the steps one by one.

The fleet simulator leans on `steps_until_change` + `run_steps` to skip per-token work;
these tests drive two identical cores with the same random traffic, one stepping and
one jumping, and require the same state (tokens, blocks, KV token-seconds, time).
"""

from __future__ import annotations

import random

import pytest

from gpu_worker.sim.batch import BatchCore, Seq, SeqState
from gpu_worker.sim.step_model import StepModel

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def model(**kw) -> StepModel:
    base = dict(name="t", max_num_seqs=6, kv_block_size_tokens=16, kv_tokens_total=16 * 40,
                prefill_tokens_per_s=10_000.0, step_base_ms=8.0, step_per_seq_ms=0.1,
                step_per_kv_token_ms=0.001)
    base.update(kw)
    return StepModel(**base)


def seq(i: int, rng: random.Random) -> Seq:
    return Seq(request_id=f"r{i}", priority=rng.choice([0, 0, 10]),
               num_prompt_tokens=rng.randint(1, 60), target_output_tokens=rng.randint(1, 90),
               cache_key=("s", f"r{i}"))


def step(core: BatchCore, prefill: int | None = None) -> float:
    """One step as SimEngine runs it; finished sequences are released."""
    if prefill is None:
        prefill = core.schedule()
    batch = list(core.running)
    ms = core.step_ms(prefill)
    for s in core.end_step(batch, ms):
        if s.num_tokens_left <= 0:
            core.release(s)
    return ms


def state(core: BatchCore, seqs: dict[str, Seq]) -> tuple:
    return (core.free_blocks, core.num_waiting, core.num_steps, core.num_preemptions,
            sorted(s.request_id for s in core.running),
            {k: (s.state, s.num_output_tokens, s.num_blocks, s.num_kv_computed,
                 round(s.kv_token_seconds, 6)) for k, s in seqs.items()})


@pytest.mark.parametrize("seed", range(30))
def test_run_steps_equals_stepping(seed):
    rng = random.Random(seed)
    a, b = BatchCore(model()), BatchCore(model())
    seqs_a: dict[str, Seq] = {}
    seqs_b: dict[str, Seq] = {}
    t_a = t_b = 0.0
    jumps = 0
    for i in range(40):
        if rng.random() < 0.6:
            x, y = seq(i, random.Random(seed * 1000 + i)), seq(i, random.Random(seed * 1000 + i))
            seqs_a[x.request_id], seqs_b[y.request_id] = x, y
            a.add(x)
            b.add(y)
        # a: step by step; b: schedule, then jump as far as allowed.
        prefill = b.schedule()
        k = b.steps_until_change()
        if not b.running:
            continue
        if k > 1:
            jumps += 1
            ends = b.run_ms(k, prefill)
            t_b += b.run_steps(k, prefill)
            assert t_b == pytest.approx(t_b - ends[-1] + ends[-1])
            for s in list(b.running):
                if s.num_tokens_left <= 0:
                    b.release(s)
            for j in range(k):
                t_a += step(a)
                # Each single step ends where run_ms said it would.
                assert sum(r.step_ms for r in list(a.steps)[-j - 1:]) == pytest.approx(ends[j])
        else:
            t_b += step(b, prefill)
            t_a += step(a)
        assert state(a, seqs_a) == state(b, seqs_b)
        assert t_a == pytest.approx(t_b)
        assert a.sim_time_s == pytest.approx(b.sim_time_s)
    assert jumps > 0


def test_no_run_while_a_waiting_request_could_be_admitted():
    core = BatchCore(model())
    rng = random.Random(1)
    core.add(seq(1, rng))
    core.schedule()
    core.add(seq(2, rng))  # arrives after this step's schedule: admitted next step
    assert core.steps_until_change() == 1


def test_run_stops_before_kv_exhaustion():
    # 4 blocks of 16: two sequences of 20 prompt tokens fill them after a few tokens.
    core = BatchCore(model(kv_tokens_total=64))
    for i in range(2):
        core.add(Seq(request_id=f"r{i}", priority=0, num_prompt_tokens=20,
                     target_output_tokens=200, cache_key=("s", f"r{i}")))
    core.schedule()
    k = core.steps_until_change()
    assert 1 <= k and core._growth_blocks(k) <= core.free_blocks
    core.run_steps(k, 0)
    assert all(s.state is SeqState.RUNNING for s in core.running)
    assert core.free_blocks >= 0
