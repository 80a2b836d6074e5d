"""`fairlane nats-config`: the permission sets it writes (checked with NATS's own
subject-matching rules), its files, and the subject layout they rely on."""

from __future__ import annotations

import json
import re
import stat

import pytest

from fairlane.cli import main as fairlane_main
from fairlane.natsauth import (
    SERVICE_ROLES,
    service_permissions,
    service_user,
    tenant_permissions,
    write_nats_auth,
)
from fairlane.protocol import ProtocolError
from fairlane.subjects import Subjects

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

S = Subjects("fl")


def _covers(pattern: str, subject: str) -> bool:
    """NATS: does `pattern` cover every subject `subject` can match (a subscription's
    wildcard must lie inside an allowed one, a publish subject is literal)."""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or s[i] == ">" or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


def _allowed(perms: dict, op: str, subject: str) -> bool:
    rules = perms[op]
    if any(_covers(d, subject) for d in rules.get("deny", [])):
        return False
    return any(_covers(a, subject) for a in rules.get("allow", []))


def test_matcher_follows_nats_rules():
    assert _covers("fl.req.*.*.acme", "fl.req.p.t.acme")
    assert not _covers("fl.req.*.*.acme", "fl.req.p.t.globex")
    assert _covers("fl.inbox.*.acme.>", "fl.inbox.o.acme.r1")
    assert not _covers("fl.inbox.*.acme.>", "fl.inbox.*.globex.>")
    assert not _covers("fl.inbox.*.acme.>", "fl.inbox.>")
    assert not _covers("fl.inbox.o.acme.r", "fl.inbox.*.acme.r")


ACME = tenant_permissions(S, "acme")


@pytest.mark.parametrize("subject,ok", [
    ("fl.req.default.paid.acme", True),
    ("fl.req.default.paid.globex", False),  # as another tenant
    ("fl.cancel.default.acme", True),
    ("fl.cancel.default.globex", False),  # another tenant's cancels
    ("fl.cancel.default", False),  # the tenant-less (services') cancel subject
    ("fl.info.default", True),
    ("fl.status.default", True),
    ("fl.work.default", False),
    ("fl.evt.default", False),
    ("fl.preempt.default", False),
    ("fl.usage.acme", False),
    ("fl.stats.default", False),  # nor a pool's stats snapshot
    ("fl.inbox.o.acme.r1", False),  # nobody's tokens are forged by a tenant
    ("$JS.API.STREAM.INFO.FL_REQUESTS", False),
    ("$JS.API.STREAM.DELETE.FL_REQUESTS", False),
    ("$JS.ACK.FL_REQUESTS.x.y.1.2.3.4.5", False),
])
def test_tenant_publish(subject, ok):
    assert _allowed(ACME, "publish", subject) is ok


@pytest.mark.parametrize("subject,ok", [
    ("fl.inbox.*.acme.>", True),
    ("fl.inbox.o1.acme.>", True),
    ("fl.inbox._rpc.acme.nuid.*", True),  # its request inbox (PubAcks, info answers)
    ("fl.inbox.*.globex.>", False),
    ("fl.inbox.>", False),
    ("_INBOX.>", False),
    ("fl.req.>", False),
    ("fl.cancel.>", False),
    ("fl.stats.*", False),  # the pools' stats are for the admin dashboard
    ("fl.stats.default", False),
    (">", False),
])
def test_tenant_subscribe(subject, ok):
    assert _allowed(ACME, "subscribe", subject) is ok


def test_rpc_inbox_lies_in_the_tenants_inboxes_and_no_chunk_subscription_sees_it():
    rpc = S.rpc_inbox("acme") + ".nuid.tok"
    assert S.reply_in_tenant_inbox(rpc, "acme")
    assert not _covers(S.inbox_subscription("owner1"), rpc)


PERMS = {r: service_permissions(S, r) for r in SERVICE_ROLES}


@pytest.mark.parametrize("role,op,subject,ok", [
    ("worker", "publish", "fl.req.default.paid.acme", False),  # a worker never publishes requests
    ("worker", "publish", "fl.cancel.default.acme", False),
    ("worker", "publish", "fl.work.default", True),
    ("worker", "publish", "fl.evt.default", True),
    ("worker", "publish", "fl.inbox.o.acme.r1", True),  # tokens
    ("worker", "publish", "fl.usage.acme", True),
    ("worker", "publish", "$JS.ACK.FL_REQUESTS.c.1.2.3.4.5", True),
    ("worker", "publish", "$JS.API.STREAM.DELETE.FL_REQUESTS", False),
    ("worker", "subscribe", "fl.cancel.>", True),
    ("worker", "subscribe", "fl.req.>", False),
    ("worker", "subscribe", "fl.inbox.>", False),  # cannot read tokens it did not send
    ("worker", "subscribe", "_INBOX.svc-worker.>", True),
    ("worker", "subscribe", "_INBOX.svc-dispatcher.>", False),
    ("dispatcher", "publish", "fl.req.default.paid.acme", False),
    ("dispatcher", "publish", "fl.preempt.default", True),
    ("dispatcher", "publish", "$JS.API.CONSUMER.MSG.NEXT.FL_REQUESTS.disp_default_paid", True),
    ("dispatcher", "publish", "$JS.API.STREAM.MSG.DELETE.FL_REQUESTS", True),
    ("dispatcher", "publish", "$KV.fl_leader.default", True),
    ("dispatcher", "publish", "$JS.API.STREAM.DELETE.FL_REQUESTS", False),
    ("dispatcher", "publish", "$JS.API.STREAM.PURGE.FL_USAGE", False),
    ("dispatcher", "subscribe", "fl.work.*", True),
    ("dispatcher", "subscribe", "fl.inbox.>", False),
    ("streamer", "publish", "fl.req.default.paid.acme", True),  # the edge, for any tenant
    ("streamer", "publish", "fl.work.default", False),
    ("streamer", "publish", "fl.evt.default", False),
    ("streamer", "publish", "fl.usage.acme", False),
    ("streamer", "publish", "fl.inbox.o.acme.r1", False),
    ("streamer", "subscribe", "fl.inbox.>", True),
    ("streamer", "subscribe", "fl.work.*", False),
    # Pool stats: the dispatcher publishes them, the streamer's dashboard reads them.
    ("dispatcher", "publish", "fl.stats.default", True),
    ("worker", "publish", "fl.stats.default", False),
    ("streamer", "publish", "fl.stats.default", False),
    ("streamer", "subscribe", "fl.stats.*", True),
    ("streamer", "subscribe", "fl.stats.>", False),  # pool ids are one token
    ("producer", "subscribe", "fl.stats.*", False),
    ("worker", "subscribe", "fl.stats.*", False),
])
def test_service_permissions(role, op, subject, ok):
    assert _allowed(PERMS[role], op, subject) is ok


def test_only_the_dispatcher_answers_requests():
    assert PERMS["dispatcher"].get("allow_responses") is True
    assert not any(PERMS[r].get("allow_responses") for r in ("worker", "streamer", "producer"))
    assert "allow_responses" not in ACME


def test_files_are_private_and_passwords_survive_a_rerun(tmp_path):
    out = tmp_path / "auth"
    first = write_nats_auth(["acme"], out, "fl")
    assert set(first) == {"acme", *(service_user(r) for r in SERVICE_ROLES)}
    for f in [out / "auth.conf", *(out / "credentials").iterdir()]:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    second = write_nats_auth(["acme", "globex"], out, "fl")
    assert {k: second[k] for k in first} == first  # issued passwords are kept
    assert "globex" in second and second["globex"] not in first.values()
    text = (out / "auth.conf").read_text()
    users = [json.loads(line.strip().rstrip(",")) for line in text.splitlines()
             if line.strip().startswith("{")]
    assert {u["user"] for u in users} == set(second)
    assert (out / "credentials" / "globex.password").read_text().strip() == second["globex"]


def test_a_tenant_may_not_take_a_service_name(tmp_path):
    with pytest.raises(ValueError, match="reserved"):
        write_nats_auth(["svc-worker"], tmp_path, "fl")


def test_cli_writes_the_config(tmp_path, capsys):
    tenants = tmp_path / "t.yaml"
    tenants.write_text("tenants:\n  acme: {}\n  globex: {}\n")
    assert fairlane_main(["nats-config", "--tenants", str(tenants), "--out",
                          str(tmp_path / "o"), "--prefix", "xy"]) == 0
    assert "include auth.conf" in capsys.readouterr().out
    conf = (tmp_path / "o" / "auth.conf").read_text()
    assert re.search(r'"xy\.req\.\*\.\*\.globex"', conf)


def test_subject_layout():
    assert S.reply_subject("own", "acme", "r1") == "fl.inbox.own.acme.r1"
    assert S.reply_in_tenant_inbox("fl.inbox.own.acme.r1", "acme")
    assert not S.reply_in_tenant_inbox("fl.inbox.own.acme.r1", "globex")
    assert not S.reply_in_tenant_inbox("fl.inbox.own.r1", "own")  # the pre-auth layout
    assert not S.reply_in_tenant_inbox("xx.inbox.own.acme.r1", "acme")
    assert S.cancel("p", "acme") == "fl.cancel.p.acme" and S.cancel("p") == "fl.cancel.p"
    assert S.cancel_tenant("fl.cancel.p.acme") == "acme"
    assert S.cancel_tenant("fl.cancel.p") is None
    assert S.cancel_subscriptions("p") == ("fl.cancel.p.*", "fl.cancel.p")
    assert Subjects.reply_tenant("fl.inbox.own.acme.r1") == "acme"
    assert Subjects.reply_tenant("fl.inbox.own.r1") is None
    assert S.stats("p") == "fl.stats.p" and S.stats_all() == "fl.stats.*"
    with pytest.raises(ProtocolError, match="invalid pool id"):
        S.stats("p.>")
