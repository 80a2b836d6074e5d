"""The worker's pull loop: ask the dispatcher for work only while there is room.

`Pulling` is the part of `gpu_worker.service.Worker` that asks for work: a core
request on ``fl.work.<pool>`` (`PullRequest`, answered with a `WorkBatch`) while there
is headroom (`gpu_worker.room`: at most ``max_num_seqs + prefetch_seqs`` requests in
flight, at most ``prefetch_seqs`` queued inside the engine, so work is placed as late
as possible). Without room it waits for a slot event (a request started or finished),
never polls.

A pull waits at the dispatcher until work arrives or ``pull_wait_ms`` (1 s). One sent
with no slot free (only prefetch room) would, when a slot frees meanwhile, hide that
slot for the rest of its wait: the dispatcher sends work to pulls with a free slot
first and preempts only when none has one. So when a slot frees while such a pull
waits, the worker sends a new pull, and the dispatcher answers the old one empty
(`dispatcher.matching`): at most one extra message per pull sent full, none otherwise.

The old pull may have been answered with work before the dispatcher had the new one:
until its answer is in, what it asked for counts as taken (`_asked`), so the worker
never holds more than ``max_num_seqs + prefetch_seqs``, however the race goes.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

import msgspec
import nats
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError

from fairlane.protocol import (
    ProtocolError,
    PullRequest,
    Requeue,
    WorkItem,
    decode_work_batch,
    encode,
)
from fairlane.subjects import Subjects
from gpu_worker.config import WorkerSettings
from gpu_worker.engine import Engine, EngineDead
from gpu_worker.epoch import EpochGuard
from gpu_worker.inflight import InFlight, mono_s
from gpu_worker.lease import WorkerLease
from gpu_worker.metrics import WorkerMetrics
from gpu_worker.room import pull_room

PULL_TIMEOUT_MARGIN_MS = 2_000  # on top of wait_ms: the dispatcher answers within wait_ms
BACKOFF_MIN_S = 0.05
BACKOFF_MAX_S = 2.0


class Pulling:
    """Mixin of `Worker`: the pull loop and what it does with the answers."""

    # Set by Worker.__init__ / Worker.run.
    s: WorkerSettings
    engine: Engine
    subjects: Subjects
    worker_id: str
    incarnation: str
    log: Any  # a bound structlog logger
    _nc: NATS | None
    _reqs: dict[str, InFlight]
    _slot_event: asyncio.Event
    _drain_event: asyncio.Event
    _dead: asyncio.Event
    _draining: bool
    _epochs: EpochGuard
    _lease: WorkerLease
    metrics: WorkerMetrics
    _pulls_out: set[asyncio.Task]  # every pull not answered yet, replaced ones too
    _asked: int  # the max_items of those pulls, together

    if TYPE_CHECKING:  # Worker's and RequestServing's (stubs here would shadow them)
        def _engine_died(self, reason: str) -> None: ...

        async def _event(self, evt: msgspec.Struct, r: InFlight | None = None) -> bool: ...

        async def _accept(self, item: WorkItem) -> None: ...

    # The counts are the worker's metrics, read back (one record, not a copy beside it).
    def _count(self, name: str, **labels: str) -> int:
        return int(self.metrics.registry.get_sample_value(name, labels) or 0)

    @property
    def num_pulls(self) -> int:  # sent, replacements included
        return (self._count("fairlane_worker_pulls_total", kind="new")
                + self.num_pulls_replaced)

    @property
    def num_pulls_replaced(self) -> int:
        return self._count("fairlane_worker_pulls_total", kind="replacement")

    @property
    def num_pulls_failed(self) -> int:
        return self._count("fairlane_worker_pull_failures_total")

    def _room(self) -> tuple[int, int, int]:
        """(how many items to ask for, of those how many would start at once, free KV
        tokens). Raises EngineDead."""
        return pull_room(self.engine.load(), len(self._reqs), self.s.max_num_seqs,
                         self.s.prefetch_seqs)

    def _new_pull(self) -> PullRequest | None:
        """The pull to send now, or None without room (or with the engine dead). What
        the pulls not answered yet may still bring counts as taken: a replaced pull may
        have been answered with work before the dispatcher had its replacement."""
        try:
            room, free_slots, free_kv = self._room()
        except EngineDead as exc:
            self._engine_died(str(exc))
            return None
        room = min(room, 4096) - self._asked
        if room <= 0:
            return None
        return PullRequest(worker_id=self.worker_id, pool=self.s.pool,
                           max_items=room, free_kv_tokens=free_kv,
                           wait_ms=min(self.s.pull_wait_ms, 60_000),
                           incarnation=self.incarnation, free_slots=min(free_slots, room))

    def _send_pull(self, pull: PullRequest, kind: str = "new") -> asyncio.Task:
        self.metrics.pulls.labels(kind).inc()
        self._asked += pull.max_items
        task = asyncio.create_task(self._pull_once(pull), name="pull_request")
        self._pulls_out.add(task)
        task.add_done_callback(self._pull_done)
        return task

    def _pull_done(self, task: asyncio.Task) -> None:
        self._pulls_out.discard(task)
        self._slot_event.set()  # what it asked for and did not get is room again
        # A replaced pull's task is awaited by no one: a crash in it (taking in its
        # answer) is the worker's, as one in the loop's own pull is (`Worker.run`).
        if not task.cancelled() and task.exception() is not None:
            self._engine_died(f"pull loop crashed: {task.exception()!r}")

    async def _pull_loop(self) -> None:
        backoff_s = BACKOFF_MIN_S
        while not self._draining:
            self._slot_event.clear()
            pull = self._new_pull()
            if pull is None:
                if self._dead.is_set():
                    return
                await self._slot_event.wait()
                continue
            if not self._lease.valid(mono_s()):
                # No acknowledged heartbeat (yet): take no work we may not report on.
                await self._lease.wait_changed(0.25)
                continue
            answer = self._send_pull(pull)
            while True:
                slot = asyncio.ensure_future(self._slot_event.wait())
                try:
                    await asyncio.wait((answer, slot), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    slot.cancel()
                if answer.done():
                    break
                # A slot freed (or work started) while the pull waits.
                self._slot_event.clear()
                better = self._replacement(pull)
                if better is not None:
                    pull, answer = better, self._send_pull(better, "replacement")
            if answer.result():
                backoff_s = BACKOFF_MIN_S
                continue
            # No dispatcher (yet), a slow one, a reconnect: back off and ask again.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drain_event.wait(), backoff_s)
            backoff_s = min(backoff_s * 2, BACKOFF_MAX_S)

    def _replacement(self, waiting: PullRequest) -> PullRequest | None:
        """A pull to send instead of `waiting`, or None: only when `waiting` said no
        slot was free and one is now (one message per such pull: the dispatcher serves
        prefetch room only after free slots, and preempts only when none is free)."""
        if waiting.free_slots or self._draining or not self._lease.valid(mono_s()):
            return None
        pull = self._new_pull()
        return pull if pull is not None and pull.free_slots else None

    async def _pull_once(self, pull: PullRequest) -> bool:
        """Send `pull`, take in what its answer brings; False if no answer came."""
        try:
            return await self._ask(pull)
        finally:
            self._asked -= pull.max_items  # what it brought is in `_reqs` by now

    async def _ask(self, pull: PullRequest) -> bool:
        assert self._nc is not None
        timeout_s = (self.s.pull_wait_ms + PULL_TIMEOUT_MARGIN_MS) / 1000
        try:
            msg = await self._nc.request(self.subjects.work(self.s.pool), encode(pull),
                                         timeout=timeout_s)
            batch = decode_work_batch(msg.data)
        except (NoRespondersError, TimeoutError, ProtocolError, nats.errors.Error) as exc:
            self.metrics.pull_failures.inc()
            level = self.log.debug if isinstance(exc, NoRespondersError) else self.log.warning
            level("pull_failed", error=repr(exc))
            return False
        if batch.items and not self._epochs.admit(batch.epoch):
            # A deposed leader's batch: never start it; hand it back.
            self.log.warning("stale_epoch_refused", epoch=batch.epoch,
                             newest=self._epochs.newest, num_items=len(batch.items))
            for item in batch.items:
                await self._refuse_stale(item)
            return True
        if pull.incarnation != self.incarnation:
            # Fenced while the pull was out: that incarnation's work is not ours.
            self.log.warning("stale_incarnation_batch", num_items=len(batch.items))
            return True
        if batch.items:
            self.log.debug("pulled", num_items=len(batch.items), max_items=pull.max_items)
        for item in batch.items:
            await self._accept(item)
        return True

    async def _refuse_stale(self, item: WorkItem) -> None:
        """Hand back work a deposed leader dispatched: never start it."""
        if item.ack_subject:
            # Its message goes straight back to JetStream: the deposed leader holds
            # it, and the new one would otherwise get it only after ack_wait.
            with contextlib.suppress(Exception):
                await self._nc.publish(item.ack_subject, b"-NAK")
        await self._event(Requeue(request_id=item.request.request_id,
                                  worker_id=self.worker_id, reason="stale_epoch"))
