"""A network namespace joined to the host by a veth pair, for partition chaos.

`Netns` makes a namespace ``flp<pid>-<k>`` and a veth pair ``flp<pid>h<k>`` (host end)
/ ``flp<pid>n<k>`` (namespace end) on a private /30 from 10.213.0.0/16 that no address
or route of this machine overlaps: the host end gets ``.1``, the namespace end ``.2``;
the namespace's loopback comes up too. Nothing is routed or forwarded beyond the pair:
a process in the namespace reaches the host only at the host end's address, and the
host reaches it only at ``.2``.

`cut()` takes the namespace end down (from inside: `ip netns exec NAME ip link set
DEV down`): established TCP connections over the pair hang (no reset; the host's
packets are dropped, the namespace's find no route) and new ones time out; `heal()`
brings it back up, and the connections resume where they stalled (after TCP's
retransmission back-off). `close()` deletes the namespace, which deletes the pair
with it; it is idempotent, and `cleanup_ours()` removes whatever this process left
(for a fixture's finalizer, after a kill between `create` and `close`).

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN for `ip netns`): `unsupported()` says why
not, for a test to skip.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import re
import shutil
import subprocess

BASE = ipaddress.ip_network("10.213.0.0/16")
PREFIX = f"flp{os.getpid()}"
_counter = itertools.count()


def _ip(*args: str, check: bool = True, netns: str | None = None) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["netns", "exec", netns, "ip"] if netns else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=check)


def unsupported() -> str | None:
    """Why a namespace cannot be made here (None: it can): no `ip`, or `ip netns add`
    not permitted."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    name = f"{PREFIX}-probe"
    r = _ip("netns", "add", name, check=False)
    if r.returncode != 0:
        return f"`ip netns add` not permitted here: {r.stderr.strip() or r.returncode}"
    _ip("netns", "del", name, check=False)
    return None


def _taken() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network this machine has an address in or a route to."""
    out = _ip("-4", "-o", "addr").stdout + _ip("-4", "route", "show", "table", "all").stdout
    nets = []
    for m in re.finditer(r"\b(\d+\.\d+\.\d+\.\d+)(/\d+)?\b", out):
        with_len = m.group(1) + (m.group(2) or "/32")
        nets.append(ipaddress.ip_network(with_len, strict=False))
    return nets


def free_slash30() -> ipaddress.IPv4Network:
    """A /30 of 10.213.0.0/16 that overlaps nothing here, starting from a place
    that depends on the pid (two test processes rarely look at the same one first)."""
    subnets = list(BASE.subnets(new_prefix=30))
    taken = _taken()
    start = (os.getpid() * 7) % len(subnets)
    for i in range(len(subnets)):
        net = subnets[(start + i) % len(subnets)]
        if not any(net.overlaps(t) for t in taken):
            return net
    raise RuntimeError("no free /30 in 10.213.0.0/16")


class Netns:
    """One namespace and its veth pair (see the module docstring). A context manager."""

    def __init__(self) -> None:
        k = next(_counter)
        self.name = f"{PREFIX}-{k}"
        self.host_dev = f"{PREFIX}h{k}"  # <= 15 characters: 'flp' + pid + 'h' + k
        self.ns_dev = f"{PREFIX}n{k}"
        self.net: ipaddress.IPv4Network | None = None
        self.created = False

    @property
    def host_addr(self) -> str:
        assert self.net is not None
        return str(self.net.network_address + 1)

    @property
    def ns_addr(self) -> str:
        assert self.net is not None
        return str(self.net.network_address + 2)

    @property
    def exec_prefix(self) -> list[str]:
        """Run a command inside: ``ip netns exec NAME`` (it execs the command: same pid)."""
        return ["ip", "netns", "exec", self.name]

    def create(self) -> Netns:
        self.net = free_slash30()
        self.created = True  # from here on, close() has something to delete
        _ip("netns", "add", self.name)
        _ip("link", "add", self.host_dev, "type", "veth", "peer", "name", self.ns_dev)
        _ip("link", "set", self.ns_dev, "netns", self.name)
        _ip("addr", "add", f"{self.host_addr}/30", "dev", self.host_dev)
        _ip("link", "set", self.host_dev, "up")
        _ip("addr", "add", f"{self.ns_addr}/30", "dev", self.ns_dev, netns=self.name)
        _ip("link", "set", self.ns_dev, "up", netns=self.name)
        _ip("link", "set", "lo", "up", netns=self.name)
        return self

    def cut(self) -> None:
        _ip("link", "set", self.ns_dev, "down", netns=self.name)

    def heal(self) -> None:
        _ip("link", "set", self.ns_dev, "up", netns=self.name)

    def close(self) -> None:
        """Delete the namespace (the veth pair goes with it) and, should the host end
        have survived, that too. Safe to call twice or after a failed `create`."""
        if not self.created:
            return
        _ip("netns", "del", self.name, check=False)
        _ip("link", "del", self.host_dev, check=False)
        self.created = False

    def __enter__(self) -> Netns:
        try:
            return self.create()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()


def ours() -> tuple[list[str], list[str]]:
    """Namespaces and links this process made that still exist."""
    spaces = [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines()
              if line.split() and line.split()[0].startswith(PREFIX)]
    links = re.findall(rf"^\d+: ({PREFIX}h\d+)[@:]", _ip("-o", "link", check=False).stdout,
                       flags=re.MULTILINE)
    return spaces, links


def cleanup_ours() -> None:
    """Delete every namespace and host-end link named for this process."""
    spaces, links = ours()
    for name in spaces:
        _ip("netns", "del", name, check=False)
    for dev in links:
        _ip("link", "del", dev, check=False)
