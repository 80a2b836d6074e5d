"""The `fairlane` command.

    fairlane up                  # nats-server, redis, dispatcher, simulated workers, streamer
    fairlane up --workers 4 --engine vllm --model /models/llama
    fairlane hash-key sk-...     # the value to put in a tenants file's api_keys

`up` runs every part as a child process of its own and stops all of them on Ctrl-C
or SIGTERM (SIGTERM, then SIGKILL after a grace period). Children also get SIGTERM
from the kernel if `fairlane up` itself dies (PR_SET_PDEATHSIG), so no orphan keeps a
port.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from fairlane.embedded import NatsServer, RedisServer, die_with_parent, free_port
from fairlane.protocol import PoolInfoRequest, ProtocolError, decode_event, encode
from fairlane.settings import load_settings
from fairlane.subjects import Subjects

DEMO_TENANTS = Path(__file__).with_name("demo_tenants.yaml")


class UpSettings(msgspec.Struct, kw_only=True):
    data_dir: str = ".fairlane"  # nats store and logs
    nats_port: int = 4222  # 0 = any free port
    http_port: int = 8080  # streamer; 0 = any free port
    pool: str = "default"
    prefix: str = "fl"
    workers: int = 2
    engine: str = "sim"  # sim | vllm
    model: str = ""  # model path for --engine vllm
    max_num_seqs: int = 32
    time_scale: float = 1.0  # simulator speed-up (tests and demos)
    cost_model: str = "default"
    tenants_file: str = ""  # empty: the packaged demo file (demo API keys, see README)
    policy: str = ""  # override the pool's policy (fifo | drr | vtc)
    redis: bool = True
    streamer: bool = True
    ready_timeout_s: float = 120.0
    log_level: str = "info"


class Fleet:
    """The child processes of one `fairlane up`."""

    def __init__(self, s: UpSettings) -> None:
        self.s = s
        self.data_dir = Path(s.data_dir).resolve()
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.nats: NatsServer | None = None
        self.redis: RedisServer | None = None

    def _spawn(self, name: str, module: str, args: list[str]) -> None:
        log_path = self.data_dir / "logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        out = open(log_path, "ab")  # noqa: SIM115 - owned by the child
        env = dict(os.environ, FAIRLANE_LOG_LEVEL=self.s.log_level)
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args], stdout=out, stderr=out, env=env,
            start_new_session=True, preexec_fn=die_with_parent,
        )
        out.close()
        self.procs.append((name, proc))

    def start(self) -> None:
        s = self.s
        if not s.tenants_file:
            s.tenants_file = str(DEMO_TENANTS)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.nats = NatsServer(
            store_dir=str(self.data_dir / "nats"),
            port=s.nats_port or free_port(),
            log_file=str(self.data_dir / "logs" / "nats-server.log"),
        )
        (self.data_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.nats.start()
        common = ["--nats-url", self.nats.url, "--prefix", s.prefix, "--pool", s.pool]
        if s.redis:
            self.redis = RedisServer().start()
        disp = [*common]
        if s.tenants_file:
            disp += ["--tenants-file", s.tenants_file]
        if s.policy:
            disp += ["--policy", s.policy]
        self._spawn("dispatcher", "dispatcher", disp)
        for i in range(s.workers):
            args = [*common, "--worker-id", f"worker-{i}", "--engine", s.engine,
                    "--max-num-seqs", str(s.max_num_seqs)]
            if s.engine == "sim":
                args += ["--time-scale", str(s.time_scale), "--cost-model", s.cost_model]
            if s.model:
                args += ["--model", s.model]
            self._spawn(f"worker-{i}", "gpu_worker", args)
        if s.streamer and _have_module("streamer.__main__"):
            self.http_port = s.http_port or free_port()
            args = ["--nats-url", self.nats.url, "--prefix", s.prefix, "--pool", s.pool,
                    "--port", str(self.http_port)]
            if self.redis:
                args += ["--redis-url", self.redis.url]
            if s.tenants_file:
                args += ["--tenants-file", s.tenants_file]
            self._spawn("streamer", "streamer", args)

    def dead_children(self) -> list[str]:
        return [f"{n} (exit {p.returncode})" for n, p in self.procs if p.poll() is not None]

    def stop(self, grace_s: float = 10.0) -> None:
        for _, p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for _, p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.redis:
            self.redis.stop()
        if self.nats:
            self.nats.stop()


def _have_module(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


async def _wait_ready(fleet: Fleet, timeout_s: float) -> None:
    """Ready = every worker has sent a heartbeat and the dispatcher answers."""
    import nats
    import nats.errors

    nc = await nats.connect(fleet.nats.url)
    seen: set[str] = set()
    done = asyncio.Event()

    async def on_evt(msg) -> None:
        with contextlib.suppress(ProtocolError):
            ev = decode_event(msg.data)
            if type(ev).__name__ == "Heartbeat":
                seen.add(ev.worker_id)
                if len(seen) >= fleet.s.workers:
                    done.set()

    await nc.subscribe(Subjects(fleet.s.prefix).events(fleet.s.pool), cb=on_evt)
    try:
        deadline = time.monotonic() + timeout_s
        while not done.is_set():
            if fleet.dead_children():
                raise RuntimeError("a process exited during start: " + ", ".join(fleet.dead_children()))
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers not ready after {timeout_s}s (see {fleet.data_dir}/logs)")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), 0.5)
        subjects = Subjects(fleet.s.prefix)
        while True:
            try:
                await nc.request(subjects.info(fleet.s.pool),
                                 encode(PoolInfoRequest(tenant="_ready")), timeout=0.5)
                break
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                if time.monotonic() > deadline:
                    raise RuntimeError("dispatcher not answering") from None
                await asyncio.sleep(0.1)
    finally:
        await nc.close()


def cmd_up(argv: list[str]) -> int:
    s = load_settings(UpSettings, argv, prog="fairlane up",
                      description="run a whole fairlane fleet on this machine")
    fleet = Fleet(s)
    stop = {"flag": False}

    def on_signal(signum, frame) -> None:
        stop["flag"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    rc = 0
    try:
        fleet.start()
        asyncio.run(_wait_ready(fleet, s.ready_timeout_s))
        port_line = ""
        if getattr(fleet, "http_port", None):
            port_line = (f"  HTTP (OpenAI API): http://127.0.0.1:{fleet.http_port}/v1  "
                         f"websocket: ws://127.0.0.1:{fleet.http_port}/v1/stream\n")
            if s.tenants_file == str(DEMO_TENANTS):
                port_line += "  demo API keys: sk-acme-demo, sk-globex-demo, sk-hobbyist-demo\n"
        print(
            f"fairlane is up: {s.workers} {s.engine} worker(s), pool {s.pool!r}\n"
            f"  NATS: {fleet.nats.url}\n{port_line}"
            f"  logs: {fleet.data_dir / 'logs'}\n"
            f"  tenants: {s.tenants_file}\n"
            f"try:  python -m producer --nats-url {fleet.nats.url} --tenant acme "
            f"--prompt 'hello' --max-tokens 32\n"
            f"Ctrl-C stops everything.",
            flush=True,
        )
        while not stop["flag"]:
            dead = fleet.dead_children()
            if dead:
                print("stopping: a process exited: " + ", ".join(dead), file=sys.stderr, flush=True)
                rc = 1
                break
            time.sleep(0.2)
    except RuntimeError as exc:
        print(f"fairlane up failed: {exc}", file=sys.stderr, flush=True)
        rc = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        fleet.stop()
        print("fairlane stopped", flush=True)
    return rc


def cmd_hash_key(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: fairlane hash-key KEY", file=sys.stderr)
        return 2
    from fairlane.tenants import hash_api_key

    print(hash_api_key(argv[0]))
    return 0


COMMANDS = {"up": cmd_up, "hash-key": cmd_hash_key}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print("usage: fairlane {up|hash-key} [options]   (fairlane up --help)", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
