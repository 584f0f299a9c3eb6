"""Network namespaces made by a test, each its own host on one bridge (needs root and iproute2).

Each namespace gets a veth pair whose outer end is on a bridge in the test's namespace,
an address of a private /24, loopback up and a default route through the bridge. Processes
started with ``prefix(name)`` see only their namespace's interfaces: a service, vLLM and a
trainer each in one talk as three hosts would, not over a shared loopback.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    return None


@dataclass(frozen=True)
class Namespaces:
    addresses: dict[str, str]
    """Each namespace's address by its short name."""
    names: dict[str, str]
    """Each namespace's system name by its short name."""
    gateway: str
    """The bridge's address: the test's own namespace reaches every namespace through it."""
    interfaces: dict[str, str]
    """Each namespace's own network interface by its short name (for GLOO_SOCKET_IFNAME)."""

    def prefix(self, name: str) -> list[str]:
        """The command prefix that runs a program inside namespace ``name``."""
        return ["ip", "netns", "exec", self.names[name]]

    def local_ports(self, name: str, first: int, last: int) -> None:
        """Namespace ``name`` binds ports the program leaves to the system (port 0, a client's
        own end) from ``first..last`` only: ``sysctl net.ipv4.ip_local_port_range``, which a
        container sets with ``--sysctl`` and a Kubernetes pod in its ``securityContext``."""
        command = f"echo '{first} {last}' > /proc/sys/net/ipv4/ip_local_port_range"
        subprocess.run([*self.prefix(name), "sh", "-c", command], check=True, capture_output=True, timeout=30)

    def accept_only(self, name: str, *ports: str) -> None:
        """A firewall for namespace ``name``: TCP arriving from the bridge is delivered only to
        ``ports`` (each ``"N"`` or ``"N-M"``), and dropped otherwise; its own loopback and the
        test's namespace (the bridge's address) stay open. Replies on connections the
        namespace opened pass, as through a stateful firewall: the kernel hands them to their
        socket before any route lookup.

        Policy-routing rules, as iproute2 is all these machines have: an arriving packet is
        delivered by a lookup in the ``local`` table, here reached only through a rule that
        names an open port, ahead of one that forbids the rest."""
        netns, interface = self.names[name], self.interfaces[name]
        # The test's own namespace is the operator, not another host: it polls health.
        _ip("-n", netns, "rule", "add", "prio", "5", "iif", interface, "from", self.gateway, "lookup", "local")
        for priority, port in enumerate(ports, start=10):
            _ip("-n", netns, "rule", "add", "prio", str(priority), "iif", interface, "ipproto", "tcp", "dport", port,
                "lookup", "local")  # fmt: skip
        _ip("-n", netns, "rule", "add", "prio", "90", "iif", interface, "ipproto", "tcp", "prohibit")
        _ip("-n", netns, "rule", "add", "prio", "100", "lookup", "local")
        _ip("-n", netns, "rule", "del", "prio", "0")  # the default rule, ahead of all of the above

    def connects(self, source: str, host: str, port: int, timeout_s: float = 3.0) -> bool:
        """Whether a program in ``source`` reaches one listening on ``port`` in ``host``."""
        listen = "import socket,sys;s=socket.create_server((sys.argv[1],int(sys.argv[2])));print(1,flush=True);input()"
        connect = "import socket,sys;socket.create_connection((sys.argv[1],int(sys.argv[2])),float(sys.argv[3]))"
        address = self.addresses[host]
        with subprocess.Popen(
            [*self.prefix(host), sys.executable, "-c", listen, address, str(port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        ) as listener:
            try:
                assert listener.stdout is not None and listener.stdout.readline() == "1\n", "the listener did not start"
                attempt = [*self.prefix(source), sys.executable, "-c", connect, address, str(port), str(timeout_s)]
                return subprocess.run(attempt, capture_output=True, timeout=timeout_s + 30).returncode == 0
            finally:
                listener.kill()


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


_CALLS = itertools.count()


@contextlib.contextmanager
def namespaces(*names: str) -> Iterator[Namespaces]:
    # Unique per call, not only per process: a namespace deleted by the previous call of this
    # process may take its veth pair with it only later (the kernel tears namespaces down in the
    # background), and the same names then failed with "File exists" (CI, at fe59c22).
    tag = (os.getpid() % 1000) * 10 + next(_CALLS) % 10
    subnet = f"10.231.{tag % 200 + 20}"
    bridge = f"rsbr{tag}"
    created: list[str] = []
    veths: list[str] = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{subnet}.254/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        addresses, system_names, interfaces = {}, {}, {}
        for index, name in enumerate(names, start=1):
            netns, outer, inner = f"rs-{name}-{tag}", f"rso{index}{tag}", f"rsi{index}{tag}"
            _ip("netns", "add", netns)
            created.append(netns)
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            veths.append(outer)
            _ip("link", "set", inner, "netns", netns)
            _ip("link", "set", outer, "master", bridge, "up")
            _ip("-n", netns, "addr", "add", f"{subnet}.{index}/24", "dev", inner)
            _ip("-n", netns, "link", "set", inner, "up")
            _ip("-n", netns, "link", "set", "lo", "up")
            _ip("-n", netns, "route", "add", "default", "via", f"{subnet}.254")
            addresses[name], system_names[name], interfaces[name] = f"{subnet}.{index}", netns, inner
        yield Namespaces(addresses, system_names, f"{subnet}.254", interfaces)
    finally:
        for outer in veths:  # deleting one end deletes the pair at once, not when the namespace goes
            subprocess.run(["ip", "link", "delete", outer], capture_output=True, timeout=30)
        for netns in created:
            subprocess.run(["ip", "netns", "delete", netns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "delete", bridge], capture_output=True, timeout=30)
