"""The trainer's side of delta pushes: a copy of the weights the servers hold since the last
push, and the encoding of the next push against it (``vllm_gloo_transfer.delta`` has the wire
format and the checksum both sides share).

Each tensor travels sparse (the flat indices and new values of the elements whose bits changed)
where that is fewer bytes than the whole tensor, else whole. The copy moves on only when a push
commits: after any failure the servers may hold either version, so the next push is full.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from rollout_api import rollout_pb2 as pb
from trainer_client.weights.sender import dtype_name
from vllm_gloo_transfer.delta import Encoding, as_words, checksum, index_dtype, sparse_pays

NamedTensors = list[tuple[str, torch.Tensor]]

_ENCODING_TO_PB = {"full": pb.TENSOR_ENCODING_FULL, "sparse": pb.TENSOR_ENCODING_SPARSE}


def nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


@dataclass
class EncodedPush:
    """One push as it travels: what ``BeginWeightUpdate`` announces and what the sender broadcasts."""

    meta: list[pb.TensorMeta]
    wire: NamedTensors
    """The tensors in broadcast order (``vllm_gloo_transfer.delta.wire_specs``): every sparse
    tensor's indices, then each tensor's values, or itself."""
    weights: dict[str, torch.Tensor] = field(repr=False)
    """Every tensor as the servers will hold it after this push (the encoder's next copy)."""
    checksums: dict[str, int] = field(repr=False)

    @property
    def is_delta(self) -> bool:
        return any(meta.encoding == pb.TENSOR_ENCODING_SPARSE for meta in self.meta)

    @property
    def wire_bytes(self) -> int:
        return nbytes(tensor for _, tensor in self.wire)

    @property
    def full_bytes(self) -> int:
        return nbytes(self.weights.values())


class DeltaEncoder:
    """Encodes pushes against the weights the servers hold (the last committed push), in the
    dtype they are given in: the servers' (``WeightPusher`` casts to it), so an element whose
    cast value stays need not travel."""

    def __init__(self) -> None:
        self._held: dict[str, torch.Tensor] = {}
        self._checksums: dict[str, int] = {}

    @property
    def has_base(self) -> bool:
        return bool(self._held)

    def forget(self) -> None:
        """The servers' weights are unknown (a failed push): the next push is full."""
        self._held.clear()
        self._checksums.clear()

    def committed(self, push: EncodedPush) -> None:
        """The servers now hold ``push``'s weights."""
        self._held, self._checksums = push.weights, push.checksums

    @torch.no_grad()
    def encode(self, named_tensors: NamedTensors, full: bool = False) -> EncodedPush:
        """The push of ``named_tensors``: a delta against the held weights where they allow it,
        else (``full``, no base, another name, dtype or shape) whole. The tensors become the
        servers' weights once committed: give copies no later step changes."""
        meta: list[pb.TensorMeta] = []
        indices_wire: NamedTensors = []
        values_wire: NamedTensors = []
        weights: dict[str, torch.Tensor] = {}
        checksums: dict[str, int] = {}
        for name, tensor in named_tensors:
            new = tensor.detach()
            weights[name] = new
            held = None if full else self._held.get(name)
            encoding: Encoding = "full"
            changed = 0
            if held is not None and held.dtype == new.dtype and held.shape == new.shape:
                indices = (as_words(new) != as_words(held)).nonzero().squeeze(1)
                if sparse_pays(new.numel(), indices.numel(), new.dtype):
                    encoding, changed = "sparse", indices.numel()
                    indices_wire.append((f"{name}:indices", indices.to(index_dtype(new.numel()))))
                    values_wire.append((f"{name}:values", new.reshape(-1)[indices]))
            if encoding == "full":
                values_wire.append((name, new))
            checksums[name] = self._checksums[name] if encoding == "sparse" and not changed else checksum(new)
            meta.append(
                pb.TensorMeta(
                    name=name,
                    dtype=dtype_name(new.dtype),
                    shape=list(new.shape),
                    encoding=_ENCODING_TO_PB[encoding],
                    changed=changed,
                    checksum=checksums[name],
                )
            )
        return EncodedPush(meta, indices_wire + values_wire, weights, checksums)
