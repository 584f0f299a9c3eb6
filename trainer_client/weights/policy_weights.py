"""The weights vLLM must serve for a trainer's model, named as vLLM's loader expects them.

A PEFT (LoRA) model's weights are pushed as ``W + delta`` under the base names, computed out of
place: PEFT's in-place merge/unmerge rounds the base weights each time, drifting a long run.
PEFT is duck-typed, so peft is not imported.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import torch

NamedTensors = list[tuple[str, torch.Tensor]]

_ADAPTER_COPY = re.compile(r"\.modules_to_save\.[^.]+\.")
"""``modules_to_save`` keeps a trained copy of a whole module per adapter; it replaces the original."""


def is_peft_model(model: torch.nn.Module) -> bool:
    return hasattr(model, "get_base_model") and hasattr(model, "peft_config")


def policy_weights(model: torch.nn.Module) -> NamedTensors:
    """(name, tensor) pairs of the weights to serve, detached, in ``named_parameters`` order."""
    if not is_peft_model(model):
        return [(name, param.detach()) for name, param in model.named_parameters()]
    base = model.get_base_model()  # type: ignore[operator]
    deltas = _lora_deltas(base)
    weights: NamedTensors = []
    for name, param in base.named_parameters():
        if ".lora_" in name or ".original_module." in name:
            continue
        tensor = param.detach()
        if name in deltas:
            tensor = tensor + deltas[name].to(tensor.dtype)
        weights.append((_ADAPTER_COPY.sub(".", name).replace(".base_layer.", "."), tensor))
    return weights


def _lora_deltas(base: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``{"<module>.base_layer.weight": delta}`` for every LoRA layer with an active adapter."""
    deltas: dict[str, torch.Tensor] = {}
    for module_name, module in base.named_modules():
        if not (hasattr(module, "get_delta_weight") and hasattr(module, "base_layer")):
            continue
        if getattr(module, "merged", False):
            raise ValueError(f"{module_name}: the adapter is merged into the base weight; unmerge it before a push")
        active = [a for a in module.active_adapters if a in getattr(module, "lora_A", {})]
        if module.disable_adapters or not active:
            continue
        with torch.no_grad():
            delta = sum(module.get_delta_weight(adapter) for adapter in active)
        deltas[f"{module_name}.base_layer.weight"] = delta
    return deltas


def adapter_files(model: torch.nn.Module) -> dict[str, bytes]:
    """A PEFT model's active adapter as the files vLLM loads (config + safetensors), in memory."""
    with tempfile.TemporaryDirectory(prefix="adapter-") as tmp:
        model.save_pretrained(tmp, safe_serialization=True)  # type: ignore[operator]
        adapter_dir = Path(tmp)
        names = ("adapter_config.json", "adapter_model.safetensors")
        return {name: (adapter_dir / name).read_bytes() for name in names}
