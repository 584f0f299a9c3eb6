"""``rollout-service serve``'s flags for the managed vLLM server of a real model, and where it
runs: a GPU with vLLM's nccl engine where the CUDA build of vLLM sees one, else the CPU."""

from __future__ import annotations

import pytest

from rollout_service import config as config_module
from rollout_service.config import ManagedServerSettings, load_settings
from rollout_service.edge.cli import apply_managed_flags
from rollout_service.engine.managed import ManagedVLLMServer


def test_the_flags_reach_vllms_command_line() -> None:
    settings = load_settings()
    options = {"model": "Qwen/Qwen2.5-0.5B-Instruct", "max_model_len": 4096, "dtype": "bfloat16", "device": "cpu"}
    apply_managed_flags(settings, {**options, "kv_cache_gib": 8}, ["--seed", "1"])
    managed = settings.engine.managed
    assert managed is not None and managed.kv_cache_gib == 8
    command = ManagedVLLMServer(managed).command()
    assert command[command.index("--model") + 1] == "Qwen/Qwen2.5-0.5B-Instruct"  # a Hub id, unchanged
    assert command[command.index("--max-model-len") + 1] == "4096"
    assert command[command.index("--dtype") + 1] == "bfloat16"
    assert command[-2:] == ["--seed", "1"]


def test_bad_or_misplaced_flags_say_which() -> None:
    with pytest.raises(ValueError, match="--gpu-memory-utilization: Input should be less than or equal to 1"):
        apply_managed_flags(load_settings(), {"gpu_memory_utilization": 1.5}, [])
    settings = load_settings()
    settings.engine.managed = None  # --vllm-url
    with pytest.raises(ValueError, match="--max-model-len, --vllm-arg set the managed vLLM server; they cannot"):
        apply_managed_flags(settings, {"max_model_len": 4096}, ["--seed"])


def test_a_gpu_server_gets_its_memory_share_and_the_nccl_push(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_module, "managed_device", lambda: "gpu")
    settings = load_settings()
    assert settings.engine.managed is not None and settings.engine.managed.device == "gpu"
    assert settings.weight_sync.backend == "nccl"
    apply_managed_flags(settings, {"gpu_memory_utilization": 0.5}, [])
    command = ManagedVLLMServer(settings.engine.managed, weight_transfer_backend="nccl").command()
    assert command[command.index("--gpu-memory-utilization") + 1] == "0.5"
    assert '{"backend": "nccl"}' in command


def test_a_server_built_from_its_own_settings_resolves_auto_too(monkeypatch: pytest.MonkeyPatch) -> None:
    for device in ("cpu", "gpu"):
        monkeypatch.setattr(config_module, "managed_device", lambda device=device: device)
        assert ManagedVLLMServer(ManagedServerSettings()).settings.device == device
