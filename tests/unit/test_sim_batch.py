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


class Shadow:
    """Each sequence's tokens and KV token-seconds kept the plain way (one token per
    step per running sequence, KV tokens x step time), to check the core's counters."""

    def __init__(self, core: BatchCore) -> None:
        self.core = core
        self.out: dict[Seq, int] = {}
        self.kvts: dict[Seq, float] = {}

    def step(self, batch: list[Seq], ms: float) -> None:
        for s in batch:
            if s.state is SeqState.RUNNING:
                out = self.out.get(s, 0)
                self.kvts[s] = self.kvts.get(s, 0.0) + (s.num_prompt_tokens + out) * ms / 1000
                self.out[s] = out + 1

    def run(self, k: int, ends: list[float]) -> None:
        for j in range(k):
            self.step(list(self.core.running), ends[j] - (ends[j - 1] if j else 0.0))

    def check(self, seqs: dict[str, Seq]) -> None:
        """After a step (or run): the core's view of every sequence is the plain one."""
        core, bs = self.core, self.core.block_size
        used = kv = 0
        for s in seqs.values():
            out = self.out.get(s, 0)
            assert s.num_output_tokens == out, s
            assert s.kv_token_seconds == pytest.approx(self.kvts.get(s, 0.0), rel=1e-9, abs=1e-9)
            if s.state is SeqState.RUNNING:
                # After a step: blocks for every token so far; all but the last computed.
                assert s.num_blocks == -(-(s.num_prompt_tokens + out) // bs), s
                assert s.num_kv_computed == s.num_prompt_tokens + out - 1, s
                assert s.num_kv_tokens == s.num_prompt_tokens + out
                used += s.num_blocks
                kv += s.num_prompt_tokens + out
            else:
                assert (s.num_blocks, s.num_kv_computed, s.num_kv_tokens) == (0, 0, 0)
        assert core.num_blocks_total - core.free_blocks == used
        assert core.kv_tokens_in_use == kv
        assert sorted(s.num_tokens_left for s in core.running)[:1] == (
            [core._min_tokens_left()] if core.running else [])


def step(core: BatchCore, prefill: int | None = None, shadow: Shadow | None = None) -> float:
    """One step as SimEngine runs it; finished sequences are released."""
    if prefill is None:
        prefill = core.schedule()
    batch = list(core.running)
    ms = core.step_ms(prefill)
    if shadow is not None:
        shadow.step(batch, ms)
    for s in core.end_step(batch, ms):
        if s.num_tokens_left <= 0:
            core.release(s)
    return ms


def state(core: BatchCore, seqs: dict[str, Seq]) -> tuple:
    return (core.free_blocks, core.num_waiting, core.num_steps, core.num_preemptions,
            sorted(s.request_id for s in core.running),
            {k: (s.state, s.num_output_tokens, s.num_blocks, s.num_kv_computed,
                 round(s.kv_token_seconds, 6)) for k, s in seqs.items()})


def compare(seed: int, **kw) -> int:
    """Two cores, the same random traffic: `a` steps one by one, `b` jumps whole runs
    (`steps_until_change` / `run_steps` / `pop_finished`); both must agree after every
    round, and each must agree with its plain per-sequence `Shadow`. Returns the jumps."""
    rng = random.Random(seed)
    a, b = BatchCore(model(**kw)), BatchCore(model(**kw))
    sa, sb = Shadow(a), Shadow(b)
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
            sb.run(k, ends)
            t_b += b.run_steps(k, prefill)
            assert t_b == pytest.approx(t_b - ends[-1] + ends[-1])
            done = b.pop_finished()
            assert done == [s for s in b.running if s.num_tokens_left <= 0]
            for s in done:
                b.release(s)
            for j in range(k):
                t_a += step(a, shadow=sa)
                # Each single step ends where run_ms said it would.
                assert sum(r.step_ms for r in list(a.steps)[-j - 1:]) == pytest.approx(ends[j])
        else:
            t_b += step(b, prefill, shadow=sb)
            b.pop_finished()  # what step() released: nothing left to pop
            t_a += step(a, shadow=sa)
        assert state(a, seqs_a) == state(b, seqs_b)
        sa.check(seqs_a)
        sb.check(seqs_b)
        assert t_a == pytest.approx(t_b)
        assert a.sim_time_s == pytest.approx(b.sim_time_s)
    return jumps


@pytest.mark.parametrize("seed", range(30))
def test_run_steps_equals_stepping(seed):
    assert compare(seed) > 0


@pytest.mark.parametrize("seed", range(6))
def test_run_steps_equals_stepping_under_kv_pressure(seed):
    # 12 blocks of 8 for 6 slots: growth preempts often, runs are cut short by it.
    assert compare(seed, kv_block_size_tokens=8, kv_tokens_total=8 * 12) >= 0


def _plant(monkeypatch, name: str) -> None:
    """Break one piece of the counters' bookkeeping."""
    orig = {n: getattr(BatchCore, n) for n in ("run_steps", "_growth_blocks", "advance_step",
                                               "pop_finished", "grow")}
    if name == "run_kv_seconds":  # the run forgets the KV its own tokens add
        def run_steps(self, k, prefill):
            u = self._U
            total = orig["run_steps"](self, k, prefill)
            self._U = u + (self._D - k) * total
            return total
        monkeypatch.setattr(BatchCore, "run_steps", run_steps)
    elif name == "growth_off_by_one":
        monkeypatch.setattr(BatchCore, "_growth_blocks",
                            lambda self, k: max(0, orig["_growth_blocks"](self, k) - 1))
    elif name == "step_kv_seconds":  # a step charged at the KV of the step after it
        def advance_step(self, ms):
            self._U += ms
            orig["advance_step"](self, ms)
        monkeypatch.setattr(BatchCore, "advance_step", advance_step)
    elif name == "finish_one_late":
        def pop_finished(self):
            self._D -= 1
            try:
                return orig["pop_finished"](self)
            finally:
                self._D += 1
        monkeypatch.setattr(BatchCore, "pop_finished", pop_finished)
    elif name == "kv_seconds_shared":  # both cores read it: only the Shadow can tell
        def kvts(self):
            c = self._core
            if c is None:
                return self._kvts
            return self._kvts + (self.num_prompt_tokens + self._out) * (c._T - self._t0) / 1000
        monkeypatch.setattr(Seq, "kv_token_seconds", property(kvts))
    elif name == "release_drops_a_token":  # leaving the batch stores one token too few
        orig_release = BatchCore.release

        def release(self, s):
            running = s.state is SeqState.RUNNING
            orig_release(self, s)
            if running:
                s._out -= 1
        monkeypatch.setattr(BatchCore, "release", release)
    elif name == "grow_skips_a_block":
        def grow(self):
            if not self._grown and self.running and self.free_blocks > 0:
                self.free_blocks += 1  # one block too few taken
            return orig["grow"](self)
        monkeypatch.setattr(BatchCore, "grow", grow)


@pytest.mark.parametrize("plant", ["run_kv_seconds", "growth_off_by_one", "step_kv_seconds",
                                   "finish_one_late", "grow_skips_a_block", "kv_seconds_shared",
                                   "release_drops_a_token"])
def test_the_comparison_catches_a_planted_error(monkeypatch, plant):
    _plant(monkeypatch, plant)
    with pytest.raises(AssertionError):
        for seed in range(30):
            compare(seed)
            compare(seed, kv_block_size_tokens=8, kv_tokens_total=8 * 12)


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
