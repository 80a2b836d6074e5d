"""Revoking an API key by editing the tenants file while the streamer runs: the key
works, the file is edited to remove it, and within the reload interval it gets 401.

Real streamer (uvicorn), real nats-server and Redis; the fleet behind the edge is
`streamer.testing.FakeFleet` (the thing under test is the edge's key lookup)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from fairlane.subjects import Subjects
from fairlane.tenants import hash_api_key
from streamer.app import create_app
from streamer.config import StreamerSettings
from streamer.testing import FakeFleet, serve_app

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

KEY = "sk-test-revoke-me"
OTHER = "sk-test-stays"


def _yaml(keys: dict[str, str]) -> str:
    tenants = "\n".join(f'  {t}: {{tier: paid, api_keys: ["{hash_api_key(k)}"]}}'
                        for t, k in keys.items())
    return f"tiers:\n  - {{name: paid}}\npools:\n  default: {{}}\ntenants:\n{tenants}\n"


async def _complete(http: httpx.AsyncClient, url: str, key: str) -> httpx.Response:
    return await http.post(url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                           json={"model": "default", "prompt": "n=2", "max_tokens": 4})


async def test_removed_key_gets_401_within_reload_interval(nats_server, redis_server, nc,
                                                           uid, tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(_yaml({"alpha": KEY, "gamma": OTHER}))
    prefix = f"t{uid}"
    reload_s = 0.5
    settings = StreamerSettings(nats_url=nats_server.url, prefix=prefix,
                                redis_url=redis_server.url, tenants_file=str(path),
                                settler_durable=f"settler{uid}", tenants_reload_s=reload_s)
    async with FakeFleet(nc, Subjects(prefix)), \
            serve_app(create_app(settings), ws_max_size=settings.max_body_bytes) as url, \
            httpx.AsyncClient(timeout=20) as http:
        ok = await _complete(http, url, KEY)
        assert ok.status_code == 200, ok.text
        path.write_text(_yaml({"gamma": OTHER}))
        edited = asyncio.get_running_loop().time()
        status = None
        for _ in range(100):  # bounded: polls an external file reload
            status = (await _complete(http, url, KEY)).status_code
            if status == 401:
                break
            await asyncio.sleep(0.05)
        assert status == 401
        # One reload interval plus the file's mtime granularity and scheduling slack.
        assert asyncio.get_running_loop().time() - edited < reload_s + 2.0
        still = await _complete(http, url, OTHER)
        assert still.status_code == 200, still.text
