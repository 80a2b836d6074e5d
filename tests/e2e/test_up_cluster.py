"""`fairlane up --nats-cluster 3`: three nats-servers, streams with 3 replicas, and the
fleet keeps serving when the node leading the request stream is killed."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time

import nats
import pytest

from producer.client import FairlaneClient
from tests.helpers import spec, wait_until
from tests.procs import alive, cmdline, descendants

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]


async def test_up_with_a_3_node_cluster_survives_the_stream_leader_dying(tmp_path):
    data = tmp_path / "fl"
    proc = subprocess.Popen(  # noqa: ASYNC220 - returns at once; output read in a thread
        [sys.executable, "-m", "fairlane.cli", "up", "--data-dir", str(data), "--nats-port", "0",
         "--http-port", "0", "--no-redis", "--no-streamer", "--workers", "1",
         "--time-scale", "0.1", "--nats-cluster", "3"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out = ""
        deadline = time.monotonic() + 90
        while "Ctrl-C stops everything" not in out:
            assert time.monotonic() < deadline, out
            line = await asyncio.to_thread(proc.stdout.readline)
            assert line, f"fairlane up exited early:\n{out}"
            out += line
        urls = re.search(r"NATS: (\S+)", out).group(1).split(",")
        assert len(urls) == 3
        creds = data / "nats-auth" / "credentials"
        admin = await nats.connect(urls, user="svc-admin",
                                   password=(creds / "svc-admin.password").read_text().strip())
        js = admin.jetstream()
        info = await js.stream_info("FL_REQUESTS")
        assert info.config.num_replicas == 3
        assert (await js.stream_info("KV_fl_leader")).config.num_replicas == 3
        client = await FairlaneClient.connect(
            ",".join(urls), tenant="acme", user="acme",
            password=(creds / "acme.password").read_text().strip())
        first = await (await client.submit(spec(tenant="acme", prompt="hi", max_tokens=4, expected_output_tokens=4))).collect()
        assert first.usage.completion_tokens == 4

        leader = info.cluster.leader
        pid = next(p for p in descendants(proc.pid)
                   if "nats-server" in cmdline(p) and f"--server_name {leader} " in cmdline(p))
        os.kill(pid, signal.SIGKILL)
        await wait_until(lambda: not alive(pid), 10)
        # A new stream leader is elected; the library re-sends the publish that found
        # none meanwhile, and clients and services fail over to live nodes.
        t0 = time.monotonic()
        stream = await client.submit(spec(tenant="acme", prompt="hi", max_tokens=4, expected_output_tokens=4))
        again = await asyncio.wait_for(stream.collect(), 30)
        assert again.usage.completion_tokens == 4
        assert time.monotonic() - t0 < 20
        # `fairlane up` restarted the node (same ports and store): it catches up.
        def restarted() -> bool:
            return any("nats-server" in cmdline(p) and f"--server_name {leader} " in cmdline(p)
                       for p in descendants(proc.pid) if p != pid)

        await wait_until(restarted, 30, interval_s=0.2)

        async def current() -> bool:
            info = await js.stream_info("FL_REQUESTS")
            return bool(info.cluster.leader) and all(
                r.current and not r.offline for r in info.cluster.replicas or [])

        await wait_until(current, 30, interval_s=0.2)
        await client.close()
        await admin.close()
        proc.send_signal(signal.SIGINT)
        rest = await asyncio.to_thread(proc.communicate, timeout=60)
        assert proc.returncode == 0 and f"nats-server-{leader} exited" in rest[0], rest[0]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                await asyncio.to_thread(proc.wait, 30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
