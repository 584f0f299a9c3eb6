"""Whether this host's CPU multiplies bf16 matrices in hardware, read from the kernel.

Why a reader of ``/proc/cpuinfo`` and not torch's probes (``trainer_client.train.precision``): the
rollout service decides its managed vLLM server's dtype from it, and the service does not
import torch. The kernel lists the same instructions that torch's
``torch.cpu._is_avx512_bf16_supported`` and ``_is_amx_tile_supported`` look for.
"""

from __future__ import annotations

from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
"""Either one: the CPU has bf16 dot-product instructions (AVX512-BF16) or AMX tiles for bf16."""


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The first processor's feature flags; none where the file is absent (not Linux)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def has_native_bf16(cpuinfo: Path = CPUINFO) -> bool:
    """Whether this CPU has bf16 matrix instructions (``BF16_FLAGS``)."""
    return bool(cpu_flags(cpuinfo) & BF16_FLAGS)
