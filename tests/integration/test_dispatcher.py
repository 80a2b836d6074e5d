"""The dispatcher shell over a real nats-server, driven by a scripted worker peer.

The peer speaks the real wire protocol (pulls, events, chunks) so each test can place
a worker's death exactly before or after the first token.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from dispatcher.config import DispatcherSettings
from dispatcher.matching import WaitingPull
from dispatcher.service import Dispatcher
from fairlane.poolconfig import SchedulerConfig
from fairlane.protocol import (
    ErrorCode,
    Finished,
    Heartbeat,
    PullRequest,
    Started,
    TokenChunk,
    Usage,
    WorkItem,
    decode_chunk,
    decode_work_batch,
    encode,
)
from fairlane.runtime import mono_ms
from fairlane.subjects import REPLY_HEADER, Subjects
from producer.client import FairlaneClient, RequestError
from tests.helpers import request, spec, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


class ScriptedWorker:
    def __init__(self, nc, subjects: Subjects, pool: str, worker_id: str) -> None:
        self.nc, self.subjects, self.pool, self.worker_id = nc, subjects, pool, worker_id
        self.seqs: dict[str, int] = {}
        self.in_flight: set[str] = set()
        self._beat: asyncio.Task | None = None

    async def start(self) -> ScriptedWorker:
        """Heartbeat every 100 ms in the background, as a real worker does."""
        await self.heartbeat()

        async def beat() -> None:
            while not self.nc.is_closed:
                await asyncio.sleep(0.1)
                await self.heartbeat()

        self._beat = asyncio.create_task(beat())
        return self

    def die(self) -> None:
        """Go silent, like a worker killed with SIGKILL."""
        if self._beat:
            self._beat.cancel()

    async def pull(self, max_items: int = 8, wait_ms: int = 2000) -> list[WorkItem]:
        pull = PullRequest(worker_id=self.worker_id, pool=self.pool, max_items=max_items,
                           wait_ms=wait_ms)
        reply = await self.nc.request(self.subjects.work(self.pool), encode(pull),
                                      timeout=wait_ms / 1000 + 2)
        items = decode_work_batch(reply.data).items
        self.in_flight.update(i.request.request_id for i in items)
        return items

    async def event(self, ev) -> None:
        await self.nc.publish(self.subjects.events(self.pool), encode(ev))

    async def heartbeat(self, interval_ms: int = 100) -> None:
        await self.event(Heartbeat(worker_id=self.worker_id, pool=self.pool,
                                   in_flight_ids=sorted(self.in_flight), interval_ms=interval_ms))

    async def token(self, item: WorkItem, text: str, finish: str | None = None) -> None:
        rid = item.request.request_id
        seq = self.seqs.get(rid, 0)
        self.seqs[rid] = seq + 1
        if seq == 0:
            await self.event(Started(request_id=rid, worker_id=self.worker_id))
        usage = None
        if finish:
            usage = Usage(request_id=rid, tenant=item.request.tenant, pool=self.pool,
                          tier=item.request.tier, completion_tokens=seq + 1)
        await self.nc.publish(item.request.reply_to, encode(TokenChunk(
            request_id=rid, seq=seq, text=text, num_tokens=1, finish_reason=finish, usage=usage)))
        if finish:
            self.in_flight.discard(rid)
            await self.event(Finished(request_id=rid, worker_id=self.worker_id, usage=usage))


@pytest.fixture
async def env(nats_server, nc, uid):
    subjects = Subjects(f"t{uid}")
    settings = DispatcherSettings(
        nats_url=nats_server.url, prefix=subjects.prefix, pool="p", worker_timeout_ms=600,
        housekeeping_ms=50, max_tokens=512, ack_wait_s=5,
    )
    dispatcher = Dispatcher(settings, SchedulerConfig(policy="fifo"))
    await dispatcher.start()
    client = FairlaneClient(nc, prefix=subjects.prefix)
    await client.start()
    yield dispatcher, client, subjects
    for task in asyncio.all_tasks():
        if task.get_coro().__qualname__.startswith("ScriptedWorker"):
            task.cancel()
    await client.close()
    await dispatcher.stop()


async def _stream_len(js, subjects: Subjects) -> int:
    return (await js.stream_info(subjects.requests_stream)).state.messages


async def _stream_drained(js, subjects: Subjects) -> None:
    """Acks and terms are fire-and-forget publishes: wait for the server to apply them."""

    async def empty() -> bool:
        return await _stream_len(js, subjects) == 0

    await wait_until(empty, 5)


async def test_dispatch_ack_on_started_and_finish(env, nc):
    dispatcher, client, subjects = env
    w = ScriptedWorker(nc, subjects, "p", "w1")
    await w.start()
    stream = await client.submit(spec(tenant="acme", pool="p", prompt="hello", max_tokens=3))
    items = await w.pull()
    assert [i.request.request_id for i in items] == [stream.request_id]
    js = nc.jetstream()
    assert await _stream_len(js, subjects) == 1  # held un-acked while not started
    await w.token(items[0], "a")
    await w.token(items[0], "b")
    await w.token(items[0], "c", finish="stop")
    done = await stream.collect()
    assert done.text == "abc" and done.finish_reason == "stop"
    await wait_until(lambda: dispatcher.scheduler.num_in_flight == 0)
    await _stream_drained(js, subjects)  # acked on Started: never replayed


async def test_queued_work_is_spread_over_the_waiting_pulls(env, nc):
    """Three requests queued and two workers' pulls (slots free) waiting when the
    dispatcher serves: each worker gets work (2 + 1), not the first all three (their
    prefills in one step while the other engine idles). The pulls are placed as
    `_on_pull` places them, both before the serve: over the wire, whether the match
    loop runs between two pulls is up to the event loop."""
    dispatcher, client, subjects = env
    streams = [await client.submit(spec(tenant="acme", pool="p", prompt=f"hi {i}",
                                        max_tokens=3)) for i in range(3)]
    await wait_until(lambda: dispatcher.scheduler.num_queued == 3)
    subs = []
    for wid in ("w1", "w2"):
        await ScriptedWorker(nc, subjects, "p", wid).heartbeat()
        subs.append(await nc.subscribe(nc.new_inbox()))
    await wait_until(lambda: len(dispatcher.core.workers.workers) == 2)
    for wid, sub in zip(("w1", "w2"), subs, strict=True):
        pull = PullRequest(worker_id=wid, pool="p", max_items=8, free_slots=4)
        dispatcher._pulls.append(WaitingPull.of(pull, sub.subject, mono_ms() + 5_000))
    dispatcher._wake.set()
    got = [decode_work_batch((await sub.next_msg(timeout=5)).data).items for sub in subs]
    assert [len(items) for items in got] == [2, 1]
    assert sorted(i.request.request_id for items in got for i in items) == sorted(
        s.request_id for s in streams)


async def test_a_newer_pull_from_a_worker_replaces_its_waiting_one(env, nc):
    """A worker whose pull had no slot free sends a new one when a slot frees
    (`gpu_worker.pulling`). The dispatcher answers the old one empty at once, not at
    the end of its 30-s wait; the new one's free slot takes the next request, and once
    it is answered the dispatcher keeps nothing of either."""
    dispatcher, client, subjects = env
    w = ScriptedWorker(nc, subjects, "p", "w1")
    await w.start()

    async def pull(max_items: int, free_slots: int):
        return await nc.request(subjects.work("p"), encode(PullRequest(
            worker_id="w1", pool="p", max_items=max_items, free_slots=free_slots,
            wait_ms=30_000)), timeout=35)

    full = asyncio.create_task(pull(1, 0))
    await wait_until(lambda: len(dispatcher._pulls) == 1)
    t0 = mono_ms()
    free = asyncio.create_task(pull(1, 1))
    assert decode_work_batch((await asyncio.wait_for(full, 5)).data).items == []
    assert mono_ms() - t0 < 5_000
    assert [p.free_slots for p in dispatcher._pulls] == [1]
    stream = await client.submit(spec(tenant="acme", pool="p", prompt="hi", max_tokens=3))
    items = decode_work_batch((await asyncio.wait_for(free, 5)).data).items
    assert [i.request.request_id for i in items] == [stream.request_id]
    assert not dispatcher._pulls and not dispatcher._pull_of


@pytest.mark.parametrize(
    "body, code",
    [
        (b"\x00not json at all", ErrorCode.MALFORMED),
        (None, ErrorCode.MALFORMED),  # invalid tenant id in the body
        ({"max_tokens": 0}, ErrorCode.INVALID_REQUEST),
        ({"max_tokens": 100_000}, ErrorCode.INVALID_REQUEST),
        ({"prompt": "   "}, ErrorCode.INVALID_REQUEST),
        ({"tenant": "other"}, ErrorCode.INVALID_REQUEST),  # body/subject mismatch
    ],
)
async def test_bad_input_gets_clear_error_and_dispatcher_keeps_serving(env, nc, body, code):
    dispatcher, client, subjects = env
    js = nc.jetstream()
    rid = uuid.uuid4().hex
    reply = f"{client.inbox}.{rid}"
    fields = dict(request_id=rid, tenant="acme", pool="p", tier="standard",
                  reply_to=reply, prompt="hi", max_tokens=8)
    if isinstance(body, dict):
        data = encode(request(**{**fields, **body}))
    elif body is None:
        data = encode(request(**fields)).replace(b'"acme"', b'"bad tenant!"')
    else:
        data = body
    sub = await nc.subscribe(reply)
    await js.publish(subjects.request("p", "standard", "acme"), data,
                     headers={"Nats-Msg-Id": rid, REPLY_HEADER: reply})
    msg = await sub.next_msg(timeout=5)
    chunk = decode_chunk(msg.data)
    assert chunk.error is not None and chunk.error.code == code
    assert chunk.error.message
    # The refused message is gone (terminated), and a good request is still served.
    w = ScriptedWorker(nc, subjects, "p", "w-ok")
    await w.start()
    good = await client.submit(spec(tenant="acme", pool="p", prompt="hello", max_tokens=1))
    items = await w.pull()
    assert [i.request.request_id for i in items] == [good.request_id]
    await w.token(items[0], "x", finish="stop")
    assert (await good.collect()).text == "x"
    await _stream_drained(js, subjects)


async def test_duplicate_request_id_is_generated_once(env, nc):
    dispatcher, client, subjects = env
    js = nc.jetstream()
    rid = uuid.uuid4().hex
    req = request(request_id=rid, tenant="acme", pool="p", tier="standard",
                  reply_to=f"{client.inbox}.{rid}", prompt="hi", max_tokens=4)
    acks = [await js.publish(subjects.request("p", "standard", "acme"), encode(req),
                             headers={"Nats-Msg-Id": rid}) for _ in range(2)]
    assert acks[1].duplicate
    w = ScriptedWorker(nc, subjects, "p", "w1")
    await w.start()
    items = await w.pull()
    assert [i.request.request_id for i in items] == [rid]
    assert await w.pull(wait_ms=300) == []


async def test_worker_dies_before_first_token_request_goes_to_another(env, nc):
    dispatcher, client, subjects = env
    dead = ScriptedWorker(nc, subjects, "p", "w-dead")
    await dead.start()
    stream = await client.submit(spec(tenant="acme", pool="p", prompt="hello", max_tokens=1))
    items = await dead.pull()
    assert len(items) == 1
    dead.die()
    # A live worker asks and, once the death is noticed, gets the request.
    live = await ScriptedWorker(nc, subjects, "p", "w-live").start()
    got: list[WorkItem] = []
    async with asyncio.timeout(10):
        while not got:
            got = await live.pull(wait_ms=300)
    assert got[0].request.request_id == stream.request_id
    await live.token(got[0], "ok", finish="stop")
    assert (await stream.collect()).text == "ok"


async def test_worker_dies_after_first_token_client_gets_worker_lost(env, nc):
    dispatcher, client, subjects = env
    w = ScriptedWorker(nc, subjects, "p", "w-dies")
    await w.start()
    stream = await client.submit(spec(tenant="acme", pool="p", prompt="hello", max_tokens=5))
    items = await w.pull()
    await w.token(items[0], "a")
    w.die()
    chunks = []
    with pytest.raises(RequestError) as err:
        async for c in stream:
            chunks.append(c.text)
    assert chunks == ["a"]
    assert err.value.error.code == ErrorCode.WORKER_LOST and err.value.error.retryable
    await wait_until(lambda: dispatcher.scheduler.num_in_flight == 0)


async def test_cancel_queued_request(env, nc):
    dispatcher, client, subjects = env
    stream = await client.submit(spec(tenant="acme", pool="p", prompt="hello", max_tokens=5))
    await wait_until(lambda: dispatcher.scheduler.is_queued(stream.request_id))
    sub = await nc.subscribe(client.subjects.reply_subject(client.owner, "acme", stream.request_id))
    await stream.cancel("user")
    chunk = decode_chunk((await sub.next_msg(timeout=5)).data)
    assert chunk.error.code == ErrorCode.CANCELLED
    assert not dispatcher.scheduler.is_known(stream.request_id)
    await _stream_drained(nc.jetstream(), subjects)


async def test_expired_request_never_reaches_a_worker(env, nc):
    dispatcher, client, subjects = env
    from fairlane.runtime import now_ms

    stream = await client.submit(spec(tenant="acme", pool="p", prompt="hello", max_tokens=5,
                                      deadline_ms=now_ms() + 100))
    with pytest.raises(RequestError) as err:
        await stream.collect()
    assert err.value.error.code == ErrorCode.EXPIRED
    w = ScriptedWorker(nc, subjects, "p", "w1")
    await w.start()
    assert await w.pull(wait_ms=200) == []


TENANTS_YAML = """
tiers:
  - {name: paid, floor_share: 0.5}
  - {name: free}
pools:
  p: {policy: drr, allow_unknown_tenants: false, max_tokens: 64}
tenants:
  acme: {tier: paid, weight: 2}
"""


@pytest.fixture
async def tiered(nats_server, nc, uid, tmp_path):
    from fairlane.tenants import TenantsWatcher

    path = tmp_path / "tenants.yaml"
    path.write_text(TENANTS_YAML)
    subjects = Subjects(f"t{uid}")
    settings = DispatcherSettings(nats_url=nats_server.url, prefix=subjects.prefix, pool="p",
                                  housekeeping_ms=20)
    dispatcher = Dispatcher(settings, tenants=TenantsWatcher(path))
    dispatcher._reload_every_ms = 20
    await dispatcher.start()
    client = FairlaneClient(nc, prefix=subjects.prefix)
    await client.start()
    yield dispatcher, client, subjects, path
    await client.close()
    await dispatcher.stop()


async def test_tier_is_resolved_from_the_dispatcher_and_enforced(tiered, nc):
    dispatcher, client, subjects, _ = tiered
    stream = await client.submit(spec(tenant="acme", pool="p", prompt="hi", max_tokens=4))
    await wait_until(lambda: dispatcher.scheduler.is_queued(stream.request_id))
    assert dispatcher.scheduler.in_flight_request(stream.request_id) is None
    # The producer refuses a wrong tier, an unknown tenant, and the pool's own limit.
    for kwargs, code in [
        (dict(tenant="acme", tier="free"), ErrorCode.INVALID_REQUEST),
        (dict(tenant="nobody"), ErrorCode.UNKNOWN_TENANT),
        (dict(tenant="acme", max_tokens=65), ErrorCode.INVALID_REQUEST),
    ]:
        with pytest.raises(RequestError) as err:
            await client.submit(spec(pool="p", prompt="hi", **{"max_tokens": 4, **kwargs}))
        assert err.value.error.code == code
    # Published straight to NATS with a self-promoted tier: the dispatcher refuses it.
    rid = uuid.uuid4().hex
    reply = f"{client.inbox}.{rid}"
    sub = await nc.subscribe(reply)
    req = request(request_id=rid, tenant="acme", pool="p", tier="free",
                  reply_to=reply, prompt="hi", max_tokens=4)
    await nc.jetstream().publish(subjects.request("p", "free", "acme"), encode(req))
    chunk = decode_chunk((await sub.next_msg(timeout=5)).data)
    assert chunk.error.code == ErrorCode.INVALID_REQUEST and "tier 'paid'" in chunk.error.message


async def test_tenants_file_edit_applies_without_restart(tiered):
    dispatcher, client, subjects, path = tiered
    with pytest.raises(RequestError) as err:
        await client.submit(spec(tenant="globex", pool="p", prompt="hi", max_tokens=4))
    assert err.value.error.code == ErrorCode.UNKNOWN_TENANT
    path.write_text(TENANTS_YAML + "  globex: {tier: free}\n")
    await wait_until(lambda: dispatcher.scheduler.tenant_config("globex") is not None)
    client._info.clear()  # skip the producer's 10 s cache for the test
    stream = await client.submit(spec(tenant="globex", pool="p", prompt="hi", max_tokens=4))
    await wait_until(lambda: dispatcher.scheduler.is_queued(stream.request_id))


async def test_policy_override_holds_across_tenants_file_edits(nats_server, uid, tmp_path):
    """`--policy` is part of the one config resolution, so a reload keeps it and new
    weights apply (they used to be refused as "policy changed, restart")."""
    from fairlane.tenants import TenantsWatcher

    path = tmp_path / "tenants.yaml"
    path.write_text(TENANTS_YAML.replace("policy: drr", "policy: fifo"))
    settings = DispatcherSettings(nats_url=nats_server.url, prefix=f"t{uid}", pool="p",
                                  housekeeping_ms=20, policy="drr")
    dispatcher = Dispatcher(settings, tenants=TenantsWatcher(path))
    dispatcher._reload_every_ms = 20
    await dispatcher.start()
    try:
        assert dispatcher.scheduler.config.policy == "drr"
        assert dispatcher.scheduler.tenant_config("acme").weight == 2
        path.write_text(TENANTS_YAML.replace("policy: drr", "policy: fifo")
                        .replace("weight: 2", "weight: 5"))
        await wait_until(lambda: dispatcher.scheduler.tenant_config("acme").weight == 5, 5)
        assert dispatcher.scheduler.config.policy == "drr"
    finally:
        await dispatcher.stop()
