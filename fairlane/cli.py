"""The `fairlane` command.

    fairlane up                  # nats-server, redis, dispatcher, simulated workers, streamer
    fairlane up --workers 4 --engine vllm --model /models/llama
    fairlane hash-key sk-...     # the value to put in a tenants file's api_keys
    fairlane usage --since -24h --format csv     # usage totals per tenant from FL_USAGE
    fairlane tenants check tenants.yaml          # validate a tenants file as the fleet does
    fairlane tenants schema                      # the tenants file's JSON Schema
    fairlane nats-config --tenants tenants.yaml  # NATS users: one per tenant, services
    fairlane simulate workload.yaml --workers 64 # the scheduler over simulated GPUs

`up` runs every part as a child process of its own and stops all of them on Ctrl-C
or SIGTERM (SIGTERM, then SIGKILL after a grace period). Children also get SIGTERM
from the kernel if `fairlane up` itself dies (PR_SET_PDEATHSIG), so no orphan keeps a
port.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import msgspec

from fairlane.embedded import (
    EmbeddedServerError,
    RedisServer,
    die_with_parent,
    free_port,
    port_in_use,
    wait_listening,
)
from fairlane.logs import LogLevel
from fairlane.natsauth import AUTH_FILE, CREDENTIALS_DIR, service_user, write_nats_auth
from fairlane.natscluster import NatsCluster, default_replicas
from fairlane.poolconfig import Policy
from fairlane.protocol import PoolInfoRequest, ProtocolError, decode_event, encode
from fairlane.runtime import run_in_foreground
from fairlane.settings import PositiveInt, load_settings
from fairlane.subjects import Subjects

DEMO_TENANTS = Path(__file__).with_name("demo_tenants.yaml")
MAX_NODE_RESTARTS = 5  # per NATS node of a cluster, over one `fairlane up`


class UpSettings(msgspec.Struct, kw_only=True):
    data_dir: str = ".fairlane"  # nats store and logs
    nats_port: int = 4222  # 0 = any free port (in a cluster: the first node's port)
    # NATS nodes: 1 = a single nats-server; 3 = a cluster on loopback (routes, JetStream
    # on each); every process gets every node's URL and fails over between them.
    nats_cluster: PositiveInt = 1
    # JetStream replicas of the streams and the leader-lease bucket; empty: min(3, nodes).
    stream_replicas: PositiveInt | None = None
    http_port: int = 8080  # streamer; 0 = any free port
    pool: str = "default"  # the model pool the fleet serves
    prefix: str = "fl"  # subject and stream prefix of the deployment
    workers: PositiveInt = 2  # GPU worker processes to start
    engine: Literal["sim", "vllm"] = "sim"  # the workers' engine: simulator or vLLM
    model: str = ""  # model path for --engine vllm
    max_num_seqs: PositiveInt = 32  # each worker's batch cap
    time_scale: float = 1.0  # simulator speed-up (tests and demos)
    step_model: str = "default"  # simulator step-time model: name in gpu_worker/sim/step_models or a .json path
    tenants_file: str = ""  # empty: the packaged demo file (demo API keys, see README)
    policy: Policy | None = None  # override the pool's policy from the tenants file
    redis: bool = True  # start a redis-server for the edge's rate limits
    # The dispatcher and every worker serve /metrics on a free port each (the streamer
    # on its HTTP port); the ready message lists the URLs. --no-metrics: they serve none.
    metrics: bool = True  # serve every process's /metrics and print where
    streamer: bool = True  # start the HTTP/websocket edge
    ready_timeout_s: float = 120.0  # give up if the fleet is not ready by then
    log_level: LogLevel = "info"  # least severe log level the children write
    # NATS auth: one user per tenant of the tenants file and least-privilege service
    # users (fairlane nats-config, written to <data-dir>/nats-auth); --no-auth: none.
    auth: bool = True


class Fleet:
    """The child processes of one `fairlane up`."""

    def __init__(self, s: UpSettings) -> None:
        self.s = s
        self.data_dir = Path(s.data_dir).resolve()
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.nats: NatsCluster | None = None
        self.node_restarts: dict[str, int] = {}
        self.redis: RedisServer | None = None
        self.metrics_urls: dict[str, str] = {}  # process name -> its /metrics URL
        # Wraps each spawn: `cmd_up` defers stop signals there (see `_StopSignals`).
        self.hold: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    @property
    def auth_dir(self) -> Path:
        return self.data_dir / "nats-auth"

    def password_file(self, user: str) -> Path:
        return self.auth_dir / CREDENTIALS_DIR / f"{user}.password"

    def login_env(self, role: str) -> dict[str, str]:
        """A child's NATS login: its service user and password file (in the
        environment, never on the command line where `ps` shows it)."""
        if not (self.s.auth and role):
            return {}
        user = service_user(role)
        return {"FAIRLANE_NATS_USER": user,
                "FAIRLANE_NATS_PASSWORD_FILE": str(self.password_file(user))}

    def _spawn(self, name: str, module: str, args: list[str], role: str = "") -> None:
        log_path = self.data_dir / "logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        out = open(log_path, "ab")  # noqa: SIM115 - owned by the child
        env = dict(os.environ, FAIRLANE_LOG_LEVEL=self.s.log_level, **self.login_env(role))
        with self.hold():
            proc = subprocess.Popen(
                [sys.executable, "-m", module, *args], stdout=out, stderr=out, env=env,
                start_new_session=True, preexec_fn=die_with_parent,
            )
            self.procs.append((name, proc))
        out.close()

    def _metrics_args(self, name: str) -> list[str]:
        """A child's --metrics-port (a free port of its own), noting its URL."""
        if not self.s.metrics:
            return []
        taken = {int(u.rsplit(":", 1)[1].split("/")[0]) for u in self.metrics_urls.values()}
        while (port := free_port()) in taken:
            pass
        self.metrics_urls[name] = f"http://127.0.0.1:{port}/metrics"
        return ["--metrics-port", str(port)]

    def start(self) -> None:
        s = self.s
        if not s.tenants_file:
            s.tenants_file = str(DEMO_TENANTS)
        for port, flag in ((s.nats_port, "--nats-port"),
                           (s.http_port if s.streamer else 0, "--http-port")):
            if port and port_in_use(port):
                raise EmbeddedServerError(f"port {port} ({flag}) is already in use: choose "
                                          f"another, or {flag} 0 for any free port")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if s.auth:  # passwords already issued are kept (fairlane nats-config)
            from fairlane.tenants import load_tenants

            write_nats_auth(sorted(load_tenants(s.tenants_file).tenants), self.auth_dir,
                            s.prefix)
        self.nats = NatsCluster(
            s.nats_cluster, str(self.data_dir / "nats"), log_dir=str(self.data_dir / "logs"),
            client_port=s.nats_port or free_port(),
            auth_conf=str(self.auth_dir / AUTH_FILE) if s.auth else None,
        )
        (self.data_dir / "logs").mkdir(parents=True, exist_ok=True)
        with self.hold():
            self.nats.start()
        replicas = s.stream_replicas or default_replicas(s.nats_cluster)
        common = ["--nats-url", self.nats.url, "--prefix", s.prefix, "--pool", s.pool,
                  "--stream-replicas", str(replicas)]
        if s.redis:
            with self.hold():
                self.redis = RedisServer().start()
        disp = [*common]
        if s.tenants_file:
            disp += ["--tenants-file", s.tenants_file]
        if s.policy:
            disp += ["--policy", s.policy]
        self._spawn("dispatcher", "dispatcher", disp + self._metrics_args("dispatcher"),
                    "dispatcher")
        for i in range(s.workers):
            args = [*common, "--worker-id", f"worker-{i}", "--engine", s.engine,
                    "--max-num-seqs", str(s.max_num_seqs)]
            if s.engine == "sim":
                args += ["--time-scale", str(s.time_scale), "--step-model", s.step_model]
            if s.model:
                args += ["--model", s.model]
            args += self._metrics_args(f"worker-{i}")
            self._spawn(f"worker-{i}", "gpu_worker", args, "worker")
        if s.streamer and _have_module("streamer.__main__"):
            self.http_port = s.http_port or free_port()
            args = [*common, "--port", str(self.http_port)]
            if self.redis:
                args += ["--redis-url", self.redis.url]
            if s.tenants_file:
                args += ["--tenants-file", s.tenants_file]
            self._spawn("streamer", "streamer", args, "streamer")
            if s.metrics:
                self.metrics_urls["streamer"] = f"http://127.0.0.1:{self.http_port}/metrics"

    def dead_children(self) -> list[str]:
        """``name (exit N): its last log line`` for each child that has exited, servers
        included, so the user reads the child's own reason here, not in a log file."""
        nodes = [(self.nats.log_name(n.server_name), n) for n in self.nats.nodes] if (
            self.nats) else []
        servers = [(name, srv.proc) for name, srv in (*nodes, ("redis-server", self.redis))
                   if srv is not None and srv.proc is not None]
        out = []
        for name, p in [*servers, *self.procs]:
            if p.poll() is not None:
                line = _last_line(self.data_dir / "logs" / f"{name}.log")
                out.append(f"{name} (exit {p.returncode})" + (f": {line}" if line else ""))
        return out

    def revive_nats_nodes(self) -> None:
        """In a cluster, a node that died is restarted (same ports and store: it catches
        up from its peers) instead of stopping the fleet, which kept serving through
        the others. A node dying again and again (MAX_NODE_RESTARTS) stops the fleet."""
        if self.nats is None or self.nats.size == 1:
            return
        for node in self.nats.nodes:
            if node.proc is None or node.proc.poll() is None:
                continue
            name = self.nats.log_name(node.server_name)
            if self.node_restarts.get(name, 0) >= MAX_NODE_RESTARTS:
                continue  # left dead: dead_children reports it
            self.node_restarts[name] = self.node_restarts.get(name, 0) + 1
            print(f"{name} exited (code {node.proc.returncode}); restarting it "
                  f"({self.node_restarts[name]}/{MAX_NODE_RESTARTS})", file=sys.stderr, flush=True)
            with contextlib.suppress(EmbeddedServerError), self.hold():
                self.nats.start_node(node.server_name)

    def check_alive(self) -> None:
        """RuntimeError with each dead child's own last words, if any has exited."""
        dead = self.dead_children()
        if dead:
            raise RuntimeError("a process exited during start: " + "; ".join(dead))

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


def _last_line(path: Path, max_bytes: int = 4096) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - max_bytes))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    return next((ln.strip() for ln in reversed(lines) if ln.strip()), "")


def _have_module(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


async def _wait_ready(fleet: Fleet, timeout_s: float) -> None:
    """Ready = every worker heartbeats, the dispatcher answers, the streamer listens."""
    import nats
    import nats.errors

    async def quiet(exc: Exception) -> None:  # the default prints a traceback per attempt
        pass

    login = {}
    if fleet.s.auth:
        admin = service_user("admin")
        login = {"user": admin, "password": fleet.password_file(admin).read_text().strip()}
    try:
        nc = await nats.connect(fleet.nats.urls, max_reconnect_attempts=3, error_cb=quiet,
                                **login)
    except (OSError, TimeoutError, nats.errors.Error) as exc:
        dead = "; ".join(fleet.dead_children())
        raise RuntimeError(f"cannot reach nats-server at {fleet.nats.url} ({exc})"
                           + (f": {dead}" if dead else "")) from None
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
            fleet.check_alive()
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
                fleet.check_alive()
                if time.monotonic() > deadline:
                    raise RuntimeError("dispatcher not answering") from None
                await asyncio.sleep(0.1)
        # The edge too: a client may connect the moment the endpoints are printed.
        if getattr(fleet, "http_port", None):
            await wait_listening(fleet.http_port, deadline, fleet.check_alive, "streamer")
    finally:
        await nc.close()


class _Interrupted(BaseException):
    """SIGINT/SIGTERM: unwinds whatever `fairlane up` is doing, start-up included
    (waiting for a port or for the workers), straight to stopping the children."""


class _StopSignals:
    """Raise `_Interrupted` on the first SIGINT/SIGTERM (a later one would cut the
    shutdown short), except inside `held()`: an exception raised in a fork's at-fork
    hooks is swallowed (and a child half-registered), so one raised then waits."""

    def __init__(self) -> None:
        self.requested = False
        self._depth = 0

    def install(self) -> None:
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        first, self.requested = not self.requested, True
        if first and not self._depth:
            raise _Interrupted

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self.requested and not self._depth:
                raise _Interrupted


def cmd_up(argv: list[str]) -> int:
    s = load_settings(UpSettings, argv, prog="fairlane up",
                      description="run a whole fairlane fleet on this machine")
    fleet = Fleet(s)
    signals = _StopSignals()
    fleet.hold = signals.held
    signals.install()
    rc = 0
    try:
        fleet.start()
        asyncio.run(_wait_ready(fleet, s.ready_timeout_s))
        _print_ready(fleet)
        while True:
            fleet.revive_nats_nodes()
            if dead := fleet.dead_children():
                break
            time.sleep(0.2)
        print("stopping: a process exited: " + "; ".join(dead), file=sys.stderr, flush=True)
        rc = 1
    except _Interrupted:
        pass
    except (RuntimeError, ValueError) as exc:  # EmbeddedServerError; a bad tenants file
        print(f"fairlane up failed: {exc}", file=sys.stderr, flush=True)
        rc = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        fleet.stop()
        print("fairlane stopped", flush=True)
    return rc


def _print_ready(fleet: Fleet) -> None:
    s = fleet.s
    port_line = ""
    # The streamer's admin endpoints (/dashboard, its /metrics) want an admin key.
    admin_key = "sk-admin-demo" if s.tenants_file == str(DEMO_TENANTS) else "<admin key>"
    if getattr(fleet, "http_port", None):
        port_line = (f"  HTTP (OpenAI API): http://127.0.0.1:{fleet.http_port}/v1  "
                     f"websocket: ws://127.0.0.1:{fleet.http_port}/v1/stream\n"
                     f"  dashboard: http://127.0.0.1:{fleet.http_port}/dashboard?key={admin_key}\n")
        if s.tenants_file == str(DEMO_TENANTS):
            port_line += ("  demo API keys: sk-acme-demo, sk-globex-demo, sk-hobbyist-demo; "
                          "admin key: sk-admin-demo\n")
    login = ""
    if s.auth:
        port_line += (f"  NATS auth: on, users and passwords in {fleet.auth_dir} "
                      f"(--no-auth turns it off)\n")
        login = f"--nats-user acme --nats-password-file {fleet.password_file('acme')} "
    if fleet.metrics_urls:  # one line per process, "name URL"
        port_line += "  metrics:\n" + "".join(
            f"    {name:<11} {url}\n" for name, url in fleet.metrics_urls.items())
        if "streamer" in fleet.metrics_urls:
            port_line += f"    (streamer: send 'Authorization: Bearer {admin_key}')\n"
    print(
        f"fairlane is up: {s.workers} {s.engine} worker(s), pool {s.pool!r}\n"
        f"  NATS: {fleet.nats.url}\n{port_line}"
        f"  logs: {fleet.data_dir / 'logs'}\n"
        f"  tenants: {s.tenants_file}\n"
        f"try:  python -m producer --nats-url {fleet.nats.url} --tenant acme {login}"
        f"--prompt 'hello' --max-tokens 32\n"
        f"Ctrl-C stops everything.",
        flush=True,
    )


def cmd_hash_key(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="fairlane hash-key",
        description="Print the hash of an API key: the value to put in a tenants "
                    "file's api_keys (keys are never stored in plain text).")
    parser.add_argument("key", nargs="?", help="the API key; read from stdin if left out "
                                               "(keeps it out of the shell history)")
    args = parser.parse_args(argv)
    key = args.key if args.key is not None else sys.stdin.read().strip()
    if not key:
        parser.error("empty key")
    from fairlane.tenants import hash_api_key

    print(hash_api_key(key))
    return 0


def cmd_usage(argv: list[str]) -> int:
    from fairlane.usage_export import cmd_usage as run

    return run(argv)


def cmd_nats_config(argv: list[str]) -> int:
    from fairlane.natsauth import cmd_nats_config as run

    return run(argv)


def cmd_simulate(argv: list[str]) -> int:
    # Own package: it runs cores the kernel must not import. Ctrl-C is its to handle.
    return run_in_foreground([sys.executable, "-m", "fleetsim", *argv])


def cmd_tenants(argv: list[str]) -> int:
    from fairlane.tenants_tool import cmd_tenants as run

    return run(argv)


COMMANDS = {
    "up": (cmd_up, "run the whole fleet on this machine (fairlane up --help)"),
    "hash-key": (cmd_hash_key, "print the hash of an API key, for a tenants file"),
    "usage": (cmd_usage, "export per-tenant usage totals for a period, as CSV or JSON"),
    "tenants": (cmd_tenants, "check a tenants file (tenants check FILE) or print its "
                             "JSON Schema (tenants schema)"),
    "simulate": (cmd_simulate, "run a workload through the scheduler over N simulated "
                               "GPUs, in virtual time (fairlane simulate --help)"),
    "nats-config": (cmd_nats_config, "write nats-server authorization: a user per tenant, "
                                     "least-privilege service users"),
}


def _usage() -> str:
    lines = ["usage: fairlane COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<10} {about}" for name, (_, about) in COMMANDS.items()]
    lines += ["", "fairlane COMMAND --help describes a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(_usage())
        return 0
    if not argv or argv[0] not in COMMANDS:
        hint = f"unknown command {argv[0]!r}\n" if argv else ""
        print(f"fairlane: {hint}{_usage()}", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]][0](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
