"""The gloo group of a weight transfer: how its ranks meet, the address each binds, and the
served dtype a join agrees on.

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

import torch
import torch.distributed as dist
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


SERVED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""The model dtypes a join can agree on, by position (a code is its index + 1)."""
_NONE = len(SERVED_DTYPES) + 1
"""The trainer's vote: no dtype, larger than every code."""


def agree_on_served_dtype(group: ProcessGroupGloo, dtype: torch.dtype | None) -> torch.dtype | None:
    """Every rank, right after a join: the dtype every worker's model runs in, or None where they
    differ or one does not say (``dtype`` None, or another). The trainer (rank 0) votes nothing
    and learns it, so that it pushes in that dtype, the cast vLLM's loaders would make. Two
    all-reduces of one number."""
    code = SERVED_DTYPES.index(dtype) + 1 if dtype in SERVED_DTYPES else 0
    lowest = torch.tensor([_NONE if group.rank() == 0 else code], dtype=torch.int64)
    highest = torch.tensor([code], dtype=torch.int64)
    group.allreduce([lowest], dist.ReduceOp.MIN).wait()
    group.allreduce([highest], dist.ReduceOp.MAX).wait()
    low, high = int(lowest.item()), int(highest.item())
    return SERVED_DTYPES[low - 1] if low == high and 0 < low < _NONE else None
