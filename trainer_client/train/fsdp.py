"""FSDP (fully sharded data parallel) for the trainer: each rank holds a shard of every
weight, and a push gathers them.

Turned on as in any ``transformers.Trainer``: ``fsdp: true`` and ``fsdp_config: {version: 2,
transformer_layer_cls_to_wrap: [...]}`` in the trainer's config file, one process per rank
(``torchrun``). Three things differ from data parallelism (DDP), where every rank holds
whole weights:

- **The push gathers.** vLLM loads whole tensors, so every rank takes part in gathering the
  full state dict (a collective) and rank 0, which alone receives it, pushes it. A push the
  service asks for between steps (a server that joined or restarted) cannot gather, since
  the other ranks are mid-step; it waits for the next regular push.
- **Log-probs are made inside the forward.** Outside the forward the lm_head weight is a
  shard, so the chunked projection onto it (``batches.completion_logprobs``) cannot run;
  the model returns the completion positions' logits itself (``logits_to_keep``), which
  costs [B, T, V] logits, as TRL's GRPOTrainer always does.
- **On CPU, accelerate leaves FSDP off** (its FSDP plugin is enabled for accelerator devices
  only), while torch's FSDP2 (``fully_shard``) runs on CPU with gloo. ``enable_on_cpu``
  turns accelerate's FSDP2 path on there, so a CPU run shards exactly as a GPU run does.
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

    accelerate's state enables its FSDP plugin only for accelerator devices; on CPU it
    would wrap the model in DDP instead and silently not shard. Raises ValueError for
    FSDP1, which torch does not run on CPU."""
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
    """The full weights vLLM must serve, gathered from every rank's shard: a collective that
    every rank must call; rank 0 gets the tensors (on CPU), the others an empty list.

    Only parameters, in ``named_parameters`` order, as an unsharded model's push sends them:
    the state dict also holds a tied lm_head under its own name, which vLLM would skip."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not full:
        return []
    return [(name, full[name]) for name, _ in model.named_parameters() if name in full]


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model``'s parameters are FSDP2 shards (DTensors)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def whole_tensor(param: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard (a collective: every rank must call it), else the tensor itself."""
    return param.full_tensor() if isinstance(param, DTensor) else param
