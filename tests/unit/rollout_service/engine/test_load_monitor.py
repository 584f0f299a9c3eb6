"""vLLM's own metrics, read by the service: the page parser, and the monitor that reads a
server whose /metrics is scripted and exports its series per server."""

from __future__ import annotations

from pathlib import Path

import pytest
from aiohttp import web

from rollout_service.config import EngineSettings
from rollout_service.engine.load_monitor import LoadMonitor
from rollout_service.engine.server_load import ServerLoad, parse_server_load
from rollout_service.engine.vllm_client import VLLMServerClient
from rollout_service.metrics import ServiceMetrics
from tests.unit.rollout_service.engine.vllm_http import serving

BUSY_PAGE = Path(__file__).parent / "data" / "vllm_metrics_busy.txt"


def test_a_real_metrics_page_is_read() -> None:
    load = parse_server_load(BUSY_PAGE.read_text())
    assert load == ServerLoad(
        kv_cache_usage=pytest.approx(0.9682539682539683),
        running=11,
        waiting=0,
        preemptions=373.0,
        prefix_cache_queries=2646.0,
        prefix_cache_hits=0.0,
    )


def test_series_are_summed_over_engines_and_the_old_usage_name_is_read() -> None:
    page = "\n".join(
        [
            'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0',
            'vllm:num_requests_waiting{engine="1",model_name="m"} 3.0',
            'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 9.0',  # a longer name: not it
            "vllm:gpu_cache_usage_perc 0.5",
            "vllm:num_preemptions_total not-a-number",
        ]
    )
    assert parse_server_load(page) == ServerLoad(kv_cache_usage=0.5, waiting=5)


async def test_the_monitor_exports_each_servers_scripted_metrics() -> None:
    page = ["vllm:kv_cache_usage_perc 0.3"]

    async def metrics_page(request: web.Request) -> web.Response:
        return web.Response(text="\n".join(page))

    app = web.Application()
    app.router.add_get("/metrics", metrics_page)
    metrics = ServiceMetrics()
    async with serving(app) as url:
        client = VLLMServerClient(url, "m", EngineSettings(urls=[url]), metrics, max_connections=8)
        await client.start()
        monitor = LoadMonitor([client], metrics)

        def exported(name: str) -> float | None:
            return metrics.registry.get_sample_value(name, {"server": url})

        try:
            await monitor.poll()
            assert exported("rollout_engine_kv_cache_usage") == pytest.approx(0.3)
            page[:] = [
                "vllm:kv_cache_usage_perc 0.8",
                "vllm:num_requests_waiting 2",
                "vllm:num_preemptions_total 3",
                "vllm:prefix_cache_queries_total 100",
                "vllm:prefix_cache_hits_total 80",
            ]
            await monitor.poll()
            assert exported("rollout_engine_kv_cache_usage") == pytest.approx(0.8)
            assert exported("rollout_engine_waiting_requests") == 2
            assert exported("rollout_engine_preemptions_total") == 3
            assert exported("rollout_engine_prefix_cache_hits_total") == 80
            assert exported("rollout_engine_prefix_cache_queries_total") == 100
            page[3:] = ["vllm:prefix_cache_queries_total 10", "vllm:prefix_cache_hits_total 5"]
            await monitor.poll()  # the server restarted: its counters began again at 0
            assert exported("rollout_engine_prefix_cache_queries_total") == 110
            assert exported("rollout_engine_prefix_cache_hits_total") == 85
            monitor.remove(url)
            page[3] = "vllm:prefix_cache_queries_total 50"
            await monitor.poll()  # a server that left is read no more
            assert exported("rollout_engine_prefix_cache_queries_total") == 110
        finally:
            await client.close()


async def test_a_server_that_does_not_answer_keeps_its_last_reading() -> None:
    metrics = ServiceMetrics()
    client = VLLMServerClient("http://127.0.0.1:9", "m", EngineSettings(urls=["http://x"]), metrics, 8)
    await client.start()
    try:
        monitor = LoadMonitor([client], metrics)
        monitor._observe(client, ServerLoad(kv_cache_usage=0.4))
        await monitor.poll()
        assert metrics.registry.get_sample_value("rollout_engine_kv_cache_usage", {"server": client.base_url}) == 0.4
    finally:
        await client.close()
