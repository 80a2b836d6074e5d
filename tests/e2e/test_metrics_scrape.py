"""Every process of a real `fairlane up` serves /metrics (the streamer's behind the
tenants file's admin key), says where, and the text is valid: parsed by
prometheus_client and linted clean by `promtool check metrics` on every endpoint (the
test is skipped, saying so, only where the binary is missing: `apt-get install
prometheus`; under CI it fails instead). After traffic through every entry path
(producer library, HTTP, websocket) and a few refusals: the workers' per-tenant token
counters add up to exactly what the clients received, the dispatcher has TTFT and
queue wait per tier and per tenant, and the streamer counts refusals by tenant and
reason."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import urllib.error
import urllib.request
from collections import defaultdict

import pytest
from prometheus_client.parser import text_string_to_metric_families

from producer.client import FairlaneClient
from tests.helpers import spec, wait_until
from tests.procs import start_fairlane_up

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

METRICS_LINE = re.compile(r"^\s+([\w-]+)\s+(http://127\.0\.0\.1:\d+/metrics)\s*$", re.M)
ADMIN_KEY = "sk-admin-demo"  # fairlane/demo_tenants.yaml: the streamer's /metrics wants it


def _scrape(url: str, key: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    req = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(req, timeout=5) as resp:  # noqa: S310 - loopback
        assert resp.status == 200
        return resp.read().decode()


def _samples(text: str, name: str) -> dict[str, float]:
    """{tenant: value} of one per-tenant sample name in an exposition text."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[s.labels["tenant"]] = out.get(s.labels["tenant"], 0) + s.value
    return out


def _promtool_problems(text: str) -> str | None:
    """What `promtool check metrics` finds in `text` ("" if clean); None: no promtool."""
    promtool = shutil.which("promtool")
    if promtool is None:
        # CI installs it (.ci/run): there, a missing binary must not pass unchecked.
        assert not os.environ.get("CI"), "promtool missing (apt-get install prometheus)"
        return None
    res = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                         text=True, timeout=30)
    return "" if res.returncode == 0 and not res.stdout.strip() else res.stdout + res.stderr


async def _ws_request(ws_url: str, key: str, prompt: str, max_tokens: int) -> dict:
    """One request over the websocket; its end frame's usage."""
    import websockets

    async with websockets.connect(ws_url, additional_headers={
            "Authorization": f"Bearer {key}"}) as ws:
        await ws.send(json.dumps({"type": "request", "id": "m1", "prompt": prompt,
                                  "max_tokens": max_tokens}))
        while True:
            frame = json.loads(await asyncio.wait_for(ws.recv(), 30))
            assert frame["type"] in ("accepted", "token", "end"), frame
            if frame["type"] == "end":
                return frame["usage"]


async def test_every_process_serves_valid_metrics_that_match_what_clients_got(tmp_path):
    proc, out = await start_fairlane_up(tmp_path / "fl")
    try:
        urls = dict(METRICS_LINE.findall(out))
        assert {"dispatcher", "worker-0", "worker-1", "streamer"} <= set(urls), out
        assert f"Bearer {ADMIN_KEY}" in out  # up says the streamer's /metrics wants the key
        nats_url = re.search(r"NATS: (nats://127.0.0.1:\d+)", out).group(1)
        http = re.search(r"(http://127.0.0.1:\d+/v1)", out).group(1)

        got: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        creds = tmp_path / "fl" / "nats-auth" / "credentials"
        for tenant, n in (("acme", 3), ("globex", 2)):
            client = await FairlaneClient.connect(
                nats_url, tenant=tenant, user=tenant,
                password=(creds / f"{tenant}.password").read_text().strip())
            streams = [await client.submit(spec(tenant=tenant, prompt=f"hello {i} " * (i + 1),
                                                max_tokens=6 + i)) for i in range(n)]
            for done in await asyncio.gather(*(s.collect() for s in streams)):
                assert done.finish_reason in ("stop", "length")
                got[tenant]["prompt"] += done.usage.prompt_tokens
                got[tenant]["completion"] += done.usage.completion_tokens
                got[tenant]["cached"] += done.usage.cached_prompt_tokens
            await client.close()
        # Another entry path: the OpenAI-compatible edge (it reports no cached tokens).
        from openai import AsyncOpenAI

        sdk = AsyncOpenAI(base_url=http, api_key="sk-globex-demo", max_retries=0)
        reply = await sdk.completions.create(model="default", prompt="hi there", max_tokens=5)
        got["globex"]["prompt"] += reply.usage.prompt_tokens
        got["globex"]["completion"] += reply.usage.completion_tokens
        # And the websocket (its end frame reports no cached tokens either).
        ws_url = http.replace("http://", "ws://").removesuffix("/v1") + "/v1/stream"
        usage = await _ws_request(ws_url, "sk-acme-demo", "over the socket", 4)
        got["acme"]["prompt"] += usage["prompt_tokens"]
        got["acme"]["completion"] += usage["completion_tokens"]
        # Refusals at the edge: an unknown model (globex's), a key nobody has.
        from openai import AuthenticationError, NotFoundError

        with pytest.raises(NotFoundError):
            await sdk.completions.create(model="no-such-pool", prompt="x", max_tokens=1)
        await sdk.close()
        bad = AsyncOpenAI(base_url=http, api_key="sk-nobody", max_retries=0)
        with pytest.raises(AuthenticationError):
            await bad.completions.create(model="default", prompt="x", max_tokens=1)
        await bad.close()

        def fleet_sum(sample: str) -> dict[str, float]:
            total: dict[str, float] = defaultdict(float)
            for name in ("worker-0", "worker-1"):
                for tenant, v in _samples(_scrape(urls[name]), sample).items():
                    total[tenant] += v
            return total

        # Usage is counted as the worker publishes it, just after the last chunk.
        want = {t: float(v["completion"]) for t, v in got.items()}
        await wait_until(lambda: fleet_sum("fairlane_worker_completion_tokens_total") == want,
                         15, 0.2)
        assert fleet_sum("fairlane_worker_prompt_tokens_total") == {
            t: float(v["prompt"]) for t, v in got.items()}
        assert fleet_sum("fairlane_worker_cached_prompt_tokens_total")["acme"] == float(
            got["acme"]["cached"])

        num_started = 0.0
        linted = True
        for name, url in urls.items():
            key = ADMIN_KEY if name == "streamer" else None
            text = _scrape(url, key)
            families = {f.name: f for f in text_string_to_metric_families(text)}
            ours = [n for n in families if n.startswith("fairlane_")]
            assert ours, f"{name}: no fairlane_ series"
            problems = _promtool_problems(text)
            linted = linted and problems is not None
            assert not problems, f"{name}: {problems}"
            # Every process watches its own event loop (fairlane.looplag) every 0.25 s.
            # Once, under CI's load, the streamer's had no sample yet at this point: wait
            # for one (a watcher that never samples still fails here).
            role = "worker" if name.startswith("worker") else name
            lag_count = f"fairlane_{role}_event_loop_lag_seconds_count"

            def lag_sampled(url=url, lag_count=lag_count, key=key) -> bool:
                return any(s.name == lag_count and s.value >= 1
                           for f in text_string_to_metric_families(_scrape(url, key))
                           for s in f.samples)

            try:
                await wait_until(lag_sampled, 10, 0.1)
            except TimeoutError:
                pytest.fail(f"{name}: no event-loop lag sample in 10 s")
            if name.startswith("worker"):
                started = families["fairlane_worker_requests_started"]
                # Per worker it depends on who pulled what; over the fleet, every one.
                num_started += sum(s.value for s in started.samples
                                   if s.name.endswith("_total"))
                assert families["fairlane_worker_kv_tokens_capacity"].samples[0].value > 0
                assert "fairlane_worker_engine_step_seconds" in families
            elif name == "dispatcher":
                assert "fairlane_dispatcher_queue_wait_seconds" in families
                # TTFT and queue wait per tenant, every entry path: 4 acme, 3 globex.
                for series, want_n in (("fairlane_dispatcher_tenant_ttft_seconds_count",
                                        {"acme": 4, "globex": 3}),
                                       ("fairlane_dispatcher_tenant_queue_wait_seconds_count",
                                        {"acme": 4, "globex": 3})):
                    # At least: a preempted or requeued one is dispatched again.
                    n = _samples(text, series)
                    assert all(n.get(t, 0) >= v for t, v in want_n.items()), (series, n)
                ttft = families["fairlane_dispatcher_ttft_seconds"]  # per tier
                num_ttft = sum(s.value for s in ttft.samples if s.name.endswith("_count"))
                assert num_ttft >= 7, num_ttft
            elif name == "streamer":
                assert "fairlane_streamer_requests" in families
                outcomes = {(s.labels["tenant"], s.labels["outcome"]): s.value
                            for s in families["fairlane_streamer_requests"].samples
                            if s.name.endswith("_total")}
                assert outcomes[("globex", "model_not_found")] == 1, outcomes
                assert outcomes[("_unknown", "unauthorized")] == 1, outcomes
                assert outcomes[("acme", "accepted")] == 1, outcomes  # the websocket one
                relayed = _samples(text, "fairlane_streamer_tokens_relayed_total")
                assert relayed["acme"] == usage["completion_tokens"], relayed
                for key in (None, "sk-acme-demo"):  # no key, a tenant's key: 401
                    with pytest.raises(urllib.error.HTTPError) as refused:
                        _scrape(url, key)
                    assert refused.value.code == 401
        # 3 acme + 2 globex through the producer, 1 globex through the HTTP edge, 1 acme
        # through the websocket (a preempted one would start again: at least).
        assert num_started >= 7, num_started

        proc.send_signal(signal.SIGINT)
        rest = await asyncio.to_thread(proc.communicate, timeout=60)
        assert proc.returncode == 0, out + rest[0]
        if not linted:
            pytest.skip("promtool is not installed (apt-get install prometheus): every "
                        "other check passed, but no endpoint was linted")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
