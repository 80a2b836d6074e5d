"""Stream provisioning against a real nats-server: create, then change only what is asked."""

from __future__ import annotations

import dataclasses

import pytest
from structlog.testing import capture_logs

from fairlane.streams import StreamSettings, ensure_streams
from fairlane.subjects import Subjects

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
