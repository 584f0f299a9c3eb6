"""Servers found through DNS (a headless Service's name): the pool follows what the name
resolves to, and a failed resolution or a failed join changes nothing."""

from __future__ import annotations

import socket

import pytest

from rollout_service.engine.discovery import EngineDiscovery, resolve_addresses, server_url, split_name
from rollout_service.errors import AlreadyExists, FailedPrecondition, NotFound, StartupError


class Dns:
    """What the name resolves to, changed by the test; ``None``: the resolver fails."""

    def __init__(self, *addresses: str) -> None:
        self.addresses: list[str] | None = list(addresses)

    async def __call__(self, host: str, port: int) -> list[str]:
        assert (host, port) == ("vllm.rl.svc", 8000)
        if self.addresses is None:
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return list(self.addresses)


class Pool:
    """Records the changes; a URL in ``refuse`` fails to join or leave with that error."""

    def __init__(self) -> None:
        self.urls: list[str] = []
        self.refuse: dict[str, Exception] = {}

    async def add(self, url: str) -> None:
        if url in self.refuse:
            raise self.refuse[url]
        self.urls.append(url)

    async def remove(self, url: str) -> None:
        if url in self.refuse:
            raise self.refuse[url]
        self.urls.remove(url)


async def test_the_pool_follows_the_names_addresses() -> None:
    dns, pool = Dns("10.0.0.2", "10.0.0.1"), Pool()
    discovery = EngineDiscovery("vllm.rl.svc:8000", 10, dns)
    pool.urls = await discovery.initial_urls()
    assert pool.urls == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]

    dns.addresses = ["10.0.0.2", "10.0.0.3"]  # a pod replaced: one leaves, one joins
    await discovery.refresh(pool.add, pool.remove)
    assert sorted(pool.urls) == ["http://10.0.0.2:8000", "http://10.0.0.3:8000"]

    dns.addresses = None  # a DNS hiccup: nothing changes
    await discovery.refresh(pool.add, pool.remove)
    dns.addresses = []  # nor does an empty answer empty the pool
    await discovery.refresh(pool.add, pool.remove)
    assert sorted(pool.urls) == ["http://10.0.0.2:8000", "http://10.0.0.3:8000"]


async def test_a_server_that_cannot_join_is_tried_again_and_admin_changes_are_left_alone() -> None:
    dns, pool = Dns("10.0.0.1"), Pool()
    discovery = EngineDiscovery("vllm.rl.svc:8000", 10, dns)
    pool.urls = await discovery.initial_urls()
    dns.addresses = ["10.0.0.1", "10.0.0.4", "10.0.0.5"]
    pool.refuse = {
        "http://10.0.0.4:8000": FailedPrecondition("not up yet"),
        "http://10.0.0.5:8000": AlreadyExists("added by AddEngine"),
    }
    await discovery.refresh(pool.add, pool.remove)
    assert pool.urls == ["http://10.0.0.1:8000"] and discovery.found == {"http://10.0.0.1:8000"}
    del pool.refuse["http://10.0.0.4:8000"]
    await discovery.refresh(pool.add, pool.remove)  # the next resolution tries it again
    assert pool.urls == ["http://10.0.0.1:8000", "http://10.0.0.4:8000"]

    dns.addresses = ["10.0.0.4"]  # .1 vanished, but an admin removed it already
    pool.refuse = {"http://10.0.0.1:8000": NotFound("not in the pool")}
    await discovery.refresh(pool.add, pool.remove)
    assert discovery.found == {"http://10.0.0.4:8000"}  # .5 never counted as found: never removed here


async def test_a_name_that_resolves_to_nothing_stops_the_start_with_a_reason() -> None:
    with pytest.raises(StartupError, match="resolves to no address after 0s"):
        await EngineDiscovery("vllm.rl.svc:8000", 10, Dns()).initial_urls()
    with pytest.raises(StartupError, match="not host:port"):
        split_name("vllm.rl.svc")


async def test_real_names_resolve_to_urls() -> None:
    assert "127.0.0.1" in await resolve_addresses("localhost", 8000)
    assert split_name("[fd00::1]:8000") == ("fd00::1", 8000)
    assert server_url("fd00::1", 8000) == "http://[fd00::1]:8000"


async def test_start_up_waits_for_the_first_ready_server() -> None:
    """A headless Service resolves to nothing (or fails) until a vLLM pod is ready: start-up
    resolves again every interval, within ``wait_s``, and takes the servers found then."""

    class Later(Dns):
        def __init__(self) -> None:
            super().__init__()
            self.answers: list[list[str] | None] = [None, [], ["10.0.0.7"]]  # failed, empty, ready

        async def __call__(self, host: str, port: int) -> list[str]:
            self.addresses = self.answers.pop(0)
            return await super().__call__(host, port)

    dns = Later()
    discovery = EngineDiscovery("vllm.rl.svc:8000", 0.01, dns, wait_s=30)
    assert await discovery.initial_urls() == ["http://10.0.0.7:8000"]
    assert dns.answers == [] and discovery.found == {"http://10.0.0.7:8000"}
    with pytest.raises(StartupError, match=r"after 0\.05s"):
        await EngineDiscovery("vllm.rl.svc:8000", 0.01, Dns(), wait_s=0.05).initial_urls()
