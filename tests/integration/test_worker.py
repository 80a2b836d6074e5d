"""The GPU worker shell against a real nats-server, with the simulator engine.

The test plays a tiny dispatcher: it answers the worker's pulls on ``<prefix>.work.p``
with WorkBatches and watches chunks, events and usage. One wildcard subscription sees
pulls, events and chunks in the order the worker sent them (one publisher connection),
so in-flight counts at each pull are exact.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections import deque
from collections.abc import Callable
from pathlib import Path

import nats
import pytest
from nats.aio.msg import Msg

from fairlane.protocol import (
    Cancel,
    ErrorCode,
    Finished,
    Heartbeat,
    HeartbeatAck,
    PullRequest,
    Requeue,
    Started,
    TokenChunk,
    WorkBatch,
    WorkItem,
    decode_chunk,
    decode_event,
    decode_pull,
    decode_usage,
    encode,
)
from fairlane.subjects import Subjects
from gpu_worker.config import WorkerSettings
from gpu_worker.service import EXIT_ENGINE_DEAD, Worker
from gpu_worker.sim.engine import SimEngine
from tests.helpers import request

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

REPO = Path(__file__).resolve().parents[2]
POOL = "p"


class FakeDispatcher:
    """Answers pulls from a queue of WorkItems; records everything the worker says."""

    def __init__(self, nc: nats.NATS, subjects: Subjects) -> None:
        self.nc = nc
        self.subjects = subjects
        self.pending: deque[WorkItem] = deque()
        self.pulls: list[PullRequest] = []
        self.events: list[object] = []
        self.chunks: dict[str, list[TokenChunk]] = {}
        self.given: list[str] = []
        self.done: set[str] = set()  # Finished or Requeue seen
        self.max_outstanding = 0
        self.headroom_violations: list[str] = []
        self.limit = 0  # max_num_seqs + prefetch_seqs of the worker under test
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self.sub = None
        self.lost_incarnations: set[str] = set()  # answered "unknown" (fencing tests)
        # The waiting pull's "replaced" flag: a newer pull from the worker answers the
        # older one empty at once, as `dispatcher.matching` does.
        self._waiting: asyncio.Event | None = None
        self.num_replaced = 0

    def knows(self, incarnation: str) -> bool:
        return incarnation not in self.lost_incarnations

    async def start(self) -> FakeDispatcher:
        self.sub = await self.nc.subscribe(f"{self.subjects.prefix}.>", cb=self._on_msg)
        return self

    async def stop(self) -> None:
        if self.sub is not None:
            await self.sub.unsubscribe()
        for t in self._tasks:
            t.cancel()

    def add(self, *items: WorkItem) -> None:
        self.pending.extend(items)
        self._changed.set()

    @property
    def outstanding(self) -> int:
        return len([rid for rid in self.given if rid not in self.done])

    async def _on_msg(self, msg: Msg) -> None:
        parts = msg.subject.split(".")
        kind = parts[1]
        if kind == "work":
            pull = decode_pull(msg.data)
            self.pulls.append(pull)
            if self.limit and self.outstanding + pull.max_items > self.limit:
                self.headroom_violations.append(
                    f"outstanding {self.outstanding} + max_items {pull.max_items} > {self.limit}"
                )
            t = asyncio.create_task(self._answer(msg, pull))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)
        elif kind == "evt":
            evt = decode_event(msg.data)
            self.events.append(evt)
            if isinstance(evt, Heartbeat) and msg.reply:  # the worker's lease
                await msg.respond(encode(HeartbeatAck(known=self.knows(evt.incarnation),
                                                      worker_timeout_ms=3_500)))
            if isinstance(evt, Finished | Requeue):
                self.done.add(evt.request_id)
        elif kind == "inbox":
            chunk = decode_chunk(msg.data)
            self.chunks.setdefault(chunk.request_id, []).append(chunk)
        self._changed.set()

    async def _answer(self, msg: Msg, pull: PullRequest) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + pull.wait_ms / 1000
        if self._waiting is not None:
            self._waiting.set()
            self._changed.set()
        self._waiting = replaced = asyncio.Event()
        while not self.pending and loop.time() < deadline:  # long-poll
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), deadline - loop.time())
            if replaced.is_set():
                self.num_replaced += 1
                await msg.respond(encode(WorkBatch()))
                return
        if self._waiting is replaced:
            self._waiting = None
        items = [self.pending.popleft() for _ in range(min(pull.max_items, len(self.pending)))]
        self.given.extend(i.request.request_id for i in items)
        self.max_outstanding = max(self.max_outstanding, self.outstanding)
        await msg.respond(encode(WorkBatch(items=items)))

    async def wait(self, pred: Callable[[], bool], timeout_s: float = 15.0) -> None:
        async def _loop() -> None:
            while not pred():
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(_loop(), timeout_s)

    def of(self, typ: type, rid: str | None = None) -> list:
        return [e for e in self.events if isinstance(e, typ)
                and (rid is None or getattr(e, "request_id", None) == rid)]

    def finished(self, rid: str) -> bool:
        c = self.chunks.get(rid)
        return bool(c) and c[-1].is_last

    def complete(self, rid: str) -> bool:
        """The last chunk AND the Finished event arrived: they travel on different
        subjects (the reply subject, fl.evt), so either may be seen first."""
        return self.finished(rid) and bool(self.of(Finished, rid))


def work_item(subjects: Subjects, rid: str, *, out: int = 8, max_tokens: int = 512,
              prompt: str = "hello simulator " * 8, tenant: str = "acme",
              return_token_ids: bool = False) -> WorkItem:
    return WorkItem(
        request=request(
            request_id=rid,
            tenant=tenant,
            pool=POOL,
            tier="free",
            reply_to=f"{subjects.prefix}.inbox.c.{rid}",
            prompt=prompt,
            max_tokens=max_tokens,
            expected_output_tokens=out,
            return_token_ids=return_token_ids,
        ),
        queue_ms=7,
    )


def assert_ordered(chunks: list[TokenChunk]) -> None:
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert chunks[-1].is_last and not any(c.is_last for c in chunks[:-1])


@contextlib.asynccontextmanager
async def worker_running(nats_server, uid: str, **overrides):
    kw = dict(
        nats_url=nats_server.url, prefix=f"t{uid}", pool=POOL, worker_id=f"w{uid}",
        time_scale=0.01, heartbeat_ms=100, pull_wait_ms=300, coalesce_ms=5,
        drain_timeout_s=5.0,
    )
    kw.update(overrides)
    settings = WorkerSettings(**kw)
    engine = SimEngine.from_settings(settings)
    worker = Worker(settings, engine)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        yield worker, engine, stop, task
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 15)


async def test_streams_chunks_events_and_usage(nats_server, nc, uid, dispatcher):
    subjects = dispatcher.subjects
    async with worker_running(nats_server, uid) as (worker, _engine, _stop, _task):
        js = nc.jetstream()
        dispatcher.add(work_item(subjects, "r1", out=20, return_token_ids=True),
                       work_item(subjects, "r2", out=5))
        await dispatcher.wait(lambda: dispatcher.complete("r1") and dispatcher.complete("r2"))
        for rid, n in (("r1", 20), ("r2", 5)):
            chunks = dispatcher.chunks[rid]
            assert_ordered(chunks)
            last = chunks[-1]
            assert last.finish_reason == "stop" and last.error is None
            assert sum(c.num_tokens for c in chunks) == n
            assert "".join(c.text for c in chunks).count(" tok") == n
            u = last.usage
            assert u is not None and u.completion_tokens == n and u.tenant == "acme"
            assert u.prompt_tokens == 32 and u.worker_id == f"w{uid}" and u.queue_ms == 7
            assert u.kv_token_seconds > 0 and 0 < u.ttft_ms <= u.e2e_ms
            kinds = [type(e).__name__ for e in dispatcher.events
                     if getattr(e, "request_id", None) == rid]
            assert kinds == ["Started", "Finished"]
            fin = dispatcher.of(Finished, rid)[0]
            assert fin.error is None and fin.usage == u
        r1_ids = [t for c in dispatcher.chunks["r1"] for t in (c.token_ids or [])]
        assert len(r1_ids) == 20
        assert all(c.token_ids is None for c in dispatcher.chunks["r2"])
        # heartbeats carry load and in-flight ids
        await dispatcher.wait(lambda: len(dispatcher.of(Heartbeat)) >= 2)
        hb = dispatcher.of(Heartbeat)[-1]
        assert hb.worker_id == f"w{uid}" and hb.pool == POOL and not hb.draining
        assert hb.load.max_num_seqs == 32 and hb.load.kv_tokens_total > 0
        # usage is metered in JetStream, deduplicated by request id
        sub = await js.subscribe(subjects.usage("acme"), ordered_consumer=True)
        got = {}
        while len(got) < 2:
            m = await sub.next_msg(timeout=5)
            got[decode_usage(m.data).request_id] = m
        assert got["r1"].headers["Nats-Msg-Id"] == "r1"
        assert decode_usage(got["r2"].data).completion_tokens == 5
        await sub.unsubscribe()


async def test_coalescing_batches_tokens(nats_server, uid, dispatcher):
    # 20 steps of ~1 ms each (time_scale 0.1 over ~10 ms steps), coalesced per 30 ms.
    async with worker_running(nats_server, uid, time_scale=0.1, coalesce_ms=30):
        dispatcher.add(work_item(dispatcher.subjects, "c1", out=40))
        await dispatcher.wait(lambda: dispatcher.finished("c1"))
    chunks = dispatcher.chunks["c1"]
    assert_ordered(chunks)
    assert sum(c.num_tokens for c in chunks) == 40
    assert 2 <= len(chunks) < 40


async def test_no_coalescing_sends_every_token(nats_server, uid, dispatcher):
    async with worker_running(nats_server, uid, coalesce_ms=0):
        dispatcher.add(work_item(dispatcher.subjects, "n1", out=10))
        await dispatcher.wait(lambda: dispatcher.finished("n1"))
    chunks = dispatcher.chunks["n1"]
    assert_ordered(chunks)
    # one chunk per token; the last token rides on the final chunk
    assert [c.num_tokens for c in chunks] == [1] * 10


async def test_fenced_while_its_first_token_waits_for_the_ack_ends_quietly(
        nats_server, nc, uid, dispatcher):
    """The worker fences itself while a request's first token waits for its start ack:
    the request ends without publishing anything, and the worker goes on (the token
    it holds must not keep its task flushing, in vain, forever)."""
    subjects = dispatcher.subjects
    acks: list[str] = []
    async with worker_running(nats_server, uid, coalesce_ms=0) as (worker, _e, _s, _t):
        async def on_ack(msg: Msg) -> None:
            acks.append(msg.subject)
            dispatcher.lost_incarnations.add(worker.incarnation)  # the next beat fences
            await dispatcher.wait(lambda: worker.num_fenced >= 1)
            await msg.respond(b"")

        sub = await nc.subscribe(f"{subjects.prefix}.acktest.>", cb=on_ack)
        item = work_item(subjects, "f1", out=50)
        item.ack_subject = f"{subjects.prefix}.acktest.f1"
        dispatcher.add(item)
        await dispatcher.wait(lambda: bool(acks) and "f1" not in worker._reqs)
        assert "f1" not in dispatcher.chunks and not dispatcher.of(Started, "f1")
        # The worker, a new incarnation, still serves.
        dispatcher.add(work_item(subjects, "f2", out=3))
        await dispatcher.wait(lambda: dispatcher.complete("f2"))
        await sub.unsubscribe()


async def test_cancel_aborts_running_request(nats_server, nc, uid, dispatcher):
    subjects = dispatcher.subjects
    async with worker_running(nats_server, uid, max_model_len=1_000_000) as (_w, engine, *_):
        dispatcher.add(work_item(subjects, "k1", out=100_000, max_tokens=100_000))
        await dispatcher.wait(lambda: len(dispatcher.chunks.get("k1", [])) >= 2)
        await nc.publish(subjects.cancel(POOL), encode(Cancel(request_id="k1", tenant="acme")))
        await nc.publish(subjects.cancel(POOL), encode(Cancel(request_id="unknown")))
        await dispatcher.wait(lambda: dispatcher.complete("k1"))
        chunks = dispatcher.chunks["k1"]
        assert_ordered(chunks)
        assert chunks[-1].error is not None and chunks[-1].error.code == ErrorCode.CANCELLED
        assert chunks[-1].usage is not None and chunks[-1].usage.finish_reason == "abort"
        fin = dispatcher.of(Finished, "k1")[0]
        assert fin.error.code == ErrorCode.CANCELLED
        await dispatcher.wait(lambda: engine.load().num_running == 0)
        assert engine.load().kv_tokens_used == 0


async def test_prompt_too_long_is_an_error_chunk(nats_server, uid, dispatcher):
    async with worker_running(nats_server, uid, max_model_len=64):
        dispatcher.add(work_item(dispatcher.subjects, "big", prompt="x" * 1000))
        await dispatcher.wait(lambda: dispatcher.complete("big"))
    [chunk] = dispatcher.chunks["big"]
    assert chunk.seq == 0 and chunk.error.code == ErrorCode.PROMPT_TOO_LONG
    assert not chunk.error.retryable
    assert dispatcher.of(Started, "big") == []
    assert dispatcher.of(Finished, "big")[0].error.code == ErrorCode.PROMPT_TOO_LONG


async def test_engine_death_fails_every_request_and_exits_nonzero(nats_server, uid, dispatcher):
    subjects = dispatcher.subjects
    async with worker_running(nats_server, uid, sim_fail_after_steps=10,
                              max_num_seqs=2, prefetch_seqs=2) as (_w, _e, _stop, task):
        dispatcher.add(*(work_item(subjects, f"d{i}", out=1000) for i in range(4)))
        rc = await asyncio.wait_for(task, 15)
    assert rc == EXIT_ENGINE_DEAD
    await dispatcher.wait(lambda: all(dispatcher.complete(f"d{i}") for i in range(4)))
    for i in range(4):
        chunks = dispatcher.chunks[f"d{i}"]
        assert_ordered(chunks)
        err = chunks[-1].error
        assert err.code == ErrorCode.ENGINE_ERROR and not err.retryable
        assert dispatcher.of(Finished, f"d{i}")[0].error.code == ErrorCode.ENGINE_ERROR


async def test_drain_timeout_gives_started_requests_worker_lost(nats_server, uid, dispatcher):
    async with worker_running(nats_server, uid, drain_timeout_s=0.2,
                              max_model_len=1_000_000) as (_w, _e, stop, task):
        dispatcher.add(work_item(dispatcher.subjects, "slow", out=100_000, max_tokens=100_000))
        await dispatcher.wait(lambda: bool(dispatcher.of(Started, "slow")))
        stop.set()
        assert await asyncio.wait_for(task, 10) == 0
    chunks = dispatcher.chunks["slow"]
    assert_ordered(chunks)
    assert chunks[-1].error.code == ErrorCode.WORKER_LOST and chunks[-1].error.retryable


async def test_sigterm_drains_subprocess(nats_server, uid, dispatcher, tmp_path):
    subjects = dispatcher.subjects
    # One slot: "run" decodes for ~1 s of real time, "q1"/"q2" wait inside the engine.
    dispatcher.add(work_item(subjects, "run", out=100),
                   work_item(subjects, "q1", out=5), work_item(subjects, "q2", out=5))
    env = {**os.environ, "PYTHONPATH": str(REPO), "FAIRLANE_NATS_URL": nats_server.url}
    log_path = tmp_path / "worker.log"
    log_file = await asyncio.to_thread(open, log_path, "wb")
    with log_file:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gpu_worker", "--prefix", f"t{uid}", "--pool", POOL,
            "--worker-id", f"w{uid}", "--max-num-seqs", "1", "--prefetch-seqs", "2",
            "--time-scale", "1.0", "--heartbeat-ms", "100", "--pull-wait-ms", "300",
            cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT,
        )
    try:
        await dispatcher.wait(lambda: bool(dispatcher.of(Started, "run"))
                              and {"q1", "q2"} <= set(dispatcher.given), 20)
        proc.send_signal(signal.SIGTERM)
        await dispatcher.wait(lambda: dispatcher.finished("run")
                              and len(dispatcher.of(Requeue)) == 2, 20)
        rc = await asyncio.wait_for(proc.wait(), 20)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    out = log_path.read_text()
    assert rc == 0, out
    assert {r.request_id for r in dispatcher.of(Requeue)} == {"q1", "q2"}
    assert all(r.reason == "draining" for r in dispatcher.of(Requeue))
    assert dispatcher.chunks["run"][-1].finish_reason == "stop"
    assert "q1" not in dispatcher.chunks and "q2" not in dispatcher.chunks
    assert dispatcher.of(Started, "q1") == [] and dispatcher.of(Started, "q2") == []
    assert any(h.draining for h in dispatcher.of(Heartbeat))
    assert '"event":"drain_done"' in out.replace(" ", "")


async def test_what_the_engine_made_at_start_up_is_frozen(nats_server, uid, monkeypatch):
    """Under `tuned_gc` (`python -m gpu_worker`), once the engine has started the worker
    freezes what is alive (`fairlane.gctune.refreeze`): no later collection walks it."""
    import gc

    from fairlane import gctune
    from gpu_worker import service

    seen: list[tuple[bool, int, int]] = []
    frozen = asyncio.Event()

    def spy() -> None:
        before = gc.get_freeze_count()
        gctune.refreeze()
        seen.append((engine._task is not None, before, gc.get_freeze_count()))
        frozen.set()

    monkeypatch.setattr(service, "refreeze", spy)
    with gctune.tuned_gc(50_000):
        async with worker_running(nats_server, uid) as (_worker, engine, *_):
            await asyncio.wait_for(frozen.wait(), 10)
    [(engine_started, before, after)] = seen
    assert engine_started and after > before  # the connection, the engine's loop
