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
