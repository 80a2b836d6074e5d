"""The continuous-batching simulator (gpu_worker.sim): batching, KV, preemption."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from fairlane.protocol import InferenceRequest, SamplingParams, WorkItem
from gpu_worker.engine import EngineDead, GenerationDelta, PromptTooLong
from gpu_worker.sim.engine import SimEngine
from gpu_worker.sim.step_model import (
    StepModel,
    StepModelError,
    available_step_models,
    load_step_model,
    parse_step_model,
    save_step_model,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(20)]

FAST = 0.001  # time_scale: a 10 ms simulated step sleeps 10 us


def model(**kw) -> StepModel:
    base = dict(
        name="test",
        max_num_seqs=8,
        kv_block_size_tokens=16,
        kv_tokens_total=16 * 1000,
        prefill_tokens_per_s=10_000.0,
        step_base_ms=10.0,
        step_per_seq_ms=1.0,
        step_per_kv_token_ms=0.001,
    )
    base.update(kw)
    return StepModel(**base)


def item(rid: str, *, prompt_tokens: int = 32, out: int | None = 8, max_tokens: int = 256,
         priority: int = 0, seed: int | None = None, prompt: str | None = None,
         stop: list[str] | None = None) -> WorkItem:
    req = InferenceRequest(
        request_id=rid,
        tenant="t1",
        pool="p1",
        tier="free",
        reply_to="inbox.x",
        prompt=prompt,
        prompt_token_ids=None if prompt is not None else list(range(prompt_tokens)),
        sampling=SamplingParams(max_tokens=max_tokens, seed=seed, stop=stop or []),
        expected_output_tokens=out,
    )
    return WorkItem(request=req, engine_priority=priority)


async def collect(engine: SimEngine, it: WorkItem) -> list[GenerationDelta]:
    return [d async for d in engine.generate(it)]


@pytest.fixture
async def engines():
    made: list[SimEngine] = []

    def make(cm: StepModel | None = None, **kw) -> SimEngine:
        kw.setdefault("time_scale", FAST)
        e = SimEngine(cm or model(), **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        await e.close()


# --- step model ---------------------------------------------------------------------


def test_default_step_model_loads_and_is_marked_not_measured():
    cm = load_step_model("default")
    assert "default" in available_step_models()
    assert cm.measured is False
    assert "NOT measured" in cm.notes
    assert cm.num_kv_blocks == cm.kv_tokens_total // cm.kv_block_size_tokens
    # step = base + per_seq * n + per_kv * kv + prefill
    assert cm.step_ms(10, 1000, 1200) == pytest.approx(
        cm.step_base_ms + 10 * cm.step_per_seq_ms + 1000 * cm.step_per_kv_token_ms
        + 1000 * 1200 / cm.prefill_tokens_per_s
    )


@pytest.mark.parametrize("name", ["h100_llama7b_torch", "h200_llama7b_torch"])
def test_gpu_measured_step_models_load_and_say_where_they_come_from(name):
    """bench/calibrate_gpu.py's output, shipped: measured, on the GPU its name says,
    and slower as the batch or the KV in use grows."""
    cm = load_step_model(name)
    assert cm.measured is True and "not vLLM" in cm.measured_on
    assert name.split("_")[0].upper() in cm.measured_on
    assert cm.step_ms(64, 64 * 1024) > cm.step_ms(1, 128) > 0
    assert cm.prefill_tokens_per_s > 10_000 and cm.kv_tokens_total > 100_000


def test_step_model_roundtrip_by_path_and_errors(tmp_path):
    cm = model(name="calibrated", measured=True, measured_on="cpu", command="calibrate")
    path = tmp_path / "calibrated.json"
    save_step_model(cm, path)
    assert load_step_model(str(path)) == cm
    with pytest.raises(StepModelError, match="shipped models"):
        load_step_model("no-such-model")
    with pytest.raises(StepModelError, match="invalid step model"):
        parse_step_model(b'{"name": "x"}')
    with pytest.raises(StepModelError, match="format_version"):
        parse_step_model(msgspec.json.encode({**msgspec.to_builtins(cm), "format_version": 9}))
    with pytest.raises(StepModelError, match="kv_tokens_total"):
        parse_step_model(msgspec.json.encode({**msgspec.to_builtins(cm), "kv_tokens_total": 1}))
    # unknown keys (extra measurements) are ignored
    extra = {**msgspec.to_builtins(cm), "samples": [1, 2]}
    assert parse_step_model(msgspec.json.encode(extra)).name == "calibrated"


# --- engine ---------------------------------------------------------------------------


async def test_single_request_tokens_and_accounting(engines):
    e = engines()
    deltas = await collect(e, item("a", prompt_tokens=40, out=12))
    assert len(deltas) == 12
    assert all(d.text.startswith(" tok") and len(d.token_ids) == 1 for d in deltas)
    last = deltas[-1]
    assert last.finish_reason == "stop"
    assert last.num_prompt_tokens == 40 and last.num_output_tokens == 12
    # Alone in the engine, its KV-token-seconds are the integral over the steps.
    expected = sum(s.kv_tokens_in_use * s.step_ms / 1000 for s in e.steps)
    assert last.kv_token_seconds == pytest.approx(expected)
    assert last.kv_token_seconds > 0
    # first step carries the prefill of 40 tokens
    assert e.steps[0].prefill_tokens == 40
    assert e.load().num_running == 0 and e.load().kv_tokens_used == 0


async def test_prompt_text_estimated_and_output_deterministic(engines):
    e = engines()
    a = await collect(e, item("x1", prompt="a" * 400, out=None, seed=7, max_tokens=10_000))
    b = await collect(e, item("x2", prompt="a" * 400, out=None, seed=7, max_tokens=10_000))
    assert a[-1].num_prompt_tokens == 100  # ~4 chars per token
    assert [d.token_ids for d in a] == [d.token_ids for d in b]
    assert a[-1].num_output_tokens == b[-1].num_output_tokens >= 1
    capped = await collect(e, item("x3", out=None, seed=7, max_tokens=1))
    assert capped[-1].num_output_tokens == 1 and capped[-1].finish_reason == "length"


async def test_max_tokens_caps_expected_output(engines):
    e = engines()
    deltas = await collect(e, item("c", out=50, max_tokens=5))
    assert deltas[-1].num_output_tokens == 5 and deltas[-1].finish_reason == "length"


async def test_batching_up_to_max_num_seqs(engines):
    e = engines(max_num_seqs=4)
    results = await asyncio.gather(*(collect(e, item(f"r{i}", out=10)) for i in range(10)))
    assert all(r[-1].num_output_tokens == 10 for r in results)
    sizes = [s.num_running for s in e.steps]
    assert max(sizes) == 4
    assert all(n <= 4 for n in sizes)


async def test_step_time_grows_with_batch_and_kv(engines):
    e = engines()
    await collect(e, item("solo", out=6))
    solo = [s for s in e.steps if s.prefill_tokens == 0]
    e.steps.clear()
    await asyncio.gather(*(collect(e, item(f"b{i}", out=6)) for i in range(6)))
    batch = [s for s in e.steps if s.prefill_tokens == 0 and s.num_running == 6]
    assert solo and batch
    assert min(s.step_ms for s in batch) > max(s.step_ms for s in solo)
    cm = e.step_model
    for s in [*solo, *batch]:
        assert s.step_ms == pytest.approx(
            cm.step_base_ms + cm.step_per_seq_ms * s.num_running
            + cm.step_per_kv_token_ms * s.kv_tokens_in_use
        )


async def test_load_reports_running_waiting_and_kv(engines):
    e = engines(max_num_seqs=2, time_scale=0.05)
    first_token = [asyncio.Event() for _ in range(5)]

    async def run(i: int) -> None:
        async for _ in e.generate(item(f"l{i}", out=100)):
            first_token[i].set()

    tasks = [asyncio.create_task(run(i)) for i in range(5)]
    await first_token[0].wait()
    await first_token[1].wait()
    load = e.load()
    assert load.num_running == 2 and load.num_waiting == 3 and load.max_num_seqs == 2
    # 2 sequences of 32 prompt tokens + 1 output: 3 blocks of 16 each
    assert load.kv_tokens_used == 2 * 3 * 16
    assert load.kv_tokens_total == 16 * 1000
    for i in range(5):
        await e.abort(f"l{i}")
    await asyncio.gather(*tasks)


async def test_preemption_when_kv_exhausted_and_preempted_request_completes(engines):
    # 8 blocks of 16 tokens; three sequences that each grow to 32 + 40 = 72 tokens
    # (5 blocks) cannot all fit: the latest one is evicted and re-prefilled later.
    e = engines(model(kv_tokens_total=128))
    results = await asyncio.gather(*(collect(e, item(f"p{i}", out=40)) for i in range(3)))
    assert e.num_preemptions >= 1
    for r in results:
        assert len(r) == 40  # no token repeated or lost across the preemption
        assert r[-1].num_output_tokens == 40 and r[-1].finish_reason == "stop"
    assert all(s.kv_tokens_in_use <= 128 for s in e.steps)
    # a re-admitted sequence re-prefills prompt + generated tokens (recompute-style)
    assert e.num_recomputed_tokens > 0
    assert e.load().kv_tokens_used == 0


async def test_preemption_evicts_lowest_priority_first(engines):
    e = engines(model(kv_tokens_total=128))
    order: list[str] = []

    async def run(rid: str, prio: int) -> None:
        await collect(e, item(rid, out=40, priority=prio))
        order.append(rid)

    # "low" arrives first but has the worse priority: it is the one evicted.
    await asyncio.gather(run("low", 5), run("hi1", 0), run("hi2", 0))
    assert e.num_preemptions >= 1
    assert order[-1] == "low"


async def test_waiting_queue_priority_then_arrival(engines):
    e = engines(max_num_seqs=1)
    first_token_order: list[str] = []
    blocker_started = asyncio.Event()

    async def run(rid: str, prio: int) -> None:
        async for _ in e.generate(item(rid, out=3, priority=prio)):
            if rid not in first_token_order:
                first_token_order.append(rid)
                blocker_started.set()

    blocker = asyncio.create_task(run("blocker", 0))
    await blocker_started.wait()
    rest = [asyncio.create_task(run(rid, p))
            for rid, p in [("late_low", 9), ("mid_a", 3), ("top", 1), ("mid_b", 3)]]
    await asyncio.gather(blocker, *rest)
    assert first_token_order == ["blocker", "top", "mid_a", "mid_b", "late_low"]


async def test_abort_ends_stream_and_frees_kv(engines):
    e = engines(max_model_len=100_000, time_scale=0.01)
    got: list[GenerationDelta] = []

    async def consume() -> None:
        async for d in e.generate(item("long", out=10_000, max_tokens=10_000)):
            got.append(d)
            if len(got) == 3:
                await e.abort("long")

    await asyncio.wait_for(consume(), 5)
    assert got[-1].finish_reason == "abort"
    assert got[-1].num_output_tokens >= 3
    assert e.load().num_running == 0 and e.load().kv_tokens_used == 0
    await e.abort("long")  # unknown/finished: a no-op
    await e.abort("never-seen")


async def test_abort_while_waiting(engines):
    e = engines(max_num_seqs=1, time_scale=0.01)
    blk = e.generate(item("blk", out=50))
    await blk.__anext__()  # "blk" holds the only slot
    waiting = asyncio.create_task(collect(e, item("w", out=5)))
    await asyncio.sleep(0)  # let it enter the engine's queue
    assert e.load().num_waiting == 1
    await e.abort("w")
    res = await waiting
    assert [d.finish_reason for d in res] == ["abort"] and res[0].num_output_tokens == 0
    assert e.load().num_waiting == 0
    await blk.aclose()
    assert e.load().num_running == 0


async def test_consumer_going_away_frees_the_sequence(engines):
    e = engines(time_scale=0.01)
    gen = e.generate(item("gone", out=1000, max_tokens=1000))
    await gen.__anext__()
    await gen.aclose()
    assert e.load().num_running == 0 and e.load().kv_tokens_used == 0


async def test_prompt_too_long(engines):
    e = engines(max_model_len=64)
    with pytest.raises(PromptTooLong) as info:
        await collect(e, item("big", prompt_tokens=64))
    assert info.value.code.value == "prompt_too_long"
    # a prompt that fits gets its output capped at max_model_len
    deltas = await collect(e, item("fits", prompt_tokens=60, out=50))
    assert deltas[-1].num_output_tokens == 4 and deltas[-1].finish_reason == "length"


async def test_engine_crash_raises_engine_dead(engines):
    e = engines(fail_after_steps=3)
    with pytest.raises(EngineDead):
        await collect(e, item("doomed", out=100))
    with pytest.raises(EngineDead):
        e.load()
    with pytest.raises(EngineDead):
        await collect(e, item("after", out=1))


async def test_time_scale_one_is_roughly_real_time(engines):
    e = engines(model(step_base_ms=5.0, step_per_seq_ms=0, step_per_kv_token_ms=0,
                      prefill_tokens_per_s=1e9), time_scale=1.0)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await collect(e, item("rt", out=10))
    assert loop.time() - t0 >= 0.045
    assert e.sim_time_s == pytest.approx(0.05, rel=0.01)


async def test_late_wake_ups_do_not_slow_the_engine_down(engines):
    """A busy event loop wakes the engine late after every step (here a task that
    holds the loop 3 ms at a time: up to ~6 ms late, as the timer's callback runs after
    the ready ones): the next step starts at the step's due end, not at the late
    wake-up, so 40 steps of 10 ms still take about 400 ms of wall time, not ~0.55 s
    (the fleet's workers' 3-4% in bench/fidelity.py). A wake-up later than a whole
    step is not caught up (a starved process does not race through steps)."""
    e = engines(model(step_base_ms=10.0, step_per_seq_ms=0, step_per_kv_token_ms=0,
                      prefill_tokens_per_s=1e9), time_scale=1.0)
    stop = False

    async def hog() -> None:
        while not stop:
            time.sleep(0.003)  # noqa: ASYNC251 - the point: the loop is busy
            await asyncio.sleep(0)

    loop = asyncio.get_running_loop()
    task = loop.create_task(hog())
    try:
        t0 = loop.time()
        await collect(e, item("late", out=40))
        elapsed_s = loop.time() - t0
    finally:
        stop = True
        await task
    assert e.sim_time_s == pytest.approx(0.4, rel=0.01)
    # Caught up: at most the last wake-up's lateness and the first submission's wait
    # beyond the model (without catching up: ~0.55 s).
    assert elapsed_s < 0.45


# --- stop strings ----------------------------------------------------------------------


def expected_stop(texts: list[str], stops: list[str]) -> tuple[str, int]:
    """(returned text, tokens emitted) for `stops` over the undisturbed token texts:
    the text up to the earliest stop occurrence; the tokens up to the one completing
    the first match."""
    full = "".join(texts)
    for n in range(1, len(texts) + 1):
        so_far = "".join(texts[:n])
        hits = [so_far.find(s) for s in stops if s in so_far]
        if hits:
            return full[: min(hits)], n
    return full, len(texts)


async def test_stop_string_ends_the_stream_without_returning_it(engines):
    e = engines()
    base = await collect(e, item("st0", out=20, seed=5))
    texts = [d.text for d in base]
    ids = [d.token_ids[0] for d in base]
    # a whole token's text; one spanning two tokens ("<last digit> tok<first digit>");
    # two digits (may first occur anywhere); two stops at once (the earlier match
    # wins); one that never occurs
    spanning = texts[6][-1] + texts[7][:5]
    cases = [[texts[9]], [spanning], [texts[4][4:6]], ["zzz", texts[12], texts[8]], ["zzz"]]
    for i, stops in enumerate(cases):
        got = await collect(e, item(f"st{i + 1}", out=20, seed=5, stop=stops))
        want_text, want_tokens = expected_stop(texts, stops)
        assert "".join(d.text for d in got) == want_text, stops
        assert [t for d in got for t in d.token_ids] == ids[:want_tokens]
        assert got[-1].num_output_tokens == want_tokens
        stopped = any(s in "".join(texts) for s in stops)
        assert got[-1].finish_reason == ("stop" if stopped else base[-1].finish_reason)
        assert not any(s in "".join(d.text for d in got) for s in stops)
    assert e.load().num_running == 0 and e.load().kv_tokens_used == 0


async def test_held_back_text_is_not_lost_on_abort(engines):
    # With a 6-character stop, the last 5 characters wait for the next token; an
    # abort (a preemption, say) must still deliver them: the continuation starts
    # after these tokens and would never send that text.
    e = engines(time_scale=0.01)
    got: list[GenerationDelta] = []
    async for d in e.generate(item("held", out=500, max_tokens=500, stop=["qqqqqq"])):
        got.append(d)
        if len(got) == 3:
            await e.abort("held")
    assert got[-1].finish_reason == "abort"
    ids = [t for d in got for t in d.token_ids]
    assert "".join(d.text for d in got) == "".join(f" tok{t}" for t in ids)
