"""Leader election: one dispatcher per pool leads, by a lease in a NATS KV bucket.

Pure part: `LeaseMachine` decides, with time passed in, whether this process leads,
when to renew, and when to fence itself. Shell: `LeaderLease` runs it against a KV
bucket whose TTL (stream max_age) makes a dead leader's key lapse.

Rules (DESIGN.md section 4, "Incarnations and fencing"):
- Acquire = `kv.create` (fails while the key exists); renew = `kv.update` with
  `last=revision` (compare-and-set), every `ttl/3`.
- The epoch is the KV revision of the acquiring `create`. Revisions are the bucket
  stream's sequence numbers, which only grow (deletes and expiries included), so a
  new leader's epoch is higher than every earlier leader's.
- The leader fences itself (stops dispatching) once `fence_fraction * ttl` has passed
  since the *send* time of its last successful write: the server counts the TTL from
  the write, so the old leader stops before the key can lapse for a standby.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum

import structlog
from nats.js.errors import KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError

from fairlane.runtime import cancel_and_wait

log = structlog.get_logger("fairlane.dispatcher.leader")


class Role(StrEnum):
    STANDBY = "standby"
    LEADER = "leader"


@dataclass
class LeaseMachine:
    """Pure lease state; all times are monotonic milliseconds passed in."""

    ttl_ms: float
    fence_fraction: float = 0.8  # fence before the server can expire the key
    role: Role = Role.STANDBY
    epoch: int = 0  # the lease's acquisition revision while leading
    revision: int = 0  # the key's last revision written by us (for compare-and-set)
    written_ms: float = 0.0  # send time of our last successful write

    @property
    def renew_every_ms(self) -> float:
        return self.ttl_ms / 3

    def acquired(self, revision: int, sent_ms: float) -> None:
        self.role, self.epoch, self.revision, self.written_ms = Role.LEADER, revision, revision, sent_ms

    def renewed(self, revision: int, sent_ms: float) -> None:
        if self.role is Role.LEADER:
            self.revision, self.written_ms = revision, sent_ms

    def lost(self) -> None:
        """The key moved under us (compare-and-set failed) or we released it."""
        self.role, self.revision = Role.STANDBY, 0

    def leading(self, now_ms: float) -> bool:
        """True only while our last write is young enough that no one else can lead."""
        if self.role is not Role.LEADER:
            return False
        if now_ms - self.written_ms >= self.fence_fraction * self.ttl_ms:
            self.lost()  # fencing: we cannot prove the lease is still ours
            return False
        return True

    def next_action_ms(self, now_ms: float) -> float:
        """How long the shell should sleep before the next try (acquire or renew)."""
        if self.role is Role.LEADER:
            return max(0.0, self.written_ms + self.renew_every_ms - now_ms)
        return self.renew_every_ms  # standby: poll for a lapsed key


def mono_ms() -> float:
    return time.monotonic() * 1000


@dataclass
class LeaderLease:
    """Asyncio shell: keeps `machine` in step with the KV key; calls `on_lead(epoch)`
    on takeover and `on_lose()` the moment leadership ends (fence or CAS failure)."""

    js: object
    bucket: str
    key: str
    holder: str  # written as the value, for operators (`nats kv get`)
    ttl_s: float
    on_lead: Callable[[int], Awaitable[None]]
    on_lose: Callable[[], Awaitable[None]]
    # Replicas of the bucket: in a NATS cluster the lease must outlive one node (a
    # bucket on a dead node would fence every dispatcher of the pool).
    replicas: int = 1
    machine: LeaseMachine = field(init=False)
    _kv: object = None
    _task: asyncio.Task | None = None
    # Whether the lease was released (graceful stop) just before this process took
    # it: then every redelivery is a queued request the predecessor handed back.
    predecessor_released: bool = False
    resigned: bool = False  # `resign`: the loop ends, this holder never leads again

    def __post_init__(self) -> None:
        self.machine = LeaseMachine(ttl_ms=self.ttl_s * 1000)

    @property
    def epoch(self) -> int:
        return self.machine.epoch if self.machine.role is Role.LEADER else 0

    def leading(self) -> bool:
        return self.machine.leading(mono_ms())

    async def start(self) -> None:
        self._kv = await self.js.create_key_value(bucket=self.bucket, ttl=self.ttl_s, history=1,
                                                  replicas=self.replicas)
        self._task = asyncio.create_task(self._loop())

    async def acquire(self) -> int:
        """Start competing; return the epoch once this process leads (a standby waits)."""
        acquired: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        on_lead = self.on_lead

        async def first_lead(epoch: int) -> None:
            if not acquired.done():
                acquired.set_result(epoch)
            await on_lead(epoch)

        self.on_lead = first_lead
        await self.start()
        log.info("awaiting_lease", key=self.key, ttl_s=self.ttl_s)
        return await acquired

    async def stop(self) -> None:
        """Graceful: release the key so a standby takes over at once."""
        if self._task is not None:
            await cancel_and_wait(self._task)
        if self.machine.role is Role.LEADER:
            with contextlib.suppress(Exception):
                await self._kv.delete(self.key, last=self.machine.revision)
            self.machine.lost()
            log.info("lease_released", key=self.key)

    async def _released(self) -> bool:
        """The key's last entry is a delete marker (a release), not absent or expired."""
        try:
            raw = await asyncio.wait_for(
                self.js.get_msg(f"KV_{self.bucket}", subject=f"$KV.{self.bucket}.{self.key}"),
                timeout=self.machine.renew_every_ms / 1000)
        except Exception:  # absent, expired, unreachable
            return False
        return (raw.headers or {}).get("KV-Operation") in ("DEL", "PURGE")

    def resign(self) -> None:
        """Never compete for the key again (from `on_lose`): whoever owns this lease has
        dropped its leader's state, so leading again would dispatch without it (and
        hold the key against a standby that could take over). A fresh process or
        `Dispatcher`, with a lease of its own, rejoins as a standby."""
        self.resigned = True

    async def _still_ours(self) -> int | None:
        """The key's revision if it holds this lease's value; None if NATS says it does
        not (another value, deleted, expired). Raises when NATS gives no answer."""
        try:
            entry = await asyncio.wait_for(self._kv.get(self.key),
                                           timeout=self.machine.renew_every_ms / 1000)
        except (KeyNotFoundError, KeyDeletedError):
            return None
        return entry.revision if entry.value == self.holder.encode() else None

    async def _loop(self) -> None:
        while not self.resigned:
            await self.step()
            if self.resigned:
                return
            await asyncio.sleep(self.machine.next_action_ms(mono_ms()) / 1000)

    async def step(self) -> None:
        m = self.machine
        was_leader = m.role is Role.LEADER
        sent = mono_ms()
        if was_leader and m.leading(sent):
            try:
                rev = await asyncio.wait_for(
                    self._kv.update(self.key, self.holder.encode(), last=m.revision),
                    timeout=m.renew_every_ms / 1000)
                m.renewed(rev, sent)
            except KeyWrongLastSequenceError as e:
                try:
                    rev = await self._still_ours()
                except Exception as exc:  # noqa: BLE001 - no answer about the key
                    # As a renewal that got no answer (below): not a sign that the key
                    # moved, so keep trying until the fence deadline (a slow broker
                    # under load once fenced a leader here that still held the key).
                    log.info("lease_check_failed", key=self.key, epoch=m.epoch,
                             error=repr(exc))
                    await asyncio.sleep(min(0.1, m.renew_every_ms / 1000))
                    return
                if rev is None:  # the key moved: someone else holds it
                    log.warning("lease_lost", key=self.key, epoch=m.epoch, error=str(e))
                    m.lost()
                else:
                    # Our own earlier renewal landed after its reply timed out: the key
                    # still holds our value (no one can create it while it exists), so
                    # renew from its revision at once. The fence still counts from our
                    # last *confirmed* write, so this is as safe as any renewal.
                    log.info("lease_resynced", key=self.key, epoch=m.epoch, revision=rev)
                    m.revision = rev  # renewal is overdue: the loop's next step is now
                    return
            except Exception as e:
                # Not an answer about the key: a timeout, no stream leader for a moment (a
                # NATS cluster node died and the bucket elects another), a reconnect. Keep
                # trying until the fence deadline: fencing is by time, so this is safe.
                log.info("lease_renew_failed", key=self.key, epoch=m.epoch, error=repr(e))
                # "No responders" comes back at once: pace the retries.
                await asyncio.sleep(min(0.1, m.renew_every_ms / 1000))
        elif not was_leader:
            # A delete marker: the last leader released the lease (a graceful stop);
            # an expired or absent key: it crashed, or there was none.
            self.predecessor_released = await self._released()
            try:
                rev = await asyncio.wait_for(
                    self._kv.create(self.key, self.holder.encode()), timeout=m.renew_every_ms / 1000)
            except Exception:
                return  # held by another dispatcher (or NATS unreachable): stay standby
            m.acquired(rev, sent)
            log.info("lease_acquired", key=self.key, epoch=rev)
            await self.on_lead(rev)
            return
        if was_leader and not m.leading(mono_ms()):
            log.warning("lease_fenced", key=self.key)
            await self.on_lose()


def pool_lease(js: object, prefix: str, pool: str, ttl_s: float,
               on_lose: Callable[[], Awaitable[None]], replicas: int = 1) -> LeaderLease:
    """The lease of one pool: bucket `<prefix>_leader`, key = pool, value =
    host:nonce:pid (the pid stays last, where operators and tools read it; the nonce
    tells two dispatchers of one process apart: a renewal whose reply was lost is
    recognised as ours by the value, `_still_ours`, never a neighbour's)."""

    async def no_op(epoch: int) -> None:
        return None

    return LeaderLease(js, bucket=f"{prefix}_leader", key=pool,
                       holder=f"{socket.gethostname()}:{uuid.uuid4().hex[:8]}:{os.getpid()}",
                       ttl_s=ttl_s,
                       on_lead=no_op, on_lose=on_lose, replicas=replicas)
