"""The gloo group of a weight transfer, bound to an address the other ranks can reach.

Why: gloo's default device takes the address the host name resolves to, often 127.0.1.1 or
127.0.0.1 (a container's or a Debian host's /etc/hosts). Each rank announces that address
through the store and every other rank connects to it, so the group only formed when all
ranks shared one network namespace: the trainer in vLLM's container, nothing across hosts
("timed out connecting: Connection refused, remote=[127.0.0.1]"). Here every rank binds
its device to the local address that routes to the trainer's rendezvous address: the
trainer to that address itself, each worker to its own address towards it.
"""

from __future__ import annotations

import socket
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
