"""The producer's NATS login: credentials, the tenant's inboxes, refused publishes.

A producer acting for ONE tenant (`FairlaneClient(tenant=...)`, the producer CLI)
logs in with that tenant's NATS user (`fairlane nats-config`), which may publish only
the tenant's requests and cancels and read only its inboxes; so the connection's
request inbox (where JetStream's PubAck and the dispatcher's answers arrive) is moved
inside them (`Subjects.rpc_inbox`). A multi-tenant edge (the streamer) logs in as a
service user and keeps nats-py's inbox under ``_INBOX.<user>``.

nats-py reports a refused publish only to the error callback, so a refused
JetStream publish would end as a timeout; `guard_publish` turns it into a
`RequestError` (code ``unauthorized``) naming the refused subject, at once, and
rides out a cluster's stream-leader election.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import nats
import structlog
from nats.aio.client import Client as NatsClient
from nats.js.errors import NoStreamResponseError, ServiceUnavailableError

from fairlane.errors import ErrorCode
from fairlane.natsconn import (
    PermissionDenied,
    PermissionWatch,
    credentials,
    permission_watch,
    server_urls,
    watch_permissions,
)
from fairlane.runtime import log_nats_error
from fairlane.subjects import Subjects
from producer.stream import RequestError

log = structlog.get_logger(__name__)
# How long a publish is re-sent while its stream has no leader (a cluster's election).
# Four PubAck timeouts (5 s each): a killed node that comes back at once can take a
# client's reconnect before it has rejoined its cluster, and publishes sent there go
# unanswered for a while (chaos nats_lease_leader_kill: 7 of 150 resumes ran out of a
# 10 s window).
FAILOVER_RETRY_S = 20.0
# How long `FairlaneClient.connect` tries to reach NATS before it raises: once
# connected, the client reconnects for ever, but a wrong URL or a server that is down
# must be an error, not a wait for ever (nats-py with unlimited reconnect attempts
# retries the first connect without end).
CONNECT_WAIT_S = 10.0


async def open_connection(nats_url: str, *, prefix: str = "fl", tenant: str | None = None,
                          user: str = "", password: str = "", tls_ca_file: str = "",
                          client: NatsClient | None = None, **nats_kw: Any) -> NatsClient:
    """nats.connect with the producer's login; `nats_kw` are nats-py's own options.
    The connection's permission errors are watched (see `guard_publish`). `client`: a
    fresh nats-py client to connect (its caller can then close it if connecting is
    abandoned half way); default a new one."""
    inbox = Subjects(prefix).rpc_inbox(tenant) if tenant else None
    watch = PermissionWatch(nats_kw.pop("error_cb", log_nats_error))
    nats_kw.setdefault("name", "fairlane-producer")
    nc = client if client is not None else NatsClient()
    await nc.connect(**{**credentials(user, password, tls_ca_file, inbox),
                        "servers": server_urls(nats_url), **nats_kw},
                     error_cb=watch.error_cb)
    watch_permissions(nc, watch)
    return nc


async def connect_client(cls: Any, nats_url: str, *, user: str = "", password: str = "",
                         tls_ca_file: str = "", connect_wait_s: float | None = CONNECT_WAIT_S,
                         **kwargs: Any) -> Any:
    """`FairlaneClient.connect`: a connection of its own (reconnecting for ever once
    made), cancels held while disconnected sent on reconnect, every stream failed on
    close. The first connect gives up after `connect_wait_s` (None: waits for NATS
    for ever) with a `ConnectionError` naming the URL and the last failure."""
    holder: list[Any] = []

    async def on_reconnect() -> None:
        if holder:
            await holder[0]._send_pending_cancels()

    async def on_closed() -> None:
        if holder:
            holder[0]._fail_all(ErrorCode.STREAM_LOST, "NATS connection closed")

    nc = NatsClient()
    try:
        await asyncio.wait_for(
            open_connection(nats_url, prefix=kwargs.get("prefix", "fl"),
                            tenant=kwargs.get("tenant"), user=user, password=password,
                            tls_ca_file=tls_ca_file, max_reconnect_attempts=-1,
                            reconnected_cb=on_reconnect, closed_cb=on_closed, client=nc),
            connect_wait_s)
    except TimeoutError:
        last = nc.last_error
        with contextlib.suppress(Exception):
            await nc.close()
        raise ConnectionError(
            f"could not connect to NATS at {nats_url} within {connect_wait_s:g} s"
            + (f" (last error: {last!r})" if last is not None else "")) from None
    client = cls(nc, owns_connection=True, **kwargs)
    holder.append(client)
    await client.start()
    return client


def denied_error(exc: PermissionDenied) -> RequestError:
    return RequestError(f"NATS refused to let this user {exc.op} to {exc.subject!r} "
                        f"(its credentials do not allow it): {exc}", ErrorCode.UNAUTHORIZED)


async def guard_publish(nc: NatsClient, subject: str,
                        publish: Callable[[], Awaitable[Any]]) -> Any:
    """Run `publish()` (JetStream's, which waits for its PubAck); raise `RequestError`
    (unauthorized) as soon as the server refuses it.

    In a NATS cluster, while the stream elects a new leader (a node died: ~2-4 s) the
    publish gets "no responders": nobody stored it, so it is sent again (same message
    id, so idempotent anyway) for up to `FAILOVER_RETRY_S`. A publish whose PubAck
    timed out (the election outlasted it, or a slow server) is sent again too: if the
    first was stored, the stream's dedupe answers the second as a duplicate of ours,
    which the caller attaches to."""
    watch = permission_watch(nc)
    deadline = asyncio.get_running_loop().time() + FAILOVER_RETRY_S
    while True:
        try:
            if watch is None:  # a connection made elsewhere: a refusal ends as a timeout
                return await publish()
            return await watch.guard("publish", subject, publish())
        except PermissionDenied as exc:
            raise denied_error(exc) from None
        except (NoStreamResponseError, ServiceUnavailableError, nats.errors.TimeoutError):
            if asyncio.get_running_loop().time() >= deadline:
                raise
            log.info("publish_no_stream_leader_retrying", subject=subject)
            await asyncio.sleep(0.25)
