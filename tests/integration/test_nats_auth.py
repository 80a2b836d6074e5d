"""Per-tenant NATS credentials on a real nats-server (issue 13; BENCHMARKS.md's auth
matrix names these tests).

One nats-server with the authorization `fairlane nats-config` writes, a dispatcher
and a simulated worker logged in as their service users, and two tenants, alpha and
beta, each with its own NATS user. Every refusal must reach the client as a clear
permission error (never a timeout), and the fleet must go on serving the other tenant.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import nats
import pytest

from dispatcher.config import DispatcherSettings
from dispatcher.service import Dispatcher
from fairlane.embedded import NatsServer
from fairlane.errors import ErrorCode
from fairlane.natsauth import service_user, write_nats_auth
from fairlane.natsconn import permission_watch
from fairlane.poolconfig import SchedulerConfig
from fairlane.protocol import (
    Cancel,
    InferenceRequest,
    SamplingParams,
    decode_pool_stats,
    encode,
)
from fairlane.subjects import Subjects
from gpu_worker.config import WorkerSettings
from gpu_worker.engines import make_engine
from gpu_worker.service import Worker
from producer.auth import open_connection
from producer.client import FairlaneClient, RequestError
from tests.helpers import spec, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

POOL = "p"
TENANTS = ("alpha", "beta")


@pytest.fixture(scope="module")
def auth(tmp_path_factory):
    """(server, subjects, passwords): a nats-server that admits only nats-config's users."""
    subjects = Subjects(f"a{uuid.uuid4().hex[:8]}")
    out = tmp_path_factory.mktemp("nats-auth")
    passwords = write_nats_auth(list(TENANTS), out, subjects.prefix)
    server = NatsServer(auth_conf=str(out / "auth.conf")).start()
    yield server, subjects, passwords
    server.stop()


@pytest.fixture(scope="module")
async def fleet(auth):
    """A dispatcher and one simulated worker, logged in as their service users."""
    server, subjects, pw = auth
    d_user, w_user = service_user("dispatcher"), service_user("worker")
    dispatcher = Dispatcher(
        DispatcherSettings(nats_url=server.url, prefix=subjects.prefix, pool=POOL,
                           nats_user=d_user, nats_password=pw[d_user]),
        SchedulerConfig(policy="drr"))
    await dispatcher.start()
    assert dispatcher.reply_scoped()  # auth on: reply subjects are checked ("auto")
    ws = WorkerSettings(nats_url=server.url, prefix=subjects.prefix, pool=POOL,
                        worker_id="w-auth", time_scale=0.1, max_num_seqs=8, heartbeat_ms=200,
                        nats_user=w_user, nats_password=pw[w_user])
    stop = asyncio.Event()
    worker = Worker(ws, make_engine(ws))
    task = asyncio.create_task(worker.run(stop))
    yield dispatcher, worker
    stop.set()
    assert await asyncio.wait_for(task, 30) == 0
    await dispatcher.stop()


async def _client(auth, tenant: str) -> FairlaneClient:
    server, subjects, pw = auth
    return await FairlaneClient.connect(server.url, prefix=subjects.prefix, tenant=tenant,
                                        user=tenant, password=pw[tenant])


async def _raw(auth, user: str) -> nats.NATS:
    """A bare connection as `user` (what a hostile tenant could write itself)."""
    server, subjects, pw = auth
    return await open_connection(server.url, prefix=subjects.prefix,
                                 tenant=None if user.startswith("svc-") else user,
                                 user=user, password=pw[user])


async def _denied(nc: nats.NATS, op: str, subject: str) -> str:
    """The permission error the server sent this connection for (op, subject)."""
    watch = permission_watch(nc)
    await nc.flush(timeout=2)

    def seen() -> bool:
        return watch.last is not None and (watch.last.op, watch.last.subject) == (
            op, subject.lower())

    await wait_until(seen, timeout_s=3)
    return str(watch.last)


def _collect(into: list):
    async def cb(msg) -> None:
        into.append(msg)
    return cb


def _long(tenant: str, n: int = 60):
    return spec(tenant=tenant, pool=POOL, prompt="hi", max_tokens=n, expected_output_tokens=n)


async def test_each_tenant_is_served_with_its_own_credentials(auth, fleet):
    alpha, beta = await _client(auth, "alpha"), await _client(auth, "beta")
    try:
        done = await asyncio.gather(*(c.submit(_long(t, 8)) for c, t in
                                      ((alpha, "alpha"), (beta, "beta"))))
        results = await asyncio.gather(*(s.collect() for s in done))
        assert [r.usage.completion_tokens for r in results] == [8, 8]
        # The reply subject carries the tenant: the broker tells the streams apart.
        assert alpha.subjects.reply_subject(alpha.owner, "alpha", "x").split(".")[3] == "alpha"
    finally:
        await alpha.close()
        await beta.close()


async def test_a_wrong_password_is_refused(auth):
    server, subjects, _ = auth
    with pytest.raises(nats.errors.Error, match="(?i)authorization"):
        await nats.connect(server.url, user="alpha", password="not-it", allow_reconnect=False,
                           max_reconnect_attempts=0, connect_timeout=2)


async def test_tenant_cannot_publish_a_request_as_another_tenant(auth, fleet):
    """The library refuses at once; the broker refuses too, and the library reports
    that as `unauthorized` naming the subject, in well under JetStream's timeout."""
    alpha = await _client(auth, "alpha")
    beta = await _client(auth, "beta")
    try:
        with pytest.raises(RequestError) as local:
            await alpha.submit(_long("beta"))
        assert local.value.code == ErrorCode.UNAUTHORIZED
        # A client that does not know it is alpha's: the broker itself refuses.
        nc = await _raw(auth, "alpha")
        rogue = FairlaneClient(nc, prefix=alpha.subjects.prefix, owns_connection=True)
        await rogue.start(provision_streams=False)
        t0 = time.monotonic()
        with pytest.raises(RequestError) as refused:
            await rogue.submit(spec(tenant="beta", pool=POOL, tier="standard", prompt="hi",
                                    max_tokens=4))
        assert time.monotonic() - t0 < 2.0
        assert refused.value.code == ErrorCode.UNAUTHORIZED
        assert f"{alpha.subjects.prefix}.req.{POOL}.standard.beta".lower() in str(refused.value)
        await rogue.close()
        # Meanwhile beta is served.
        assert (await (await beta.submit(_long("beta", 4))).collect()).usage.completion_tokens == 4
    finally:
        await alpha.close()
        await beta.close()


async def test_tenant_cannot_read_another_tenants_tokens(auth, fleet):
    _, subjects, _ = auth
    beta = await _client(auth, "beta")
    spy = await _raw(auth, "alpha")
    try:
        got: list = []
        await spy.subscribe(f"{subjects.prefix}.inbox.*.beta.>", cb=_collect(got))
        err = await _denied(spy, "subscription", f"{subjects.prefix}.inbox.*.beta.>")
        assert "permissions violation" in err.lower()
        # Not even with a wider wildcard (tenant alpha may read alpha's inboxes only).
        await spy.subscribe(f"{subjects.prefix}.inbox.>", cb=_collect(got))
        await _denied(spy, "subscription", f"{subjects.prefix}.inbox.>")
        await spy.subscribe("_INBOX.>", cb=_collect(got))
        await _denied(spy, "subscription", "_INBOX.>")
        done = await (await beta.submit(_long("beta", 6))).collect()
        assert done.usage.completion_tokens == 6
        await spy.flush()
        assert got == []
    finally:
        await spy.close()
        await beta.close()


async def test_tenant_cannot_cancel_another_tenants_request(auth, fleet):
    _, subjects, _ = auth
    beta = await _client(auth, "beta")
    spy = await _raw(auth, "alpha")
    try:
        stream = await beta.submit(_long("beta", 150))
        chunks = stream.__aiter__()
        await chunks.__anext__()  # running on the worker now
        rid = stream.request_id
        bad = Cancel(request_id=rid, tenant="beta", reason="hostile")
        # 1. On beta's cancel subject: the broker refuses.
        await spy.publish(subjects.cancel(POOL, "beta"), encode(bad))
        await _denied(spy, "publish", subjects.cancel(POOL, "beta"))
        # 2. On the tenant-less (services') subject: refused too.
        await spy.publish(subjects.cancel(POOL), encode(bad))
        await _denied(spy, "publish", subjects.cancel(POOL))
        # 3. On alpha's own subject, naming beta's request: the broker lets it through,
        #    and the dispatcher and the worker ignore it (the subject says alpha).
        await spy.publish(subjects.cancel(POOL, "alpha"), encode(bad))
        await spy.flush()
        last = None
        async for chunk in chunks:
            last = chunk
        assert last.finish_reason == "length" and last.usage.completion_tokens == 150
        # beta's own cancel still works.
        other = await beta.submit(_long("beta", 400))
        other_chunks = other.__aiter__()
        await other_chunks.__anext__()
        await other.cancel("user")
        worker = fleet[1]
        await wait_until(lambda: other.request_id not in worker._reqs, timeout_s=5)
    finally:
        await spy.close()
        await beta.close()


@pytest.mark.parametrize("suffix", ["work.p", "evt.p", "preempt.p", "usage.beta", "usage.alpha",
                                    "inbox.x.beta.r1", "req.p.standard.beta", "stats.p"])
async def test_tenant_cannot_publish_to_service_subjects(auth, fleet, suffix):
    _, subjects, _ = auth
    spy = await _raw(auth, "alpha")
    try:
        subject = f"{subjects.prefix}.{suffix}"
        await spy.publish(subject, b"{}")
        err = await _denied(spy, "publish", subject)
        assert subject.lower() in err.lower()
    finally:
        await spy.close()


async def test_pool_stats_reach_the_streamer_and_no_tenant(auth, fleet):
    """The dispatcher (svc-dispatcher) publishes its pool's stats snapshot; the
    streamer's service user reads it (the admin dashboard); a tenant may neither read
    nor forge it, and the streamer may not forge it either."""
    _, subjects, _ = auth
    streamer = await _raw(auth, service_user("streamer"))
    alpha = await _raw(auth, "alpha")
    try:
        got: list = []
        arrived = asyncio.Event()

        async def on_stats(msg) -> None:
            got.append(decode_pool_stats(msg.data))
            arrived.set()

        await streamer.subscribe(subjects.stats_all(), cb=on_stats)
        await asyncio.wait_for(arrived.wait(), 10)  # published every second
        assert got[0].pool == POOL and got[0].epoch == fleet[0].epoch
        await alpha.subscribe(subjects.stats_all(), cb=_collect([]))
        await _denied(alpha, "subscription", subjects.stats_all())
        await streamer.publish(subjects.stats(POOL), b"{}")
        await _denied(streamer, "publish", subjects.stats(POOL))
    finally:
        await streamer.close()
        await alpha.close()


async def test_tenant_cannot_use_the_jetstream_api(auth, fleet):
    _, subjects, _ = auth
    spy = await _raw(auth, "alpha")
    try:
        subject = f"$JS.API.STREAM.DELETE.{subjects.requests_stream}"
        await spy.publish(subject, b"")
        await _denied(spy, "publish", subject)
    finally:
        await spy.close()


async def test_worker_cannot_publish_requests_or_cancels(auth, fleet):
    _, subjects, _ = auth
    nc = await _raw(auth, service_user("worker"))
    try:
        for subject in (subjects.request(POOL, "standard", "beta"), subjects.cancel(POOL, "beta")):
            await nc.publish(subject, b"{}")
            await _denied(nc, "publish", subject)
    finally:
        await nc.close()


async def test_reply_subject_outside_the_tenants_inbox_is_refused(auth, fleet):
    """alpha may publish on its own request subject, but not aim the tokens at beta's
    inbox: the dispatcher drops the request (terminated, no tokens anywhere)."""
    server, subjects, pw = auth
    watcher = await _raw(auth, "beta")
    alpha = await _raw(auth, "alpha")
    admin = await nats.connect(server.url, user=service_user("admin"),
                               password=pw[service_user("admin")])
    try:
        got: list = []
        await watcher.subscribe(f"{subjects.prefix}.inbox.*.beta.>", cb=_collect(got))
        await watcher.flush()
        rid = uuid.uuid4().hex
        req = InferenceRequest(request_id=rid, tenant="alpha", pool=POOL, tier="standard",
                               reply_to=f"{subjects.prefix}.inbox.o1.beta.{rid}", prompt="hi",
                               sampling=SamplingParams(max_tokens=4), created_ms=0)
        subject = subjects.request(POOL, "standard", "alpha")
        await alpha.jetstream().publish(subject, encode(req), headers={"Nats-Msg-Id": rid})
        js = admin.jetstream()

        async def gone() -> bool:
            info = await js.stream_info(subjects.requests_stream, subjects_filter=subject)
            return not (info.state.subjects or {}).get(subject)

        await wait_until(gone, timeout_s=10, interval_s=0.1)
        await asyncio.sleep(0.5)
        await watcher.flush()
        assert got == []
        assert not fleet[0].core.is_known(rid)
    finally:
        for c in (watcher, alpha, admin):
            await c.close()


async def test_usage_export_logs_in_as_the_operator_and_a_tenant_may_not(auth, fleet):
    server, subjects, pw = auth
    alpha = await _client(auth, "alpha")
    try:
        await (await alpha.submit(_long("alpha", 3))).collect()
    finally:
        await alpha.close()

    def usage(user: str):
        import os
        import subprocess
        import sys

        return subprocess.run(
            [sys.executable, "-m", "fairlane.cli", "usage", "--since", "-1h", "--format", "json",
             "--nats-url", server.url, "--prefix", subjects.prefix, "--nats-user", user],
            env={**os.environ, "FAIRLANE_NATS_PASSWORD": pw[user]}, capture_output=True,
            text=True, timeout=30)

    ok = await asyncio.to_thread(usage, service_user("admin"))
    assert ok.returncode == 0, ok.stderr
    assert "alpha" in ok.stdout
    refused = await asyncio.to_thread(usage, "alpha")  # a tenant may not read FL_USAGE
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
