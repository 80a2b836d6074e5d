"""The admin dashboard on a real nats-server: a dispatcher publishing its stats
snapshot, a simulated worker, the streamer serving /dashboard, /dashboard/data and
/metrics behind the tenants file's admin key, and two tenants sending load through it.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import httpx
import pytest

from dispatcher.config import DispatcherSettings
from dispatcher.service import Dispatcher
from fairlane.protocol import PoolStats, decode_pool_stats
from fairlane.subjects import Subjects
from fairlane.tenants import TenantsWatcher, hash_api_key
from gpu_worker.config import WorkerSettings
from gpu_worker.engines import make_engine
from gpu_worker.service import Worker
from streamer.app import create_app
from streamer.config import StreamerSettings
from streamer.dashboard import COOKIE
from streamer.testing import serve_app
from tests.helpers import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

POOL = "p"
KEY_ALPHA, KEY_BETA, KEY_ADMIN = "sk-dash-alpha", "sk-dash-beta", "sk-dash-admin"


def tenants_yaml() -> str:
    return f"""
tiers:
  - {{name: paid, floor_share: 0.5}}
  - {{name: free}}
pools:
  {POOL}: {{policy: drr, cost_model: requests, preemption: {{enabled: false}}}}
tenants:
  alpha: {{tier: paid, weight: 2, api_keys: ["{hash_api_key(KEY_ALPHA)}"]}}
  beta: {{tier: paid, weight: 1, api_keys: ["{hash_api_key(KEY_BETA)}"]}}
admin:
  api_keys: ["{hash_api_key(KEY_ADMIN)}"]
"""


@dataclass
class Fleet:
    url: str
    subjects: Subjects
    dispatcher: Dispatcher


@contextlib.asynccontextmanager
async def dashboard_fleet(nats_url: str, uid: str, tmp_path, *, max_num_seqs: int = 2,
                          time_scale: float = 0.5):
    """Dispatcher (stats every 0.2 s) + one simulated worker + the streamer, all in this
    event loop on their own prefix; yields a `Fleet`. Stops all of it after."""
    path = tmp_path / "tenants.yaml"
    path.write_text(tenants_yaml())
    subjects = Subjects(f"d{uid}")
    dispatcher = Dispatcher(
        DispatcherSettings(nats_url=nats_url, prefix=subjects.prefix, pool=POOL,
                           tenants_file=str(path), stats_interval_s=0.2),
        tenants=TenantsWatcher(path))
    await dispatcher.start()
    ws = WorkerSettings(nats_url=nats_url, prefix=subjects.prefix, pool=POOL,
                        worker_id=f"w-{uid}", time_scale=time_scale, max_num_seqs=max_num_seqs,
                        heartbeat_ms=200)
    stop = asyncio.Event()
    worker_task = asyncio.create_task(Worker(ws, make_engine(ws)).run(stop))
    settings = StreamerSettings(nats_url=nats_url, prefix=subjects.prefix, redis_url="",
                                tenants_file=str(path), usage_settler=False, pool=POOL)
    try:
        async with serve_app(create_app(settings)) as url:
            yield Fleet(url, subjects, dispatcher)
    finally:
        stop.set()
        assert await asyncio.wait_for(worker_task, 30) == 0
        await dispatcher.stop()


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _pool(http: httpx.AsyncClient) -> dict | None:
    r = await http.get("/dashboard/data", headers=_bearer(KEY_ADMIN))
    assert r.status_code == 200, r.text
    pools = {p["stats"]["pool"]: p for p in r.json()["pools"]}
    return pools.get(POOL)


async def test_dashboard_data_shows_both_tenants_under_load(nats_server, uid, tmp_path):
    async with dashboard_fleet(nats_server.url, uid, tmp_path, time_scale=1.0) as fleet, \
            httpx.AsyncClient(base_url=fleet.url, timeout=60) as http:

        async def send(key: str, i: int) -> int:
            r = await http.post("/v1/completions", headers=_bearer(key), json={
                "model": POOL, "prompt": f"hello {i}", "max_tokens": 80})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["completion_tokens"]

        load = [asyncio.create_task(send(k, i)) for i in range(10) for k in (KEY_ALPHA, KEY_BETA)]
        seen: dict = {}

        async def both_busy() -> bool:
            pool = await _pool(http)
            if pool is None:
                return False
            rows = {t["tenant"]: t for t in pool["stats"]["tenants"]}
            busy = {name for name, t in rows.items()
                    if t["num_queued"] > 0 and t["num_in_flight"] > 0 and t["share"] > 0}
            seen.update(pool=pool, rows=rows)
            return busy == {"alpha", "beta"}

        # Two slots, twenty requests of up to 80 tokens: both tenants have work waiting
        # and running for several seconds, many 0.2 s stats snapshots (with twelve
        # 40-token requests a contended CI run once saw no snapshot with both queued).
        try:
            await wait_until(both_busy, timeout_s=30, interval_s=0.1)
        except TimeoutError:
            raise AssertionError(f"never both busy; last tenants seen: {seen.get('rows')}") \
                from None
        pool, rows = seen["pool"], seen["rows"]
        stats = pool["stats"]
        assert not pool["stale"] and pool["age_s"] < 2
        assert (stats["policy"], stats["cost_model"], stats["num_workers"]) == (
            "drr", "requests", 1)
        assert stats["num_in_flight"] >= 2 and stats["num_queued"] > 0
        assert stats["num_tenants_active"] == 2
        alpha, beta = rows["alpha"], rows["beta"]
        assert (alpha["tier"], alpha["weight"], beta["weight"]) == ("paid", 2.0, 1.0)
        tiers = {t["tier"]: t for t in stats["tiers"]}
        assert list(tiers) == ["paid", "free"]  # every tier, highest first
        assert tiers["paid"]["share"] == pytest.approx(1.0) and tiers["free"]["share"] == 0
        assert tiers["paid"]["floor_share"] == 0.5 and tiers["paid"]["num_tenants_active"] == 2
        assert tiers["paid"]["num_queued"] == alpha["num_queued"] + beta["num_queued"]
        # Both active in one tier: its whole share split 2:1 by weight.
        assert alpha["fair_share"] == pytest.approx(2 / 3, abs=1e-3)
        assert beta["fair_share"] == pytest.approx(1 / 3, abs=1e-3)
        assert alpha["share"] + beta["share"] == pytest.approx(1.0, abs=1e-3)
        assert alpha["queue_wait_p50_ms"] is not None and alpha["num_rejected"] == 0

        done = await asyncio.gather(*load)
        assert len(done) == 20 and all(0 < n <= 80 for n in done)

        async def measured() -> bool:
            pool = await _pool(http)
            rows = {t["tenant"]: t for t in pool["stats"]["tenants"]}
            return all(rows[t]["ttft_p99_ms"] is not None and rows[t]["num_in_flight"] == 0
                       for t in ("alpha", "beta"))

        await wait_until(measured, timeout_s=10, interval_s=0.1)
        pool = await _pool(http)
        for t in pool["stats"]["tenants"]:
            assert t["ttft_p50_ms"] >= t["queue_wait_p50_ms"] >= 0
            assert t["ttft_p99_ms"] >= t["ttft_p50_ms"] and t["fair_share"] == 0  # idle now
        paid = pool["stats"]["tiers"][0]
        assert paid["queue_wait_p99_ms"] >= paid["queue_wait_p50_ms"] > 0


async def test_dispatcher_publishes_pool_stats_on_nats(nats_server, nc, uid, tmp_path):
    async with dashboard_fleet(nats_server.url, uid, tmp_path) as fleet:
        got: asyncio.Queue[PoolStats] = asyncio.Queue()

        async def on_stats(msg) -> None:
            got.put_nowait(decode_pool_stats(msg.data))

        sub = await nc.subscribe(fleet.subjects.stats(POOL), cb=on_stats)
        first = await asyncio.wait_for(got.get(), 5)
        second = await asyncio.wait_for(got.get(), 5)
        await sub.unsubscribe()
        assert first.pool == second.pool == POOL and second.ts_ms >= first.ts_ms
        assert first.epoch == fleet.dispatcher.epoch > 0
        assert [t.tier for t in first.tiers] == ["paid", "free"] and first.tenants == []


async def test_admin_endpoints_want_the_admin_key_and_no_tenant_key(nats_server, uid, tmp_path):
    async with dashboard_fleet(nats_server.url, uid, tmp_path) as fleet, \
            httpx.AsyncClient(base_url=fleet.url, timeout=10) as http:
        for path in ("/dashboard/data", "/metrics", "/dashboard"):
            for headers in ({}, _bearer(KEY_ALPHA), _bearer("sk-nothing"), {"Authorization": "Bearer"},
                            {"Authorization": f"Basic {KEY_ADMIN}"}):
                r = await http.get(path, headers=headers)
                assert r.status_code == 401, (path, headers, r.text)
                assert r.headers["www-authenticate"] == "Bearer"
            r = await http.get(path, headers=_bearer(KEY_ADMIN))
            assert r.status_code == 200, (path, r.text)
        r = await http.get("/dashboard/data")
        assert r.json()["error"]["code"] == "unauthorized" and "admin key" in r.text
        r = await http.get("/metrics", headers=_bearer(KEY_ADMIN))
        assert "fairlane_streamer_" in r.text
        # A tenant key is not an admin key, and the admin key is no tenant's.
        r = await http.get("/dashboard?key=" + KEY_BETA)
        assert r.status_code == 401 and COOKIE not in r.headers.get("set-cookie", "")
        r = await http.post("/v1/completions", headers=_bearer(KEY_ADMIN),
                            json={"model": POOL, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 401

    # A browser: ?key= once, then the HttpOnly cookie (for /dashboard only).
    async with dashboard_fleet(nats_server.url, uid + "b", tmp_path) as fleet, \
            httpx.AsyncClient(base_url=fleet.url, timeout=10) as browser:
        r = await browser.get("/dashboard?key=" + KEY_ADMIN)
        assert r.status_code == 303 and r.headers["location"] == "/dashboard"
        cookie = r.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie and "path=/dashboard" in cookie
        page = await browser.get("/dashboard")
        assert page.status_code == 200 and "fairlane" in page.text
        assert "<script src" not in page.text and "http" not in page.text.split("<body")[1]
        assert (await browser.get("/dashboard/data")).status_code == 200
        assert (await browser.get("/metrics")).status_code == 401  # the cookie's path
        browser.cookies.set(COOKIE, KEY_ALPHA, path="/dashboard")
        assert (await browser.get("/dashboard/data")).status_code == 401
