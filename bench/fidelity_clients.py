"""The fidelity benchmark's load generator as one client process per traffic class
(`fidelity_real.PER_CLASS`, the default): each class's requests are sent and read by
a spawned process with its own NATS connection and event loop, as different tenants'
clients are in production.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from bench.fidelity_load import Live, LoadGen, warm_up
from producer.client import FairlaneClient

CLIENT_STEP_TIMEOUT_S = 60.0  # a client process's start (spawn, connect, warm-up), or a reply
#
# The parent and each client process talk over a pipe, in this order:
#   client -> ("ready", pid)   connected, warmed up
#   parent -> t0               the run's start (time.monotonic, which is loop.time() in
#                              every process: one clock for all)
#   client -> ("waited",)      its window's requests ended, or t0 + run_s passed
#   parent -> "finish"         every client has waited (the CPU snapshot is taken)
#   client -> ("done", obs, lag_ms, error codes)
# A failure in a client sends ("error", text) instead and ends it.


def _recv(conn: Connection, timeout_s: float, who: str) -> Any:
    """The next message, or TimeoutError; EOFError if the other end is gone."""
    if not conn.poll(timeout_s):
        raise TimeoutError(f"{who}: nothing for {timeout_s:g} s")
    return conn.recv()


def client_process(conn: Connection, nats_url: str, prefix: str, lives: list[Live], obs: Any,
                   run_s: float) -> None:
    """A client process's body (spawned: a fresh interpreter, nothing inherited)."""
    try:
        asyncio.run(_client_main(conn, nats_url, prefix, lives, obs, run_s))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, then exit 1
        with contextlib.suppress(Exception):
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None


async def _client_main(conn: Connection, nats_url: str, prefix: str, lives: list[Live],
                       obs: Any, run_s: float) -> None:
    client = await FairlaneClient.connect(nats_url, prefix=prefix, max_buffered_chunks=4096)
    try:
        await warm_up(client, lives)
        conn.send(("ready", os.getpid()))
        t0 = await asyncio.to_thread(_recv, conn, CLIENT_STEP_TIMEOUT_S, "t0 from the parent")
        gen = LoadGen(client, obs)
        await gen.run_window(lives, t0, run_s)
        conn.send(("waited",))
        await asyncio.to_thread(_recv, conn, run_s + CLIENT_STEP_TIMEOUT_S, "finish")
        lag, errors = await gen.finish()
        conn.send(("done", obs, lag, errors))
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(client.close(), 15)


@dataclass
class ClientProcs:
    """The load generator as one client process per traffic class (`PER_CLASS`)."""

    procs: dict[str, Any] = field(default_factory=dict)  # class -> multiprocessing.Process
    conns: dict[str, Connection] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)  # "client:CLASS" -> pid

    def start(self, lives: list[Live], obs: Any, nats_url: str, prefix: str,
              run_s: float) -> None:
        ctx = multiprocessing.get_context("spawn")  # not fork: this process runs a loop
        by_class: dict[str, list[Live]] = {}
        for lv in lives:
            by_class.setdefault(lv.cls, []).append(lv)
        for cls, group in by_class.items():
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=client_process, name=f"fidelity-client-{cls}", daemon=True,
                            args=(theirs, nats_url, prefix, group, type(obs)(obs.lo_s, obs.hi_s),
                                  run_s))
            p.start()
            theirs.close()
            self.procs[cls], self.conns[cls] = p, mine

    async def _gather(self, timeout_s: float, kind: str) -> dict[str, tuple]:
        """Every client's next message, which must be `kind`."""
        async def one(cls: str) -> tuple:
            try:
                msg = await asyncio.to_thread(_recv, self.conns[cls], timeout_s,
                                              f"client {cls}")
            except EOFError:
                raise RuntimeError(f"client {cls} exited (code "
                                   f"{self.procs[cls].exitcode}) before {kind!r}") from None
            if msg[0] == "error":
                raise RuntimeError(f"client {cls}: {msg[1]}")
            if msg[0] != kind:
                raise RuntimeError(f"client {cls}: expected {kind!r}, got {msg[0]!r}")
            return msg
        msgs = await asyncio.gather(*(one(cls) for cls in self.conns))
        return dict(zip(self.conns, msgs, strict=True))

    async def ready(self) -> None:
        for cls, msg in (await self._gather(CLIENT_STEP_TIMEOUT_S, "ready")).items():
            self.pids[f"client:{cls}"] = msg[1]

    def send_all(self, msg: Any) -> None:
        for conn in self.conns.values():
            conn.send(msg)

    async def waited(self, run_s: float) -> None:
        await self._gather(run_s + CLIENT_STEP_TIMEOUT_S, "waited")

    async def done(self, obs: Any) -> tuple[list[float], list[str]]:
        """Their observations merged into `obs`; (lag ms, error codes) of all."""
        lag: list[float] = []
        errors: list[str] = []
        for msg in (await self._gather(CLIENT_STEP_TIMEOUT_S, "done")).values():
            obs.absorb(msg[1])
            lag += msg[2]
            errors += msg[3]
        return lag, errors

    def stop(self, *, kill: bool = False) -> None:
        """Reap them: they exit after "done" (closing their client takes a moment);
        with `kill` (a failure: the others would wait for a t0 or a "finish" that
        never comes) or past that moment, they are killed."""
        for p in self.procs.values():
            if not kill and p.exitcode is None:
                p.join(timeout=20)
            if p.exitcode is None:
                p.kill()
                p.join(timeout=5)
        for conn in self.conns.values():
            conn.close()
