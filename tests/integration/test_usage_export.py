"""`fairlane usage` against a real nats-server: the usage records a real worker
publishes, and hand-made records (published as the worker does, with Nats-Msg-Id)
whose finish times straddle the period's edges."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import subprocess
import sys

import pytest
from nats.js.api import DiscardPolicy

from fairlane.embedded import free_port
from fairlane.protocol import Usage, encode
from fairlane.runtime import now_ms
from fairlane.streams import USAGE_MAX_AGE_S, USAGE_MAX_MSGS, StreamSettings, ensure_streams
from fairlane.subjects import Subjects
from fairlane.usage_export import COLUMNS, cmd_usage, format_time, read_usage
from tests.helpers import in_process_fleet, spec, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

MINUTE_MS = 60_000


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """The command as an operator runs it: a separate process."""
    return subprocess.run([sys.executable, "-m", "fairlane.cli", "usage", *args],
                          capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items()
                               if not k.startswith("FAIRLANE_")})


async def stream_count(js, subjects: Subjects) -> int:
    return (await js.stream_info(subjects.usage_stream)).state.messages


async def test_totals_of_a_real_workers_usage_records(nats_server, nc, uid):
    async with in_process_fleet(nats_server.url, nc, uid, time_scale=0.05) as (client, subjects):
        since = now_ms()
        plan = {"acme": [3, 5, 7], "globex": [2]}  # tenant -> max_tokens of each request
        # expected_output_tokens: the simulator's natural length, else random (1 +
        # Exp(mean 128)) and a short one ends with "stop" before max_tokens.
        streams = [(tenant, await client.submit(spec(tenant=tenant, pool="p", prompt="hello",
                                                     max_tokens=n, expected_output_tokens=n)))
                   for tenant, sizes in plan.items() for n in sizes]
        done = {tenant: [] for tenant in plan}
        for tenant, stream in streams:
            done[tenant].append((await asyncio.wait_for(stream.collect(), 30)).usage)
        js = nc.jetstream()
        # The worker publishes usage in the background, after the last chunk.
        await wait_until(lambda: _has(js, subjects, 4), timeout_s=10)
        report = await read_usage(js, subjects, since - MINUTE_MS, now_ms() + MINUTE_MS)

    rows = {t.tenant: t for t in report.totals}
    assert sorted(rows) == ["acme", "globex"]
    for tenant, usages in done.items():
        row = rows[tenant]
        assert row.pool == "p"
        assert row.num_requests == len(usages)
        assert row.completion_tokens == sum(plan[tenant]) == sum(
            u.completion_tokens for u in usages)
        assert row.prompt_tokens == sum(u.prompt_tokens for u in usages) > 0
        assert row.kv_token_seconds == pytest.approx(sum(u.kv_token_seconds for u in usages))
        assert row.kv_token_seconds > 0
        assert row.first_ts_ms == min(u.ts_ms for u in usages)
        assert row.last_ts_ms == max(u.ts_ms for u in usages)

    # The same numbers from the command, run as its own process.
    out = run_cli("--nats-url", nats_server.url, "--prefix", subjects.prefix,
                  "--since", format_time(since - MINUTE_MS), "--until", "now", "--format", "json")
    assert out.returncode == 0, out.stderr
    by_tenant = {r["tenant"]: r for r in json.loads(out.stdout)["rows"]}
    assert {t: r["completion_tokens"] for t, r in by_tenant.items()} == {"acme": 15, "globex": 2}
    assert by_tenant["acme"]["num_requests"] == 3


async def _has(js, subjects: Subjects, n: int) -> bool:
    return await stream_count(js, subjects) >= n


@pytest.fixture
async def records(nc, uid):
    """Hand-made records around a period [t0 - 1h, t0), published like the worker's."""
    subjects = Subjects(f"t{uid}")
    js = nc.jetstream()
    await ensure_streams(js, subjects)
    t0 = (now_ms() // 1000) * 1000

    def usage(rid: str, tenant: str, pool: str, ts_ms: int, n: int) -> Usage:
        return Usage(request_id=rid, tenant=tenant, pool=pool, tier="paid", worker_id="w",
                     prompt_tokens=10 * n, completion_tokens=n, cached_prompt_tokens=n // 2,
                     num_recomputed_tokens=n, kv_token_seconds=0.5 * n, finish_reason="stop",
                     ts_ms=ts_ms)

    made = [
        usage("r-early", "acme", "p", t0 - 2 * 60 * MINUTE_MS, 100),  # before the period
        usage("r-1", "acme", "p", t0 - 60 * MINUTE_MS, 1),  # on `since`: inside
        usage("r-2", "acme", "p", t0 - 30 * MINUTE_MS, 2),
        usage("r-3", "acme", "q", t0 - 20 * MINUTE_MS, 4),
        usage("r-4", "globex", "p", t0 - 10 * MINUTE_MS, 8),
        usage("r-edge", "globex", "p", t0, 1000),  # on `until`: outside
    ]
    for u in made:
        await js.publish(subjects.usage(u.tenant), encode(u),
                         headers={"Nats-Msg-Id": u.request_id})
    # A retried publish of r-2 is a duplicate the stream drops: billed once.
    await js.publish(subjects.usage("acme"), encode(made[2]), headers={"Nats-Msg-Id": "r-2"})
    # Something that is not a Usage on a usage subject: skipped, and said so.
    await js.publish(subjects.usage("acme"), b"not json", headers={"Nats-Msg-Id": "junk"})
    return subjects, t0


async def test_period_edges_and_filters(nc, records):
    subjects, t0 = records
    js = nc.jetstream()
    since, until = t0 - 60 * MINUTE_MS, t0
    report = await read_usage(js, subjects, since, until)
    got = {(t.tenant, t.pool): (t.num_requests, t.prompt_tokens, t.completion_tokens,
                                t.cached_prompt_tokens, t.recomputed_tokens, t.kv_token_seconds)
           for t in report.totals}
    assert got == {("acme", "p"): (2, 30, 3, 1, 3, 1.5),
                   ("acme", "q"): (1, 40, 4, 2, 4, 2.0),
                   ("globex", "p"): (1, 80, 8, 4, 8, 4.0)}
    assert report.num_undecodable == 1
    acme_p = report.totals[0]
    assert (acme_p.first_ts_ms, acme_p.last_ts_ms) == (since, t0 - 30 * MINUTE_MS)

    only = await read_usage(js, subjects, since, until, tenant="globex")
    assert [(t.tenant, t.num_requests) for t in only.totals] == [("globex", 1)]
    assert only.num_undecodable == 0  # the junk is on acme's subject: never read
    only = await read_usage(js, subjects, since, until, pool="q")
    assert [(t.tenant, t.pool) for t in only.totals] == [("acme", "q")]
    wide = await read_usage(js, subjects, t0 - 3 * 60 * MINUTE_MS, t0 + 1)
    assert sum(t.num_requests for t in wide.totals) == 6
    assert (await read_usage(js, subjects, t0 + MINUTE_MS, t0 + 2 * MINUTE_MS)).totals == []


async def test_csv_and_json_output(nats_server, records, capsys):
    subjects, t0 = records
    common = ["--nats-url", nats_server.url, "--prefix", subjects.prefix,
              "--since", format_time(t0 - 60 * MINUTE_MS), "--until", format_time(t0)]
    # In-process (the function `fairlane usage` runs), on a thread: it runs its own loop.
    assert await asyncio.to_thread(cmd_usage, [*common, "--format", "csv"]) == 0
    captured = capsys.readouterr()
    rows = list(csv.DictReader(io.StringIO(captured.out)))
    assert tuple(rows[0]) == COLUMNS
    assert [(r["tenant"], r["pool"], r["num_requests"], r["completion_tokens"]) for r in rows] \
        == [("acme", "p", "2", "3"), ("acme", "q", "1", "4"), ("globex", "p", "1", "8")]
    assert rows[0]["first_record_at"] == format_time(t0 - 60 * MINUTE_MS)
    assert "skipped 1 record" in captured.err

    out = run_cli(*common, "--format", "json", "--tenant", "acme")
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert body["since"] == format_time(t0 - 60 * MINUTE_MS) and body["until"] == format_time(t0)
    assert body["tenant"] == "acme" and body["pool"] is None
    assert [(r["pool"], r["num_requests"], r["prompt_tokens"], r["kv_token_seconds"])
            for r in body["rows"]] == [("p", 2, 30, 1.5), ("q", 1, 40, 2.0)]
    assert set(body["rows"][0]) == set(COLUMNS)

    # Relative times, the way an operator types them (a value starting with '-').
    out = run_cli("--nats-url", nats_server.url, "--prefix", subjects.prefix,
                  "--since", "-7d", "--tenant", "globex")
    assert out.returncode == 0, out.stderr
    assert [r["num_requests"] for r in csv.DictReader(io.StringIO(out.stdout))] == ["2"]


async def test_unreachable_nats_or_missing_stream_is_exit_1(nats_server, uid):
    out = run_cli("--nats-url", f"nats://127.0.0.1:{free_port()}", "--since", "-1h")
    assert out.returncode == 1 and "cannot reach NATS" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    out = run_cli("--nats-url", nats_server.url, "--prefix", f"none{uid}", "--since", "-1h")
    assert out.returncode == 1 and f"NONE{uid.upper()}_USAGE" in out.stderr
    out = run_cli("--nats-url", nats_server.url, "--since", "yesterday")
    assert out.returncode == 2 and "--since" in out.stderr


async def test_usage_stream_is_bounded_by_default(nc, uid):
    js = nc.jetstream()
    subjects = Subjects(f"t{uid}")
    await ensure_streams(js, subjects)
    cfg = (await js.stream_info(subjects.usage_stream)).config
    assert cfg.max_age == USAGE_MAX_AGE_S == 90 * 86_400
    assert cfg.max_msgs == USAGE_MAX_MSGS and cfg.discard == DiscardPolicy.OLD
    await ensure_streams(js, subjects, StreamSettings(usage_max_msgs=1000))
    assert (await js.stream_info(subjects.usage_stream)).config.max_msgs == 1000


async def test_a_period_the_stream_already_dropped_is_flagged(nats_server, nc, uid):
    js, subjects = nc.jetstream(), Subjects(f"t{uid}")
    await ensure_streams(js, subjects, StreamSettings(usage_max_msgs=3))
    t0 = now_ms()
    for i in range(5):  # the first two are dropped by the count bound
        u = Usage(request_id=f"r{i}", tenant="acme", pool="p", tier="paid",
                  completion_tokens=1, ts_ms=t0 - (5 - i) * MINUTE_MS)
        await js.publish(subjects.usage("acme"), encode(u), headers={"Nats-Msg-Id": u.request_id})
    report = await read_usage(js, subjects, t0 - 10 * MINUTE_MS, t0)
    assert report.totals[0].num_requests == 3
    assert report.incomplete_before_ms == t0 - 3 * MINUTE_MS
    # A period that starts after the oldest record kept is complete.
    assert (await read_usage(js, subjects, t0 - 2 * MINUTE_MS, t0)).incomplete_before_ms is None
    out = run_cli("--nats-url", nats_server.url, "--prefix", subjects.prefix,
                  "--since", format_time(t0 - 10 * MINUTE_MS), "--format", "json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["incomplete_before"] == format_time(t0 - 3 * MINUTE_MS)
    assert "no longer holds records finished before" in out.stderr
