"""TLS on client connections: with the CA made at test time a client connects (and logs
in); a plaintext client is refused, and so is one that does not trust the CA."""

from __future__ import annotations

import asyncio
import json
import ssl
import uuid

import nats
import pytest

from fairlane.embedded import NatsServer
from fairlane.natsauth import write_nats_auth
from fairlane.subjects import Subjects
from producer.client import FairlaneClient
from tests.tls_certs import make_tls_files

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    subjects = Subjects(f"s{uuid.uuid4().hex[:8]}")
    tls = make_tls_files(tmp_path_factory.mktemp("tls"))
    out = tmp_path_factory.mktemp("nats-auth")
    passwords = write_nats_auth(["alpha"], out, subjects.prefix)
    server = NatsServer(auth_conf=str(out / "auth.conf"), tls=tls).start()
    yield server, subjects, passwords, tls
    server.stop()


async def test_client_with_the_ca_connects_and_logs_in(tls_server):
    server, subjects, pw, tls = tls_server
    client = await FairlaneClient.connect(server.url, prefix=subjects.prefix, tenant="alpha",
                                          user="alpha", password=pw["alpha"],
                                          tls_ca_file=tls.ca_file)
    try:
        assert client.nc.is_connected  # the server requires TLS: this one is TLS
        await client.nc.publish(subjects.request("p", "standard", "alpha"), b"{}")
        await client.nc.flush(timeout=2)
    finally:
        await client.close()


async def test_plaintext_client_is_refused(tls_server):
    server, *_ = tls_server
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        info = json.loads((await asyncio.wait_for(reader.readline(), 5)).split(b" ", 1)[1])
        assert info["tls_required"] is True
        writer.write(b'CONNECT {"verbose":false,"user":"alpha","pass":"x"}\r\nPING\r\n')
        await writer.drain()
        rest = await asyncio.wait_for(reader.read(4096), 5)  # an -ERR, then closed
        assert b"PONG" not in rest
        assert await asyncio.wait_for(reader.read(), 5) == b""  # the server hung up
    finally:
        writer.close()


async def test_client_that_does_not_trust_the_ca_is_refused(tls_server):
    server, subjects, pw, _ = tls_server
    with pytest.raises((ssl.SSLError, OSError, nats.errors.Error, TimeoutError)):
        await nats.connect(server.url, user="alpha", password=pw["alpha"],
                           tls=ssl.create_default_context(), allow_reconnect=False,
                           max_reconnect_attempts=0, connect_timeout=3)


async def test_a_cluster_routes_over_mutual_tls(tmp_path):
    """Three nodes whose routes speak TLS and verify each other's certificate: the
    cluster forms (R3 stream, every replica current), and a route port asks for TLS."""
    from fairlane.natsauth import service_user
    from fairlane.natscluster import NatsCluster

    tls = make_tls_files(tmp_path / "tls")
    passwords = write_nats_auth(["alpha"], tmp_path / "auth", "fl")
    cluster = NatsCluster(3, str(tmp_path / "nats"), log_dir=str(tmp_path), tls=tls,
                          auth_conf=str(tmp_path / "auth" / "auth.conf"))
    try:
        cluster.start()
        admin = service_user("admin")
        nc = await nats.connect(cluster.urls[1:], user=admin, password=passwords[admin],
                                tls=ssl.create_default_context(cafile=tls.ca_file))
        js = nc.jetstream()
        from nats.js.api import StreamConfig

        await js.add_stream(StreamConfig(name="TLS_R3", subjects=["tlsr3.>"], num_replicas=3))
        await js.publish("tlsr3.x", b"1")
        info = await js.stream_info("TLS_R3")
        assert info.cluster.leader and len(info.cluster.replicas) == 2
        await nc.close()
        route_port = int(json.loads(
            (tmp_path / "nats" / "n1" / "server.conf").read_text().split("cluster ", 1)[1]
            .splitlines()[0])["listen"].rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", route_port)
        # A plaintext peer gets either an INFO that demands TLS or no INFO at all (the
        # route waits for a TLS handshake and times the peer out).
        info_line = await asyncio.wait_for(reader.readline(), 5)
        writer.close()
        if info_line:
            assert json.loads(info_line.split(b" ", 1)[1])["tls_required"] is True
    finally:
        cluster.stop()
