"""Resumable generation in the simulator (DESIGN.md 5b): continuations and the
simulated prefix cache (gpu_worker.sim.prefix_cache)."""

from __future__ import annotations

import asyncio
import random
from collections import OrderedDict

import pytest

from fairlane.protocol import Continuation, InferenceRequest, SamplingParams, WorkItem
from gpu_worker.engine import GenerationDelta
from gpu_worker.sim.engine import SimEngine
from gpu_worker.sim.prefix_cache import PrefixCache
from gpu_worker.sim.step_model import StepModel

pytestmark = [pytest.mark.unit, pytest.mark.timeout(20)]

BLOCK = 16


def model(kv_blocks: int = 1000) -> StepModel:
    return StepModel(
        name="test",
        max_num_seqs=8,
        kv_block_size_tokens=BLOCK,
        kv_tokens_total=BLOCK * kv_blocks,
        prefill_tokens_per_s=10_000.0,
        step_base_ms=10.0,
        step_per_seq_ms=1.0,
        step_per_kv_token_ms=0.001,
    )


def item(rid: str, *, prompt_tokens: int = 40, out: int | None = 30, max_tokens: int = 256,
         seed: int | None = None, resume: list[int] | None = None,
         cache_salt: str | None = "salt-a") -> WorkItem:
    req = InferenceRequest(
        request_id=rid,
        tenant="t1",
        pool="p1",
        tier="free",
        reply_to="inbox.x",
        prompt_token_ids=list(range(prompt_tokens)),
        sampling=SamplingParams(max_tokens=max_tokens, seed=seed),
        expected_output_tokens=out,
        resume=None if resume is None else Continuation(generated_token_ids=list(resume)),
    )
    return WorkItem(request=req, cache_salt=cache_salt)


def ids_of(deltas: list[GenerationDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


async def collect(engine: SimEngine, it: WorkItem) -> list[GenerationDelta]:
    return [d async for d in engine.generate(it)]


async def run_until(engine: SimEngine, it: WorkItem, num_tokens: int) -> list[int]:
    """Consume `num_tokens` tokens, then abort: what a preempted request's client holds."""
    got: list[int] = []
    async for d in engine.generate(it):
        got.extend(d.token_ids)
        if len(got) == num_tokens:
            await engine.abort(it.request.request_id)
    return got


@pytest.fixture
async def engines():
    made: list[SimEngine] = []

    def make(cm: StepModel | None = None, **kw) -> SimEngine:
        kw.setdefault("time_scale", 0.001)
        e = SimEngine(cm or model(), **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        await e.close()


# --- continuations ---------------------------------------------------------------------


@pytest.mark.parametrize("out", [None, 30])  # natural length drawn from the seed / declared
async def test_resumed_tokens_equal_the_undisturbed_runs_remaining_tokens(engines, out):
    e = engines()
    whole = await collect(e, item("r", out=out, seed=11, max_tokens=10_000))
    full = ids_of(whole)
    assert len(full) >= 3, "seed 11 must give a few tokens for this test to mean much"
    for k in (1, len(full) // 2, len(full) - 1):
        resumed = await collect(e, item("r", out=out, seed=11, max_tokens=10_000,
                                        resume=full[:k]))
        assert ids_of(resumed) == full[k:]
        assert len(resumed) == len(full) - k  # one delta per new token, none repeated
        # counts are the whole request's: earlier tokens included, prompt as before
        assert [d.num_output_tokens for d in resumed] == list(range(k + 1, len(full) + 1))
        assert resumed[-1].finish_reason == whole[-1].finish_reason
        assert resumed[-1].num_prompt_tokens == whole[-1].num_prompt_tokens == 40


async def test_max_tokens_is_the_whole_requests_budget(engines):
    e = engines()
    full = ids_of(await collect(e, item("m", out=50, max_tokens=10)))
    assert len(full) == 10
    rest = await collect(e, item("m", out=50, max_tokens=10, resume=full[:4]))
    assert ids_of(rest) == full[4:] and len(rest) == 6
    assert rest[-1].finish_reason == "length" and rest[-1].num_output_tokens == 10

    steps_before = e.num_steps
    for already in (full, [*full, 7, 8]):  # budget spent (or overspent): nothing new
        done = await collect(e, item("m", out=50, max_tokens=10, resume=already))
        assert len(done) == 1 and done[0].token_ids == [] and done[0].text == ""
        assert done[0].finish_reason == "length"
        assert done[0].num_output_tokens == len(already)
    assert e.num_steps == steps_before  # it never took a slot
    assert e.load().num_running == e.load().num_waiting == 0


async def test_resume_past_the_natural_end_stops_at_once(engines):
    e = engines()
    full = ids_of(await collect(e, item("n", out=5, max_tokens=100)))
    done = await collect(e, item("n", out=5, max_tokens=100, resume=full))
    assert [(d.finish_reason, d.token_ids) for d in done] == [("stop", [])]


# --- the prefix cache -------------------------------------------------------------------


async def test_resume_on_the_same_engine_and_salt_hits_the_prefix_cache(engines):
    e = engines()
    full = ids_of(await collect(e, item("undisturbed", out=30, seed=3)))
    held = await run_until(e, item("p", out=30, seed=3), 20)
    assert held == full[:20]
    # The aborted run's full blocks stay cached, counted as free KV.
    assert e.prefix_cache.blocks(("salt-a", "p")) >= (40 + 20 - 1) // BLOCK
    assert e.load().kv_tokens_used == 0

    e.steps.clear()
    resumed = await collect(e, item("p", out=30, seed=3, resume=held))
    assert ids_of(resumed) == full[20:]
    # 60 tokens to re-prefill; the last one is always computed again, so at most 3
    # full blocks (48 tokens) come from the cache and 12 are recomputed.
    last = resumed[-1]
    assert last.num_recomputed_tokens == 12
    assert last.num_cached_prompt_tokens == 40
    assert all(d.num_recomputed_tokens == 12 for d in resumed)
    assert e.steps[0].prefill_tokens == 12
    assert e.num_recomputed_tokens == 12
    assert e.num_prefix_cache_hit_tokens == 48


async def test_resume_under_another_salt_or_on_another_engine_recomputes_everything(engines):
    e, other_engine = engines(), engines()
    held = await run_until(e, item("s", out=30), 20)

    for engine, salt in ((e, "salt-b"), (other_engine, "salt-a")):
        engine.steps.clear()
        resumed = await collect(engine, item("s", out=30, cache_salt=salt, resume=held))
        assert len(resumed) == 10
        assert resumed[-1].num_recomputed_tokens == 40 + 20
        assert resumed[-1].num_cached_prompt_tokens == 0
        assert engine.steps[0].prefill_tokens == 60
        assert engine.num_prefix_cache_hit_tokens == 0
    # the miss left the salt-a entry alone: the right salt still hits
    again = await collect(e, item("s", out=30, cache_salt="salt-a", resume=held))
    assert again[-1].num_recomputed_tokens == 12


async def test_a_fresh_request_gets_no_recompute_accounting(engines):
    e = engines()
    deltas = await collect(e, item("f", out=10))
    assert all(d.num_recomputed_tokens == 0 for d in deltas)
    assert e.num_recomputed_tokens == e.num_prefix_cache_hit_tokens == 0


@pytest.mark.parametrize(
    ("other_prompt_tokens", "blocks_left", "recomputed"),
    [
        (127, 2, 60 - 2 * BLOCK),  # needs 8 of 10 blocks: 6 uncached free + 2 evicted
        (150, 0, 60),  # needs all 10: the whole entry is evicted
    ],
)
async def test_cached_blocks_are_evicted_under_pressure_tail_first(
    engines, other_prompt_tokens, blocks_left, recomputed
):
    e = engines(model(kv_blocks=10))
    full = ids_of(await collect(e, item("a", out=30)))
    # 40 + 30 tokens, the last without KV: 69 computed, 4 full blocks cached.
    assert e.prefix_cache.blocks(("salt-a", "a")) == 4
    assert e.load().kv_tokens_used == 0  # cached blocks are free

    await collect(e, item("b", prompt_tokens=other_prompt_tokens, out=1))
    assert e.prefix_cache.blocks(("salt-a", "a")) == blocks_left
    assert e.prefix_cache.num_evicted_blocks == 4 - blocks_left

    resumed = await collect(e, item("a", out=30, resume=full[:20]))
    assert ids_of(resumed) == full[20:]
    assert resumed[-1].num_recomputed_tokens == recomputed


async def test_preempted_sequence_reuses_its_cached_blocks(engines):
    # 14 blocks; three sequences growing to 32 + 60 tokens (6 blocks) cannot all fit.
    # A sequence preempted for KV keeps its full blocks in the cache; what survives
    # the others' growth until it is re-admitted is not prefilled again.
    e = engines(model(kv_blocks=14))
    results = await asyncio.gather(
        *(collect(e, item(f"y{i}", prompt_tokens=32, out=60)) for i in range(3))
    )
    assert e.num_preemptions >= 1
    assert all(len(r) == 60 and r[-1].num_output_tokens == 60 for r in results)
    # every re-admission prefilled at least its prompt + 1 token again, split
    # between cache hits and recomputation
    prefilled_again = e.num_recomputed_tokens + e.num_prefix_cache_hit_tokens
    assert prefilled_again >= e.num_preemptions * (32 + 1)
    assert e.num_recomputed_tokens > 0 and e.num_prefix_cache_hit_tokens > 0
    # a fresh request's own accounting stays 0 (it is not a continuation)
    assert all(d.num_recomputed_tokens == 0 for r in results for d in r)
    assert all(s.kv_tokens_in_use <= 14 * BLOCK for s in e.steps)


# --- PrefixCache on its own ---------------------------------------------------------------


def test_prefix_cache_lru_eviction_and_take():
    c = PrefixCache()
    c.put("a", 3)
    c.put("b", 2)
    c.put("c", 4)
    assert c.num_blocks == 9 and len(c) == 3
    assert c.evict(4) == 4  # all of "a", then one (tail) block of "b"
    assert (c.blocks("a"), c.blocks("b"), c.blocks("c")) == (0, 1, 4)
    assert c.take("c", 2) == 2  # reuse at most what the resumed prefix covers
    assert c.blocks("c") == 0 and c.num_blocks == 1  # the rest is plain free now
    c.put("b", 5)  # a newer run of the same key replaces the entry (and is newest)
    c.put("d", 1)
    assert c.num_blocks == 6
    assert c.evict(100) == 6 and c.num_blocks == 0 and len(c) == 0
    assert c.take("missing", 10) == 0
    c.put("z", 0)  # nothing full to keep
    assert len(c) == 0


class _ReferencePrefixCache:
    """The cache's specification, the plain way (an OrderedDict, oldest first)."""

    def __init__(self) -> None:
        self.entries: OrderedDict[str, int] = OrderedDict()

    def put(self, key: str, n: int) -> None:
        self.entries.pop(key, None)
        if n > 0:
            self.entries[key] = n

    def take(self, key: str, max_blocks: int) -> int:
        return min(self.entries.pop(key, 0), max(0, max_blocks))

    def evict(self, n: int) -> int:
        evicted = 0
        while evicted < n and self.entries:
            key, held = next(iter(self.entries.items()))
            drop = min(held, n - evicted)
            if drop == held:
                del self.entries[key]
            else:
                self.entries[key] = held - drop
            evicted += drop
        return evicted


def test_prefix_cache_matches_its_specification_over_random_operations():
    rng = random.Random(7)
    c, ref = PrefixCache(), _ReferencePrefixCache()
    keys = [f"k{i}" for i in range(40)]
    for _ in range(20_000):
        op, key = rng.random(), rng.choice(keys)
        if op < 0.45:
            n = rng.randint(0, 6)
            c.put(key, n), ref.put(key, n)
        elif op < 0.8:
            n = rng.randint(-1, 8)
            assert c.take(key, n) == ref.take(key, n)
        else:
            n = rng.randint(0, 12)
            assert c.evict(n) == ref.evict(n)
        assert c.num_blocks == sum(ref.entries.values()) and len(c) == len(ref.entries)
        assert c.blocks(key) == ref.entries.get(key, 0) and (key in c) == (key in ref.entries)


def test_prefix_cache_without_evictions_stays_bounded():
    """Entries replaced or taken leave emptied slots behind; with no eviction to reach
    them they are compacted away, not kept for the engine's lifetime."""
    c = PrefixCache()
    for i in range(100_000):
        c.put(f"k{i % 10}", 3)
        if i % 3 == 0:
            c.take(f"k{(i + 5) % 10}", 3)
    assert len(c) <= 10
    assert len(c._order) <= 2 * len(c) + 65
