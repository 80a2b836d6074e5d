"""Nothing stranded: requests on subjects no dispatcher serves get an answer and leave.

JetStream accepts a publish to any ``<prefix>.req.<pool>.<tier>.<tenant>`` subject, but
a dispatcher consumes only its own pool's configured tiers, so a request on another
tier, or for a pool nobody serves, would sit in ``FL_REQUESTS`` forever and its client
would wait forever (a WorkQueue stream allows no catch-all consumer beside the tier
consumers). The leading dispatcher of each pool therefore sweeps the stream every few
seconds (`Janitor.sweep`):

- its own pool, a tier it does not have: answered at once with ``invalid_request``
  naming the pool's tiers (tiers change only with a restart, so this is final);
- a pool with no leader lease in the ``<prefix>_leader`` bucket that no sweep of this
  process has seen led, for longer than ``stranded_after_s``: answered with
  ``invalid_request`` ("no dispatcher serves pool"). A pool that was led once and lost
  its leader is left alone: its requests are durable and wait for a dispatcher.

A message is deleted before it is answered, and only the sweep whose delete succeeds
answers, so several pools' janitors never answer one request twice.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from fairlane.protocol import (
    ErrorCode,
    ErrorInfo,
    ProtocolError,
    TokenChunk,
    encode,
)
from fairlane.subjects import Subjects, reply_of

log = structlog.get_logger(__name__)

Send = Callable[[str, bytes], Awaitable[None]]


class Janitor:
    max_per_sweep = 1_000  # bound on the work of one sweep (the next one continues)

    def __init__(self, js: Any, subjects: Subjects, pool: str, tiers: Callable[[], list[str]],
                 send: Send, stranded_after_s: float = 10.0,
                 reply_allowed: Callable[[str, str | None], bool] | None = None) -> None:
        self.js = js
        self.subjects = subjects
        self.pool = pool
        self.tiers = tiers
        self.send = send
        self.stranded_after_s = stranded_after_s
        # (reply subject, the request subject's tenant) -> may we answer there (auth on:
        # only inside that tenant's inboxes, see Ingest._reply_allowed).
        self.reply_allowed = reply_allowed or (lambda reply, tenant: True)
        self._started_s = time.monotonic()
        self._led_pools: set[str] = {pool}
        self._kv: Any = None
        self.num_answered = 0

    async def sweep(self) -> int:
        """One pass over the stream's subjects; returns how many requests it answered."""
        stream = self.subjects.requests_stream
        # Watched on every sweep, so a pool led even briefly is never called unserved.
        self._led_pools |= await self._led_now()
        info = await self.js.stream_info(stream, subjects_filter=f"{self.subjects.prefix}.req.>")
        subjects: dict[str, int] = info.state.subjects or {}
        if not subjects:
            return 0
        observed_long_enough = time.monotonic() - self._started_s >= self.stranded_after_s
        tiers = set(self.tiers())
        budget = self.max_per_sweep
        answered = 0
        for subject in subjects:
            try:
                pool, tier, _tenant = Subjects.parse_request(subject)
            except ProtocolError:
                continue
            if pool == self.pool and tier not in tiers:
                why = (f"pool {pool!r} has no tier {tier!r}; its tiers are "
                       f"{', '.join(sorted(tiers))}")
            elif (pool not in self._led_pools and observed_long_enough):
                why = f"no dispatcher serves pool {pool!r}"
            else:
                continue
            n = await self._answer_all(stream, subject, why, budget)
            answered += n
            budget -= n
            if budget <= 0:
                break
        self.num_answered += answered
        return answered

    async def _led_now(self) -> set[str]:
        """Pools whose leader lease exists right now."""
        try:
            if self._kv is None:
                self._kv = await self.js.key_value(f"{self.subjects.prefix}_leader")
            return set(await self._kv.keys())
        except Exception:  # no bucket or no keys yet: nobody leads anything else
            return set()

    async def _answer_all(self, stream: str, subject: str, why: str, budget: int) -> int:
        n, seq = 0, 0
        while n < budget:
            try:
                raw = await self.js.get_msg(stream, seq=seq + 1, subject=subject, next=True)
            except Exception:  # none left (NotFoundError), or a blip: next sweep
                return n
            seq = raw.seq
            try:
                if not await self.js.delete_msg(stream, seq):
                    continue
            except Exception:  # another janitor took it first
                continue
            rid, reply = reply_of(raw.data or b"", raw.headers)
            if reply and not self.reply_allowed(reply, _tenant_of(raw.subject or subject)):
                reply = None
            log.warning("stranded_request_refused", subject=subject, request_id=rid,
                        reason=why)
            if reply:
                chunk = TokenChunk(request_id=rid or "", seq=0,
                                   error=ErrorInfo.of(ErrorCode.INVALID_REQUEST, why))
                await self.send(reply, encode(chunk))
            n += 1
        return n


def _tenant_of(subject: str) -> str | None:
    parts = subject.split(".")
    return parts[4] if len(parts) == 5 and parts[1] == "req" else None
