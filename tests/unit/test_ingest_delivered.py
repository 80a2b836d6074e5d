"""`dispatcher.ingest.num_delivered` reads a JetStream ack subject as nats-py does."""

from __future__ import annotations

import pytest
from nats.aio.msg import Msg

from dispatcher.ingest import num_delivered

pytestmark = pytest.mark.unit

ACK_SUBJECTS = [
    # The layout nats-server sends without a domain (9 tokens).
    "$JS.ACK.FL_REQUESTS.dispatch-default-standard.1.12345.12340.1732861234567890123.42",
    "$JS.ACK.S.c.3.7.2.1732861234567890123.0",
    # With <domain>.<account hash> (11 tokens), and a trailing token (12).
    "$JS.ACK._.ACCHASH.S.c.2.7.2.1732861234567890123.5",
    "$JS.ACK.hub.ACCHASH.S.c.5.7.2.1732861234567890123.5.rand",
]


@pytest.mark.parametrize("reply", ACK_SUBJECTS)
def test_as_nats_py_reads_it(reply):
    msg = Msg(_client=None, subject="fl.req.default.standard.acme", reply=reply, data=b"")
    assert num_delivered(reply) == msg.metadata.num_delivered


@pytest.mark.parametrize("reply", [None, "", "_INBOX.abc.1", "$JS.ACK.too.short",
                                   "$JS.ACK.S.c.x.7.2.1.0", "$JS.API.CONSUMER.INFO.S.c"])
def test_anything_else_is_not_a_delivery(reply):
    assert num_delivered(reply) == 0
