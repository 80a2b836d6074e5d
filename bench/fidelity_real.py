"""The real fleet of bench/fidelity.py: a dispatcher and simulator workers behind a
loopback nats-server (`bench.fleet`), and a load generator that submits a workload's
arrivals at their times with the producer library and times every stream.

TTFT is the client's: first token chunk minus the moment the arrival's submit began
(so a late generator shows as lag, reported, not as TTFT). CPU seconds of every fleet
process (/proc/<pid>/stat), of the clients and of the whole machine are read around
the run: a CPU-starved fleet steps slower than its model, which is the first thing
that separates it from the simulator.

Clients (`CLIENT_LAYOUTS`): by default each traffic class is its own client process
(its own connection and event loop; `bench/fidelity_clients.py`), as different tenants'
clients are in production; the load generator itself is `bench/fidelity_load.py`.
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
import os
import statistics
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import yaml

from bench.fidelity_clients import ClientProcs
from bench.fidelity_load import Live, LoadGen, NullObservations, lives_of, warm_up
from bench.fleet import Fleet, WorkerSpec
from fleetsim.records import Arrival
from fleetsim.workload import Workload
from producer.client import FairlaneClient

POOL = "default"
# One client process per traffic class (the default), or one client for all in this
# process (the rig before per-class clients; see the module docstring).
PER_CLASS, SHARED = "per-class", "shared"
CLIENT_LAYOUTS = (PER_CLASS, SHARED)
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
                     spec: WorkerSpec, log_dir: Path, notes: list[str],
                     with_client: bool = True,
                     ) -> AsyncIterator[tuple[Fleet, FairlaneClient | None]]:
    """A started fleet and (`with_client`) a connected client; both stopped on the way
    out, however it is left (the client first: it cancels its open streams upstream)."""
    fleet = Fleet(nats_url, prefix, yaml.safe_dump(tenants_doc(wl, doc)),
                  wl.scheduler_config.policy, log_dir, num_workers=workers, worker=spec,
                  pool=POOL)
    LIVE_FLEETS[id(fleet)] = fleet
    client, started = None, False
    try:
        await fleet.start()
        started = True
        if with_client:
            client = await FairlaneClient.connect(nats_url, prefix=prefix,
                                                  max_buffered_chunks=4096)
        yield fleet, client
    finally:
        if client is not None:
            try:
                await asyncio.wait_for(client.close(), 15)
            except Exception as exc:  # noqa: BLE001 - the fleet must still be stopped
                notes.append(f"{prefix}: client.close failed: {exc!r}")
        if started:
            # Let the cancels (this client's, or the client processes') land first: a
            # worker told to stop drains by finishing what it runs (seconds at these
            # lengths), past the stop's grace period.
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


async def _busy_sampler(fleet: Fleet, obs: Any, t0: float, out: list[int]) -> None:
    """The fleet's running sequences (heartbeats) once a second inside the window."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(1.0)
        if obs.in_window(loop.time() - t0):
            out.append(sum(hb.load.num_running for hb in fleet.heartbeats.values()))


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
                          spec=spec, log_dir=log_dir, notes=notes,
                          with_client=clients == SHARED) as (fleet, client):
        pids = fleet_pids(fleet, nats_pid)
        if client is None:  # PER_CLASS: the client processes connect on their own
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
            await gen.run_window(lives, t0, run_s)
            cpu = cpu_usage(cpu0, cpu_snapshot(pids))
            sampler.cancel()
            lag, errors = await gen.finish()
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
        assert client is not None
        await warm_up(client, lives)
        await fleet.wait_idle(10)
        gen = LoadGen(client, obs=NullObservations())
        t0 = loop.time()
        for lv in lives:
            delay = t0 + lv.arrival.t_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            await asyncio.wait_for(gen.request(lv), 30)
    return [(lv.t_first - lv.t_sub) * 1000 for lv in lives
            if lv.t_first is not None and lv.t_sub is not None]


async def message_hop_ms(nats_url: str, n: int = 200) -> list[float]:
    """One dispatcher<->worker message's time on this rig, for the simulator's
    `network_ms`: half of each core-NATS request-reply round trip between two
    connections of this (idle) process, through the loopback nats-server."""
    asker, answerer = await nats.connect(nats_url), await nats.connect(nats_url)
    try:
        subject = f"fl.bench.hop.{os.getpid()}"

        async def echo(msg: Any) -> None:
            await msg.respond(msg.data)

        await answerer.subscribe(subject, cb=echo)
        await answerer.flush()
        payload = b"x" * 256  # about a dispatch's size
        for _ in range(10):  # warm: the first round trips set up the reply subscription
            await asker.request(subject, payload, timeout=5)
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            await asker.request(subject, payload, timeout=5)
            out.append((time.perf_counter() - t0) * 1000 / 2)
        return out
    finally:
        for nc in (asker, answerer):
            with contextlib.suppress(Exception):
                await nc.close()
