"""A NATS cluster on this machine: N nats-servers with routes and JetStream on each.

For `fairlane up --nats-cluster 3` and the cluster chaos tests. Every node listens on
127.0.0.1 (client, route and monitor ports of its own), keeps its JetStream store in
``<base_dir>/n<i>``, and names itself ``n<i>`` (JetStream clustering needs names).
`start` returns once every node reports healthy (JetStream's meta group has a
leader), so streams can be created right after. A node killed with `kill_node`
restarts on the same ports and store with `start_node` and catches up from its peers.
With `tls`, clients must speak TLS and the routes do too, each node verifying its
peers' certificates against the CA (mutual TLS: only the cluster's nodes may join).

`Isolated` (for the partition chaos test) runs one node in a network namespace of its
own: it listens on its address there and runs under ``ip netns exec``; the other nodes
listen for routes on the host's end of the link to it instead of 127.0.0.1 (the only
host address the namespace can reach), and keep their client ports on 127.0.0.1.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from fairlane.embedded import EmbeddedServerError, NatsServer, TlsFiles, free_port

CLUSTER_NAME = "fairlane"
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Isolated:
    """One node in a network namespace, joined to the host by a veth pair."""

    node: str  # its name, e.g. "n3"
    exec_prefix: tuple[str, ...]  # ("ip", "netns", "exec", NAME)
    node_addr: str  # its address in the namespace: client, route and monitor ports
    host_addr: str  # the host's end: where the other nodes listen for routes


def default_replicas(cluster_size: int) -> int:
    """JetStream replicas for a cluster of this size: 3 where possible (survives one
    node down), never more nodes than exist."""
    return max(1, min(3, cluster_size))


@dataclass
class NatsCluster:
    size: int
    base_dir: str
    log_dir: str | None = None
    client_port: int = 0  # first node's client port; 0 = free ports for all
    auth_conf: str | None = None
    tls: TlsFiles | None = None
    isolated: Isolated | None = None
    nodes: list[NatsServer] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError("a cluster has at least one node")
        iso = self.isolated
        if iso is not None and (self.size == 1 or self.tls):
            raise ValueError("an isolated node needs a cluster of 2+ nodes without TLS")
        # Every port up front and distinct: a port picked for a node not yet started is
        # not bound, so the kernel could hand it out again to an earlier node.
        taken = {self.client_port} if self.client_port else set()
        ports = _distinct_free_ports(3 * self.size, taken)
        route_ports = ports[:self.size]
        client_ports = ports[self.size:2 * self.size]
        monitor_ports = ports[2 * self.size:]
        names = [f"n{i + 1}" for i in range(self.size)]
        hosts = [iso.node_addr if iso and iso.node == n else LOOPBACK for n in names]
        route_hosts = [h if h != LOOPBACK or iso is None else iso.host_addr for h in hosts]
        routes = ",".join(f"nats://{h}:{p}" for h, p in zip(route_hosts, route_ports, strict=True))
        single = self.size == 1  # a plain server: the store and log a single node always had
        for i in range(self.size):
            name = names[i]
            log = (str(Path(self.log_dir) / f"{self.log_name(name)}.log")
                   if self.log_dir else None)
            cluster_args = [] if single or self.tls else [
                "--cluster_name", CLUSTER_NAME,
                "--cluster", f"nats://{route_hosts[i]}:{route_ports[i]}", "--routes", routes]
            # With TLS, routes speak it too, and verify each other's certificate (signed
            # by the same CA): only the cluster's own nodes can join it.
            cluster_conf = [] if single or not self.tls else ["cluster " + json.dumps({
                "name": CLUSTER_NAME, "listen": f"127.0.0.1:{route_ports[i]}",
                "routes": routes.split(","),
                "tls": {"cert_file": self.tls.cert_file, "key_file": self.tls.key_file,
                        "ca_file": self.tls.ca_file, "verify": True, "timeout": 2}})]
            self.nodes.append(NatsServer(
                store_dir=self.base_dir if single else str(Path(self.base_dir) / name),
                log_file=log,
                port=self.client_port if (i == 0 and self.client_port) else client_ports[i],
                monitor_port=monitor_ports[i],
                auth_conf=self.auth_conf, tls=self.tls, server_name="" if single else name,
                extra_args=cluster_args, extra_conf=cluster_conf, host=hosts[i],
                cmd_prefix=list(iso.exec_prefix) if iso and iso.node == name else []))

    def log_name(self, server_name: str) -> str:
        """The node's name in logs and messages: ``nats-server`` alone, else
        ``nats-server-n<i>``."""
        return "nats-server" if self.size == 1 else f"nats-server-{server_name}"

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    @property
    def url(self) -> str:
        """Every node's URL, comma-separated: what each process's --nats-url takes."""
        return ",".join(self.urls)

    def node(self, name: str) -> NatsServer:
        return next(n for n in self.nodes if n.server_name == name or self.size == 1)

    def start(self, timeout_s: float = 60.0) -> NatsCluster:
        for n in self.nodes:
            n.start(timeout_s)
        self.wait_healthy(timeout_s)
        return self

    def wait_healthy(self, timeout_s: float = 60.0, nodes: list[NatsServer] | None = None) -> None:
        """Until each node's /healthz says ok: connected to its routes, JetStream
        current (a meta leader elected), so stream operations do not fail with 503."""
        deadline = time.monotonic() + timeout_s
        for n in nodes or self.nodes:
            while not healthy(n):
                if n.proc is None or n.proc.poll() is not None:
                    raise EmbeddedServerError(f"nats-server {n.server_name} exited")
                if time.monotonic() > deadline:
                    raise EmbeddedServerError(
                        f"nats-server {n.server_name} not healthy within {timeout_s}s")
                time.sleep(0.1)

    def kill_node(self, name: str) -> None:
        """SIGKILL one node (its store survives for `start_node`)."""
        self.node(name).kill()

    def start_node(self, name: str, timeout_s: float = 60.0) -> None:
        node = self.node(name)
        node.start(timeout_s)
        self.wait_healthy(timeout_s, [node])

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


def _distinct_free_ports(n: int, taken: set[int]) -> list[int]:
    out: list[int] = []
    while len(out) < n:
        p = free_port()
        if p not in taken:
            taken.add(p)
            out.append(p)
    return out


def healthy(node: NatsServer) -> bool:
    try:
        with urllib.request.urlopen(f"http://{node.host}:{node.monitor_port}/healthz",
                                    timeout=1) as r:
            return r.status == 200 and json.loads(r.read() or b"{}").get("status") == "ok"
    except (OSError, urllib.error.URLError, ValueError):
        return False
