"""The trainer's precision: bf16 autocast by default where the hardware multiplies bf16
natively, float32 elsewhere (``--bf16 true|false`` and a YAML's ``bf16``: ``test_trainer_cli``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer_client.grpo_config import AsyncGRPOConfig
from trainer_client.train.precision import has_native_bf16, loading_kwargs, resolve_bf16


def cpu_with(monkeypatch: pytest.MonkeyPatch, amx: bool, avx512_bf16: bool) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)


@pytest.mark.parametrize(
    ("amx", "avx512_bf16", "native"), [(True, True, True), (False, True, True), (False, False, False)]
)
def test_the_default_follows_the_cpus_bf16_instructions(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, amx: bool, avx512_bf16: bool, native: bool
) -> None:
    cpu_with(monkeypatch, amx, avx512_bf16)
    assert has_native_bf16("cpu") is native
    assert resolve_bf16(None, "cpu") is native
    assert AsyncGRPOConfig(output_dir=str(tmp_path), max_steps=1).bf16 is native
    for requested in (True, False):  # asked for, whatever the hardware
        assert resolve_bf16(requested, "cpu") is requested
        assert AsyncGRPOConfig(output_dir=str(tmp_path), max_steps=1, bf16=requested).bf16 is requested


def test_bf16_on_a_cpu_trains_with_eager_attention() -> None:
    assert loading_kwargs(True, "cpu") == {"dtype": torch.float32, "attn_implementation": "eager"}
    # the weights are float32 either way, and elsewhere the attention is the model's own default
    assert loading_kwargs(False, "cpu") == {"dtype": torch.float32}
    assert loading_kwargs(True, "cuda") == {"dtype": torch.float32}


def test_a_torch_without_the_cpu_probes_trains_in_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        monkeypatch.delattr(torch.cpu, probe)
    assert has_native_bf16("cpu") is False
