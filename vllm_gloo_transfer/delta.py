"""Delta pushes: the wire format and checksum that the trainer's encoder
(``trainer_client.weights.delta``) and the receiving engine (``vllm_gloo_transfer.plugin``)
share, and the receiver's copy of the last pushed weights that deltas patch.

A delta push sends each tensor either in full or as the flat indices and new values of the
elements whose bits changed since the last push. Both sides keep the weights of the last push
(the trainer in the served dtype, the server as it received them), and both checksum every
tensor after each push: the server compares its checksum with the trainer's before it applies
anything, so a missed delta is caught instead of drifting silently. Importing this module needs
torch only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

Encoding = Literal["full", "sparse"]
ENCODINGS: tuple[Encoding, ...] = ("full", "sparse")

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHECKSUM_CHUNK = 1 << 18
"""Elements checksummed at once: their int64 copy stays in cache."""
_MIX = 0x9E37_79B9_7F4A_7C15 - (1 << 64)  # odd, as int64: every element's weight is odd


class DeltaMismatch(RuntimeError):
    """The weights after a delta are not those the trainer checksummed: a delta was missed."""


def index_dtype(numel: int) -> torch.dtype:
    """The narrowest index type that addresses a tensor of ``numel`` elements."""
    return torch.int32 if numel <= torch.iinfo(torch.int32).max else torch.int64


def sparse_pays(numel: int, changed: int, dtype: torch.dtype) -> bool:
    """Whether ``changed`` (index, value) pairs are fewer bytes than the whole tensor."""
    return changed * (index_dtype(numel).itemsize + dtype.itemsize) < numel * dtype.itemsize


def as_words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bits, flat, as signed integers of its element size: equal words, equal bits
    (so NaNs and -0.0 compare as what they are)."""
    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.bool:
        return flat.view(torch.int8)
    return flat.view(_INT_OF_SIZE[flat.dtype.itemsize])


def checksum(tensor: torch.Tensor) -> int:
    """A 64-bit checksum of the tensor's bits and their positions, on its own device: its bytes
    read as 64-bit words (the last one zero-padded), each times an odd, position-dependent
    weight, summed mod 2**64, so any single changed element changes it. Both sides compute it
    the same way."""
    flat = tensor.detach().reshape(-1)
    if flat.storage_offset() * flat.element_size() % 8:
        flat = flat.clone()  # a 64-bit view must start on a multiple of 8 bytes
    raw = flat.view(torch.uint8)
    aligned = raw.numel() // 8 * 8
    words = raw[:aligned].view(torch.int64)
    weights = _chunk_weights(words.device)
    scratch = torch.empty(min(words.numel(), _CHECKSUM_CHUNK), dtype=torch.int64, device=words.device)
    total = torch.zeros((), dtype=torch.int64, device=words.device)
    number = 0
    for number, start in enumerate(range(0, words.numel(), _CHECKSUM_CHUNK)):
        mixed = scratch[: min(_CHECKSUM_CHUNK, words.numel() - start)]
        torch.mul(words[start : start + mixed.numel()], weights[: mixed.numel()], out=mixed)
        total += mixed.sum() * (2 * number + 1)
    if aligned < raw.numel():  # the last bytes, as one more chunk of one word
        last = torch.zeros(8, dtype=torch.uint8, device=raw.device)
        last[: raw.numel() - aligned] = raw[aligned:]
        total += last.view(torch.int64)[0] * (2 * number + 3)
    return int(total.item()) % 2**64  # all 64 bits: a flipped sign bit of the last lane is bit 63


_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _chunk_weights(device: torch.device) -> torch.Tensor:
    """The odd weight of each position in a chunk (made once per device)."""
    if device not in _WEIGHTS:
        weights = torch.arange(_CHECKSUM_CHUNK, dtype=torch.int64, device=device)
        _WEIGHTS[device] = weights.mul_(_MIX).bitwise_or_(1)
    return _WEIGHTS[device]


@dataclass(frozen=True)
class WireSpec:
    """One tensor as it travels: its dtype and shape."""

    dtype: torch.dtype
    shape: list[int]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def wire_specs(
    dtypes: list[torch.dtype], shapes: list[list[int]], encodings: list[Encoding], counts: list[int]
) -> list[WireSpec]:
    """What travels, in order: the indices of every sparse tensor, then each tensor's values (a
    sparse one's) or itself (a full one's). Indices first, so that the gloo path packs them in one
    bucket and the values in another instead of a broadcast per tensor
    (``vllm_gloo_transfer.packing``)."""
    entries = list(zip(dtypes, shapes, encodings, counts, strict=True))
    indices = [
        WireSpec(index_dtype(math.prod(shape)), [count])
        for _, shape, encoding, count in entries
        if encoding == "sparse"
    ]
    values = [WireSpec(dtype, shape if encoding == "full" else [count]) for dtype, shape, encoding, count in entries]
    return indices + values


@dataclass
class DeltaBase:
    """The server's copy of the last pushed weights, flat, with each tensor's checksum: what
    the next delta patches. Kept only while the trainer sends its pushes with encodings."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    checksums: dict[str, int] = field(default_factory=dict)

    def clear(self) -> None:
        self.tensors.clear()
        self.checksums.clear()

    def patch(
        self,
        name: str,
        encoding: Encoding,
        wire: list[torch.Tensor],
        shape: list[int],
        expected: int,
    ) -> torch.Tensor:
        """Apply one tensor of a push (``wire``: the tensor, or its indices and values) and return
        the whole tensor it makes, once its checksum is ``expected``, the trainer's."""
        if encoding == "full":
            (values,) = wire
            tensor = values.detach().reshape(-1).clone()  # the received buffer is reused
            self.tensors[name] = tensor
            self.checksums[name] = checksum(tensor)
        else:
            tensor = self.tensors.get(name)
            if tensor is None:
                raise DeltaMismatch(
                    f"a delta for {name!r} arrived, but this server holds no base for it (no full push "
                    "since it joined): the trainer must push in full"
                )
            indices, values = wire
            if indices.numel():  # an untouched tensor keeps its checksum
                tensor[indices.long()] = values
                self.checksums[name] = checksum(tensor)
        if self.checksums[name] != expected:
            raise DeltaMismatch(
                f"delta checksum mismatch at {name!r}: this server's weights after the delta are not the "
                "trainer's (a delta was missed): the trainer must push in full"
            )
        return tensor.view(shape)
