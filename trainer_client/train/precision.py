"""The trainer's compute precision: float32, or bf16 autocast over float32 weights.

The default follows the hardware: bf16 autocast is faster only with native bf16 matmuls. Under
it the weights, gradients, optimizer state, log-softmax and pushes stay float32. On a CPU it
trains with eager attention, which is faster there than torch's fused CPU kernel in bf16.
"""

from __future__ import annotations

from typing import Any

import torch

CPU_BF16_PROBES = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
"""``torch.cpu`` functions that say whether this CPU has bf16 matmul instructions."""


def device_type(use_cpu: bool) -> str:
    """Where the trainer computes, as accelerate chooses it: CUDA when there is one, unless ``use_cpu``."""
    return "cuda" if not use_cpu and torch.cuda.is_available() else "cpu"


def has_native_bf16(device_type: str) -> bool:
    """Whether ``device_type`` ("cpu", "cuda") multiplies bf16 matrices in hardware."""
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    # torch's private probes (torch >= 2.3): absent, assume none
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in CPU_BF16_PROBES)


def resolve_bf16(requested: bool | None, device_type: str) -> bool:
    """``requested``, or for None (the default) whether this hardware has native bf16."""
    return has_native_bf16(device_type) if requested is None else requested


def loading_kwargs(bf16: bool, device_type: str) -> dict[str, Any]:
    """``from_pretrained``'s keyword arguments: float32 weights, and eager attention for bf16 on a CPU."""
    if bf16 and device_type == "cpu":
        return {"dtype": torch.float32, "attn_implementation": "eager"}
    return {"dtype": torch.float32}  # the model's default attention


def name(bf16: bool) -> str:
    return "bf16 autocast" if bf16 else "float32"
