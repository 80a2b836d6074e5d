"""`fairlane up` as a user runs it: starts, serves, and Ctrl-C leaves nothing behind."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import subprocess

import pytest

from producer.client import FairlaneClient
from tests.helpers import spec, wait_until
from tests.procs import alive, cmdline, descendants, start_fairlane_up

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


async def _start_up(tmp_path) -> tuple[subprocess.Popen, str, int, int]:
    """`fairlane up` on free ports; returns once it says it is up, with its ports."""
    proc, out = await start_fairlane_up(tmp_path / "fl")
    nats_port = int(re.search(r"NATS: nats://127.0.0.1:(\d+)", out).group(1))
    http_port = int(re.search(r"http://127.0.0.1:(\d+)/v1", out).group(1))
    return proc, out, nats_port, http_port


async def test_fairlane_up_serves_and_ctrl_c_leaves_no_process(tmp_path):
    proc, out, nats_port, http_port = await _start_up(tmp_path)
    try:
        children = descendants(proc.pid)
        assert len(children) >= 6  # nats, redis, dispatcher, 2 workers, streamer

        # NATS auth is on by default: log in as the tenant, with the password up wrote.
        password = (tmp_path / "fl" / "nats-auth" / "credentials" / "acme.password").read_text()
        client = await FairlaneClient.connect(f"nats://127.0.0.1:{nats_port}", tenant="acme",
                                              user="acme", password=password.strip())
        done = await (await client.submit(spec(tenant="acme", prompt="hi", max_tokens=8))).collect()
        await client.close()
        assert done.finish_reason in ("stop", "length") and done.usage.completion_tokens > 0

        # The public edge, with the official SDK and a demo key, on the real fleet.
        from openai import AsyncOpenAI

        sdk = AsyncOpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="sk-acme-demo")
        reply = await sdk.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert 0 < reply.usage.completion_tokens <= 8
        parts = [c async for c in await sdk.completions.create(
            model="default", prompt="hi", max_tokens=8, stream=True)]
        assert parts and parts[-1].choices[0].finish_reason in ("stop", "length")
        await sdk.close()

        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
        rest = await asyncio.to_thread(proc.communicate, timeout=60)
        assert proc.returncode == 0, out + rest[0]
        assert "fairlane stopped" in rest[0]
        assert [pid for pid in children if alive(pid)] == []
        assert not _port_open(nats_port) and not _port_open(http_port)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_fairlane_up_killed_with_sigkill_takes_its_children_along(tmp_path):
    proc, _, nats_port, http_port = await _start_up(tmp_path)
    children = descendants(proc.pid)
    assert len(children) >= 6
    proc.kill()  # no chance to clean up: the kernel's parent-death signal must do it
    proc.wait()
    try:
        await wait_until(lambda: not [pid for pid in children if alive(pid)], 30)
    except TimeoutError:
        left = [cmdline(pid)[:120] for pid in children if alive(pid)]
        pytest.fail(f"still running 30 s after SIGKILL of fairlane up: {left}")
    assert not _port_open(nats_port) and not _port_open(http_port)


async def test_a_second_stop_signal_while_stopping_still_stops_cleanly(tmp_path):
    """Ctrl-C twice, or Ctrl-C and a supervisor's SIGTERM: the second signal lands while
    the first is being handled. It must not cut the shutdown short (a traceback, the
    children's graceful stop skipped)."""
    proc, out, nats_port, http_port = await _start_up(tmp_path)
    try:
        children = descendants(proc.pid)
        proc.send_signal(signal.SIGINT)
        proc.send_signal(signal.SIGTERM)  # a different signal: not merged with the first
        rest = await asyncio.to_thread(proc.communicate, timeout=60)
        assert proc.returncode == 0, out + rest[0]
        assert "Traceback" not in rest[0] and "fairlane stopped" in rest[0], rest[0]
        assert [pid for pid in children if alive(pid)] == []
        assert not _port_open(nats_port) and not _port_open(http_port)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
