"""The vLLM command line a managed server is started with."""

from __future__ import annotations

import json

from rollout_service.config import ManagedServerSettings
from rollout_service.engine.managed import ManagedVLLMServer


def flag(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


def test_a_cpu_server_gets_32_token_blocks_and_a_gpu_server_vllms_own() -> None:
    assert flag(ManagedVLLMServer(ManagedServerSettings(port=1)).command(), "--block-size") == "32"
    assert flag(ManagedVLLMServer(ManagedServerSettings(port=1, device="gpu")).command(), "--block-size") is None
    chosen = ManagedServerSettings(port=1, device="gpu", block_size=16)
    assert flag(ManagedVLLMServer(chosen).command(), "--block-size") == "16"


def test_the_weight_transfer_engine_is_the_one_the_service_syncs_with() -> None:
    """One setting, ``weight_sync.backend``, names it for the service and the server."""
    settings = ManagedServerSettings(port=1)
    nccl = flag(ManagedVLLMServer(settings, weight_transfer_backend="nccl").command(), "--weight-transfer-config")
    assert nccl is not None and json.loads(nccl) == {"backend": "nccl"}
    assert "--weight-transfer-config" not in ManagedVLLMServer(settings, weight_transfer_backend=None).command()
