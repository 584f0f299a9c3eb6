"""The weight push's rendezvous port: the configured one, or the next free for each further
trainer on the host, held from the claim until released, and bindable by the store."""

from __future__ import annotations

from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from trainer_client.weights import group_port
from trainer_client.weights.group_port import GROUP_PORT_SPAN, GroupPortClaim

pytestmark = pytest.mark.timeout(60)

HOST = "127.0.0.1"


@pytest.fixture
def first() -> int:
    """A port far from others' (a claim of any free port, released)."""
    claim = GroupPortClaim(HOST, 0)
    claim.release()
    return min(claim.port, 65535 - GROUP_PORT_SPAN)


def test_trainers_on_one_host_take_the_next_free_ports_of_the_span(first: int) -> None:
    claims = [GroupPortClaim(HOST, first) for _ in range(3)]
    try:
        ports = [claim.port for claim in claims]
        assert len(set(ports)) == 3 and all(first <= port < first + GROUP_PORT_SPAN for port in ports)
        assert ports == sorted(ports)
    finally:
        for claim in claims:
            claim.release()


def test_the_store_binds_the_claimed_port_and_later_claims_skip_it(first: int) -> None:
    claim = GroupPortClaim(HOST, first)
    store = TCPStore(HOST, claim.port, 2, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    worker = TCPStore(HOST, claim.port, 2, is_master=False, timeout=timedelta(seconds=10))
    worker.set("joined", "yes")
    assert store.get("joined") == b"yes"
    other = GroupPortClaim(HOST, first)
    try:
        assert other.port != claim.port
    finally:
        other.release()
        claim.release()


def test_renew_moves_to_another_port_and_frees_the_old_one(first: int) -> None:
    claim = GroupPortClaim(HOST, first)
    old = claim.port
    try:
        assert claim.renew() != old
        assert first <= claim.port < first + GROUP_PORT_SPAN
        again = GroupPortClaim(HOST, old)
        assert again.port == old
        again.release()
    finally:
        claim.release()


def test_a_full_span_says_which_setting_to_change(first: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(group_port, "GROUP_PORT_SPAN", 2)
    held = [GroupPortClaim(HOST, first), GroupPortClaim(HOST, first)]
    try:
        with pytest.raises(OSError, match=f"{first}..{first + 1}.*--vllm_group_port"):
            GroupPortClaim(HOST, first)
    finally:
        for claim in held:
            claim.release()


def test_port_zero_takes_any_free_port() -> None:
    claim = GroupPortClaim(HOST, 0)
    try:
        assert claim.port > 0
    finally:
        claim.release()
