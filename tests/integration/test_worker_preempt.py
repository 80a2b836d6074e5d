"""The worker's side of a fleet-level preemption, against a real nats-server.

An engine admits waiting work only at a step boundary, so what decides the replacement's
first-token time is whether the victim's slot is free, and the replacement in the
engine, before the step in progress ends. The worker therefore frees the slot and admits
the replacement inside its `Preempt` handler, not a few event-loop turns later in the
requests' own tasks (which, behind a full batch's token flushes, missed the boundary
now and then and cost the newcomer a whole extra step). And the replacement goes into the
engine before the victim's abort: an engine whose submissions are asynchronous (vLLM's
adapter) could otherwise start a step between the two and give the freed slot to work
it already had waiting.
"""

from __future__ import annotations

import pytest
from nats.aio.msg import Msg

from fairlane.protocol import Preempt, Preempted, Started, encode
from gpu_worker.sim.batch import SeqState
from tests.integration.test_worker import (
    POOL,
    assert_ordered,
    work_item,
    worker_running,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


async def test_preempt_frees_the_slot_and_admits_the_replacement_in_its_handler(
        nats_server, nc, uid, dispatcher, monkeypatch):
    subjects = dispatcher.subjects
    # One slot, no prefetch, steps of ~160 ms (time scale 20): the handler's effect is
    # checked before the step in progress can end.
    async with worker_running(nats_server, uid, max_num_seqs=1, prefetch_seqs=0,
                              time_scale=20.0, coalesce_ms=0) as (worker, engine, _s, _t):
        dispatcher.add(work_item(subjects, "victim", out=1000, max_tokens=1000,
                                 return_token_ids=True))
        await dispatcher.wait(lambda: len(dispatcher.chunks.get("victim", [])) >= 2)
        victim_seq = engine._seqs["victim"]
        assert victim_seq.state is SeqState.RUNNING

        order = Preempt(request_id="victim", worker_id=f"w{uid}",
                        replacement=work_item(subjects, "newcomer", out=3))
        calls: list[tuple[str, str]] = []
        real_generate, real_abort = engine.generate, engine.abort

        def generate(item):
            calls.append(("generate", item.request.request_id))
            return real_generate(item)

        async def abort(request_id):
            calls.append(("abort", request_id))
            await real_abort(request_id)

        monkeypatch.setattr(engine, "generate", generate)
        monkeypatch.setattr(engine, "abort", abort)
        steps_before = engine.num_steps
        await worker._on_preempt(Msg(_client=nc, subject=subjects.preempt(POOL),
                                     data=encode(order)))
        assert calls == [("generate", "newcomer"), ("abort", "victim")]
        # Synchronously: the victim left the batch, the newcomer waits for the boundary.
        assert victim_seq.state is SeqState.FINISHED
        assert engine.load().num_running == 0 and engine.load().num_waiting == 1
        assert engine._seqs["newcomer"].state is SeqState.WAITING

        await dispatcher.wait(lambda: dispatcher.finished("newcomer")
                              and dispatcher.of(Preempted, "victim"))
        # Its prefill ran in the step right after the one in progress (each step's
        # record is written when it begins): no step was lost in between.
        in_progress, next_step = engine.steps[steps_before], engine.steps[steps_before + 1]
        assert in_progress.prefill_tokens == 0 and in_progress.num_running == 1
        assert next_step.prefill_tokens == 32 and next_step.num_running == 1
        assert dispatcher.of(Started, "newcomer")

        # The victim's client has every token it was sent, and the hand-back names them
        # all: the continuation regenerates nothing the client already has.
        chunks = dispatcher.chunks["victim"]
        assert [c.seq for c in chunks] == list(range(len(chunks)))
        sent = [t for c in chunks for t in (c.token_ids or [])]
        resume = dispatcher.of(Preempted, "victim")[0].resume
        assert resume.generated_token_ids == sent and resume.next_seq == len(chunks)
        assert not any(c.is_last for c in chunks)
        assert_ordered(dispatcher.chunks["newcomer"])
