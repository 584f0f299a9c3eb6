"""The gloo weight sender (CPU servers): plain torch, importable without vLLM.

The trainer is rank 0 of a gloo group with the vLLM workers running ``vllm_gloo_transfer.plugin``;
:meth:`GlooWeightSender.connect` must mirror their side exactly: a rank-0-hosted ``TCPStore``
under a ``PrefixStore`` keyed by the rendezvous URI, every rank counted in before the group, then
a ``ProcessGroupGloo``. Tensors are broadcast in dtype buckets (each broadcast is a round trip)
that both sides derive from the announced update_info, or through shared memory when every
worker is on this host.
"""

from __future__ import annotations

import ipaddress
import threading
import time
from datetime import timedelta

import torch
from torch.distributed import PrefixStore, TCPStore
from torch.distributed.distributed_c10d import ProcessGroupGloo

from trainer_client.weights.sender import WORKER_POLL_S, NamedTensors, UpdateAbandoned, WeightSender
from vllm_gloo_transfer.groups import abandon_join, agree_on_served_dtype, arrive, gloo_group
from vllm_gloo_transfer.packing import broadcast_buckets, packing_trailer
from vllm_gloo_transfer.shared_memory import SharedWeightsFile, offer_shared_memory


def rendezvous_uri(host: str, port: int) -> str:
    """vLLM's ``get_tcp_uri``, byte for byte: it is the PrefixStore prefix both sides must share."""
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        return f"tcp://{host}:{port}"
    return f"tcp://[{host}]:{port}"


class GlooWeightSender(WeightSender):
    """Rank 0 of the trainer <-> vLLM workers gloo group."""

    REJOIN_NEEDS_NEW_PORT = False
    """The store outlives a join: a re-join reuses the port under a new epoch prefix."""
    RESIZES_IN_PLACE = True
    """Another world size joins through the same store: a new store would drop workers connecting to it."""

    _store: TCPStore | None = None
    _group: ProcessGroupGloo | None = None
    _shared_file: SharedWeightsFile | None = None
    _through_shared_memory = False

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.timeout_s)

    @property
    def connected(self) -> bool:
        return self._group is not None

    @property
    def transport(self) -> str:
        return "shared memory" if self._through_shared_memory else "gloo"

    def connect(self, epoch: int = 0, world_size: int | None = None, abandoned: threading.Event | None = None) -> None:
        """Join as rank 0 (``WeightSender.connect``). The store is kept across joins, each join's
        keys under its ``epoch``'s prefix, so a re-join never meets a previous one's keys."""
        if world_size is not None:
            self.world_size = world_size
        prefix = self._join_store(epoch)
        arrive(prefix)
        self._await_workers(prefix, abandoned or threading.Event())
        # The device on the advertised address, which the workers reach (``vllm_gloo_transfer.groups``).
        self._group = gloo_group(prefix, 0, self.world_size, self.timeout, self.master_address)
        if self.shared_memory and self._shared_file is None:
            self._shared_file = SharedWeightsFile.create()  # None where the system has no memfd
        try:
            self._through_shared_memory = offer_shared_memory(self._group, self._shared_file)
            self.served_dtype = agree_on_served_dtype(self._group, None)
        except BaseException:
            self.leave()
            raise

    def host(self) -> None:
        """Start hosting the rendezvous store, if not yet; ``connect`` does it at the first join."""
        if self._store is None:
            self._store = TCPStore(
                self.master_address,
                self.master_port,
                self.world_size,
                is_master=True,
                timeout=self.timeout,
                wait_for_workers=False,
                multi_tenant=False,
            )

    def abandon(self, epoch: int, reason: str) -> None:
        """Give join ``epoch`` up: the workers waiting for it leave at once, freeing their
        engines (``vllm_gloo_transfer.groups.await_every_rank``)."""
        if self._store is not None:
            abandon_join(self._join_store(epoch), reason)

    def _join_store(self, epoch: int) -> PrefixStore:
        """The store under join ``epoch``'s prefix, hosted from now on."""
        self.host()
        assert self._store is not None
        return PrefixStore(f"{rendezvous_uri(self.master_address, self.master_port)}/epoch-{epoch}", self._store)

    def _await_workers(self, store: PrefixStore, abandoned: threading.Event) -> None:
        """Wait until every worker has announced its address, before building the group, whose
        own rendezvous cannot be cancelled: this wait ends as soon as ``abandoned`` is set."""
        keys = [f"0/{rank}" for rank in range(1, self.world_size)]  # torch's key of a rank's address
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not store.check(keys):
            if abandoned.wait(WORKER_POLL_S):
                abandon_join(store, "the weight update was aborted")
                raise UpdateAbandoned("the join was given up before every vLLM worker joined the transfer group")
            if time.monotonic() >= deadline:
                arrived = sum(store.check([key]) for key in keys)
                abandon_join(store, "the trainer's wait for every worker timed out")
                raise TimeoutError(
                    f"{arrived} of {len(keys)} vLLM workers joined the weight-transfer group within "
                    f"{self.timeout.total_seconds():g}s (weight_sync.transfer_timeout_s): the others "
                    f"cannot reach {self.master_address}:{self.master_port}, or their servers are down"
                )

    def broadcast(self, named_tensors: NamedTensors) -> None:
        """Send the tensors from rank 0 in buckets, in order; must match the announced update_info."""
        group = self._group
        assert group is not None, "not connected"
        tensors = [tensor.detach().to("cpu") for _name, tensor in named_tensors]
        if self._through_shared_memory:
            assert self._shared_file is not None
            self._shared_file.write(tensors)
            buckets = []  # the trailer alone says the file is written
        else:
            buckets = broadcast_buckets([(t.dtype, t.numel()) for t in tensors])
        for bucket in buckets:
            payload = torch.cat([tensors[i].reshape(-1) for i in bucket])
            group.broadcast(payload, 0).wait()
        group.broadcast(packing_trailer(sum(t.numel() for t in tensors), len(buckets)), 0).wait()

    def leave(self) -> None:
        """Leave the group (the workers' receives fail at once) but keep hosting the store."""
        group, self._group = self._group, None
        self._through_shared_memory = False
        self.served_dtype = None  # the next join says it again: the servers may have changed
        if group is not None:
            group.shutdown()

    def close(self) -> None:
        """Leave the group, stop hosting the store and free the shared memory; safe to call twice."""
        self.leave()
        self._store = None
        if self._shared_file is not None:
            self._shared_file.close()
            self._shared_file = None
