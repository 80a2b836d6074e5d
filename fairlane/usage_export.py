"""`fairlane usage`: per-tenant (and pool) usage totals from FL_USAGE, for billing.

    fairlane usage --since 2026-11-01 --until 2026-12-01 --format csv > november.csv
    fairlane usage --since -1h --tenant acme --format json

FL_USAGE holds one `fairlane.protocol.Usage` record per finished request (published by
the worker with ``Nats-Msg-Id`` = request id, so a retried publish is stored once). A
record belongs to the period [since, until) by its own ``ts_ms`` (when the request
finished), not by when JetStream stored it: a publish may be retried for seconds, and a
boundary record must land in exactly one of two adjacent exports.

The read is an ephemeral pull consumer that starts by time (``by_start_time``) a little
before ``since`` and stops a little after ``until``, at the last record stored when the
export began, or at the end of the stream, whichever comes first; so an export over a
live stream ends, and repeating it over a past period gives the same numbers (while
the stream's limits still keep that period: the report says when they do not).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import io
import json
import os
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, NoReturn

import nats
import nats.errors
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from fairlane.natsconn import connect_options, server_urls
from fairlane.protocol import ID_PATTERN, ProtocolError, Usage, decode_usage
from fairlane.runtime import now_ms
from fairlane.subjects import DEFAULT_PREFIX, Subjects

PROG = "fairlane usage"
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
# How far JetStream's store time may trail (publish retries, ~13 s worst case) or lead
# (clock skew between worker and server) a record's own ts_ms. The read starts and
# stops this far outside the period, so no record of the period is missed; records
# outside it are read and not counted.
STORE_SLACK_MS = 5 * 60_000
FETCH_BATCH = 512
COLUMNS = ("tenant", "pool", "num_requests", "prompt_tokens", "completion_tokens",
           "cached_prompt_tokens", "recomputed_tokens", "kv_token_seconds", "first_record_at",
           "last_record_at")
_ID_RE = re.compile(ID_PATTERN)
_RELATIVE_RE = re.compile(r"^(?:now)?-(\d+(?:\.\d+)?)([smhdw])$")
_UNIT_MS = {"s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000}


@dataclass(slots=True)
class UsageQuery:
    """What `fairlane usage` was asked for (its flags, times still as given)."""

    since: str
    until: str = "now"
    tenant: str = ""  # empty: every tenant
    pool: str = ""  # empty: every pool
    format: Literal["csv", "json"] = "csv"
    nats_url: str = DEFAULT_NATS_URL
    prefix: str = DEFAULT_PREFIX
    connect_timeout_s: float = 5.0
    # With NATS auth on: an operator's user (fairlane nats-config's svc-admin) may read it.
    nats_user: str = ""
    nats_password: str = ""
    nats_password_file: str = ""
    nats_tls_ca_file: str = ""


class UsageArgsError(ValueError):
    """A bad argument; the message is one line naming it."""


class UsageReadError(RuntimeError):
    """NATS unreachable or the usage stream missing; one line."""


@dataclass(slots=True)
class UsageTotals:
    """One (tenant, pool)'s sums over the period."""

    tenant: str
    pool: str
    num_requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    # Prefill recomputed to resume preempted or migrated requests: the platform's cost,
    # which the record says is not billed (a column of its own, for billing to decide).
    recomputed_tokens: int = 0
    kv_token_seconds: float = 0.0
    first_ts_ms: int = 0
    last_ts_ms: int = 0

    def add(self, u: Usage) -> None:
        self.num_requests += 1
        self.prompt_tokens += u.prompt_tokens
        self.completion_tokens += u.completion_tokens
        self.cached_prompt_tokens += u.cached_prompt_tokens
        self.recomputed_tokens += u.num_recomputed_tokens
        self.kv_token_seconds += u.kv_token_seconds
        self.first_ts_ms = min(self.first_ts_ms or u.ts_ms, u.ts_ms)
        self.last_ts_ms = max(self.last_ts_ms, u.ts_ms)

    def row(self) -> dict[str, Any]:
        return {"tenant": self.tenant, "pool": self.pool, "num_requests": self.num_requests,
                "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "cached_prompt_tokens": self.cached_prompt_tokens,
                "recomputed_tokens": self.recomputed_tokens,
                "kv_token_seconds": round(self.kv_token_seconds, 3),
                "first_record_at": format_time(self.first_ts_ms),
                "last_record_at": format_time(self.last_ts_ms)}


@dataclass(slots=True)
class UsageReport:
    since_ms: int
    until_ms: int
    tenant: str | None
    pool: str | None
    totals: list[UsageTotals]  # sorted by (tenant, pool)
    num_records_read: int  # records the consumer delivered, counted or not
    num_undecodable: int  # records that are not a Usage (skipped, reported on stderr)
    # Set when the stream's limits (or a purge) already dropped records of the period:
    # the finish time of the oldest record still kept. Totals before it are incomplete.
    incomplete_before_ms: int | None = None


# --- times ---------------------------------------------------------------------------


def parse_time(text: str, now: int, flag: str) -> int:
    """Unix epoch ms from ISO-8601 (no zone = UTC) or ``now`` / ``-1h`` / ``-30m``."""
    value = text.strip()
    if value == "now":
        return now
    if m := _RELATIVE_RE.match(value):
        return now - int(float(m[1]) * _UNIT_MS[m[2]])
    try:
        dt = datetime.fromisoformat(value)
    except ValueError:
        raise UsageArgsError(
            f"{flag}={text!r}: expected ISO-8601 (2026-11-23T10:00:00Z) or a time relative "
            f"to now (-1h, -30m, -7d, now)") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return int(dt.timestamp() * 1000)


def format_time(ts_ms: int) -> str:
    """ISO-8601 UTC with milliseconds (``2026-11-23T10:00:00.000Z``); '' for none."""
    if not ts_ms:
        return ""
    dt = datetime.fromtimestamp(ts_ms / 1000, UTC)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{ts_ms % 1000:03d}Z"


def resolve_period(s: UsageQuery, now: int | None = None) -> tuple[int, int]:
    """(since_ms, until_ms) from the settings, or UsageArgsError."""
    now = now_ms() if now is None else now
    since = parse_time(s.since, now, "--since")
    until = parse_time(s.until, now, "--until")
    if since >= until:
        raise UsageArgsError(f"--since ({format_time(since)}) must be before --until "
                             f"({format_time(until)})")
    for flag, value in (("--tenant", s.tenant), ("--pool", s.pool)):
        if value and not _ID_RE.match(value):
            raise UsageArgsError(f"{flag}={value!r}: expected 1-64 of [A-Za-z0-9_-]")
    return since, until


# --- reading FL_USAGE ----------------------------------------------------------------


async def read_usage(js: JetStreamContext, subjects: Subjects, since_ms: int, until_ms: int,
                     *, tenant: str | None = None, pool: str | None = None,
                     fetch_timeout_s: float = 1.0) -> UsageReport:
    """Sum FL_USAGE's records with ``since_ms <= ts_ms < until_ms`` per (tenant, pool)."""
    try:
        info = await js.stream_info(subjects.usage_stream)
    except NotFoundError:
        raise UsageReadError(f"no usage stream {subjects.usage_stream} on this server "
                             f"(is --prefix {subjects.prefix} the fleet's prefix?)") from None
    last_seq = info.state.last_seq  # records stored after the export began are left out
    totals: dict[tuple[str, str], UsageTotals] = {}
    report = UsageReport(since_ms, until_ms, tenant, pool, [], 0, 0)
    if info.state.first_seq > 1:  # records were dropped: were any of this period's?
        oldest_ms = await _oldest_kept_ms(js, subjects, info.state.first_seq)
        if oldest_ms is not None and oldest_ms > since_ms:
            report.incomplete_before_ms = oldest_ms
    if info.state.messages == 0:
        return report
    start = datetime.fromtimestamp((since_ms - STORE_SLACK_MS) / 1000, UTC)
    stop_after = datetime.fromtimestamp((until_ms + STORE_SLACK_MS) / 1000, UTC)
    config = ConsumerConfig(
        deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=start,
        ack_policy=AckPolicy.NONE, mem_storage=True,
        # The server removes it soon if this process dies before deleting it.
        inactive_threshold=30.0)
    sub = await js.pull_subscribe(subjects.usage(tenant) if tenant else subjects.usage_all(),
                                  durable=None, stream=subjects.usage_stream, config=config)
    name = None
    try:
        ci = await sub.consumer_info()
        name, pending = ci.name, ci.num_pending
        while pending:
            try:
                msgs = await sub.fetch(FETCH_BATCH, timeout=fetch_timeout_s)
            except (TimeoutError, nats.errors.TimeoutError):
                pending = (await sub.consumer_info()).num_pending
                continue
            for msg in msgs:
                md = msg.metadata
                if md.sequence.stream > last_seq or md.timestamp > stop_after:
                    pending = 0
                    break
                pending = md.num_pending
                report.num_records_read += 1
                try:
                    u = decode_usage(msg.data)
                except ProtocolError:
                    report.num_undecodable += 1
                    continue
                if not since_ms <= u.ts_ms < until_ms or (pool and u.pool != pool):
                    continue
                key = (u.tenant, u.pool)
                if key not in totals:
                    totals[key] = UsageTotals(u.tenant, u.pool)
                totals[key].add(u)
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
            if name:
                await js.delete_consumer(subjects.usage_stream, name)
    report.totals = [totals[k] for k in sorted(totals)]
    return report


async def _oldest_kept_ms(js: JetStreamContext, subjects: Subjects, first_seq: int
                         ) -> int | None:
    """The finish time of the stream's oldest record (None if it cannot be read)."""
    try:
        msg = await js.get_msg(subjects.usage_stream, seq=first_seq)
        return decode_usage(msg.data or b"").ts_ms
    except (ProtocolError, TimeoutError, nats.errors.Error):
        return None


async def connect(nats_url: str, timeout_s: float, s: UsageQuery | None = None) -> nats.NATS:
    """NATS, or UsageReadError naming the URL: a CLI gives up where a service waits."""
    failures: list[Exception] = []

    async def on_error(exc: Exception) -> None:  # the default prints a traceback per try
        failures.append(exc)

    nc = nats.NATS()
    try:
        login = connect_options(s) if s is not None else {"servers": server_urls(nats_url)}
        await asyncio.wait_for(nc.connect(
            **login, name="fairlane-usage", connect_timeout=timeout_s, allow_reconnect=False,
            max_reconnect_attempts=0, error_cb=on_error), timeout_s + 1)
    except (OSError, TimeoutError, nats.errors.Error) as exc:
        cause = failures[-1] if failures else exc
        why = str(cause) or type(cause).__name__
        raise UsageReadError(f"cannot reach NATS at {nats_url}: {why}") from None
    return nc


async def export(s: UsageQuery, since_ms: int, until_ms: int) -> UsageReport:
    nc = await connect(s.nats_url, s.connect_timeout_s, s)
    try:
        return await read_usage(nc.jetstream(), Subjects(s.prefix), since_ms, until_ms,
                                tenant=s.tenant or None, pool=s.pool or None)
    except (TimeoutError, nats.errors.Error) as exc:  # JetStream off, timeouts, a lost link
        raise UsageReadError(f"reading the usage stream failed: "
                             f"{str(exc) or type(exc).__name__}") from None
    finally:
        with contextlib.suppress(Exception):
            await nc.close()


# --- output --------------------------------------------------------------------------


def render(report: UsageReport, fmt: Literal["csv", "json"]) -> str:
    rows = [t.row() for t in report.totals]
    if fmt == "json":
        return json.dumps({
            "since": format_time(report.since_ms), "until": format_time(report.until_ms),
            "tenant": report.tenant, "pool": report.pool,
            "incomplete_before": (format_time(report.incomplete_before_ms)
                                  if report.incomplete_before_ms else None),
            "rows": rows,
        }, indent=2) + "\n"
    return _csv(rows)


def _csv(rows: Iterable[dict[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


class _Parser(argparse.ArgumentParser):
    """One error line and exit 2, like every fairlane command's settings."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    env = os.environ
    p = _Parser(prog=PROG, description=(
        "Export per-tenant (and pool) usage totals for a period from the FL_USAGE "
        "stream: requests, prompt/completion/cached tokens, KV-token-seconds, first and "
        "last record time. A record counts in [since, until) by the time its request "
        "finished."))
    times = ("ISO-8601 (2026-11-23T10:00:00Z; without a zone: UTC) or relative to now "
             "(-1h, -30m, -7d, now)")
    p.add_argument("--since", required=True, help=f"Start of the period, inclusive: {times}.")
    p.add_argument("--until", default="now", help="End of the period, exclusive; the same "
                                                  "forms. Default: now.")
    p.add_argument("--tenant", default="", help="Only this tenant.")
    p.add_argument("--pool", default="", help="Only this pool.")
    p.add_argument("--format", choices=("csv", "json"), default="csv",
                   help="Output on stdout: csv (a header, one row per tenant and pool) or "
                        "json. Default: csv.")
    # Only the connection comes from the environment: a FAIRLANE_POOL exported for the
    # fleet must not silently filter an export.
    p.add_argument("--nats-url", default=env.get("FAIRLANE_NATS_URL", DEFAULT_NATS_URL),
                   help="NATS server with the usage stream [env FAIRLANE_NATS_URL; "
                        f"default {DEFAULT_NATS_URL}].")
    p.add_argument("--prefix", default=env.get("FAIRLANE_PREFIX", DEFAULT_PREFIX),
                   help="Subject and stream prefix of the deployment [env FAIRLANE_PREFIX; "
                        f"default {DEFAULT_PREFIX}].")
    p.add_argument("--connect-timeout-s", type=float, default=5.0,
                   help="Give up on NATS after this many seconds. Default: 5.")
    p.add_argument("--nats-user", default=env.get("FAIRLANE_NATS_USER", ""),
                   help="NATS user, with auth on (svc-admin) [env FAIRLANE_NATS_USER].")
    p.add_argument("--nats-password-file", default=env.get("FAIRLANE_NATS_PASSWORD_FILE", ""),
                   help="File whose first line is its password (or env FAIRLANE_NATS_PASSWORD) "
                        "[env FAIRLANE_NATS_PASSWORD_FILE].")
    p.add_argument("--nats-tls-ca-file", default=env.get("FAIRLANE_NATS_TLS_CA_FILE", ""),
                   help="CA that signed the NATS server's certificate: connect with TLS "
                        "[env FAIRLANE_NATS_TLS_CA_FILE].")
    return p


def _glue_dash_values(argv: list[str]) -> list[str]:
    """``--since -1h`` -> ``--since=-1h``: argparse takes a value starting with '-' for
    an option, and relative times do."""
    out: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg in ("--since", "--until"):
            value = next(it, None)
            out.append(arg if value is None else f"{arg}={value}")
        else:
            out.append(arg)
    return out


def parse_args(argv: list[str]) -> UsageQuery:
    """The query from the command line; exits 2 with one line on a bad flag."""
    ns = _parser().parse_args(_glue_dash_values(argv))
    return UsageQuery(since=ns.since, until=ns.until, tenant=ns.tenant, pool=ns.pool,
                      format=ns.format, nats_url=ns.nats_url, prefix=ns.prefix,
                      connect_timeout_s=ns.connect_timeout_s, nats_user=ns.nats_user,
                      nats_password=os.environ.get("FAIRLANE_NATS_PASSWORD", ""),
                      nats_password_file=ns.nats_password_file,
                      nats_tls_ca_file=ns.nats_tls_ca_file)


def cmd_usage(argv: list[str]) -> int:
    """`fairlane usage`: exit 0 with the export on stdout; 2 bad arguments; 1 NATS."""
    q = parse_args(argv)
    try:
        since_ms, until_ms = resolve_period(q)
        Subjects(q.prefix)
        if not q.connect_timeout_s > 0:
            raise UsageArgsError(f"--connect-timeout-s={q.connect_timeout_s}: must be > 0")
    except (UsageArgsError, ProtocolError) as exc:
        print(f"{PROG}: error: {exc} (see {PROG} --help)", file=sys.stderr)
        return 2
    try:
        report = asyncio.run(export(q, since_ms, until_ms))
    except UsageReadError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(render(report, q.format))
    if report.incomplete_before_ms:
        print(f"{PROG}: warning: the usage stream no longer holds records finished before "
              f"{format_time(report.incomplete_before_ms)} (dropped by its limits, "
              f"--usage-max-age-s / --usage-max-msgs): totals from --since to then are "
              f"incomplete", file=sys.stderr)
    if report.num_undecodable:
        print(f"{PROG}: warning: skipped {report.num_undecodable} record(s) that are not "
              f"usage records", file=sys.stderr)
    return 0
