"""Fleet-level preemption on a real nats-server: dispatcher, simulated worker, client.

A tenant that floods every slot with long requests does not make a quiet tenant wait
for a slot to turn over: the dispatcher preempts one of the flood's requests, the
worker hands back its continuation, the quiet tenant's request gets the slot, and the
preempted stream resumes later from its tokens: one unbroken stream, the same output
as an undisturbed run.
"""

from __future__ import annotations

import asyncio
import collections

import pytest

from dispatcher.config import DispatcherSettings
from dispatcher.service import Dispatcher
from fairlane.poolconfig import PreemptionConfig, SchedulerConfig
from fairlane.protocol import Preempted, Started, decode_event
from fairlane.subjects import Subjects
from gpu_worker.config import WorkerSettings
from gpu_worker.engines import make_engine
from gpu_worker.service import Worker
from producer.client import FairlaneClient
from tests.helpers import spec, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

LONG_TOKENS = 300


async def _fleet(nats_url: str, uid: str, preemption: PreemptionConfig, policy: str = "drr",
                 prefetch_seqs: int = 0):
    subjects = Subjects(f"t{uid}")
    dispatcher = Dispatcher(
        DispatcherSettings(nats_url=nats_url, prefix=subjects.prefix, pool="p",
                           housekeeping_ms=50),
        SchedulerConfig(policy=policy, preemption=preemption))
    await dispatcher.start()
    ws = WorkerSettings(nats_url=nats_url, prefix=subjects.prefix, pool="p",
                        worker_id=f"w-{uid}", time_scale=0.5, max_num_seqs=2,
                        prefetch_seqs=prefetch_seqs, heartbeat_ms=200)
    stop = asyncio.Event()
    worker_task = asyncio.create_task(Worker(ws, make_engine(ws)).run(stop))
    return subjects, dispatcher, stop, worker_task


async def _events(nc, subjects: Subjects) -> dict[str, collections.Counter]:
    seen: dict[str, collections.Counter] = {"started": collections.Counter(),
                                            "preempted": collections.Counter()}

    async def on_event(msg) -> None:
        ev = decode_event(msg.data)
        if isinstance(ev, Started):
            seen["started"][ev.request_id] += 1
        elif isinstance(ev, Preempted):
            seen["preempted"][ev.request_id] += 1

    await nc.subscribe(subjects.events("p"), cb=on_event)
    return seen


def _long(i: int, tenant: str = "flood"):
    return spec(tenant=tenant, pool="p", tier="standard", prompt="x" * 64,
                max_tokens=LONG_TOKENS, expected_output_tokens=LONG_TOKENS, seed=500 + i,
                return_token_ids=True)


async def _run(nats_server, nc, uid, preemption: PreemptionConfig, policy: str = "drr",
               prefetch_seqs: int = 0):
    subjects, dispatcher, stop, worker_task = await _fleet(nats_server.url, uid, preemption,
                                                           policy, prefetch_seqs)
    seen = await _events(nc, subjects)
    client = FairlaneClient(nc, prefix=subjects.prefix)
    await client.start()
    try:
        # 2 slots, the prefetch waiting inside the engine, 1 queued in the dispatcher.
        flood = [await client.submit(_long(i)) for i in range(3 + prefetch_seqs)]
        flood_done = [asyncio.create_task(s.collect()) for s in flood]
        loop = asyncio.get_running_loop()
        flood_ends_s: list[float] = []  # when each flood stream's last chunk was read
        for t in flood_done:
            t.add_done_callback(lambda _: flood_ends_s.append(loop.time()))
        await wait_until(lambda: len(seen["started"]) >= 2, 20)  # every slot busy
        await asyncio.sleep(0.3)
        t0 = loop.time()
        quiet = await client.submit(spec(tenant="quiet", pool="p", tier="standard",
                                         prompt="hi", max_tokens=4, expected_output_tokens=4))
        quiet_done = await asyncio.wait_for(quiet.collect(), 60)
        quiet_ttft_s = quiet_done.first_chunk_ms / 1000 - t0
        flood_results = await asyncio.wait_for(asyncio.gather(*flood_done), 60)
        quiet_after_first_flood_end = quiet_done.first_chunk_ms / 1000 >= min(flood_ends_s)
        return (seen, quiet_ttft_s, flood_done, flood_results, client, subjects, dispatcher,
                quiet_after_first_flood_end)
    finally:
        await client.close()
        stop.set()
        await asyncio.wait_for(worker_task, 30)
        await dispatcher.stop()


@pytest.mark.parametrize("prefetch_seqs", [0, 4])
async def test_quiet_tenant_preempts_the_flood_and_the_victim_resumes_unbroken(
        nats_server, nc, uid, prefetch_seqs):
    """With prefetch, the flood's next requests already wait inside the engine: the
    quiet request travels with the preemption order and, ranked ahead of them by its
    engine priority, takes the freed slot at the next step."""
    seen, ttft_s, _, flood, *_ = await _run(
        nats_server, nc, uid, PreemptionConfig(min_run_ms=200), prefetch_seqs=prefetch_seqs)
    # Without preemption the quiet request waits for a 300-token request to end
    # (seconds); with it, for one abort and a prefill.
    assert ttft_s < 1.0, ttft_s
    assert sum(seen["preempted"].values()) >= 1
    victims = set(seen["preempted"])
    for r in flood:  # every flood stream complete and gap-free (collect checks seq)
        assert r.finish_reason == "length" and len(r.token_ids) == LONG_TOKENS
        assert r.usage.completion_tokens == LONG_TOKENS
    # Each request started once per run: its first run, plus one per preemption.
    for rid, n in seen["started"].items():
        assert n == 1 + seen["preempted"][rid], (rid, n)
    assert victims  # and the continuation equals the undisturbed output:
    # (the simulator's tokens are fixed by the seed, as greedy sampling fixes vLLM's)
    from gpu_worker.sim.engine import SimEngine
    eng = SimEngine("default", time_scale=0.0)
    from fairlane.protocol import WorkItem
    from tests.helpers import request
    for i, r in enumerate(flood):
        item = WorkItem(request=request(request_id=f"undisturbed-{i}", tenant="flood", pool="p",
                                        tier="standard", reply_to="fl.inbox.x.y", prompt="x" * 64,
                                        max_tokens=LONG_TOKENS,
                                        expected_output_tokens=LONG_TOKENS, seed=500 + i))
        ids = [t async for d in eng.generate(item) for t in d.token_ids]
        assert ids == r.token_ids
    await eng.close()


async def test_no_preemption_when_it_is_switched_off(nats_server, nc, uid):
    seen, *_, quiet_after_first_flood_end = await _run(nats_server, nc, uid,
                                                       PreemptionConfig(enabled=False))
    assert sum(seen["preempted"].values()) == 0
    # It waited for a slot to turn over: its first token came after a flood stream ended
    # (~1.2 s of 300 tokens; how long that is depends on the engine's speed, this not).
    assert quiet_after_first_flood_end


async def test_fifo_never_preempts(nats_server, nc, uid):
    seen, *_ = await _run(nats_server, nc, uid, PreemptionConfig(preempt_after_ms=0),
                          policy="fifo")
    assert sum(seen["preempted"].values()) == 0


async def test_a_gap_in_the_stream_resumes_from_the_tokens_read(nats_server, nc, uid):
    """Chunks lost on the way (a broker restart while the inbox re-subscribes): the
    library stops that attempt unbilled and continues from what it has read."""
    from fairlane.protocol import TokenChunk, encode
    from tests.helpers import in_process_fleet

    async with in_process_fleet(nats_server.url, nc, uid, time_scale=0.2) as (client, subjects):
        stream = await client.submit(_long(7, tenant="gappy"))
        it = stream.__aiter__()
        got = [await asyncio.wait_for(it.__anext__(), 20) for _ in range(3)]
        # A chunk from further on arrives first: chunks in between were lost.
        ahead = TokenChunk(request_id=stream.request_id, seq=got[-1].seq + 5, text="?")
        await nc.publish(f"{client.inbox}.{stream.request_id}", encode(ahead))
        rest = [c async for c in it]
        token_ids = [t for c in (*got, *rest) for t in (c.token_ids or [])]
        assert len(token_ids) == LONG_TOKENS and rest[-1].finish_reason == "length"
        assert stream.num_resumes == 1 and stream.attempt == 1
        assert rest[-1].usage.completion_tokens == LONG_TOKENS
        from fairlane.protocol import WorkItem
        from gpu_worker.sim.engine import SimEngine
        from tests.helpers import request
        eng = SimEngine("default", time_scale=0.0)
        item = WorkItem(request=request(request_id="calm", tenant="gappy", pool="p",
                                        tier="standard", reply_to="fl.inbox.x.y",
                                        prompt="x" * 64, max_tokens=LONG_TOKENS,
                                        expected_output_tokens=LONG_TOKENS, seed=507))
        assert token_ids == [t async for d in eng.generate(item) for t in d.token_ids]
        await eng.close()
