"""The gloo group of a weight transfer: how its ranks meet, and the address each binds.

The address, why: gloo's default device takes the address the host name resolves to, often 127.0.1.1 or
127.0.0.1 (a container's or a Debian host's /etc/hosts). Each rank announces that address
through the store and every other rank connects to it, so the group only formed when all
ranks shared one network namespace: the trainer in vLLM's container, nothing across hosts
("timed out connecting: Connection refused, remote=[127.0.0.1]"). Here every rank binds
its device to the local address that routes to the trainer's rendezvous address: the
trainer to that address itself, each worker to its own address towards it.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta

from torch.distributed import Store
from torch.distributed.distributed_c10d import ProcessGroupGloo


def local_address_towards(host: str, port: int) -> str:
    """The local address the kernel routes to ``host`` from: a connected UDP socket's own
    address (no packet is sent). ``host`` itself when it is this host's."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(sockaddr)
        return str(probe.getsockname()[0])


def gloo_group(store: Store, rank: int, world_size: int, timeout: timedelta, address: str) -> ProcessGroupGloo:
    """A gloo group whose device listens on ``address``; sequence-numbered like vLLM's."""
    options = ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [ProcessGroupGloo.create_device(hostname=address)]
    group = ProcessGroupGloo(store, rank, world_size, options)
    group._set_sequence_number_for_group()  # the workers wait for rank 0's number
    return group


ARRIVED_KEY = "arrived"
"""Counts the ranks that reached a join's rendezvous (under the join's epoch prefix)."""
ABANDONED_KEY = "abandoned"
"""Set by the trainer when it gives a join up; its value says why."""
ARRIVAL_POLL_S = 0.05


def arrive(store: Store) -> None:
    """Count this rank in at the join's rendezvous."""
    store.add(ARRIVED_KEY, 1)


def abandon_join(store: Store, reason: str) -> None:
    """Give the join up: every worker waiting in :func:`await_every_rank` leaves at once."""
    store.set(ABANDONED_KEY, reason)


def await_every_rank(store: Store, world_size: int, timeout_s: float) -> None:
    """Wait until all ``world_size`` ranks have arrived, before forming the group.

    Why: gloo's own rendezvous waits out its timeout and nothing cancels it, and a vLLM
    engine whose worker waits there generates nothing. Waiting here, in short looks at the
    store, ends as soon as the trainer abandons the join (an aborted update) or its store
    goes away (a dead trainer); once every rank is in, the group forms at once.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if store.check([ABANDONED_KEY]):
            raise RuntimeError(f"the trainer gave this join up: {store.get(ABANDONED_KEY).decode(errors='replace')}")
        arrived = store.add(ARRIVED_KEY, 0)
        if arrived >= world_size:
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"{arrived} of {world_size} ranks (the trainer and every server's workers) reached the "
                f"weight-transfer rendezvous within {timeout_s:g}s (weight_sync.join_timeout_s)"
            )
        time.sleep(ARRIVAL_POLL_S)
