"""Reading the CPU's bf16 instructions from /proc/cpuinfo, as the service's vLLM dtype default does."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_common.cpu_features import cpu_flags, has_native_bf16
from trainer_client.train import precision

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
flags\t\t: fpu sse2 avx2 {extra}
bogomips\t: 4792.80

processor\t: 1
flags\t\t: fpu sse2 avx2 {extra}
"""


@pytest.mark.parametrize(
    ("extra", "native"),
    [("avx512f avx512_bf16", True), ("amx_tile amx_bf16", True), ("avx512f avx512_vnni", False), ("", False)],
)
def test_bf16_instructions_are_read_from_the_flags(tmp_path: Path, extra: str, native: bool) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(CPUINFO.format(extra=extra))
    assert "avx2" in cpu_flags(cpuinfo)
    assert has_native_bf16(cpuinfo) is native


def test_no_cpuinfo_means_no_flags(tmp_path: Path) -> None:
    assert cpu_flags(tmp_path / "absent") == frozenset()
    assert has_native_bf16(tmp_path / "absent") is False


def test_the_service_and_the_trainer_agree_on_this_machine() -> None:
    """The service (no torch) reads the kernel's flags, the trainer asks torch: the same answer,
    so a managed vLLM computes in bf16 exactly where a trainer beside it defaults to bf16 autocast."""
    assert has_native_bf16() is precision.has_native_bf16("cpu")
