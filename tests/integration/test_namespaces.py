"""Service, vLLM and trainer in three network namespaces, as on three hosts: the trainer
advertises its own address, the service accepts it as the caller's, vLLM's workers join the
trainer's rendezvous across the bridge, and vLLM then serves exactly the pushed weights."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen2ForCausalLM

from rollout_service.config import ManagedServerSettings
from rollout_service.engine.managed import ManagedVLLMServer
from tests.integration.conftest import serving
from tests.integration.netns import Namespaces, namespaces, unavailable
from tests.integration.test_shared_capacity import start
from tests.integration.test_weight_sync import perturbed, vllm_matches
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "")]

REPO = Path(__file__).resolve().parents[2]
VLLM_PORT, SERVICE_PORT = 8000, 50051


class NamespacedVLLM(ManagedVLLMServer):
    """The managed server's command, run inside a namespace and bound to its address."""

    def __init__(self, net: Namespaces, settings: ManagedServerSettings) -> None:
        super().__init__(settings, served_model_name="tiny")
        self.net = net
        self.port = VLLM_PORT
        self.url = f"http://{net.addresses['vllm']}:{VLLM_PORT}"

    def command(self) -> list[str]:
        command = super().command()
        command[command.index("--host") + 1] = self.net.addresses["vllm"]
        return self.net.prefix("vllm") + command


@pytest.mark.timeout(420)
async def test_a_push_crosses_three_namespaces(tiny_model: Path, tmp_path: Path) -> None:
    with namespaces("vllm", "service", "trainer") as net:
        vllm = NamespacedVLLM(
            net,
            ManagedServerSettings(
                model=tiny_model, max_model_len=1024, log_file=tmp_path / "vllm.log", pin_processes=False
            ),
        )
        await asyncio.to_thread(vllm.start)
        service = None
        try:
            target = f"{net.addresses['service']}:{SERVICE_PORT}"
            env = dict(
                os.environ,
                ROLLOUT_HOST=net.addresses["service"],
                ROLLOUT_SECURITY__ALLOW_INSECURE="true",  # a private bridge; TLS is tested elsewhere
                ROLLOUT_ENGINE__TOKENIZER=str(tiny_model),
                ROLLOUT_ENGINE__MODEL="tiny",
                ROLLOUT_ADAPTERS__DIR=str(tmp_path / "adapters"),
            )
            command = [sys.executable, "-m", "rollout_service.edge.cli", "serve", "--vllm-url", vllm.url]
            command += ["--port", str(SERVICE_PORT), "--metrics-port", "0"]
            service = await start([*net.prefix("service"), *command], tmp_path / "service.log", env)
            await wait_until(lambda: serving(target), 90, "the service in its namespace to serve")

            pusher = [*net.prefix("trainer"), sys.executable, "-m", "tests.integration.netns_pusher"]
            pusher += ["--target", target, "--model", str(tiny_model), "--seed", "5"]
            done = await asyncio.to_thread(
                subprocess.run, pusher, cwd=REPO, capture_output=True, text=True, timeout=240
            )
            assert done.returncode == 0, done.stderr[-3000:]
            result = json.loads(done.stdout.strip().splitlines()[-1])
            # The trainer advertised its own namespace's address, not a loopback one ...
            assert result == {"policy_version": 1, "trainer_address": net.addresses["trainer"]}
            # ... and vLLM, two namespaces away, serves exactly what it pushed.
            base = Qwen2ForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
            assert await vllm_matches(vllm.url, perturbed(base, 5), cache_salt="pushed") <= 1e-4
        finally:
            if service is not None:
                os.killpg(service.pid, signal.SIGTERM)
                await asyncio.wait_for(service.wait(), 30)
            await asyncio.to_thread(vllm.stop)
