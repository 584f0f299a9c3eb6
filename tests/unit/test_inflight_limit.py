"""Per-server in-flight limits from vLLM's own metrics: the page parser, the limit's rule,
and the monitor that reads a server whose /metrics is scripted and resizes the slots."""

from __future__ import annotations

from pathlib import Path

import pytest
from aiohttp import web

from rollout_service.config import AdaptiveInflightSettings, EngineSettings
from rollout_service.engine.inflight_limit import AdaptiveLimit
from rollout_service.engine.load_monitor import LoadMonitor
from rollout_service.engine.server_load import ServerLoad, parse_server_load
from rollout_service.engine.vllm_client import VLLMServerClient
from rollout_service.metrics import ServiceMetrics
from tests.unit.test_engine import serving

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


def reading(usage: float, *, waiting: int = 0, preemptions: float = 0.0) -> ServerLoad:
    return ServerLoad(kv_cache_usage=usage, waiting=waiting, preemptions=preemptions)


def test_the_limit_grows_while_usage_is_low_and_the_limit_binds() -> None:
    limit = AdaptiveLimit(10, minimum=2, maximum=14)
    assert limit.update(reading(0.3), inflight=10) == 11
    assert limit.update(reading(0.3), inflight=11) == 12
    assert limit.update(reading(0.3), inflight=4) == 12  # the server is not full: no reason to grow
    assert limit.update(reading(0.3, waiting=1), inflight=12) == 12  # vLLM queues already
    assert limit.update(reading(0.75), inflight=12) == 12  # inside the band around the target
    assert limit.update(reading(0.3), inflight=12) == 13
    assert limit.update(reading(0.3), inflight=13) == 14
    assert limit.update(reading(0.3), inflight=14) == 14  # the maximum


def test_the_limit_shrinks_on_high_usage_or_a_preemption_once_per_overload() -> None:
    limit = AdaptiveLimit(40, minimum=8, maximum=64)
    assert limit.update(reading(0.95), inflight=40) == 30
    # The server still holds 40 sequences: the next readings show the same overload, and
    # cutting again for it would drive the limit to the floor.
    assert limit.update(reading(0.97), inflight=38) == 30
    assert limit.update(reading(0.9, preemptions=0.0), inflight=30) == 30  # settled, in the band
    assert limit.update(reading(0.6, preemptions=4.0), inflight=30) == 22  # vLLM preempted
    # Room again: it grows, but only to one below the limit that was preempted at.
    grown = [limit.update(reading(0.6, preemptions=4.0), inflight=limit.limit) for _ in range(20)]
    assert grown[:3] == [24, 26, 28] and set(grown[3:]) == {29}
    # Without an overload for probe_after (30) readings, the ceiling lifts by one.
    probed = [limit.update(reading(0.6, preemptions=4.0), inflight=limit.limit) for _ in range(10)]
    assert probed == [29] * 9 + [30]  # the 30th reading since the preemption
    for _ in range(10):
        limit.update(reading(0.99), inflight=limit.limit)
    assert limit.limit == 8  # the minimum


def test_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="minimum <= maximum"):
        AdaptiveLimit(4, minimum=8, maximum=4)
    assert AdaptiveLimit(1000, minimum=1, maximum=16).limit == 16


def hold(client: VLLMServerClient, sequences: int) -> None:
    """As if ``sequences`` were in flight on the client's server since the last reading."""
    client.inflight = client.peak_inflight = sequences


async def test_the_monitor_adapts_each_servers_limit_from_its_scripted_metrics() -> None:
    """Two servers: one fills its KV cache, the other has room. Their limits move apart,
    the slots follow their sum, and the servers' counters are exported per server."""
    pages = {"full": ["vllm:kv_cache_usage_perc 0.3"], "roomy": ["vllm:kv_cache_usage_perc 0.3"]}

    def app_of(name: str) -> web.Application:
        async def metrics(request: web.Request) -> web.Response:
            return web.Response(text="\n".join(pages[name]))

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        return app

    metrics = ServiceMetrics()
    async with serving(app_of("full")) as full_url, serving(app_of("roomy")) as roomy_url:
        clients = [
            VLLMServerClient(url, "m", EngineSettings(urls=[url]), metrics, max_connections=64)
            for url in (full_url, roomy_url)
        ]
        for client in clients:
            await client.start()
        full, roomy = clients
        settings = AdaptiveInflightSettings(enabled=True, min_per_server=4, max_per_server=64)
        monitor = LoadMonitor(clients, metrics, 0.01, settings, initial_total=40)
        capacities: list[int] = []
        monitor.on_capacity = capacities.append
        try:
            assert (full.limit, roomy.limit, monitor.capacity) == (20, 20, 40)
            hold(full, 20)
            hold(roomy, 20)
            await monitor.poll()  # both have room: both grow
            assert (full.limit, roomy.limit) == (22, 22) and capacities == [44]

            pages["full"] = [
                "vllm:kv_cache_usage_perc 0.98",
                "vllm:num_preemptions_total 3",
                "vllm:prefix_cache_queries_total 100",
                "vllm:prefix_cache_hits_total 80",
            ]
            hold(full, 22)
            hold(roomy, 22)
            await monitor.poll()
            assert (full.limit, roomy.limit) == (16, 24) and capacities[-1] == 40
            hold(full, 16)
            pages["full"][0] = "vllm:kv_cache_usage_perc 0.8"
            await monitor.poll()  # in the band: held
            assert full.limit == 16

            def exported(name: str, server: str) -> float | None:
                return metrics.registry.get_sample_value(name, {"server": server})

            assert exported("rollout_engine_inflight_limit", full_url) == 16
            assert exported("rollout_engine_kv_cache_usage", full_url) == pytest.approx(0.8)
            assert exported("rollout_engine_preemptions_total", full_url) == 3
            assert exported("rollout_engine_prefix_cache_hits_total", full_url) == 80
            assert exported("rollout_engine_prefix_cache_queries_total", full_url) == 100
            pages["full"][2:] = ["vllm:prefix_cache_queries_total 10", "vllm:prefix_cache_hits_total 5"]
            await monitor.poll()  # the server restarted: its counters began again at 0
            assert exported("rollout_engine_prefix_cache_queries_total", full_url) == 110
            assert exported("rollout_engine_prefix_cache_hits_total", full_url) == 85
        finally:
            for client in clients:
                await client.close()


async def test_a_server_that_does_not_answer_keeps_its_limit() -> None:
    client = VLLMServerClient("http://127.0.0.1:9", "m", EngineSettings(urls=["x"]), ServiceMetrics(), 8)
    await client.start()
    try:
        monitor = LoadMonitor([client], ServiceMetrics(), 0.01, AdaptiveInflightSettings(enabled=True), 8)
        await monitor.poll()
        assert client.limit == 8
    finally:
        await client.close()


async def test_the_limit_grows_on_the_peak_since_the_last_reading_not_the_count_now() -> None:
    """Requests of a group end together: a reading between two waves sees nothing in flight,
    though the limit held the server back a moment before."""
    client = VLLMServerClient("http://127.0.0.1:9", "m", EngineSettings(urls=["x"]), ServiceMetrics(), 8)
    monitor = LoadMonitor([client], ServiceMetrics(), 0.01, AdaptiveInflightSettings(enabled=True), 8)
    client.inflight, client.peak_inflight = 0, 8  # a wave of 8 just ended
    monitor._observe(client, ServerLoad(kv_cache_usage=0.2))
    assert client.limit == 9 and client.peak_inflight == 0  # the peak restarts from the count now
    monitor._observe(client, ServerLoad(kv_cache_usage=0.2))
    assert client.limit == 9  # nothing was in flight since: no reason to grow
