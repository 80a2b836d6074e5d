"""Stream provisioning against a real nats-server: create, then change only what is asked."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time

import nats
import pytest
from structlog.testing import capture_logs

from fairlane.embedded import NatsServer
from fairlane.streams import TRANSIENT_ERRORS, StreamSettings, ensure_streams
from fairlane.subjects import Subjects
from tests.helpers import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]


async def test_new_streams_get_the_settings_asked_for(nc, uid):
    js, subjects = nc.jetstream(), Subjects(f"t{uid}")
    await ensure_streams(js, subjects, StreamSettings(
        requests_max_age_s=600, requests_max_bytes=1 << 20, usage_max_age_s=3600,
        usage_max_bytes=2 << 20, max_queued_per_tenant=7))
    req = (await js.stream_info(subjects.requests_stream)).config
    usage = (await js.stream_info(subjects.usage_stream)).config
    assert (req.max_age, req.max_bytes, req.max_msgs_per_subject) == (600, 1 << 20, 7)
    assert (usage.max_age, usage.max_bytes) == (3600, 2 << 20)
    assert req.num_replicas == usage.num_replicas == 1
    assert req.duplicate_window == usage.duplicate_window == 120


async def test_a_default_start_leaves_an_existing_streams_settings_alone(nc, uid):
    js, subjects = nc.jetstream(), Subjects(f"t{uid}")
    await ensure_streams(js, subjects)
    # An operator tunes the stream by hand (nats CLI) ...
    cfg = (await js.stream_info(subjects.requests_stream)).config
    await js.update_stream(dataclasses.replace(cfg, max_msgs_per_subject=5, max_bytes=4096))
    # ... and the next process to start, with default settings, keeps that.
    with capture_logs() as logs:
        await ensure_streams(js, subjects, StreamSettings())
    cfg = (await js.stream_info(subjects.requests_stream)).config
    assert (cfg.max_msgs_per_subject, cfg.max_bytes) == (5, 4096)
    assert not [e for e in logs if e["event"] == "stream_updated"]


async def test_an_explicit_setting_changes_only_that_field_and_is_logged(nc, uid):
    js, subjects = nc.jetstream(), Subjects(f"t{uid}")
    await ensure_streams(js, subjects, StreamSettings(max_queued_per_tenant=5))
    with capture_logs() as logs:
        await ensure_streams(js, subjects, StreamSettings(usage_max_age_s=600))
    usage = (await js.stream_info(subjects.usage_stream)).config
    req = (await js.stream_info(subjects.requests_stream)).config
    assert usage.max_age == 600
    assert req.max_msgs_per_subject == 5  # not asked this time: kept
    updates = [e for e in logs if e["event"] == "stream_updated"]
    assert len(updates) == 1 and updates[0]["stream"] == subjects.usage_stream
    assert list(updates[0]["changes"]) == ["max_age"]


async def test_a_service_waits_until_jetstream_answers_then_creates_the_streams(uid):
    subjects = Subjects(f"t{uid}")
    # Takes connections, but nothing answers the JetStream API: a cluster node whose
    # JetStream leader is still being elected, as far as a client can tell.
    bare = NatsServer(jetstream=False).start()
    server = None
    try:
        nc = await nats.connect(bare.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        try:
            with capture_logs() as logs:
                task = asyncio.create_task(
                    ensure_streams(nc.jetstream(), subjects, patience_s=math.inf))
                # Until its first try has failed (a log line: no event to await).
                await wait_until(
                    lambda: any(e["event"] == "jetstream_not_answering" for e in logs), 10)
                assert not task.done()  # still waiting, not failed
                # JetStream comes: the same address, now with it.
                bare.stop()
                server = NatsServer(port=bare.port).start()
                await asyncio.wait_for(task, 20)
            js = nc.jetstream()
            assert (await js.stream_info(subjects.requests_stream)).config.name
            assert (await js.stream_info(subjects.usage_stream)).config.name
        finally:
            await nc.close()
    finally:
        bare.stop()
        if server is not None:
            server.stop()


async def test_without_patience_the_caller_is_told_at_once(uid):
    bare = NatsServer(jetstream=False).start()
    try:
        nc = await nats.connect(bare.url)
        try:
            js, subjects = nc.jetstream(), Subjects(f"t{uid}")
            t0 = time.monotonic()
            with pytest.raises(TRANSIENT_ERRORS):
                await ensure_streams(js, subjects)  # a producer's call: no retry
            assert time.monotonic() - t0 < 6.0  # at most one API timeout
            with capture_logs() as logs:
                with pytest.raises(TRANSIENT_ERRORS):  # bounded patience: it ends too
                    await ensure_streams(js, subjects, patience_s=1.0)
            tries = [e for e in logs if e["event"] == "jetstream_not_answering"]
            assert 1 <= len(tries) <= 3
        finally:
            await nc.close()
    finally:
        bare.stop()
