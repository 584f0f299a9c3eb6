"""Trainer side of vLLM's own NCCL weight-transfer engine (GPU servers), through vLLM's
``nccl_common.trainer_init``, so this sender needs vLLM installed beside the trainer.

vLLM's rendezvous has no join epochs, so every re-join needs a fresh port. Its join and NCCL's
broadcast take no timeout, so both run in a thread of their own, abandoned to NCCL after
``timeout_s`` or an abort; its communicator is never used again. The broadcast has not yet
run end to end against vLLM.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from typing import Any, TypeVar

import torch

from trainer_client.weights.sender import WORKER_POLL_S, NamedTensors, UpdateAbandoned, WeightSender

T = TypeVar("T")

INSTALL_HINT = (
    "the service's vLLM servers use the nccl weight-transfer backend; the trainer then needs "
    "vLLM installed for its NCCL communicator (pip install 'rollout-service[gpu]') and a CUDA device"
)


def call_within(
    timeout_s: float, what: str, fn: Callable[..., T], *args: Any, abandoned: threading.Event | None = None
) -> T:
    """``fn(*args)`` in a daemon thread, waited for at most ``timeout_s``, or until
    ``abandoned`` is set (then :class:`UpdateAbandoned`)."""
    outcome: Future[T] = Future()

    def run() -> None:
        try:
            outcome.set_result(fn(*args))
        except BaseException as exc:  # handed to the caller's thread
            outcome.set_exception(exc)

    threading.Thread(target=run, name=f"nccl-{what}", daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not wait([outcome], min(WORKER_POLL_S, max(0.0, deadline - time.monotonic()))).done:
        if abandoned is not None and abandoned.is_set():
            raise UpdateAbandoned(f"the NCCL {what} was given up: the service aborted the update")
        if time.monotonic() < deadline:
            continue
        raise TimeoutError(
            f"NCCL {what} did not finish within {timeout_s:g}s (weight_sync.transfer_timeout_s): a vLLM worker "
            "did not join or stopped receiving; the service aborts the update and the next push re-joins"
        )
    return outcome.result()


class NcclWeightSender(WeightSender):
    """Rank 0 of the trainer <-> vLLM workers NCCL group."""

    REJOIN_NEEDS_NEW_PORT = True
    RESIZES_IN_PLACE = False
    """vLLM's NCCL rendezvous has no epochs: another world size is a new sender."""

    _communicator: Any = None
    """vLLM's communicator while joined (``shared_memory`` is unused: NCCL moves GPU to GPU)."""

    @property
    def connected(self) -> bool:
        return self._communicator is not None

    @property
    def transport(self) -> str:
        return "nccl"

    def connect(self, epoch: int = 0, world_size: int | None = None, abandoned: threading.Event | None = None) -> None:
        """Join as rank 0 (``WeightSender.connect``); ``epoch`` is unused and ``world_size`` must
        be this sender's."""
        if world_size not in (None, self.world_size):
            raise ValueError(f"this sender was made for world size {self.world_size}, not {world_size}; make a new one")
        if not torch.cuda.is_available():
            raise RuntimeError(INSTALL_HINT)
        try:
            from vllm.distributed.weight_transfer.nccl_common import trainer_init
        except ImportError as exc:
            raise RuntimeError(f"{INSTALL_HINT} ({exc})") from exc
        rendezvous = {
            "master_address": self.master_address,
            "master_port": self.master_port,
            "world_size": self.world_size,
        }
        self._communicator = call_within(self.timeout_s, "join", trainer_init, rendezvous, abandoned=abandoned)

    def broadcast(self, named_tensors: NamedTensors) -> None:
        try:
            call_within(self.timeout_s, "broadcast", self._broadcast, named_tensors)
        except TimeoutError:
            self._communicator = None  # a group that stopped moving cannot be trusted
            raise

    def _broadcast(self, named_tensors: NamedTensors) -> None:
        stream = torch.cuda.current_stream()
        for _name, tensor in named_tensors:
            # NCCL sends numel elements from data_ptr(): it must be a contiguous CUDA tensor,
            # kept referenced until the broadcast is enqueued.
            payload = tensor.detach().to("cuda").contiguous()
            self._communicator.broadcast(payload, src=0, stream=stream)
        stream.synchronize()  # the caller may change the weights on return

    def leave(self) -> None:
        communicator, self._communicator = self._communicator, None
        if communicator is not None:
            communicator.destroy()
