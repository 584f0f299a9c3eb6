"""``--trainer-address auto``: the local address that reaches the service."""

from __future__ import annotations

import ipaddress

import pytest

from trainer_client.advertised_address import AddressError, advertised_address, service_host_port


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("localhost:50051", ("localhost", 50051)),
        ("dns:///rollout:50051", ("rollout", 50051)),
        ("[::1]:7", ("::1", 7)),
        ("10.1.2.3:443", ("10.1.2.3", 443)),
    ],
)
def test_the_service_host_and_port_come_from_the_target(target: str, expected: tuple[str, int]) -> None:
    assert service_host_port(target) == expected


def test_auto_on_a_local_service_is_loopback_and_an_explicit_address_is_kept() -> None:
    assert advertised_address("auto", "127.0.0.1:50051") == "127.0.0.1"
    assert ipaddress.ip_address(advertised_address("auto", "localhost:50051")).is_loopback
    assert advertised_address("10.0.0.5", "127.0.0.1:50051") == "10.0.0.5"


def test_a_route_to_another_address_picks_a_non_loopback_local_address() -> None:
    # No packet leaves the host: connecting a UDP socket only asks the kernel for a route.
    try:
        address = advertised_address("auto", "192.0.2.1:50051")  # TEST-NET-1
    except AddressError:
        pytest.skip("this host has no route beyond loopback")
    assert not ipaddress.ip_address(address).is_loopback


@pytest.mark.parametrize("target", ["rollout", "rollout:http", "no-such-host.invalid:50051"])
def test_a_target_without_a_usable_host_and_port_says_what_to_set(target: str) -> None:
    with pytest.raises(AddressError, match="--t"):
        advertised_address("auto", target)
