"""Trainer side of vLLM's own NCCL weight-transfer engine (GPU servers).

On GPU the service's vLLM servers run with ``--weight-transfer-config '{"backend":
"nccl"}'``: their workers join a NCCL group through a ``StatelessProcessGroup`` rendezvous
whose TCPStore is hosted by rank 0, this trainer. The mirror of that is vLLM's own
``nccl_common.trainer_init`` (a ``PyNcclCommunicator``), so this sender needs vLLM
installed next to the trainer (``pip install 'rollout-service[gpu]'``), as TRL's vLLM
weight sync does; the gloo sender (``gloo.py``) does not.

Differences from the gloo sender that the pusher must know:

- vLLM's rendezvous has no join epochs: each join hosts a fresh store, so every re-join
  needs a fresh port (``REJOIN_NEEDS_NEW_PORT``).
- Tensors are broadcast from the GPU, unpacked (vLLM's worker default), one after another
  in the announced order, on the current CUDA stream, which is synchronised before return
  so the caller may change the weights right after.

Timeouts, as the gloo path has them: vLLM's ``trainer_init`` and NCCL's broadcast take
none (a worker that never joins, or stops receiving, blocks the trainer for good), so both
run in a thread of their own and give up after ``timeout_s`` (the service's
``weight_sync.transfer_timeout_s``): the push fails, the service has aborted the update,
and the next push joins a fresh group on a fresh port. The abandoned thread is left to
NCCL; its communicator is never used again. A join also stops waiting as soon as the
service aborts the update (``WeightPusher`` hears of it through its commit).

Status: written against vLLM's ``nccl_engine.py`` / ``nccl_common.py``. The broadcast has not
run end to end (no GPU on the development machine, and the lent GPU machine has no vLLM). The
join's first half, vLLM's own ``StatelessProcessGroup`` rendezvous, is tested on CPU: a join
given up while it waits there frees the trainer, the next join on a fresh port works, and the
process exits cleanly with the abandoned thread still blocked in the store.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
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
    outcome: dict[str, Any] = {}
    finished = threading.Event()

    def run() -> None:
        try:
            outcome["value"] = fn(*args)
        except BaseException as exc:  # handed to the caller's thread
            outcome["error"] = exc
        finally:
            finished.set()

    threading.Thread(target=run, name=f"nccl-{what}", daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not finished.wait(min(WORKER_POLL_S, max(0.0, deadline - time.monotonic()))):
        if abandoned is not None and abandoned.is_set():
            raise UpdateAbandoned(f"the NCCL {what} was given up: the service aborted the update")
        if time.monotonic() < deadline:
            continue
        raise TimeoutError(
            f"NCCL {what} did not finish within {timeout_s:g}s (weight_sync.transfer_timeout_s): a vLLM worker "
            "did not join or stopped receiving; the service aborts the update and the next push re-joins"
        )
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


class NcclWeightSender(WeightSender):
    """Rank 0 of the trainer <-> vLLM workers NCCL group."""

    REJOIN_NEEDS_NEW_PORT = True
    RESIZES_IN_PLACE = False
    """vLLM's NCCL rendezvous has no epochs: another world size is a new sender (and store)."""

    _communicator: Any = None
    """vLLM's communicator while joined (``shared_memory`` is unused: NCCL moves GPU to GPU)."""

    @property
    def connected(self) -> bool:
        return self._communicator is not None

    @property
    def transport(self) -> str:
        return "nccl"

    def connect(self, epoch: int = 0, world_size: int | None = None, abandoned: threading.Event | None = None) -> None:
        """Join as rank 0 (blocks until every worker joins). ``epoch`` is unused: see the module
        doc. ``world_size`` must be this sender's (not ``RESIZES_IN_PLACE``). ``abandoned``:
        set when the join is given up, which ends the wait with :class:`UpdateAbandoned`
        (the join's thread is left to NCCL, as after a timeout)."""
        if self._communicator is not None:
            raise RuntimeError("already connected; leave() first")
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
        if self._communicator is None:
            raise RuntimeError("not connected: call connect() first")
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
        stream.synchronize()

    def leave(self) -> None:
        communicator, self._communicator = self._communicator, None
        if communicator is not None:
            communicator.destroy()
