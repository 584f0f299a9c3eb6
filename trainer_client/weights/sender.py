"""The weight sender's base: rank 0 of the transfer group with the vLLM workers, one subclass
per vLLM weight-transfer backend, driven by ``WeightPusher``.

``connect()`` and ``broadcast()`` block until the workers take part, so they run concurrently
with the server's ``/init_weight_transfer_engine`` and ``/update_weights``; each is bounded by
``timeout_s``.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import ClassVar

import torch

NamedTensors = Iterable[tuple[str, torch.Tensor]]

WORKER_POLL_S = 0.05
"""How often a join looks whether the workers are in (and whether it was abandoned)."""


class UpdateAbandoned(RuntimeError):
    """The service gave up the update (an abort) while this trainer waited to send it."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``: the worker resolves it with ``getattr(torch, name)``."""
    return str(dtype).removeprefix("torch.")


def update_info_for(named_tensors: NamedTensors) -> dict[str, list]:
    """The ``update_info`` body of ``/update_weights`` announcing these tensors."""
    named = list(named_tensors)
    return {
        "names": [name for name, _ in named],
        "dtype_names": [dtype_name(tensor.dtype) for _, tensor in named],
        "shapes": [list(tensor.shape) for _, tensor in named],
    }


class WeightSender(ABC):
    REJOIN_NEEDS_NEW_PORT: ClassVar[bool]
    """Each join hosts a fresh rendezvous, so a re-join after a failure needs a fresh port."""
    RESIZES_IN_PLACE: ClassVar[bool]
    """A join may bring another world size to this sender; otherwise that is a new sender."""
    served_dtype: torch.dtype | None = None
    """The dtype every worker's model runs in, where the last join told it (gloo); None: unknown."""

    def __init__(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        timeout_s: float = 60.0,
        shared_memory: bool = True,
    ) -> None:
        """``shared_memory``: reach workers on this host through shared memory where the backend can."""
        if world_size < 2:
            raise ValueError(f"world_size must be >= 2 (trainer + at least one worker), got {world_size}")
        self.master_address = master_address
        self.master_port = master_port
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.shared_memory = shared_memory

    @property
    @abstractmethod
    def connected(self) -> bool: ...

    @property
    @abstractmethod
    def transport(self) -> str:
        """How the current join's pushes travel, for logs."""

    @abstractmethod
    def connect(self, epoch: int = 0, world_size: int | None = None, abandoned: threading.Event | None = None) -> None:
        """Join the group as rank 0 (blocks until every worker joins). ``epoch``: the service's
        number for this join; ``world_size``: this join's, if the servers changed;
        ``abandoned``: when set, ends the wait with :class:`UpdateAbandoned`."""

    @abstractmethod
    def broadcast(self, named_tensors: NamedTensors) -> None:
        """Send the tensors from rank 0 in the announced order (``update_info_for``)."""

    @abstractmethod
    def leave(self) -> None:
        """Leave the group: the workers' receives fail at once."""

    def close(self) -> None:
        """Leave the group and release what the sender hosts; safe to call twice."""
        self.leave()
