"""The dispatcher's pulls: matching queued work to workers with room.

Workers pull when they have room; a pull waits here until work arrives or it
expires. Each serving pass asks the pure core for preemptions, then hands the queued
work out over the waiting pulls (`scheduler.spread`: free slots first, evenly). Split
from `dispatcher.service` (`Dispatcher` mixes it in) for size.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog
from nats.aio.msg import Msg

from dispatcher.held import work_item
from dispatcher.scheduler.spread import PullShare, spread
from fairlane.protocol import ProtocolError, PullRequest, WorkBatch, decode_pull, encode
from fairlane.runtime import mono_ms, now_ms

if TYPE_CHECKING:
    from dispatcher.leader import LeaderLease
    from dispatcher.scheduler.core import Scheduler
    from dispatcher.scheduler.pool import PoolCore

log = structlog.get_logger("dispatcher.service")


@dataclass(eq=False, slots=True, kw_only=True, init=False)
class WaitingPull(PullShare):
    """A worker's pull held until work arrives or it expires."""

    pull: PullRequest
    reply: str
    expires_ms: float

    def __init__(self, *, max_items: int, free_slots: int, free_kv_tokens: int,
                 pull: PullRequest, reply: str, expires_ms: float) -> None:
        # PullShare writes its __init__ (mypyc); not super(): a slots dataclass is a
        # new class, which zero-argument super() does not see.
        PullShare.__init__(self, max_items, free_slots, free_kv_tokens)
        self.pull, self.reply, self.expires_ms = pull, reply, expires_ms

    @classmethod
    def of(cls, pull: PullRequest, reply: str, expires_ms: float) -> WaitingPull:
        # free_slots None: a worker that predates the field (all of max_items counts).
        free = pull.max_items if pull.free_slots is None else pull.free_slots
        return cls(max_items=pull.max_items, free_slots=free,
                   free_kv_tokens=pull.free_kv_tokens, pull=pull, reply=reply,
                   expires_ms=expires_ms)


class Matching:
    """Mixin of `dispatcher.service.Dispatcher`: the pulls and the serving passes."""

    core: PoolCore
    scheduler: Scheduler
    lease: LeaderLease | None
    epoch: int
    nc: Any
    _pulls: deque[WaitingPull]
    _pull_of: dict[str, WaitingPull]  # each worker's newest waiting pull
    _wake: asyncio.Event

    async def _on_pull(self, msg: Msg) -> None:
        try:
            pull = decode_pull(msg.data)
        except ProtocolError as exc:
            log.warning("bad_pull", error=exc.message)
            if msg.reply:
                await self.nc.publish(msg.reply, encode(WorkBatch()))
            return
        now = mono_ms()
        await self._apply(self.core.on_pull(pull.worker_id, pull.free_kv_tokens, now,
                                            pull.incarnation))
        # A newer pull from the same worker process replaces its waiting one: a worker
        # whose pull had no slot free sends a new one when a slot frees while it waits,
        # rather than leave that slot unadvertised for up to pull_wait_ms. The old one
        # is answered empty at the next pass (no room, due now).
        old = self._pull_of.get(pull.worker_id)
        if old is not None and not old.given and old.pull.incarnation == pull.incarnation:
            old.max_items = old.free_slots = 0
            old.expires_ms = now
        waiting = WaitingPull.of(pull, msg.reply, now + pull.wait_ms)
        self._pull_of[pull.worker_id] = waiting
        self._pulls.append(waiting)
        self._wake.set()

    async def _match_loop(self) -> None:
        """Serve waiting pulls in arrival order whenever work or a pull arrives."""
        while True:
            timeout = None
            if self._pulls:
                timeout = max(0.0, min(p.expires_ms for p in self._pulls) - mono_ms()) / 1000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
            self._wake.clear()
            await self._serve_pulls()

    async def _serve_pulls(self) -> None:
        now = mono_ms()
        if self.lease is not None and not self.lease.leading():
            return  # fenced: dispatch nothing more; unanswered pulls time out
        # Before prefetch takes it: a waiting request of a tenant below its share would
        # sit in an engine's queue until a slot turns over.
        await self._maybe_preempt(now)
        if self.scheduler.num_queued:
            # Free slots first, spread evenly (`scheduler.spread`): the policy's picks
            # start at once, and not two on one engine while another has a slot free;
            # then the prefetch room, spread the same way.
            pulls = list(self._pulls)
            free = [p for p in pulls if p.free_slots > 0]

            def take(p: WaitingPull, n: int) -> int:
                return p.take(self.core, p.pull.worker_id, n, now, p.pull.incarnation)

            if spread(free, self._num_queued, take, WaitingPull.room_now):
                spread(free + [p for p in pulls if p.free_slots <= 0], self._num_queued,
                       take, WaitingPull.room)
        # Which pulls are answered is settled before the first await: a pull arriving
        # while the answers go out joins the waiting ones for the next pass.
        answer: list[WaitingPull] = []
        pending: deque[WaitingPull] = deque()
        for p in self._pulls:
            # Not declared lost since (nor replaced by a newer incarnation).
            alive = self.core.is_alive(p.pull.worker_id, p.pull.incarnation)
            (answer if p.given or now >= p.expires_ms or not alive else pending).append(p)
        self._pulls = pending
        for p in answer:
            if self._pull_of.get(p.pull.worker_id) is p:
                del self._pull_of[p.pull.worker_id]
        epoch_ms = now_ms()
        for p in answer:
            items = [work_item(d, now, epoch_ms) for d in p.given]
            await self.nc.publish(p.reply, encode(WorkBatch(items=items, epoch=self.epoch)))
        await self._maybe_preempt(now)

    def _num_queued(self) -> int:
        return self.scheduler.num_queued

    async def _maybe_preempt(self, now: float) -> None:
        """Work waits and no pull has a slot free (prefetch room does not count): maybe
        a tenant below its fair share should not wait for a slot to turn over
        (DESIGN.md section 5b). The core decides, and rechecks cheaply."""
        if (self.scheduler.num_queued and not any(p.free_slots for p in self._pulls)
                and (self.lease is None or self.lease.leading())):
            await self._apply(self.core.preemptions(now, 0))
