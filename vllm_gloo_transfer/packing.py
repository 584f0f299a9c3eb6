"""The gloo push's wire format, shared by the trainer's sender (``trainer_client.weights.gloo``)
and the receiving engine inside vLLM (``vllm_gloo_transfer.plugin``): the tensors are
packed into buckets, each one broadcast, because a broadcast is a round trip that costs
about a millisecond whatever its size; both sides derive the buckets from the announced
names, dtypes and shapes, and a trailer lets the receiver check what arrived."""

from __future__ import annotations

import torch

BUCKET_BYTES = 64 << 20
"""Most bytes one broadcast packs (a larger tensor still goes alone): bounds the extra copy."""


def packing_trailer(elements: int, buckets: int) -> torch.Tensor:
    """Sent after the buckets: gloo fills a larger receive buffer from a smaller message
    without complaint, so the receiver checks what was sent against what was announced."""
    return torch.tensor([elements, buckets], dtype=torch.int64)


def broadcast_buckets(specs: list[tuple[torch.dtype, int]], limit: int = BUCKET_BYTES) -> list[list[int]]:
    """Indices of the announced tensors (dtype, number of elements), grouped into the
    buckets that travel as one broadcast each: consecutive tensors of one dtype, up to
    ``limit`` bytes."""
    buckets: list[list[int]] = []
    size = 0
    for index, (dtype, numel) in enumerate(specs):
        nbytes = numel * dtype.itemsize
        last = buckets[-1] if buckets else None
        if last is not None and specs[last[0]][0] == dtype and size + nbytes <= limit:
            last.append(index)
            size += nbytes
        else:
            buckets.append([index])
            size = nbytes
    return buckets
