"""FSDP for the trainer (``fsdp`` and ``fsdp_config`` as in any ``transformers.Trainer``).

Unlike DDP: a push is a collective gather of the full weights, which rank 0 pushes (so a push
the service asks for mid-step waits for the next regular one); log-probs are made inside the
forward, where the lm_head weight is whole; and on CPU, where accelerate leaves FSDP off,
``enable_on_cpu`` turns its FSDP2 path on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from trainer_client.weights.policy_weights import NamedTensors, is_peft_model

if TYPE_CHECKING:
    from accelerate import Accelerator


def enable_on_cpu(accelerator: Accelerator, plugin_args: dict) -> bool:
    """Turn on accelerate's FSDP2 path for a multi-process CPU run it left at DDP; True if it did.
    Raises ValueError for FSDP1, which torch does not run on CPU."""
    state = accelerator.state
    if state.distributed_type != DistributedType.MULTI_CPU:
        return False
    plugin = FullyShardedDataParallelPlugin(**plugin_args)
    if plugin.fsdp_version != 2:
        raise ValueError("FSDP on CPU needs FSDP2: set fsdp_config's version to 2")
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    return True


def check_supported(model: torch.nn.Module) -> None:
    """Refuse what the gathered push does not handle yet, before any training."""
    if is_peft_model(model):
        raise ValueError("FSDP with a LoRA adapter is not supported yet: train LoRA with DDP (torchrun without fsdp)")


def gathered_weights(model: torch.nn.Module) -> NamedTensors:
    """The full weights vLLM must serve, gathered from every rank's shard (a collective); rank 0
    gets them on CPU, in ``named_parameters`` order (no tied lm_head), the others an empty list."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return [(name, full[name]) for name, _ in model.named_parameters() if name in full]


def is_sharded(model: torch.nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def whole_tensor(param: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard (a collective: every rank must call it), else the tensor itself."""
    return param.full_tensor() if isinstance(param, DTensor) else param
