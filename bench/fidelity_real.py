"""The real fleet of bench/fidelity.py: a dispatcher and simulator workers behind a
loopback nats-server (`bench.fleet`), and a load generator that submits a workload's
arrivals at their times with the producer library and times every stream.

TTFT is the client's: first token chunk minus the moment the arrival's submit began
(so a late generator shows as lag, reported, not as TTFT). CPU seconds of every fleet
process (/proc/<pid>/stat), of the clients and of the whole machine are read around
the run: a CPU-starved fleet steps slower than its model, which is the first thing
that separates it from the simulator.

Clients (`CLIENT_LAYOUTS`): by default each traffic class is its own client process
(its own connection and event loop), as different tenants' clients are in production.
`shared` runs every class through one client in this process, the rig before
per-class clients: there the flood's burst of submits held up a quiet tenant's (the
generator up to 137 ms late in fidelity's light scenario), and its first tokens
shared one socket and event loop with the flood's ~9,500 token chunks a second. The
first no fleet does; the second, measured, moved the quiet tenant's TTFT by well
under a millisecond at the median (BENCHMARKS §9).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import yaml

from bench.fleet import Fleet, WorkerSpec
from fleetsim.records import Arrival
from fleetsim.workload import Workload
from producer.client import FairlaneClient, RequestError, RequestSpec, SamplingParams

POOL = "default"
CHARS_PER_TOKEN = 4  # fairlane.validation.estimate_prompt_tokens: (chars + 3) // 4
PUBLISH_CONCURRENCY = 256  # a tenant's submits in flight at once (as bench/preemption.py)
# One client process per traffic class (the default), or one client for all in this
# process (the rig before per-class clients; see the module docstring).
PER_CLASS, SHARED = "per-class", "shared"
CLIENT_LAYOUTS = (PER_CLASS, SHARED)
CLIENT_STEP_TIMEOUT_S = 60.0  # a client process's start (spawn, connect, warm-up), or a reply
LIMIT_FIELDS = ("max_concurrent", "max_queued", "max_kv_tokens")

# Every fleet this process started and has not stopped: main() SIGKILLs what is left
# (Ctrl-C, a crash) so nothing outlives the benchmark.
LIVE_FLEETS: dict[int, Fleet] = {}  # by id(): a Fleet (a dataclass) is not hashable


def tenants_doc(wl: Workload, doc: dict) -> dict:
    """The tenants file a dispatcher needs to run what fleetsim runs for `doc`: the
    same pool section and tiers, every class's tenants with their tier and limits."""
    raw = {c["name"]: c for c in doc["classes"]}
    tenants: dict[str, dict] = {}
    for c in wl.classes:
        for k in range(c.num_tenants):
            i = c.first_tenant + k
            entry: dict[str, Any] = {"tier": wl.tenants.tiers[wl.tenants.tier_of[i]],
                                     "weight": wl.tenants.weight_of[i]}
            entry.update({f: raw[c.name][f] for f in LIMIT_FIELDS if f in raw[c.name]})
            tenants[c.tenant_name(k)] = entry
    out: dict[str, Any] = {"pools": {POOL: doc.get("pool") or {}}, "tenants": tenants}
    if doc.get("tiers"):
        out["tiers"] = doc["tiers"]
    return out


def prompt_of(num_tokens: int) -> str:
    """A prompt the workers count as exactly `num_tokens` tokens."""
    return "x" * (CHARS_PER_TOKEN * num_tokens)


# --- CPU ------------------------------------------------------------------------------------


def proc_cpu_s(pid: int) -> float | None:
    """utime + stime of a process, in seconds; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of the whole machine since boot (/proc/stat)."""
    with contextlib.suppress(OSError, ValueError):
        vals = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
        return sum(vals) - idle, sum(vals)
    return 0, 0


def cpu_snapshot(pids: dict[str, int]) -> dict[str, float]:
    snap = {name: s for name, pid in pids.items() if (s := proc_cpu_s(pid)) is not None}
    busy, total = machine_ticks()
    return {**snap, "bench": time.process_time(), "_busy": busy, "_total": total,
            "_wall": time.monotonic()}


def _is_client(name: str) -> bool:
    """This process ("bench") or a client process ("client:CLASS"): the load, not the
    fleet."""
    return name == "bench" or name.startswith("client:")


def cpu_usage(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """Cores each process used between two snapshots, "fleet" = every process but
    the load generator's (nats, dispatcher, workers), "clients" = the load generator's
    (this process and its client processes), and the machine's busy fraction (all its
    processes, ours and anyone else's)."""
    wall = b["_wall"] - a["_wall"]
    if wall <= 0:
        return {}
    procs = {name: round((b[name] - a[name]) / wall, 3) for name in a
             if not name.startswith("_") and name in b}
    out = {**procs, "fleet": round(sum(v for k, v in procs.items() if not _is_client(k)), 3),
           "clients": round(sum(v for k, v in procs.items() if _is_client(k)), 3)}
    ticks = b["_total"] - a["_total"]
    out["machine_busy_frac"] = round((b["_busy"] - a["_busy"]) / ticks, 3) if ticks else None
    return out


# --- the fleet ----------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def real_fleet(wl: Workload, doc: dict, *, nats_url: str, prefix: str, workers: int,
                     spec: WorkerSpec, log_dir: Path,
                     notes: list[str]) -> AsyncIterator[tuple[Fleet, FairlaneClient]]:
    """A started fleet and a connected client; both stopped on the way out, however
    it is left (the client first: it cancels its open streams upstream)."""
    fleet = Fleet(nats_url, prefix, yaml.safe_dump(tenants_doc(wl, doc)),
                  wl.scheduler_config.policy, log_dir, num_workers=workers, worker=spec,
                  pool=POOL)
    LIVE_FLEETS[id(fleet)] = fleet
    client = None
    try:
        await fleet.start()
        client = await FairlaneClient.connect(nats_url, prefix=prefix, max_buffered_chunks=4096)
        yield fleet, client
    finally:
        if client is not None:
            try:
                await asyncio.wait_for(client.close(), 15)
            except Exception as exc:  # noqa: BLE001 - the fleet must still be stopped
                notes.append(f"{prefix}: client.close failed: {exc!r}")
            # Let the cancels land first: a worker told to stop drains by finishing what
            # it runs (seconds at these lengths), past the stop's grace period.
            with contextlib.suppress(Exception):
                await fleet.wait_idle(15)
        codes = await fleet.stop(grace_s=6.0)
        LIVE_FLEETS.pop(id(fleet), None)
        bad = {k: v for k, v in codes.items() if v != 0}
        if bad:
            notes.append(f"{prefix}: processes did not exit cleanly on SIGTERM: {bad} "
                         "(None = SIGKILLed after the grace period)")


def fleet_pids(fleet: Fleet, nats_pid: int | None) -> dict[str, int]:
    pids = {name: p.pid for name, p in fleet.procs}
    if nats_pid is not None:
        pids["nats"] = nats_pid
    return pids


@dataclass
class Live:
    """One arrival's request on the real fleet (loop-clock seconds)."""

    cls: str
    tenant: str
    tier: str
    arrival: Arrival
    t_sub: float | None = None
    t_first: float | None = None
    t_done: float | None = None
    num_tokens: int = 0
    error: str | None = None
    stream: Any = None  # its RequestStream once submitted


@dataclass
class LoadGen:
    """Submits arrivals at t0 + t_s and reads their streams; tokens go to `obs` as
    they arrive (it counts those inside its window)."""

    client: FairlaneClient
    obs: Any  # bench.fidelity.Observations
    t0: float = 0.0
    lives: list[Live] = field(default_factory=list)
    tasks: set[asyncio.Task] = field(default_factory=set)
    # Per tenant: a burst's publishes must not hold up another tenant's submit (they
    # would be separate clients in production).
    sems: dict[str, asyncio.Semaphore] = field(default_factory=dict)

    async def request(self, live: Live) -> None:
        loop = asyncio.get_running_loop()
        live.t_sub = loop.time()
        a = live.arrival
        try:
            sem = self.sems.setdefault(live.tenant, asyncio.Semaphore(PUBLISH_CONCURRENCY))
            async with sem:
                stream = live.stream = await self.client.submit(RequestSpec(
                    tenant=live.tenant, tier=live.tier, prompt=prompt_of(a.prompt_tokens),
                    sampling=SamplingParams(max_tokens=a.max_tokens),
                    expected_output_tokens=min(a.output_tokens, a.max_tokens)))
            async for chunk in stream:
                n = chunk.num_tokens or len(chunk.token_ids or ())
                if not n:
                    continue
                now = loop.time()
                if live.t_first is None:
                    live.t_first = now
                live.num_tokens += n
                self.obs.generated(live.cls, now - self.t0, now - self.t0, n)
            live.t_done = loop.time()
        except RequestError as exc:
            live.error = exc.error.code.value

    async def run(self, lives: list[Live], t0: float) -> None:
        """Start each request at its arrival time (`lives` in time order)."""
        loop = asyncio.get_running_loop()
        self.t0 = t0
        for live in lives:
            delay = t0 + live.arrival.t_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            self.lives.append(live)
            task = loop.create_task(self.request(live))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def cancel_all(self) -> None:
        """Stop reading and cancel the unfinished requests upstream (a stream whose
        reader stops is only forgotten by the client library; its work would go on)."""
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*list(self.tasks), return_exceptions=True)
        for live in self.lives:
            if live.t_done is None and live.stream is not None and not live.stream.is_done:
                with contextlib.suppress(Exception):
                    await live.stream.cancel("bench_done")
        with contextlib.suppress(Exception):
            await self.client.nc.flush(timeout=10)

    def report(self) -> None:
        """Every request's times into `obs` (relative to t0); unfinished ones count as
        arrived, and with their first token if they had one (censored otherwise)."""
        for live in self.lives:
            a, cls = live.arrival, live.cls
            self.obs.arrival(cls, a.t_s)
            if live.t_sub is None or live.t_first is None:
                continue
            ttft_s = live.t_first - live.t_sub
            self.obs.first_token(cls, a.t_s, ttft_s)
            if live.t_done is not None and live.error is None:
                self.obs.finished(cls, a.t_s, live.t_done - live.t_sub, ttft_s, live.num_tokens)

    def lag_ms(self) -> list[float]:
        """How late each measured arrival's submit began (the generator's lag)."""
        return [(lv.t_sub - self.t0 - lv.arrival.t_s) * 1000 for lv in self.lives
                if lv.t_sub is not None and self.obs.in_window(lv.arrival.t_s)]


def lives_of(wl: Workload, arrivals: list[Arrival], class_of: list[str]) -> list[Live]:
    t = wl.tenants
    return [Live(class_of[a.tenant], t.names[a.tenant], t.tiers[t.tier_of[a.tenant]], a)
            for a in arrivals]


async def _busy_sampler(fleet: Fleet, obs: Any, t0: float, out: list[int]) -> None:
    """The fleet's running sequences (heartbeats) once a second inside the window."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(1.0)
        if obs.in_window(loop.time() - t0):
            out.append(sum(hb.load.num_running for hb in fleet.heartbeats.values()))


async def warm_up(client: FairlaneClient, lives: list[Live]) -> None:
    """One short request per class (imports, connections, the first pulls), awaited."""
    seen: dict[str, Live] = {}
    for lv in lives:
        seen.setdefault(lv.cls, lv)
    gen = LoadGen(client, obs=_Null())
    for lv in seen.values():
        a = Arrival(0.0, lv.arrival.tenant, 32, 8, 8)
        await asyncio.wait_for(gen.request(Live(lv.cls, lv.tenant, lv.tier, a)), 30)


class _Null:
    def generated(self, *args: Any) -> None:
        pass


async def _wait_window(gen: LoadGen, obs: Any, until: float) -> None:
    """Until `until` (loop time) or every request arriving in the window has ended."""
    loop = asyncio.get_running_loop()
    while loop.time() < until and any(
            lv.t_done is None and lv.error is None for lv in gen.lives
            if obs.in_window(lv.arrival.t_s)):
        await asyncio.sleep(0.1)


# --- client processes (PER_CLASS) ---------------------------------------------------------
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
        await gen.run(lives, t0)
        await _wait_window(gen, obs, t0 + run_s)
        conn.send(("waited",))
        await asyncio.to_thread(_recv, conn, run_s + CLIENT_STEP_TIMEOUT_S, "finish")
        await gen.cancel_all()
        gen.report()
        conn.send(("done", obs, gen.lag_ms(), [lv.error for lv in gen.lives if lv.error]))
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


async def _run_clients(fleet: Fleet, lives: list[Live], obs: Any, *, run_s: float,
                       nats_url: str, prefix: str, pids: dict[str, int],
                       busy: list[int]) -> tuple[dict, list[float], list[str]]:
    """`lives` through one client process per class: (CPU cores, lag ms, error codes)."""
    loop = asyncio.get_running_loop()
    clients = ClientProcs()
    try:
        clients.start(lives, obs, nats_url, prefix, run_s)
        await clients.ready()
        await fleet.wait_idle(10)
        pids = {**pids, **clients.pids}
        cpu0 = cpu_snapshot(pids)
        t0 = loop.time() + 0.5  # time for t0 to reach every client
        clients.send_all(t0)
        sampler = loop.create_task(_busy_sampler(fleet, obs, t0, busy))
        try:
            await clients.waited(run_s)
        finally:
            sampler.cancel()
        cpu1 = cpu_snapshot(pids)
        clients.send_all("finish")
        lag, errors = await clients.done(obs)
    except BaseException:
        clients.stop(kill=True)
        raise
    clients.stop()
    return cpu_usage(cpu0, cpu1), lag, errors


async def run_real(wl: Workload, doc: dict, arrivals: list[Arrival], class_of: list[str],
                   obs: Any, *, run_s: float, nats_url: str, nats_pid: int | None,
                   prefix: str, workers: int, spec: WorkerSpec, log_dir: Path,
                   notes: list[str], clients: str = PER_CLASS) -> dict[str, Any]:
    """The arrivals through a fresh real fleet; requests arriving in `obs`'s window
    may run until `run_s` after t0 (the simulator runs as long). `clients`: one client
    process per class, or one client here for all (`CLIENT_LAYOUTS`). Diagnostics."""
    if clients not in CLIENT_LAYOUTS:
        raise ValueError(f"clients: one of {CLIENT_LAYOUTS}, got {clients!r}")
    loop = asyncio.get_running_loop()
    lives = lives_of(wl, arrivals, class_of)
    busy: list[int] = []
    async with real_fleet(wl, doc, nats_url=nats_url, prefix=prefix, workers=workers,
                          spec=spec, log_dir=log_dir, notes=notes) as (fleet, client):
        pids = fleet_pids(fleet, nats_pid)
        if clients == PER_CLASS:
            cpu, lag, errors = await _run_clients(fleet, lives, obs, run_s=run_s,
                                                  nats_url=nats_url, prefix=prefix, pids=pids,
                                                  busy=busy)
        else:
            await warm_up(client, lives)
            await fleet.wait_idle(10)
            gen = LoadGen(client, obs)
            cpu0 = cpu_snapshot(pids)
            t0 = loop.time() + 0.2
            sampler = loop.create_task(_busy_sampler(fleet, obs, t0, busy))
            await gen.run(lives, t0)
            await _wait_window(gen, obs, t0 + run_s)
            cpu = cpu_usage(cpu0, cpu_snapshot(pids))
            sampler.cancel()
            await gen.cancel_all()
            gen.report()
            lag, errors = gen.lag_ms(), [lv.error for lv in gen.lives if lv.error]
        problems = fleet.log_problems(max_lines=5)
    return {"clients": clients, "cpu_cores": cpu,
            "lag_p50_ms": round(statistics.median(lag), 2) if lag else None,
            "lag_max_ms": round(max(lag), 2) if lag else None,
            "busy_slots_mean": round(statistics.mean(busy), 1) if busy else None,
            "errors": len(errors), "error_codes": sorted(set(errors)),
            "log_problems": problems}


async def idle_ttft_ms(wl: Workload, doc: dict, probes: list[Arrival], *, nats_url: str,
                       prefix: str, workers: int, spec: WorkerSpec, log_dir: Path,
                       notes: list[str]) -> list[float]:
    """TTFTs of sequential probes on an idle real fleet (tenant index 0), each awaited
    to its end before the next starts at its time."""
    loop = asyncio.get_running_loop()
    class_of = ["probe"] * len(wl.tenants)
    lives = lives_of(wl, probes, class_of)
    async with real_fleet(wl, doc, nats_url=nats_url, prefix=prefix, workers=workers,
                          spec=spec, log_dir=log_dir, notes=notes) as (fleet, client):
        await warm_up(client, lives)
        await fleet.wait_idle(10)
        gen = LoadGen(client, obs=_Null())
        t0 = loop.time()
        for lv in lives:
            delay = t0 + lv.arrival.t_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            await asyncio.wait_for(gen.request(lv), 30)
    return [(lv.t_first - lv.t_sub) * 1000 for lv in lives
            if lv.t_first is not None and lv.t_sub is not None]
