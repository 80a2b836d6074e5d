"""A leader that loses its lease while NATS is unreachable rejoins as a standby in the
same process and leads again: under `fairlane up` nothing would restart it."""

from __future__ import annotations

import asyncio
import os
import signal

import nats
import pytest

from fairlane.embedded import NatsServer
from fairlane.subjects import Subjects
from tests.helpers import wait_until
from tests.procs import Procs

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(90)]


async def test_leader_cut_off_past_its_lease_leads_again_without_a_restart(tmp_path, uid):
    procs = Procs(tmp_path)
    server = NatsServer().start()
    nc = None
    try:
        subjects = Subjects(f"t{uid}")
        disp = procs.spawn("dispatcher", "-m", "dispatcher", "--nats-url", server.url,
                           "--prefix", subjects.prefix, "--pool", "p",
                           "--leader-lease-ttl-s", "1", "--housekeeping-ms", "50")
        nc = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        kv = None

        async def holder() -> int | None:
            nonlocal kv
            try:
                kv = kv or await nc.jetstream().key_value(f"{subjects.prefix}_leader")
                entry = await kv.get("p")
                return int(entry.value.decode().rsplit(":", 1)[1])  # host:nonce:pid
            except Exception:
                return None

        await wait_until(holder, 20, interval_s=0.1)
        assert await holder() == disp.pid
        os.kill(server.proc.pid, signal.SIGSTOP)  # the broker is unreachable past the TTL
        await asyncio.sleep(3.0)
        os.kill(server.proc.pid, signal.SIGCONT)

        log_path = tmp_path / "dispatcher.log"
        # It noticed the loss (the key lapsed while the broker was frozen) ...
        await wait_until(lambda: "rejoining_as_standby" in log_path.read_text(), 30,
                         interval_s=0.1)

        async def leads_again() -> bool:  # ... and took the lease again
            return await holder() == disp.pid and "lease_acquired" in log_path.read_text(
            ).split("rejoining_as_standby", 1)[1]

        await wait_until(leads_again, 30, interval_s=0.2)
        assert disp.poll() is None  # the same process, never exited
    finally:
        if nc is not None:
            await nc.close()
        procs.close()
        server.stop()
