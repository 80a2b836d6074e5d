"""The producer's silence watchdog (DESIGN.md section 4): no client waits forever.

A stream with no chunk for `silence_s` asks the pool's dispatcher where its request
is (`fl.status.<pool>`); the answer decides (`producer.watch.silence_action`): wait on,
ask again, or end the stream with the error. One task watches every stream of a client
and asks about the silent ones in batches, one round trip per (pool, tenant) and up to
`MAX_STATUS_BATCH` ids: a client holding thousands of queued streams (a burst waiting
for slots) would otherwise ask thousands of times a second.
"""

from __future__ import annotations

import asyncio
from typing import Any

import nats
import structlog

from fairlane.protocol import (
    MAX_STATUS_BATCH,
    ProtocolError,
    RequestStatus,
    StatusRequest,
    decode_statuses,
    encode,
)
from fairlane.subjects import Subjects
from producer.stream import RequestStream
from producer.watch import STATUS_TIMEOUT_S, Action, silence_action

log = structlog.get_logger(__name__)


class SilenceWatch:
    """Mixin of `FairlaneClient`: the status questions and the silence watchdog."""

    # Set by FairlaneClient.__init__.
    nc: Any
    subjects: Subjects
    silence_s: float
    max_silence_s: float
    _streams: dict[str, RequestStream]

    def _forget(self, request_id: str) -> None:
        raise NotImplementedError

    async def request_status(self, pool: str, request_id: str,
                             tenant: str = "") -> RequestStatus | None:
        """The pool dispatcher's status of a request; None when nobody answers."""
        return (await self.request_statuses(pool, [request_id], tenant)).get(request_id)

    async def _watch_silence(self) -> None:
        """One task for all streams: ask about the silent ones, fail the lost ones."""
        loop = asyncio.get_running_loop()
        tick_s = min(1.0, self.silence_s / 2)
        while True:
            await asyncio.sleep(tick_s)
            now = loop.time()
            silent = [s for s in self._streams.values()
                      if not s._done and s.failure is None and not s._ended_upstream
                      and now - s._last_chunk_s >= self.silence_s]
            # One batch request per (pool, tenant) and up to MAX_STATUS_BATCH ids, not
            # one per stream: a client with thousands of queued streams (a burst) would
            # otherwise ask thousands of times a second, slowing everyone's tokens.
            groups: dict[tuple[str, str], list[RequestStream]] = {}
            for s in silent:
                groups.setdefault((s.pool, s.tenant), []).append(s)
            batches = [(pool, tenant, group[i:i + MAX_STATUS_BATCH])
                       for (pool, tenant), group in groups.items()
                       for i in range(0, len(group), MAX_STATUS_BATCH)]
            await asyncio.gather(*(self._check_silent(*b) for b in batches),
                                 return_exceptions=True)

    async def request_statuses(self, pool: str, request_ids: list[str],
                               tenant: str = "") -> dict[str, RequestStatus]:
        """The pool dispatcher's status of each request, in one round trip (ids it
        did not answer for are missing: nobody answered, or an older dispatcher
        answered the first id only — the rest are then asked one by one)."""
        ask = StatusRequest(request_id=request_ids[0], tenant=tenant,
                            request_ids=request_ids if len(request_ids) > 1 else [])
        try:
            msg = await self.nc.request(self.subjects.status(pool), encode(ask),
                                        timeout=STATUS_TIMEOUT_S)
            statuses = decode_statuses(msg.data)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError, ProtocolError,
                nats.errors.ConnectionClosedError):
            return {}
        out = {st.request_id: st for st in statuses}
        if len(statuses) == 1 and len(request_ids) > 1:  # a dispatcher without batches
            for rid in request_ids[1:]:
                st = await self.request_status(pool, rid, tenant)
                if st is not None:
                    out[rid] = st
        return out

    async def _check_silent(self, pool: str, tenant: str, streams: list[RequestStream]) -> None:
        statuses = await self.request_statuses(pool, [s.request_id for s in streams], tenant)
        for stream in streams:
            self._on_silence_status(stream, statuses.get(stream.request_id))

    def _on_silence_status(self, stream: RequestStream, status: RequestStatus | None) -> None:
        if stream._done or stream.failure is not None:
            return
        if stream._unvouched_since_s is None:
            stream._unvouched_since_s = stream._last_chunk_s
        silent_s = asyncio.get_running_loop().time() - stream._unvouched_since_s
        action, error = silence_action(status, silent_s, self.max_silence_s,
                                       started=stream._next_seq > stream._resumed_at_seq,
                                       attempt=stream.attempt)
        if action is Action.WAIT:
            stream._last_chunk_s = asyncio.get_running_loop().time()
            stream._unvouched_since_s = None
        elif action is Action.FAIL:
            assert error is not None
            log.warning("stream_silent_failed", request_id=stream.request_id,
                        code=str(error.code), silent_s=round(silent_s, 1))
            stream._fail(error)
            self._forget(stream.request_id)
        else:  # ASK_AGAIN: restart the short timer, keep the total-silence clock
            stream._last_chunk_s = asyncio.get_running_loop().time()
