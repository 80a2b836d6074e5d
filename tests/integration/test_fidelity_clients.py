"""bench/fidelity_real.py's load generator as one client process per traffic class,
against a real fleet (nats-server, a dispatcher, a simulated worker): every class's
requests come back timed in one set of observations, its processes' CPU is counted
as load, and a client process that fails is a clear error with nothing left behind."""

from __future__ import annotations

import os

import pytest

from bench.fidelity_clients import ClientProcs
from bench.fidelity_load import Live
from bench.fidelity_obs import Observations
from bench.fidelity_real import CLIENT_LAYOUTS, PER_CLASS, run_real
from bench.fidelity_scenarios import class_of_tenants
from bench.fleet import WorkerSpec
from fleetsim.records import Arrival
from fleetsim.workload import load_workload

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

WINDOW_S = (0.0, 3.0)


def _doc() -> dict:
    def cls(name: str) -> dict:
        return {"name": name, "count": 1, "tier": "paid",
                "arrival": {"process": "poisson", "rate_per_s": 4},
                "prompt_tokens": {"dist": "fixed", "value": 16},
                "output_tokens": {"dist": "fixed", "value": 8}}
    return {"duration_s": WINDOW_S[1], "seed": 3, "pool": {"policy": "drr"},
            "tiers": [{"name": "paid", "floor_share": 0.5}],
            "classes": [cls("noisy"), cls("quiet")]}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("clients", CLIENT_LAYOUTS)
async def test_each_class_is_its_own_client_process_and_every_request_is_timed(
        nats_server, uid, tmp_path, clients):
    """Per class (the default) and shared (the earlier rig, `real-shared`): the same
    requests, timed the same way; only where the clients run differs."""
    doc = _doc()
    wl = load_workload(doc)
    arrivals = list(wl.arrivals())
    assert {a.tenant for a in arrivals} == {0, 1}  # both classes have traffic
    obs = Observations(*WINDOW_S)
    diag = await run_real(
        wl, doc, arrivals, class_of_tenants(wl), obs, run_s=WINDOW_S[1] + 10,
        nats_url=nats_server.url, nats_pid=None, prefix=f"fc{uid}", workers=1,
        spec=WorkerSpec(max_num_seqs=8, prefetch_seqs=2, time_scale=1.0, heartbeat_ms=500),
        log_dir=tmp_path, notes=[], clients=clients)
    assert diag["clients"] == clients and diag["errors"] == 0
    for cls in ("noisy", "quiet"):
        n = sum(1 for a in arrivals if class_of_tenants(wl)[a.tenant] == cls)
        assert obs.arrived[cls] == n  # the parent's view: merged from that class's process
        assert len(obs.ttft_s[cls]) == n and len(obs.e2e_s[cls]) == n
        assert all(0 < t < 5 for t in obs.ttft_s[cls])
        assert 0 < obs.tokens[cls] <= 8 * n  # tokens generated inside the window
        assert len(obs.tpot_s[cls]) == n  # every stream read to its end (8 tokens)
        # Where each TTFT went, from its Usage (none is preempted here): the worker's
        # part and the queue's are inside the client's TTFT.
        assert len(obs.split_s[cls]) == n
        for ttft, queue, worker in obs.split_s[cls]:
            assert 0 <= queue < ttft and 0 < worker < ttft and queue + worker < ttft
    cpu = diag["cpu_cores"]
    if clients == PER_CLASS:
        assert {"client:noisy", "client:quiet"} <= set(cpu)
        assert cpu["clients"] >= cpu["client:noisy"] + cpu["client:quiet"] - 0.002  # rounding
    else:
        assert not [k for k in cpu if k.startswith("client:")]
        assert cpu["clients"] == cpu["bench"]  # the one client is this process
    assert diag["lag_max_ms"] is not None and diag["lag_max_ms"] < 1000


async def test_a_client_process_that_fails_is_a_clear_error_and_is_reaped():
    # Nothing listens on port 1: the client's connect fails in its own process.
    obs = Observations(*WINDOW_S)
    lives = [Live("quiet", "t0", "paid", Arrival(0.1, 0, 8, 8, 8))]
    clients = ClientProcs()
    clients.start(lives, obs, "nats://127.0.0.1:1", "fcdead", run_s=5.0)
    try:
        with pytest.raises(RuntimeError, match="client quiet"):
            await clients.ready()
    finally:
        clients.stop()
    for p in clients.procs.values():
        assert p.exitcode is not None and not _alive(p.pid)
