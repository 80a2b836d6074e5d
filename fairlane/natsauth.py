"""`fairlane nats-config`: per-tenant NATS users and least-privilege service users.

    fairlane nats-config --tenants tenants.yaml --out nats-auth/

writes ``nats-auth/auth.conf`` (an ``authorization`` block for nats-server: put
``include auth.conf`` in the server's configuration) and one password file per user
under ``nats-auth/credentials/`` (mode 0600, as is auth.conf itself, which holds
the passwords too: nats-server compares plain passwords unless they are bcrypt hashes).
A second run keeps the passwords already issued and adds new tenants' users, so a
running fleet keeps its credentials when the tenants file grows.

Who may do what (DESIGN.md section 3; every cell tested in
tests/integration/test_nats_auth.py, the matrix is in BENCHMARKS.md):

- a tenant publishes only its own requests (``<p>.req.*.*.<tenant>``) and cancels
  (``<p>.cancel.*.<tenant>``), asks ``<p>.info.*`` / ``<p>.status.*``, and subscribes
  only to its own inboxes (``<p>.inbox.*.<tenant>.>``), where its replies and its
  JetStream PubAcks arrive too (its connection's request inbox is
  ``<p>.inbox._rpc.<tenant>``). No JetStream API, no ``_INBOX.>``.
- services connect as ``svc-<role>`` with the request inbox ``_INBOX.svc-<role>``;
  the worker cannot publish requests, only the dispatcher answers pulls and may
  delete/get request messages, only the edge (streamer, producer) may publish requests
  for any tenant. Only the dispatcher publishes the pools' stats (``<p>.stats.*``),
  only the streamer (its admin dashboard) reads them. None may delete or purge a stream.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
from pathlib import Path
from typing import Any

from fairlane.natsconn import user_inbox
from fairlane.subjects import Subjects, check_id

SERVICE_ROLES = ("dispatcher", "worker", "streamer", "producer", "admin")
SERVICE_USER_PREFIX = "svc-"
AUTH_FILE = "auth.conf"
CREDENTIALS_DIR = "credentials"
_PASSWORD_BYTES = 24


def service_user(role: str) -> str:
    return SERVICE_USER_PREFIX + role


# --- permission sets -----------------------------------------------------------------


def _manage_streams(*streams: str) -> list[str]:
    """`ensure_streams` at every process's start: look up, create, update (no delete)."""
    out = ["$JS.API.INFO", "$JS.API.STREAM.NAMES"]
    for s in streams:
        out += [f"$JS.API.STREAM.INFO.{s}", f"$JS.API.STREAM.CREATE.{s}",
                f"$JS.API.STREAM.UPDATE.{s}"]
    return out


def _consume(stream: str) -> list[str]:
    """A durable pull consumer on `stream`: create/look up, fetch, ack."""
    return [f"$JS.API.CONSUMER.CREATE.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}.>",
            f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.>", f"$JS.API.CONSUMER.INFO.{stream}.>",
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.>", f"$JS.ACK.{stream}.>"]


def tenant_permissions(sub: Subjects, tenant: str) -> dict[str, Any]:
    p = sub.prefix
    t = check_id("tenant", tenant)
    return {
        "publish": {"allow": [f"{p}.req.*.*.{t}", f"{p}.cancel.*.{t}", f"{p}.info.*",
                              f"{p}.status.*"]},
        "subscribe": {"allow": [sub.tenant_inboxes(t)]},
    }


def service_permissions(sub: Subjects, role: str) -> dict[str, Any]:
    p, req, usage = sub.prefix, sub.requests_stream, sub.usage_stream
    kv = f"KV_{p}_leader"
    inbox = f"{user_inbox(service_user(role))}.>"
    never = ["$JS.API.STREAM.DELETE.>", "$JS.API.STREAM.PURGE.>"]
    if role == "admin":  # operators' tools (fairlane usage, readiness checks): everything
        return {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}
    if role == "dispatcher":
        pub = [f"{p}.preempt.*", f"{p}.stats.*", f"{p}.inbox.>", *_manage_streams(req, usage, kv),
               *_consume(req), f"$JS.API.STREAM.MSG.GET.{req}", f"$JS.API.STREAM.MSG.DELETE.{req}",
               f"$JS.API.STREAM.MSG.GET.{kv}", f"$JS.API.DIRECT.GET.{kv}",
               f"$JS.API.DIRECT.GET.{kv}.>", f"$KV.{p}_leader.>",
               # The janitor lists the bucket's keys: an ordered consumer, deleted after.
               *_consume(kv), f"$JS.API.CONSUMER.DELETE.{kv}.>", f"$JS.FC.{kv}.>"]
        subs = [f"{p}.work.*", f"{p}.evt.*", f"{p}.cancel.>", f"{p}.info.*", f"{p}.status.*",
                inbox]
        # Answers to pulls, heartbeats, info and status go to the asker's reply subject.
        return {"publish": {"allow": pub, "deny": [f"{p}.req.>", *never]},
                "subscribe": {"allow": subs}, "allow_responses": True}
    if role == "worker":
        pub = [f"{p}.work.*", f"{p}.evt.*", f"{p}.inbox.>", f"{p}.usage.*", f"$JS.ACK.{req}.>",
               *_manage_streams(req, usage)]
        return {"publish": {"allow": pub, "deny": [f"{p}.req.>", f"{p}.cancel.>", *never]},
                "subscribe": {"allow": [f"{p}.cancel.>", f"{p}.preempt.*", inbox]}}
    if role in ("streamer", "producer"):  # the edge: publishes for any tenant it authenticated
        pub = [f"{p}.req.>", f"{p}.cancel.>", f"{p}.info.*", f"{p}.status.*",
               *_manage_streams(req, usage), *_consume(usage)]
        # The streamer's admin dashboard reads the pools' stats snapshots.
        stats = [f"{p}.stats.*"] if role == "streamer" else []
        return {"publish": {"allow": pub, "deny": never},
                "subscribe": {"allow": [f"{p}.inbox.>", *stats, inbox]}}
    raise ValueError(f"unknown service role {role!r}")


# --- the files -----------------------------------------------------------------------


def _write_private(path: Path, text: str) -> None:
    """Create (or replace) a file readable by its owner only, never briefly wider."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def _existing_passwords(cred_dir: Path) -> dict[str, str]:
    out = {}
    if cred_dir.is_dir():
        for f in cred_dir.glob("*.password"):
            lines = f.read_text(encoding="utf-8").splitlines()
            if lines and lines[0].strip():
                out[f.name.removesuffix(".password")] = lines[0].strip()
    return out


def auth_block(users: list[dict[str, Any]]) -> str:
    """nats-server's ``authorization`` block (its configuration format reads JSON)."""
    body = ",\n".join("    " + json.dumps(u) for u in users)
    return f"authorization {{\n  users = [\n{body}\n  ]\n}}\n"


def write_nats_auth(tenants: list[str], out_dir: str | Path, prefix: str = "fl") -> dict[str, str]:
    """Write auth.conf and the users' password files; return user -> password."""
    sub = Subjects(prefix)
    out = Path(out_dir)
    cred_dir = out / CREDENTIALS_DIR
    cred_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    os.chmod(cred_dir, 0o700)
    for t in tenants:
        check_id("tenant", t)
        if t.startswith(SERVICE_USER_PREFIX):
            raise ValueError(f"tenant {t!r}: names starting with {SERVICE_USER_PREFIX!r} are "
                             "reserved for the fleet's service users")
    known = _existing_passwords(cred_dir)
    perms = {service_user(r): service_permissions(sub, r) for r in SERVICE_ROLES}
    perms |= {t: tenant_permissions(sub, t) for t in sorted(tenants)}
    passwords: dict[str, str] = {}
    users = []
    for user, p in perms.items():
        passwords[user] = known.get(user) or secrets.token_urlsafe(_PASSWORD_BYTES)
        users.append({"user": user, "password": passwords[user], "permissions": p})
        _write_private(cred_dir / f"{user}.password", passwords[user] + "\n")
    _write_private(out / AUTH_FILE, auth_block(users))
    return passwords


def cmd_nats_config(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="fairlane nats-config",
        description="Write nats-server authorization (one user per tenant, least-privilege "
                    "service users) and the users' password files (mode 0600).")
    parser.add_argument("--tenants", required=True, help="the tenants file (YAML or TOML)")
    parser.add_argument("--out", default="nats-auth", help="directory to write auth.conf and "
                        "credentials/<user>.password into (default: nats-auth)")
    parser.add_argument("--prefix", default="fl", help="subject prefix of the deployment")
    args = parser.parse_args(argv)
    from fairlane.tenants import load_tenants

    try:
        tenants = sorted(load_tenants(args.tenants).tenants)
        write_nats_auth(tenants, args.out, args.prefix)
    except (OSError, ValueError) as exc:
        print(f"fairlane nats-config: error: {exc}", file=sys.stderr)
        return 1
    out = Path(args.out)
    print(f"wrote {out / AUTH_FILE} ({len(tenants)} tenants, {len(SERVICE_ROLES)} service users)"
          f" and {out / CREDENTIALS_DIR}/<user>.password\n"
          f"nats-server: add `include {AUTH_FILE}` to its configuration\n"
          f"processes: --nats-user USER --nats-password-file {out / CREDENTIALS_DIR}/USER.password")
    return 0
