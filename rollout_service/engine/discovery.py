"""vLLM servers found through DNS (``engine.discover``), e.g. a Kubernetes headless Service.

The name is resolved every ``interval_s``: new addresses join the pool, vanished ones leave
it. Only servers found here are removed here (AddEngine's stay), and a failed resolution
changes nothing, so a DNS hiccup cannot empty the pool.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable

from rollout_service.errors import AlreadyExists, NotFound, ServiceError, StartupError

logger = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[list[str]]]
"""Addresses of a host name (tests pass their own)."""
Change = Callable[[str], Awaitable[object]]
"""Adds or removes the server of a URL (``PoolMembership.add`` / ``.remove``)."""


def split_name(discover: str) -> tuple[str, int]:
    host, sep, port = discover.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise StartupError(f"engine.discover {discover!r} is not host:port, e.g. vllm.rl.svc.cluster.local:8000")
    return host.strip("[]"), int(port)


async def resolve_addresses(host: str, port: int) -> list[str]:
    """The addresses ``host`` resolves to, off the loop."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def server_url(address: str, port: int) -> str:
    host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    return f"http://{host}:{port}"


RESOLVE_INTERVAL_S = 10.0


class EngineDiscovery:
    def __init__(
        self,
        discover: str,
        interval_s: float = RESOLVE_INTERVAL_S,
        resolver: Resolver = resolve_addresses,
        wait_s: float = 0.0,
    ) -> None:
        self.host, self.port = split_name(discover)
        self.interval_s = interval_s
        self.wait_s = wait_s
        self._resolver = resolver
        self.found: set[str] = set()
        """Servers in the pool because the name resolved to them."""

    async def initial_urls(self) -> list[str]:
        """The first pool, resolving for up to ``wait_s``: vLLM pods take minutes to be ready."""
        deadline = asyncio.get_running_loop().time() + self.wait_s
        while not (urls := await self._resolve()):
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                raise StartupError(
                    f"engine.discover {self.host}:{self.port} resolves to no address after {self.wait_s:g}s "
                    "(engine.discover_wait_s); are the vLLM pods ready?"
                )
            logger.info("waiting for engine.discover %s:%d to resolve (%.0fs left)", self.host, self.port, left)
            await asyncio.sleep(min(self.interval_s, left))  # the resolution period, not synchronisation
        self.found = set(urls)
        return urls

    async def _resolve(self) -> list[str] | None:
        try:
            addresses = await self._resolver(self.host, self.port)
            return [server_url(address, self.port) for address in sorted(set(addresses))]
        except (OSError, ValueError) as exc:  # socket.gaierror is an OSError
            logger.warning(
                "resolving engine.discover %s:%d failed (%s); the pool stays as it is", self.host, self.port, exc
            )
            return None

    async def run(self, add: Change, remove: Change) -> None:
        while True:
            await asyncio.sleep(self.interval_s)  # a resolution period, not synchronisation
            await self.refresh(add, remove)

    async def refresh(self, add: Change, remove: Change) -> None:
        urls = await self._resolve()
        if urls is None:
            return
        if not urls:
            logger.warning("engine.discover %s:%d resolves to no address; keeping the pool", self.host, self.port)
            return
        for url in sorted(set(urls) - self.found):
            try:
                await add(url)
            except AlreadyExists:
                continue  # added by AddEngine: it stays the admin's to remove
            except ServiceError as exc:
                logger.warning("discovered vLLM server %s could not join (%s); trying again later", url, exc)
                continue
            self.found.add(url)
            logger.info("discovered vLLM server %s joined the pool", url)
        for url in sorted(self.found - set(urls)):
            try:
                await remove(url)
            except NotFound:
                pass  # removed by RemoveEngine already
            except ServiceError as exc:
                logger.warning("vLLM server %s left DNS but stays in the pool: %s", url, exc)
                continue
            self.found.discard(url)
            logger.info("vLLM server %s left DNS and the pool", url)
