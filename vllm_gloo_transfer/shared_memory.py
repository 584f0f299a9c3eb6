"""The gloo push's same-host path: the tensors go through shared memory, the group only syncs.

Why: a trainer next to its vLLM server (the default, one host) sent every push over gloo's
loopback TCP. Receiving it cost vLLM's worker about 1.9 ms of CPU a push on the benchmark's
model (1.6M parameters), a fifth of what a push costs vLLM, on the core that generates.
Reading views of a mapping both processes share costs next to nothing.

How:
- The trainer holds one anonymous memory file (a memfd) for the life of its sender. It dies
  with the trainer, so a crash leaves no file behind.
- At each join the trainer offers it to the workers over the group: its pid, its fd and a
  random nonce, which it keeps in the file's header.
- A worker on the same host (same pid namespace, same user) opens ``/proc/<pid>/fd/<fd>``,
  if that is a memfd of this name (in another pid namespace it can be any file), and
  checks the nonce. Every rank then says yes or no in one all-reduce.
- The group uses the file only if every worker said yes. Otherwise the buckets travel over
  gloo as before: a server in another container or on another host simply says no.
- Per push the trainer writes every tensor into the file, at offsets both sides derive from
  the announced specs (:func:`layout`). It then broadcasts the trailer alone, and the
  worker hands out views of its mapping.

The views stay valid until the update is finished. The trainer writes the next push only
once the service has begun the next update, and the service begins it only after this one
is finished or aborted; after an abort the next update joins again, and a join drops the
views. So the worker accepts one receive per update on this path (``vllm_gloo_transfer.plugin``).

Plain torch and the standard library: the trainer imports this without vLLM.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import secrets

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import ProcessGroupGloo

logger = logging.getLogger(__name__)

OFFER_MAGIC = 0x5348_4D57_4549_4748  # "SHMWEIGH": an offer, not the zeros of a trainer that makes none
MEMFD_NAME = "rollout-weights"
"""The file's name, which ``/proc/<pid>/fd/<fd>`` shows as ``/memfd:rollout-weights (deleted)``."""
HEADER_BYTES = 64
"""The file's first bytes hold the nonce of the offer; tensors start after them."""
ALIGN_BYTES = 64
"""Each tensor starts on a multiple of this, so a byte view can be viewed as any dtype."""
_OFFER_FIELDS = 5  # magic, pid, fd, and the nonce's two halves
_NONCE_BYTES = 16


def layout(specs: list[tuple[torch.dtype, int]]) -> tuple[list[int], int]:
    """Byte offsets of the announced tensors (dtype, number of elements) in the file, and
    the file's size: both sides derive them, so nothing but the trailer is sent."""
    offsets = []
    end = HEADER_BYTES
    for dtype, numel in specs:
        offsets.append(end)
        end += -(-numel * dtype.itemsize // ALIGN_BYTES) * ALIGN_BYTES
    return offsets, end


class _MappedFile:
    """A file descriptor and a shared mapping of the file's first bytes, as a byte tensor."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._bytes = torch.empty(0, dtype=torch.uint8)

    def _map(self, size: int) -> None:
        """Map the file's first ``size`` bytes, writable; the tensor keeps the mapping alive, so
        views handed out before stay valid. ``MAP_POPULATE`` maps every page now rather than at
        its first touch."""
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        self._bytes = torch.frombuffer(mmap.mmap(self._fd, size, flags=flags), dtype=torch.uint8)

    def close(self) -> None:
        """Close the file; views handed out keep their pages mapped until they are dropped."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class SharedWeightsFile(_MappedFile):
    """The trainer's side: the memfd that pushes are written into, grown as needed."""

    def __init__(self, fd: int) -> None:
        super().__init__(fd)
        self._nonce = secrets.token_bytes(_NONCE_BYTES)
        self._resize(HEADER_BYTES)
        self._bytes[:_NONCE_BYTES] = torch.frombuffer(bytearray(self._nonce), dtype=torch.uint8)

    @classmethod
    def create(cls) -> SharedWeightsFile | None:
        """A new file, or None (logged) where the system has no memfd (not Linux)."""
        try:
            return cls(os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC))
        except (AttributeError, OSError) as exc:
            logger.info("weights travel over gloo: no shared memory file: %s", exc)
            return None

    def offer(self) -> torch.Tensor:
        """What a worker needs to find this file and to check it found the right one."""
        nonce = torch.frombuffer(bytearray(self._nonce), dtype=torch.int64)
        return torch.cat([torch.tensor([OFFER_MAGIC, os.getpid(), self._fd]), nonce])

    def write(self, tensors: list[torch.Tensor]) -> None:
        """Copy the tensors to their offsets (:func:`layout`), growing the file first if needed."""
        offsets, size = layout([(tensor.dtype, tensor.numel()) for tensor in tensors])
        if size > self._bytes.numel():
            self._resize(size)
        for tensor, offset in zip(tensors, offsets, strict=True):
            nbytes = tensor.numel() * tensor.dtype.itemsize
            self._bytes[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)

    def _resize(self, size: int) -> None:
        os.ftruncate(self._fd, size)
        self._map(size)


class OutOfReach(Exception):
    """Why a worker cannot use the trainer's shared memory; it then receives over gloo."""


class SharedWeightsMapping(_MappedFile):
    """A worker's side: the trainer's file, opened through ``/proc`` and mapped."""

    def __init__(self, fd: int) -> None:
        super().__init__(fd)
        self._map(HEADER_BYTES)

    @classmethod
    def open(cls, offer: torch.Tensor) -> SharedWeightsMapping:
        """The offered file. :class:`OutOfReach` says why not: this process is on another
        host, in another container (pid namespace) or another user's, or nothing is offered."""
        if int(offer[0]) != OFFER_MAGIC:
            raise OutOfReach("the trainer offers no shared memory (--no-shared-memory-push)")
        pid, fd = int(offer[1]), int(offer[2])
        path = f"/proc/{pid}/fd/{fd}"
        elsewhere = OutOfReach(f"{path} is not the trainer's file here (another host or pid namespace)")
        try:
            # Another pid namespace may have any file at that pid and fd: open only a file of ours.
            if not os.readlink(path).startswith(f"/memfd:{MEMFD_NAME}"):
                raise elsewhere
            descriptor = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise OutOfReach(f"the trainer's shared memory ({path}) is out of reach: {exc}") from exc
        try:
            mapping = cls(descriptor)
        except (OSError, ValueError) as exc:
            os.close(descriptor)
            raise OutOfReach(f"cannot map the trainer's shared memory ({path}): {exc}") from exc
        if not torch.equal(mapping._bytes[:_NONCE_BYTES].view(torch.int64), offer[3:]):
            mapping.close()
            raise elsewhere
        return mapping

    def views(self, specs: list[tuple[torch.dtype, list[int]]]) -> list[torch.Tensor]:
        """The announced tensors as views of the file (valid until the trainer's next write)."""
        numels = [math.prod(shape) for _, shape in specs]
        offsets, size = layout([(dtype, numel) for (dtype, _), numel in zip(specs, numels, strict=True)])
        if size > self._bytes.numel():
            available = os.fstat(self._fd).st_size
            if available < size:
                raise RuntimeError(
                    f"the trainer's shared memory holds {available} bytes where the announced tensors need {size}: "
                    "the trainer and the server disagree on the layout; install the same version on both"
                )
            self._map(available)
        return [
            self._bytes[offset : offset + numel * dtype.itemsize].view(dtype).view(shape)
            for (dtype, shape), numel, offset in zip(specs, numels, offsets, strict=True)
        ]


def offer_shared_memory(group: ProcessGroupGloo, file: SharedWeightsFile | None) -> bool:
    """Rank 0, right after a join: offer ``file`` (None: offer nothing) and learn whether
    every worker can use it. The workers run :func:`accept_shared_memory`."""
    offer = file.offer() if file is not None else torch.zeros(_OFFER_FIELDS, dtype=torch.int64)
    group.broadcast(offer, 0).wait()
    return _all_agree(group, file is not None)


def accept_shared_memory(group: ProcessGroupGloo) -> tuple[SharedWeightsMapping | None, str]:
    """A worker, right after a join: take rank 0's offer if every rank can. Without it,
    None and why, for the worker's log."""
    offer = torch.zeros(_OFFER_FIELDS, dtype=torch.int64)
    group.broadcast(offer, 0).wait()
    try:
        mapping, why_not = SharedWeightsMapping.open(offer), ""
    except OutOfReach as exc:
        mapping, why_not = None, str(exc)
    if _all_agree(group, mapping is not None):
        return mapping, ""
    if mapping is not None:
        mapping.close()
        why_not = "another worker of the group cannot reach the trainer's shared memory"
    return None, why_not


def _all_agree(group: ProcessGroupGloo, yes: bool) -> bool:
    """Every rank's ``yes``, and-ed: an all-reduce of the minimum."""
    vote = torch.tensor([int(yes)], dtype=torch.int64)
    group.allreduce([vote], dist.ReduceOp.MIN).wait()
    return bool(vote.item())
