"""How every process connects to NATS: credentials, TLS, and permission errors.

With NATS auth on (`fairlane nats-config`, the default under `fairlane up`), each
process connects as a user: a service (``dispatcher``, ``worker``, ``streamer``, ...)
or one tenant. `connect_options` turns the shared settings into nats-py's
`connect()` keywords; `NatsConnSettings` is part of every process's settings (through
`fairlane.streams.StreamSettings`).

A refused publish or subscribe is not an exception in nats-py: the server answers
``-ERR 'Permissions Violation for Publish to "..."'`` asynchronously and the client
passes it to ``error_cb`` only, so a refused JetStream publish would look like a
timeout. `PermissionWatch` records those errors per connection, so callers can turn a
refusal into a clear error at once (`producer.auth.guard_publish`).
"""

from __future__ import annotations

import asyncio
import re
import ssl
import weakref
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any

import msgspec
import structlog

log = structlog.get_logger(__name__)

# nats-server 2.10+ words it "permissions violation for publish to \"fl.req...\"".
_VIOLATION_RE = re.compile(
    r'permissions violation for (?P<op>publish|subscription) to "?(?P<subject>[^"\s]+)', re.I)


# A silent node is left within 4-6 s (pings at 2 s; the third unanswered one fails
# over): well inside a stream leader's election (4-9 s) and the producer's 30 s silence
# bound, and far above any event-loop stall seen under load here (a false "stale"
# only costs a reconnect).
DEFAULT_PING_INTERVAL_S = 2.0
DEFAULT_MAX_OUTSTANDING_PINGS = 2


class NatsConnSettings(msgspec.Struct, kw_only=True):
    """Credentials and TLS of a process's NATS connection (each a flag and env var)."""

    nats_user: str = ""  # NATS user (a tenant's or a service's, see fairlane nats-config); empty = none
    # The user's password; prefer FAIRLANE_NATS_PASSWORD or --nats-password-file to
    # the flag, which other users of the machine can read in the process list.
    nats_password: str = ""
    nats_password_file: str = ""  # file whose first line is the user's password
    # CA certificate that signed the NATS server's: connect with TLS and verify the server.
    nats_tls_ca_file: str = ""
    # Seconds between the client's pings to its NATS server. A node cut off by a network
    # partition resets nothing: the connection just hangs, and nats-py's default (2 min)
    # would leave the process on the dead node for minutes instead of failing over.
    nats_ping_interval_s: Annotated[float, msgspec.Meta(gt=0)] = DEFAULT_PING_INTERVAL_S
    # Pings without a pong before the connection counts as stale and fails over to
    # another server: a dead node is noticed within (this + 1) x the ping interval.
    nats_max_outstanding_pings: Annotated[int, msgspec.Meta(ge=1)] = DEFAULT_MAX_OUTSTANDING_PINGS


def read_password(s: NatsConnSettings) -> str:
    if s.nats_password or not s.nats_password_file:
        return s.nats_password
    lines = Path(s.nats_password_file).read_text(encoding="utf-8").splitlines()
    return lines[0].strip() if lines else ""


def tls_context(ca_file: str) -> ssl.SSLContext:
    """Verify the server against `ca_file` (and its name against the URL's host)."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def server_urls(nats_url: str) -> list[str]:
    """A comma-separated list of server URLs (a cluster): nats-py fails over in order."""
    return [u.strip() for u in nats_url.split(",") if u.strip()]


def connect_options(s: Any, *, inbox_prefix: str | None = None) -> dict[str, Any]:
    """nats.connect keywords for settings carrying `NatsConnSettings` fields (and
    ``nats_url``): servers, user and password, TLS, the request inbox prefix, and the
    ping interval that notices a dead node."""
    opts: dict[str, Any] = {  # (settings without these fields get the defaults)
        "ping_interval": getattr(s, "nats_ping_interval_s", DEFAULT_PING_INTERVAL_S),
        "max_outstanding_pings": getattr(s, "nats_max_outstanding_pings",
                                         DEFAULT_MAX_OUTSTANDING_PINGS),
    }
    if getattr(s, "nats_url", ""):
        opts["servers"] = server_urls(s.nats_url)
    if s.nats_user:
        opts["user"] = s.nats_user
        opts["password"] = read_password(s)
    if s.nats_tls_ca_file:
        opts["tls"] = tls_context(s.nats_tls_ca_file)
    if s.nats_user and not inbox_prefix:
        inbox_prefix = user_inbox(s.nats_user)
    if inbox_prefix:
        opts["inbox_prefix"] = inbox_prefix
    return opts


def user_inbox(user: str) -> str:
    """A logged-in connection's request inbox: ``_INBOX.<user>``, so a user's
    permission to read replies covers its own and no other user's."""
    return f"_INBOX.{user}"


def credentials(user: str = "", password: str = "", tls_ca_file: str = "",
                inbox_prefix: str | None = None) -> dict[str, Any]:
    """The same keywords from plain values (the producer library's `connect`)."""
    return connect_options(NatsConnSettings(nats_user=user, nats_password=password,
                                            nats_tls_ca_file=tls_ca_file),
                           inbox_prefix=inbox_prefix)


class PermissionDenied(Exception):
    """The NATS server refused a publish or subscribe for this connection's user."""

    def __init__(self, op: str, subject: str, text: str) -> None:
        # op: "publish" or "subscription"
        super().__init__(text)
        self.op = op
        self.subject = subject


class PermissionWatch:
    """Permission violations reported on one connection, and waiters for them."""

    def __init__(self, inner: Callable[[Exception], Awaitable[None]] | None = None) -> None:
        self._inner = inner
        self._waiters: dict[tuple[str, str], list[asyncio.Future]] = {}
        self.num_violations = 0
        self.last: PermissionDenied | None = None

    async def error_cb(self, exc: Exception) -> None:
        text = str(exc)
        m = _VIOLATION_RE.search(text)
        if m is None:
            if self._inner is not None:
                await self._inner(exc)
            return
        denied = PermissionDenied(m["op"].lower(), m["subject"], text.removeprefix("nats: "))
        self.num_violations += 1
        self.last = denied
        log.warning("nats_permission_denied", op=denied.op, subject=denied.subject)
        # nats-py lowercases the server's error line: subjects are matched lowercased.
        for fut in self._waiters.pop((denied.op, denied.subject.lower()), []):
            if not fut.done():
                fut.set_exception(denied)

    async def guard(self, op: str, subject: str, aw: Awaitable[Any]) -> Any:
        """Await `aw`, unless the server refuses `op` on `subject` first: then raise
        `PermissionDenied` (not the timeout `aw` would end with much later)."""
        fut = asyncio.get_running_loop().create_future()
        key = (op, subject.lower())
        self._waiters.setdefault(key, []).append(fut)
        task = asyncio.ensure_future(aw)
        try:
            await asyncio.wait({task, fut}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return fut.result()  # raises PermissionDenied
        finally:
            waiters = self._waiters.get(key, [])
            if fut in waiters:
                waiters.remove(fut)
            if not waiters:
                self._waiters.pop(key, None)
            if not fut.done():
                fut.cancel()
            if not task.done():
                task.cancel()


_WATCHES: weakref.WeakKeyDictionary[Any, PermissionWatch] = weakref.WeakKeyDictionary()


def watch_permissions(nc: Any, watch: PermissionWatch) -> None:
    """Remember `watch` as the one receiving `nc`'s error_cb (see `permission_watch`)."""
    _WATCHES[nc] = watch


def permission_watch(nc: Any) -> PermissionWatch | None:
    """The watch of a connection made with `watch_permissions`, else None."""
    return _WATCHES.get(nc)
