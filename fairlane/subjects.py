"""Subject names (DESIGN.md section 3). Every id is validated before it becomes a token.

A subject token must not contain `.`, `*`, `>` or whitespace, or a tenant could publish
into another tenant's subject space; the id pattern rules all of those out.
"""

from __future__ import annotations

import re

from fairlane.protocol import ID_PATTERN, ErrorCode, ProtocolError, peek_reply_fields

DEFAULT_PREFIX = "fl"
# Header carrying the reply subject beside the body, so a request whose body cannot
# be decoded can still be answered with a clear error.
REPLY_HEADER = "Fl-Reply-To"

_ID_RE = re.compile(ID_PATTERN)
# A reply subject: dot-separated tokens, no wildcards or whitespace.
_SUBJECT_RE = re.compile(r"^[A-Za-z0-9_$-]+(\.[A-Za-z0-9_$-]+)*$")


def check_id(kind: str, value: str) -> str:
    if not isinstance(value, str) or not _ID_RE.match(value):
        raise ProtocolError(
            f"invalid {kind} id {value!r}: expected 1-64 of [A-Za-z0-9_-]",
            ErrorCode.INVALID_REQUEST,
        )
    return value


def check_reply_subject(value: str) -> str:
    if not _SUBJECT_RE.match(value) or len(value) > 256:
        raise ProtocolError(
            f"invalid reply subject {value!r}: no wildcards or whitespace",
            ErrorCode.INVALID_REQUEST,
        )
    return value


def reply_of(data: bytes, headers: dict | None) -> tuple[str | None, str | None]:
    """(request_id, a valid reply subject or None) of a request message that may not
    decode: from the body if it can be read, else the reply header, so whoever sent an
    unreadable or unservable request can still be told why."""
    rid, reply = peek_reply_fields(data)
    if reply is None and headers:
        reply = headers.get(REPLY_HEADER)
    if reply is not None:
        try:
            check_reply_subject(reply)
        except ProtocolError:
            reply = None
    return rid, reply


class Subjects:
    """Subject builders for one deployment prefix (default ``fl``)."""

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        self.prefix = check_id("prefix", prefix)

    @property
    def requests_stream(self) -> str:
        """``FL_REQUESTS`` for the default prefix; each prefix gets its own streams so
        several deployments (or tests) can share one nats-server."""
        return f"{self.prefix.upper()}_REQUESTS"

    @property
    def usage_stream(self) -> str:
        return f"{self.prefix.upper()}_USAGE"

    def request(self, pool: str, tier: str, tenant: str) -> str:
        return (
            f"{self.prefix}.req.{check_id('pool', pool)}."
            f"{check_id('tier', tier)}.{check_id('tenant', tenant)}"
        )

    def requests_all(self) -> str:
        return f"{self.prefix}.req.>"

    def requests_tier(self, pool: str, tier: str) -> str:
        return f"{self.prefix}.req.{check_id('pool', pool)}.{check_id('tier', tier)}.*"

    def work(self, pool: str) -> str:
        return f"{self.prefix}.work.{check_id('pool', pool)}"

    def events(self, pool: str) -> str:
        return f"{self.prefix}.evt.{check_id('pool', pool)}"

    def cancel(self, pool: str, tenant: str = "") -> str:
        """``<prefix>.cancel.<pool>.<tenant>``: the tenant in the subject is what the
        broker authenticates (a tenant may publish only its own). Without a tenant, the
        pre-auth ``<prefix>.cancel.<pool>``, which only services may publish to."""
        base = f"{self.prefix}.cancel.{check_id('pool', pool)}"
        return f"{base}.{check_id('tenant', tenant)}" if tenant else base

    def cancel_subscriptions(self, pool: str) -> tuple[str, str]:
        """What a dispatcher or worker listens on: every tenant's cancel subject, and
        the tenant-less one that producers from before per-tenant auth publish to."""
        base = self.cancel(pool)
        return f"{base}.*", base

    def cancel_tenant(self, subject: str) -> str | None:
        """The tenant a cancel was published as (None: the tenant-less subject)."""
        parts = subject.split(".")
        return parts[3] if len(parts) == 4 and parts[1] == "cancel" else None

    def preempt(self, pool: str) -> str:
        return f"{self.prefix}.preempt.{check_id('pool', pool)}"

    def status(self, pool: str) -> str:
        return f"{self.prefix}.status.{check_id('pool', pool)}"

    def info(self, pool: str) -> str:
        return f"{self.prefix}.info.{check_id('pool', pool)}"

    def stats(self, pool: str) -> str:
        """The pool's `PoolStats` snapshots, published by its leading dispatcher."""
        return f"{self.prefix}.stats.{check_id('pool', pool)}"

    def stats_all(self) -> str:
        """Every pool's snapshots (the streamer's dashboard subscribes to it)."""
        return f"{self.prefix}.stats.*"

    def usage(self, tenant: str) -> str:
        return f"{self.prefix}.usage.{check_id('tenant', tenant)}"

    def usage_all(self) -> str:
        return f"{self.prefix}.usage.>"

    def inbox_prefix(self, owner: str) -> str:
        """Reply subjects of one streamer/producer node: ``<prefix>.inbox.<owner>``."""
        return f"{self.prefix}.inbox.{check_id('owner', owner)}"

    # Reply subjects carry the request's tenant after the owner:
    # ``<prefix>.inbox.<owner>.<tenant>.<request id>``. The broker then tells tenants
    # apart (a tenant may subscribe only to ``<prefix>.inbox.*.<tenant>.>``), while one
    # node still reads all its streams with one subscription (``<prefix>.inbox.<owner>.>``).

    def reply_subject(self, owner: str, tenant: str, request_id: str) -> str:
        return f"{self.inbox_prefix(owner)}.{check_id('tenant', tenant)}.{request_id}"

    def inbox_subscription(self, owner: str, tenant: str | None = None) -> str:
        """One node's chunk subscription: all its tenants', or one tenant's only (what
        a tenant's own credentials may subscribe to)."""
        if tenant:
            return f"{self.inbox_prefix(owner)}.{check_id('tenant', tenant)}.>"
        return f"{self.inbox_prefix(owner)}.>"

    def tenant_inboxes(self, tenant: str) -> str:
        """Every reply subject of `tenant`: its NATS subscribe permission."""
        return f"{self.prefix}.inbox.*.{check_id('tenant', tenant)}.>"

    def rpc_inbox(self, tenant: str) -> str:
        """nats-py's request inbox (``inbox_prefix``) for a connection acting as one
        tenant: inside the tenant's inboxes, so JetStream's PubAck and the dispatcher's
        answers reach it, under an owner token no chunk subscription uses."""
        return f"{self.prefix}.inbox._rpc.{check_id('tenant', tenant)}"

    def reply_in_tenant_inbox(self, reply: str, tenant: str) -> bool:
        """Whether `reply` lies in `tenant`'s inboxes (``<prefix>.inbox.*.<tenant>.>``):
        with auth on, a request may aim its tokens nowhere else."""
        parts = reply.split(".")
        return (len(parts) >= 5 and parts[0] == self.prefix and parts[1] == "inbox"
                and parts[3] == tenant)

    @staticmethod
    def reply_tenant(subject: str) -> str | None:
        """The tenant token of a reply subject in the tenant layout, else None."""
        parts = subject.split(".")
        return parts[3] if len(parts) >= 5 and parts[1] == "inbox" else None

    @staticmethod
    def parse_request(subject: str) -> tuple[str, str, str]:
        """(pool, tier, tenant) from ``<prefix>.req.<pool>.<tier>.<tenant>``."""
        parts = subject.split(".")
        if len(parts) != 5 or parts[1] != "req":
            raise ProtocolError(f"not a request subject: {subject!r}")
        return parts[2], parts[3], parts[4]
