"""What a chaos run observes: one tap on every subject of the fleet (request publishes,
work batches, worker events, usage publishes, token chunks) and the workers' logs.
Split from `tests.chaos.harness` for size; `ChaosRun` owns one `Observer`."""

from __future__ import annotations

import contextlib
import json
from collections import defaultdict
from datetime import datetime
from pathlib import Path
from typing import Any

import nats

from fairlane.protocol import (
    Finished,
    Heartbeat,
    Preempted,
    ProtocolError,
    Started,
    decode_chunk,
    decode_event,
    decode_preempt,
    decode_request,
    decode_usage,
    decode_work_batch,
)
from fairlane.subjects import Subjects
from tests.chaos.harness_types import BILLABLE_FINISH, LOST_CODES, POOL, PREFIX, Attempt, Req, now  # noqa: F401


class Observer:
    """Core-NATS taps on events, usage publishes, token chunks and work batches."""

    def __init__(self, pool: str = POOL) -> None:
        self.subjects = Subjects(PREFIX)
        self.pool = pool
        # rid -> (t, worker_id, incarnation, resumed: a continuation, not from scratch)
        self.started: dict[str, list[tuple[float, str, str, bool]]] = defaultdict(list)
        self.finished: dict[str, list[tuple[float, str, str, str | None, int]]] = defaultdict(list)
        self.preempted: dict[str, list[float]] = defaultdict(list)
        self.heartbeats: dict[str, tuple[float, Heartbeat]] = {}
        self.usage: dict[str, list[tuple[float, Any]]] = defaultdict(list)
        # rid -> (t, seq, num_tokens, error code, finish_reason)
        self.chunks: dict[str, list[tuple[float, int, int, str | None, str | None]]] = (
            defaultdict(list))
        self.dispatched: dict[str, list[tuple[float, int, int]]] = defaultdict(list)  # t, epoch, attempt
        # rid -> (t, attempt, continuation's next_seq or None): every request publish
        self.published: dict[str, list[tuple[float, int, int | None]]] = defaultdict(list)
        self.batches: list[tuple[float, int, int]] = []  # (t, epoch, num items)
        self.disconnects: list[float] = []
        self.nc: nats.NATS | None = None

    async def start(self, url: str) -> None:
        async def on_disc() -> None:
            self.disconnects.append(now())

        async def quiet(exc: Exception) -> None:
            pass

        self.nc = await nats.connect(url.split(","), name="chaos-observer", max_reconnect_attempts=-1,
                                     reconnect_time_wait=0.1, error_cb=quiet,
                                     disconnected_cb=on_disc)
        big = {"pending_msgs_limit": 10_000_000, "pending_bytes_limit": 1 << 31}
        await self.nc.subscribe(self.subjects.events(self.pool), cb=self._on_event, **big)
        await self.nc.subscribe(self.subjects.usage_all(), cb=self._on_usage, **big)
        await self.nc.subscribe(f"{PREFIX}.inbox.>", cb=self._on_chunk, **big)
        await self.nc.subscribe("_INBOX.>", cb=self._on_reply, **big)
        await self.nc.subscribe(self.subjects.requests_all(), cb=self._on_request, **big)
        # A preemption order carries the waiting request it frees the slot for: a dispatch.
        await self.nc.subscribe(self.subjects.preempt(self.pool), cb=self._on_preempt, **big)
        await self.nc.flush()

    async def close(self) -> None:
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.close()

    async def _on_event(self, msg) -> None:
        t = now()
        try:
            ev = decode_event(msg.data)
        except ProtocolError:
            return
        if isinstance(ev, Started):
            self.started[ev.request_id].append((t, ev.worker_id, ev.incarnation,
                                                getattr(ev, "resumed", False)))
        elif isinstance(ev, Finished):
            code = ev.error.code.value if ev.error is not None else None
            n = ev.usage.completion_tokens if ev.usage is not None else 0
            self.finished[ev.request_id].append((t, ev.worker_id, ev.incarnation, code, n))
        elif isinstance(ev, Preempted):
            self.preempted[ev.request_id].append(t)
        elif isinstance(ev, Heartbeat):
            self.heartbeats[ev.worker_id] = (t, ev)

    async def _on_usage(self, msg) -> None:
        with contextlib.suppress(ProtocolError):
            u = decode_usage(msg.data)
            self.usage[u.request_id].append((now(), u))

    async def _on_chunk(self, msg) -> None:
        with contextlib.suppress(ProtocolError):
            c = decode_chunk(msg.data)
            self.chunks[c.request_id].append(
                (now(), c.seq, c.num_tokens, c.error.code.value if c.error else None,
                 c.finish_reason))

    async def _on_request(self, msg) -> None:
        with contextlib.suppress(ProtocolError):
            r = decode_request(msg.data)
            self.published[r.request_id].append(
                (now(), r.attempt, r.resume.next_seq if r.resume is not None else None))

    async def _on_preempt(self, msg) -> None:
        with contextlib.suppress(ProtocolError):
            order = decode_preempt(msg.data)
            if order.replacement is not None:
                req = order.replacement.request
                self.dispatched[req.request_id].append((now(), order.epoch, req.attempt))

    async def _on_reply(self, msg) -> None:
        if not msg.data.startswith(b'{"items":'):
            return
        with contextlib.suppress(ProtocolError):
            b = decode_work_batch(msg.data)
            t = now()
            self.batches.append((t, b.epoch, len(b.items)))
            for item in b.items:
                self.dispatched[item.request.request_id].append((t, b.epoch, item.request.attempt))

    # --- derived views --------------------------------------------------------------

    def running_on(self, worker_id: str, at: float | None = None) -> set[str]:
        """Requests started on `worker_id` and not finished (as of `at`)."""
        at = now() if at is None else at
        out = set()
        for rid, starts in self.started.items():
            mine = [s for s in starts if s[1] == worker_id and s[0] <= at]
            if not mine:
                continue
            last = max(s[0] for s in mine)
            ended = [*(f[0] for f in self.finished.get(rid, ())), *self.preempted.get(rid, ())]
            if not any(last <= e <= at for e in ended):
                out.add(rid)
        return out

    def dispatched_unstarted(self, worker_pulls: set[str], at: float) -> set[str]:
        return {rid for rid in worker_pulls
                if not any(s[0] <= at for s in self.started.get(rid, ()))}

    def first_started_after(self, t: float) -> float | None:
        ts = [s[0] for starts in self.started.values() for s in starts if s[0] > t]
        return min(ts) if ts else None


def parse_logs(path: Path, offset_s: float, events: set[str]) -> list[dict]:
    """JSON log lines whose ``event`` is in `events`, with ``t`` (monotonic s) added."""
    out = []
    if not path.exists():
        return out
    for line in path.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if d.get("event") not in events:
            continue
        with contextlib.suppress(Exception):
            ts = datetime.fromisoformat(d["timestamp"].replace("Z", "+00:00")).timestamp()
            d["t"] = ts - offset_s
        out.append(d)
    return out


# --- the fleet ----------------------------------------------------------------------------
