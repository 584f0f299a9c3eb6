"""The gloo weight sender (CPU servers): plain torch, importable without vLLM.

The trainer is rank 0 of a gloo group whose other ranks are the vLLM workers running
``vllm_gloo_transfer.plugin`` (joined through
``/init_weight_transfer_engine`` with ``rank_offset`` 1). The worker opens its side with
``vllm.distributed.utils.stateless_init_torch_distributed_process_group(host, port, rank,
world_size, "gloo")``, so :meth:`GlooWeightSender.connect` must build exactly its mirror:

- a ``TCPStore`` that rank 0 hosts (``is_master``; ``torch.distributed.rendezvous`` makes
  rank 0 the master with ``multi_tenant=True``, the workers connect as clients);
- a ``PrefixStore`` whose prefix is the rendezvous URI ``tcp://host:port``;
- before the group, every rank counts itself in (``vllm_gloo_transfer.groups.arrive``) and
  the workers wait for all; a trainer that gives the join up says so in the store, which
  releases them at once (``abandon``);
- a ``ProcessGroupGloo`` on it, plus ``_set_sequence_number_for_group()``: rank 0 writes
  the group's sequence number that every other rank waits for at init; without it the
  workers hang until their timeout.

Then per update the trainer broadcasts the tensors from rank 0, in the order announced by
``sender.update_info_for``, while the server's ``/update_weights`` call receives them: packed
into buckets (:func:`broadcast_buckets`, consecutive tensors of one dtype, flattened and
concatenated), one broadcast each, because each broadcast is a round trip that costs about
a millisecond whatever its size. Both sides derive the buckets from the announced names,
dtypes and shapes, so the update_info needs no extra field. When every worker is on this
host, the tensors go through shared memory instead and the group carries only the trailer
(``vllm_gloo_transfer.shared_memory``); the handshake is the same.
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
from vllm_gloo_transfer.groups import abandon_join, arrive, gloo_group
from vllm_gloo_transfer.packing import broadcast_buckets, packing_trailer
from vllm_gloo_transfer.shared_memory import SharedWeightsFile, offer_shared_memory


def worker_address_key(rank: int) -> str:
    """Where a rank announces its gloo address in the group's store: gloo's own key (the rank)
    under ``ProcessGroupGloo``'s prefix for its first device ("0"). A torch internal, pinned by
    ``tests/unit/test_weight_backends.py``."""
    return f"0/{rank}"


def rendezvous_uri(host: str, port: int) -> str:
    """Same string as vLLM's ``get_tcp_uri``: it is the PrefixStore prefix, so the two
    sides only see each other's keys if they agree on it byte for byte."""
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
    """Another world size joins through the same store: restarting the store instead would
    drop the workers already connecting to it."""

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
        """``"shared memory"`` or ``"gloo"``."""
        return "shared memory" if self._through_shared_memory else "gloo"

    def connect(self, epoch: int = 0, world_size: int | None = None, abandoned: threading.Event | None = None) -> None:
        """Join the group as rank 0 (blocks until all workers join); ``world_size``: this
        join's, when the servers changed since the last; ``abandoned``: set when the join is
        given up, which ends the wait with :class:`UpdateAbandoned`.

        The rendezvous store is hosted once and kept across joins; each join's keys live
        under the prefix of its ``epoch`` (the service numbers the joins), so a re-join after
        a failure never meets the keys of a previous one and the port is never re-bound.
        """
        if self._group is not None:
            raise RuntimeError("already connected; leave() first")
        if world_size is not None:
            if world_size < 2:
                raise ValueError(f"world_size must be >= 2 (trainer + at least one worker), got {world_size}")
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
        """Wait until every worker has announced its address, before building the group.

        Why: the group's own rendezvous waits out the whole timeout and cannot be cancelled
        (neither shutdown nor abort frees it), so a join the service gave up (vLLM down, the
        service gone) held the trainer for minutes. Waiting here, in short looks at the
        store, ends as soon as ``abandoned`` is set; once the workers are in, the group
        forms at once.
        """
        keys = [worker_address_key(rank) for rank in range(1, self.world_size)]
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
        group = self._require_group()
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
        if group is not None:
            group.shutdown()

    def close(self) -> None:
        """Leave the group, stop hosting the store and free the shared memory; safe to call twice."""
        self.leave()
        self._store = None
        if self._shared_file is not None:
            self._shared_file.close()
            self._shared_file = None

    def _require_group(self) -> ProcessGroupGloo:
        if self._group is None:
            raise RuntimeError("not connected: call connect() first")
        return self._group
