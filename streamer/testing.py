"""Test and benchmark helpers: run the app on a free port, and a tiny fake fleet.

`FakeFleet` stands in for dispatcher + workers: a real JetStream consumer on
``<PREFIX>_REQUESTS`` that answers every request by publishing `TokenChunk`s to its
``reply_to`` and a `Usage` record to ``<PREFIX>_USAGE``. It is a test double, not a
simulator: what it sends is driven by words in the prompt, e.g.
``"n=50 size=8 delay_ms=1 hold"``:

    n=N          chunks to send (default: min(max_tokens, 8)), one token each
    size=S       characters of text per chunk (default 4)
    delay_ms=D   pause between chunks
    hold         send one chunk, then wait until the request is cancelled
    fail=CODE    answer with an error chunk of that ErrorCode
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from nats.js.api import AckPolicy, ConsumerConfig

from fairlane.embedded import free_port
from fairlane.protocol import (
    Cancel,
    ErrorCode,
    ErrorInfo,
    InferenceRequest,
    TokenChunk,
    Usage,
    decode_cancel,
    decode_request,
    encode,
)
from fairlane.runtime import cancel_and_wait, now_ms
from fairlane.streams import ensure_streams
from fairlane.subjects import Subjects


@contextlib.asynccontextmanager
async def serve_app(app: Any, *, host: str = "127.0.0.1", ws_max_size: int = 1 << 20,
                    ) -> AsyncIterator[str]:
    """Run `app` under uvicorn in this event loop; yields its base URL."""
    port = free_port()
    config = uvicorn.Config(
        app, host=host, port=port, lifespan="on", ws="websockets-sansio",
        ws_max_size=ws_max_size, ws_per_message_deflate=False, log_level="warning",
        access_log=False,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("uvicorn exited before starting")
            await asyncio.sleep(0.01)
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        try:
            await asyncio.wait_for(task, 15)
        except TimeoutError:
            # Open keep-alive or streaming connections can hold a graceful exit; a test
            # server must still go away in bounded time.
            server.force_exit = True
            try:
                await asyncio.wait_for(task, 5)
            except TimeoutError:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task


def _directives(req: InferenceRequest) -> dict[str, str]:
    text = req.prompt or ""
    if req.messages:
        text = req.messages[-1].content
    out: dict[str, str] = {}
    for word in text.split():
        key, _, value = word.partition("=")
        out[key] = value
    return out


class FakeFleet:
    def __init__(self, nc: Any, subjects: Subjects, *, publish_usage: bool = True) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.subjects = subjects
        self.publish_usage = publish_usage
        self.requests: list[InferenceRequest] = []
        self.cancels: list[Cancel] = []
        self._cancelled: dict[str, asyncio.Event] = {}
        self._tasks: set[asyncio.Task] = set()
        self._loop_task: asyncio.Task | None = None
        self._subs: list[Any] = []

    async def start(self) -> FakeFleet:
        await ensure_streams(self.js, self.subjects)
        psub = await self.js.pull_subscribe(
            self.subjects.requests_all(),
            durable="fake-fleet",
            stream=self.subjects.requests_stream,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, max_ack_pending=100_000),
        )
        self._subs.append(psub)
        # fl.cancel.<pool>.<tenant>, and the tenant-less fl.cancel.<pool>.
        self._subs.append(await self.nc.subscribe(f"{self.subjects.prefix}.cancel.>",
                                                  cb=self._on_cancel))
        self._loop_task = asyncio.create_task(self._loop(psub))
        return self

    async def stop(self) -> None:
        # cancel_and_wait, not one cancel: on Python 3.11 the fetch's wait_for can
        # swallow a cancel, and the loop would run on past a plain cancel-then-gather.
        tasks = [t for t in [self._loop_task, *self._tasks] if t is not None]
        for t in tasks:
            t.cancel()  # all at once, as before; then each waited for (re-cancelled)
        for t in tasks:
            await cancel_and_wait(t)
        for s in self._subs:
            with contextlib.suppress(Exception):
                await s.unsubscribe()

    async def __aenter__(self) -> FakeFleet:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _on_cancel(self, msg: Any) -> None:
        c = decode_cancel(msg.data)
        self.cancels.append(c)
        self._cancelled.setdefault(c.request_id, asyncio.Event()).set()

    def cancelled_ids(self) -> set[str]:
        return {c.request_id for c in self.cancels}

    async def wait_cancelled(self, request_id: str, timeout_s: float = 5.0) -> Cancel:
        ev = self._cancelled.setdefault(request_id, asyncio.Event())
        await asyncio.wait_for(ev.wait(), timeout_s)
        return next(c for c in self.cancels if c.request_id == request_id)

    async def _loop(self, psub: Any) -> None:
        from nats.errors import TimeoutError as NatsTimeout

        while True:
            try:
                msgs = await psub.fetch(256, timeout=0.2)
            except (TimeoutError, NatsTimeout):
                continue
            for msg in msgs:
                await msg.ack()
                req = decode_request(msg.data)
                self.requests.append(req)
                t = asyncio.create_task(self._serve(req))
                self._tasks.add(t)
                t.add_done_callback(self._tasks.discard)

    async def _serve(self, req: InferenceRequest) -> None:
        d = _directives(req)
        rid = req.request_id
        cancelled = self._cancelled.setdefault(rid, asyncio.Event())
        if "fail" in d:
            err = ErrorInfo.of(ErrorCode(d["fail"]), f"fake fleet failure {d['fail']}")
            await self.nc.publish(req.reply_to, encode(TokenChunk(request_id=rid, seq=0, error=err)))
            return
        n = int(d.get("n") or min(req.sampling.max_tokens, 8))
        size = int(d.get("size") or 4)
        delay = float(d.get("delay_ms") or 0) / 1000
        piece = ("x" * size)[:size]
        sent = 0
        for seq in range(n):
            if cancelled.is_set():
                return
            last = seq == n - 1 and "hold" not in d
            usage = None
            if last:
                usage = Usage(request_id=rid, tenant=req.tenant, pool=req.pool, tier=req.tier,
                              prompt_tokens=len(req.prompt or "") // 4 + 1,
                              completion_tokens=n, finish_reason="length", ts_ms=now_ms())
            chunk = TokenChunk(request_id=rid, seq=seq, text=piece, num_tokens=1,
                               token_ids=[seq] if req.return_token_ids else None,
                               finish_reason="length" if last else None, usage=usage)
            await self.nc.publish(req.reply_to, encode(chunk))
            sent += 1
            if usage is not None and self.publish_usage:
                await self.js.publish(self.subjects.usage(req.tenant), encode(usage),
                                      headers={"Nats-Msg-Id": rid})
            if "hold" in d:
                break
            if delay:
                await asyncio.sleep(delay)
        if "hold" in d:
            await cancelled.wait()
