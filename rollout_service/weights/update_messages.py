"""The plain data of one weight update: what ``BeginWeightUpdate`` announces and how it is checked,
what the trainer is told back, where its seconds went, and vLLM's ``/init_weight_transfer_engine``
bodies. The edge converts them to and from the proto; ``weight_sync`` drives vLLM with them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollout_service.errors import InvalidArgument, echo

TORCH_DTYPES = {"float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8", "bool"}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of an update, in the trainer's broadcast order."""

    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class UpdateTicket:
    """What ``begin`` tells the trainer."""

    update_id: str
    join_group: bool
    group_world_size: int
    backend: str
    policy_version: int
    group_epoch: int


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
