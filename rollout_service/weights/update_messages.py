"""The plain data of one weight update: what ``BeginWeightUpdate`` announces and how it is checked,
what the trainer is told back, where its seconds went, and vLLM's ``/init_weight_transfer_engine``
bodies. The edge converts them to and from the proto; ``weight_sync`` drives vLLM with them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from rollout_service.errors import InvalidArgument, echo

DTYPE_BYTES = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "int8": 1, "uint8": 1, "bool": 1,
}  # fmt: skip
TORCH_DTYPES = set(DTYPE_BYTES)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of an update, in the trainer's broadcast order."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    encoding: Literal["", "full", "sparse"] = ""
    """How it travels (``vllm_gloo_transfer.delta``); "": a plain full push."""
    changed: int = 0
    """Sparse: the elements that travel."""
    checksum: int = 0
    """With an encoding: the trainer's checksum of the tensor after the push."""


def is_delta(tensors: list[TensorSpec]) -> bool:
    """Some tensor travels sparse: the servers must hold the last push to apply it."""
    return any(tensor.encoding == "sparse" for tensor in tensors)


def wire_bytes(tensors: list[TensorSpec]) -> int:
    """The bytes a push sends: a sparse tensor's indices and values, any other whole. The index
    width is ``vllm_gloo_transfer.delta.index_dtype``'s, restated: the service imports no torch."""
    total = 0
    for tensor in tensors:
        itemsize = DTYPE_BYTES[tensor.dtype]
        numel = math.prod(tensor.shape)
        if tensor.encoding == "sparse":
            total += tensor.changed * (itemsize + (4 if numel < 2**31 else 8))
        else:
            total += numel * itemsize
    return total


@dataclass(frozen=True)
class UpdateTicket:
    """What ``begin`` tells the trainer."""

    update_id: str
    join_group: bool
    group_world_size: int
    backend: str
    policy_version: int
    group_epoch: int
    delta_allowed: bool = False


@dataclass(frozen=True)
class UpdateTimes:
    """Where the seconds of one finished update went."""

    update_id: str
    committed: bool
    phases: dict[str, float]
    """Phase (eval_hold, join, pause, transfer, finish, resume) -> wall-clock seconds; unreached: absent."""
    paused_seconds: float
    """From the first pause call to the end of resume (0 if it never paused)."""


def validate_begin(address: str, port: int, tensors: list[TensorSpec]) -> None:
    if not address:
        raise InvalidArgument("trainer_address is empty; give the address vLLM's workers can reach the trainer at")
    if not 0 < port < 65536:
        raise InvalidArgument(f"trainer_port {port} is not a valid TCP port")
    if not tensors:
        raise InvalidArgument("tensors is empty; list every tensor the trainer will broadcast, in order")
    for tensor in tensors:
        if tensor.dtype not in TORCH_DTYPES:
            raise InvalidArgument(
                f"tensor {echo(tensor.name)} has dtype {echo(tensor.dtype)}; "
                f"use one of {', '.join(sorted(TORCH_DTYPES))}"
            )
        if not tensor.name:
            raise InvalidArgument("a tensor has an empty name")
        if tensor.encoding == "sparse" and tensor.changed > math.prod(tensor.shape):
            raise InvalidArgument(
                f"tensor {echo(tensor.name)} is sparse with {tensor.changed} changed elements, more than its "
                f"shape {list(tensor.shape)} holds"
            )
    if len({tensor.encoding == "" for tensor in tensors}) > 1:
        raise InvalidArgument(
            "some tensors give an encoding and some do not: a push gives one for every tensor (a delta, or a full "
            "push the servers keep as a delta base) or for none (a plain full push)"
        )


def update_info(tensors: list[TensorSpec], keep_base: bool) -> dict[str, Any]:
    """The ``/update_weights`` body announcing the tensors; ``keep_base``: with their encodings and
    checksums, so the servers keep what the push makes as the base of the next delta."""
    info: dict[str, Any] = {
        "names": [t.name for t in tensors],
        "dtype_names": [t.dtype for t in tensors],
        "shapes": [list(t.shape) for t in tensors],
    }
    if keep_base:
        info |= {
            "encodings": [t.encoding for t in tensors],
            "counts": [t.changed if t.encoding == "sparse" else 0 for t in tensors],
            "checksums": [t.checksum for t in tensors],
        }
    return info


def init_info(
    backend: str,
    address: str,
    port: int,
    rank_offset: int,
    world_size: int,
    timeout_s: float,
    epoch: int,
    join_timeout_s: float,
) -> dict[str, Any]:
    """The ``/init_weight_transfer_engine`` body for one server. vLLM rejects unknown keys, so only
    this project's gloo engine gets the group's timeouts and the join epoch keying its rendezvous."""
    info: dict[str, Any] = {
        "master_address": address,
        "master_port": port,
        "rank_offset": rank_offset,
        "world_size": world_size,
    }
    if backend == "gloo":
        info |= {"timeout_s": timeout_s, "join_timeout_s": join_timeout_s, "epoch": epoch}
    return info


def leave_info() -> dict[str, Any]:
    """The gloo init body that only leaves: the worker drops its group and any update received but not
    applied. The address fields are placeholders its validation accepts."""
    return {"master_address": "", "master_port": 0, "rank_offset": 1, "world_size": 2, "leave": True}
