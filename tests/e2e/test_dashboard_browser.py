"""The admin dashboard in a real browser against a real `fairlane up`: headless
Debian `chromium` opens /dashboard?key=<admin key> (cookie, redirect, the page's own
script polling /dashboard/data) while tenants send load through the HTTP edge; the
rendered DOM must hold their rows, and a screenshot is kept in tests/artifacts/.

Needs the `chromium` binary (`apt-get install chromium`; .ci/run installs it). Without
it this test FAILS, it does not skip: a dashboard nobody looked at is not tested.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
from pathlib import Path

import httpx
import pytest

from tests.helpers import wait_until
from tests.procs import start_fairlane_up

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"  # .gitignore'd
ADMIN_KEY = "sk-admin-demo"  # fairlane/demo_tenants.yaml
LOAD = {"sk-acme-demo": 6, "sk-globex-demo": 6, "sk-hobbyist-demo": 2}  # key -> concurrency


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    pytest.fail("chromium is not installed: the dashboard's browser test needs it "
                "(apt-get install -y --no-install-recommends chromium; .ci/run does)")


async def _browse(profile: Path, url: str, *args: str) -> str:
    """Run headless chromium on `url` until its virtual time budget (5 s of page time,
    network waits excluded) is spent; returns its stdout. Killed if it hangs."""
    proc = await asyncio.create_subprocess_exec(
        _chromium(), "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars",
        "--no-first-run", f"--user-data-dir={profile}", "--window-size=1280,900",
        "--virtual-time-budget=5000", *args, url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 90)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the browser's helpers too
        await proc.wait()
        raise
    assert proc.returncode == 0, err.decode()[-2000:]
    return out.decode()


async def _keep_busy(base: str, key: str, concurrency: int, stop: asyncio.Event) -> int:
    """Keep `concurrency` requests of one tenant going until `stop`; returns how many
    were served (some may be refused by the tenant's rate limit: that is fine)."""
    served = 0
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        async def one() -> None:
            nonlocal served
            while not stop.is_set():
                r = await http.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                                    json={"model": "default", "prompt": "tell me a story",
                                          "max_tokens": 300})
                served += r.status_code == 200
                if r.status_code == 429:
                    await asyncio.sleep(0.2)  # noqa: ASYNC110 - back off a rate limit
        await asyncio.gather(*(one() for _ in range(concurrency)))
    return served


async def _listening(base: str) -> bool:
    """The streamer answers (`fairlane up` may say "up" a moment before it listens)."""
    try:
        async with httpx.AsyncClient(base_url=base, timeout=2) as http:
            return (await http.get("/healthz")).status_code == 200
    except httpx.TransportError:
        return False


async def test_dashboard_renders_tenant_rows_in_a_real_browser(tmp_path):
    _chromium()  # fail first, before starting a fleet, if there is no browser
    proc, out = await start_fairlane_up(tmp_path / "fl")
    stop = asyncio.Event()
    load: list[asyncio.Task] = []
    try:
        base = re.search(r"(http://127.0.0.1:\d+)/v1", out).group(1)
        await wait_until(lambda: _listening(base), timeout_s=30, interval_s=0.1)
        load = [asyncio.create_task(_keep_busy(base, k, n, stop)) for k, n in LOAD.items()]
        async with httpx.AsyncClient(base_url=base, timeout=10) as http:
            async def all_shown() -> bool:
                r = await http.get("/dashboard/data",
                                   headers={"Authorization": f"Bearer {ADMIN_KEY}"})
                assert r.status_code == 200, r.text
                rows = {t["tenant"] for p in r.json()["pools"] for t in p["stats"]["tenants"]}
                return {"acme", "globex", "hobbyist"} <= rows

            await wait_until(all_shown, timeout_s=30, interval_s=0.2)

        # The page as a browser renders it, after its script fetched the data.
        url = f"{base}/dashboard?key={ADMIN_KEY}"
        dom = await _browse(tmp_path / "chrome-dom", url, "--dump-dom")
        for tenant in ("acme", "globex", "hobbyist"):
            assert f'data-tenant="{tenant}"' in dom, dom[-3000:]
        for tier in ("enterprise", "paid", "free"):
            assert f'data-tier="{tier}"' in dom
        assert re.search(r'id="status"[^>]*>updated ', dom), dom[:3000]

        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "dashboard.png"
        shot.unlink(missing_ok=True)
        await _browse(tmp_path / "chrome-shot", url, f"--screenshot={shot}")
        data = shot.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
        print(f"dashboard screenshot: {shot}")

        # Without the key: the sign-in form, no figures.
        dom = await _browse(tmp_path / "chrome-anon", f"{base}/dashboard", "--dump-dom")
        assert 'name="key"' in dom and "data-tenant" not in dom

        stop.set()
        served = await asyncio.wait_for(asyncio.gather(*load), 60)
        assert all(n > 0 for n in served), served
        proc.send_signal(signal.SIGINT)
        rest = await asyncio.to_thread(proc.communicate, timeout=60)
        assert proc.returncode == 0, out + rest[0]
    finally:
        stop.set()
        for t in load:
            t.cancel()
        await asyncio.gather(*load, return_exceptions=True)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
