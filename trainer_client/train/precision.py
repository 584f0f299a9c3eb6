"""The trainer's compute precision: float32, or bf16 autocast over float32 weights.

Why: TRL's ``GRPOConfig`` trains in bf16 autocast by default, and on hardware with native
bf16 matmuls (a GPU that supports it; a CPU with AMX or AVX512-BF16) that is where a step's
time goes down. On the benchmark's model and 2-core CPU a trainer step was clearly shorter in
bf16 autocast than in float32, and the log-probs moved by far less than the loss's clip
range (``benchmarks/SPEED_HISTORY.md``). Without native bf16 the CPU emulates it and
autocast is slower, so the default follows the hardware.

What stays float32 under autocast: the weights, their gradients, AdamW's state, the
log-softmax (``logprobs``) and every weight pushed to vLLM. Only the matmuls and attention
run in bf16.

On a CPU, bf16 autocast trains with transformers' eager attention: torch's fused CPU
attention kernel took more of a bf16 backward on short GRPO sequences than all the matmuls
(``benchmarks/SPEED_HISTORY.md``); eager attention is two matmuls and a softmax, which
autocast runs in bf16 and float32. In float32 the two were equally fast.
"""

from __future__ import annotations

from typing import Any

import torch

EAGER_ATTENTION = "eager"
CPU_BF16_PROBES = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
"""``torch.cpu`` functions that say whether this CPU has bf16 matmul instructions."""


def device_type(use_cpu: bool) -> str:
    """Where the trainer computes, as accelerate chooses it: CUDA when there is one, unless
    ``use_cpu`` (TrainingArguments' ``--use_cpu``) forces the CPU."""
    return "cuda" if not use_cpu and torch.cuda.is_available() else "cpu"


def has_native_bf16(device_type: str) -> bool:
    """Whether ``device_type`` ("cpu", "cuda") multiplies bf16 matrices in hardware."""
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device_type == "cpu":  # torch's private probes (torch >= 2.3): absent, assume none
        return any(getattr(torch.cpu, probe, lambda: False)() for probe in CPU_BF16_PROBES)
    return False


def resolve_bf16(requested: bool | None, device_type: str) -> bool:
    """``requested``, or for None (the default) whether this hardware has native bf16."""
    return has_native_bf16(device_type) if requested is None else requested


def attention_implementation(bf16: bool, device_type: str) -> str | None:
    """The attention a policy trained this way loads with: eager for bf16 on a CPU (see the
    module's docstring), else None, the model's own default."""
    return EAGER_ATTENTION if bf16 and device_type == "cpu" else None


def loading_kwargs(bf16: bool, device_type: str) -> dict[str, Any]:
    """``from_pretrained``'s keyword arguments for a policy trained this way: float32 weights,
    with ``attention_implementation``'s attention where it names one."""
    attention = attention_implementation(bf16, device_type)
    return {"dtype": torch.float32, **({} if attention is None else {"attn_implementation": attention})}


def name(bf16: bool) -> str:
    """The precision's name in the trainer's summary."""
    return "bf16 autocast" if bf16 else "float32"


def describe(bf16: bool) -> str:
    """The trainer's log line."""
    if bf16:
        return f"{name(bf16)} (weights, optimizer state, log-softmax and pushes stay float32)"
    return name(bf16)
