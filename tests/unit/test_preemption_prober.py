"""bench/preemption_prober.py: the parent's side of the prober-process protocol (a stub
child stands in for the prober: the protocol, not the fleet, is under test here)."""

from __future__ import annotations

import argparse
import json
import sys

import pytest

from bench.preemption_prober import GO, READY, prober_argv, run_prober

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def child(code: str) -> list[str]:
    return [sys.executable, "-c", code]


async def test_records_come_back_after_go():
    records = [{"ttft_ms": 20.0 + i, "request_id": f"r{i}"} for i in range(2000)]  # > 64 KiB
    code = (f"import sys, json\nprint({READY!r}, flush=True)\n"
            f"assert sys.stdin.readline().strip() == {GO!r}\n"
            f"print(json.dumps({{'probes': {records!r}}}), flush=True)\n")
    got, t_go = await run_prober(child(code), timeout_s=20)
    assert got == json.loads(json.dumps(records))
    assert t_go > 0


async def test_a_child_that_dies_before_ready_is_an_error():
    with pytest.raises(RuntimeError, match="did not start"):
        await run_prober(child("import sys; sys.exit(3)"), timeout_s=5)


async def test_a_child_that_fails_after_go_is_an_error():
    code = f"import sys\nprint({READY!r}, flush=True)\nsys.stdin.readline()\nsys.exit(1)\n"
    with pytest.raises(RuntimeError, match="exited 1"):
        await run_prober(child(code), timeout_s=5)


async def test_a_child_past_its_time_is_killed():
    code = f"import time\nprint({READY!r}, flush=True)\ntime.sleep(60)\n"
    with pytest.raises(TimeoutError):
        await run_prober(child(code), timeout_s=0.5)


def test_argv_carries_what_probe_reads():
    args = argparse.Namespace(probe_interval_s=0.1, first_grace_s=5.0, done_grace_s=5.0,
                              client_silence_s=3.0)
    argv = prober_argv(nats_url="nats://127.0.0.1:4222", prefix="pe1", tenant="L", seed=7,
                       duration_s=20.5, out_range=(16, 48), args=args, done_grace_s=0.0)
    opts = dict(zip(argv[2::2], argv[3::2], strict=True))
    assert opts["--tenant"] == "L" and opts["--seed"] == "7"
    assert (opts["--out-min"], opts["--out-max"]) == ("16", "48")
    assert float(opts["--done-grace-s"]) == 0.0  # the alone phase's, not the bench's
    assert float(opts["--client-silence-s"]) == 3.0
