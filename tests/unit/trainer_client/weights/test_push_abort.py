"""A push the service aborts mid-broadcast ends as soon as the trainer hears of the abort,
not at the transfer group's timeout: a real gloo group with a worker process that joins
and then never receives (a stopped vLLM), and a service stand-in that aborts the update."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from rollout_api import rollout_pb2 as pb
from tests.support import wait_until
from trainer_client.weights.gloo import GlooWeightSender
from trainer_client.weights.push import WeightPusher

GROUP_TIMEOUT_S = 60.0
WORKER = """
import signal, sys
from datetime import timedelta
from torch.distributed import PrefixStore, TCPStore
from trainer_client.weights.gloo import rendezvous_uri
from vllm_gloo_transfer.groups import agree_on_served_dtype, gloo_group
from vllm_gloo_transfer.shared_memory import accept_shared_memory

port = int(sys.argv[1])
store = TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=30))
prefix = PrefixStore(rendezvous_uri("127.0.0.1", port) + "/epoch-1", store)
group = gloo_group(prefix, 1, 2, timedelta(seconds=60), "127.0.0.1")
accept_shared_memory(group)
agree_on_served_dtype(group, None)
signal.pause()  # joined, then never receives, until killed: a vLLM stopped mid-push
"""


class AbortingService:
    """BeginWeightUpdate answers a join of one worker; the commit is refused once the trainer
    broadcasts, as the service's watchdog refuses an update that stopped moving."""

    def __init__(self, broadcasting: threading.Event) -> None:
        self.broadcasting = broadcasting
        self.aborts: list[str] = []

    async def begin_weight_update(self, *args: object, **kwargs: object) -> pb.BeginWeightUpdateResponse:
        return pb.BeginWeightUpdateResponse(
            update_id="wu-1", join_group=True, group_world_size=2, backend="gloo", group_epoch=1
        )

    async def commit_weight_update(self, update_id: str, timeout_s: float) -> pb.CommitWeightUpdateResponse:
        await wait_until(self.broadcasting.is_set, 30, "the trainer to broadcast")
        raise RuntimeError("weight update wu-1 was aborted (not committed: no progress after transfer)")

    async def abort_weight_update(self, update_id: str, reason: str) -> SimpleNamespace:
        self.aborts.append(reason)
        return SimpleNamespace()


@pytest.mark.timeout(60)
async def test_a_push_aborted_mid_broadcast_ends_at_the_abort_not_the_group_timeout(monkeypatch) -> None:
    broadcasting = threading.Event()
    broadcast = GlooWeightSender.broadcast

    def noted_broadcast(self: GlooWeightSender, named_tensors: object) -> None:
        broadcasting.set()
        broadcast(self, named_tensors)  # type: ignore[arg-type]

    monkeypatch.setattr(GlooWeightSender, "broadcast", noted_broadcast)
    service = AbortingService(broadcasting)
    pusher = WeightPusher(
        service,  # type: ignore[arg-type]
        "run",
        transfer_timeout_s=GROUP_TIMEOUT_S,
        shared_memory=False,  # every byte over gloo, as to a server on another host
    )
    worker = await asyncio.create_subprocess_exec(sys.executable, "-c", WORKER, str(pusher.port))
    try:
        weights = [("w", torch.ones(64 << 20))]  # far more than the sockets buffer: the send blocks
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="was aborted"):
            await pusher.push(weights)
        ended_after = time.monotonic() - started
        assert ended_after < GROUP_TIMEOUT_S / 4, ended_after
        assert service.aborts and not pusher._sender.connected  # type: ignore[union-attr]
    finally:
        worker.kill()
        await asyncio.wait_for(worker.wait(), 10)
        pusher.close()
