"""Failures of a server, a request or a reward are contained: counted, warned, survived."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rollout_api import rollout_pb2 as pb
from rollout_api.client import RolloutClient, dataset_run_spec
from rollout_common.ports import free_port
from rollout_service.edge.server import RUNS_HEALTH_NAME
from rollout_service.generation.scheduler import BACKOFF_AFTER_FAILURES
from tests.integration.conftest import service_settings, service_with_client, serving
from tests.integration.tcp_proxy import KillableProxy
from tests.integration.test_shared_capacity import consume
from tests.support import wait_until
from trainer_client.stream.feed import GroupFeed

pytestmark = pytest.mark.integration


async def dropped(client: RolloutClient, run_id: str) -> int:
    return (await client.get_run(run_id)).stats.groups_dropped


async def test_unreachable_server_drops_groups_and_the_service_keeps_serving(
    vllm_server, tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    # The live server answers /v1/models at start-up; the dead one gets every request.
    settings = service_settings([dead], tiny_model, scheduler={"max_inflight": 4})
    settings.engine.tokenizer = str(tiny_model)
    with caplog.at_level(logging.WARNING):
        async with service_with_client(settings) as (_service, client):
            run = await client.create_run(dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=2))
            await wait_until(lambda: dropped(client, run.run_id), 30, "dropped groups")
            await wait_until(lambda: _ge(dropped(client, run.run_id), 3), 30, "three dropped groups")
            info = await client.get_run(run.run_id)
            stats = await client.stats()
    assert info.state == info.state.__class__(1)  # RUN_STATE_RUNNING: the run survives
    assert info.stats.groups_scored == 0
    assert stats.engine_request_failures >= 3
    warnings = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert any("dropped group" in m and "ClientConnectorError" in m for m in warnings), warnings[:3]


async def _ge(value, threshold: int) -> bool:
    return (await value) >= threshold


async def test_killed_server_mid_run_then_recovery(vllm_server, tiny_model: Path, caplog) -> None:
    upstream = urlparse(vllm_server.url)
    proxy = KillableProxy(upstream.hostname, upstream.port)
    await proxy.start()
    settings = service_settings([proxy.url], tiny_model, scheduler={"max_inflight": 4}, engine={"read_timeout_s": 20})
    with caplog.at_level(logging.WARNING):
        async with service_with_client(settings) as (_service, client):
            spec = dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=2, max_tokens=32)
            run = await client.create_run(spec)
            stream = client.stream(run.run_id, "c", credits=1000)
            received = 0
            async with asyncio.timeout(120):
                async for group in stream:
                    received += 1
                    stream.ack([group.group_id])
                    if received == 3:
                        await proxy.kill()  # in-flight requests die with their connections
                        await wait_until(lambda: _ge(dropped(client, run.run_id), 2), 30, "drops after the kill")
                        await proxy.start()  # the server comes back on the same port
                        before = received
                    if received >= 3 and received > before + 2:
                        break  # groups flow again after recovery
            await stream.aclose()
            info = await client.get_run(run.run_id)
    assert info.stats.groups_dropped >= 2
    assert info.stats.groups_trained >= 5
    assert any("dropped group" in r.message for r in caplog.records if r.levelno == logging.WARNING)


@pytest.mark.parametrize("reward", ["always_raises", "returns_nan", "hangs"])
async def test_failing_reward_drops_groups_and_other_runs_go_on(
    vllm_server, tiny_model: Path, caplog, reward: str
) -> None:
    settings = service_settings(
        [vllm_server.url],
        tiny_model,
        scheduler={"max_inflight": 4, "reward_timeout_s": 0.5},
        reward_modules=["tests.integration.reward_plugins"],
    )
    with caplog.at_level(logging.WARNING):
        async with service_with_client(settings) as (_service, client):
            broken = await client.create_run(dataset_run_spec("letters", {reward: 1.0}, group_size=2, max_tokens=8))
            healthy = await client.create_run(
                dataset_run_spec("letters", {"constant": 1.0}, group_size=2, max_tokens=8)
            )
            stream = client.stream(healthy.run_id, "c", credits=3)
            got = 0
            async with asyncio.timeout(60):
                async for group in stream:
                    assert [s.reward for s in group.samples] == [1.0, 1.0]
                    assert [s.advantage for s in group.samples] == [0.0, 0.0]
                    stream.ack([group.group_id])
                    got += 1
                    if got == 3:
                        break
            await stream.aclose()
            await wait_until(lambda: _ge(dropped(client, broken.run_id), 2), 30, "dropped groups of the broken run")
            info = await client.get_run(broken.run_id)
    assert info.stats.groups_scored == 0
    expected = {"always_raises": "raised RuntimeError", "returns_nan": "returned nan", "hangs": "took longer than"}
    assert any(expected[reward] in r.message for r in caplog.records if r.levelno == logging.WARNING)


async def test_sigterm_exits_in_bounded_time_even_with_a_reward_hung_in_a_thread(
    vllm_server, tiny_model: Path, tmp_path: Path
) -> None:
    """The loop's executor and the interpreter both join threads: a hung sync reward kept
    the process alive for ever after SIGTERM."""
    port, marker = free_port(), tmp_path / "reward-called"
    env = dict(
        os.environ,
        ROLLOUT_ENGINE__TOKENIZER=str(tiny_model),
        ROLLOUT_ENGINE__MODEL="tiny",
        ROLLOUT_REWARD_MODULES='["tests.integration.reward_plugins"]',
        ROLLOUT_SHUTDOWN_TIMEOUT_S="3",
        HANGING_REWARD_MARKER=str(marker),
    )
    command = [sys.executable, "-m", "rollout_service.edge.cli", "serve", "--vllm-url", vllm_server.url]
    command += ["--port", str(port), "--metrics-port", "0"]
    log = tmp_path / "service.log"
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            *command, stdout=out, stderr=asyncio.subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        target = f"127.0.0.1:{port}"
        await wait_until(lambda: serving(target), 60, "the service process to serve")
        async with RolloutClient(target) as client:
            spec = dataset_run_spec("letters", {"hangs_in_a_thread": 1.0}, group_size=2, max_tokens=4)
            await client.create_run(spec)
        await wait_until(marker.exists, 60, "the reward to hang")
        process.send_signal(signal.SIGTERM)
        returncode = await asyncio.wait_for(process.wait(), 30)
    finally:
        if process.returncode is None:
            os.killpg(process.pid, signal.SIGKILL)
            await asyncio.wait_for(process.wait(), 10)
    assert returncode == 1, log.read_text()[-2000:]
    assert "shutdown did not finish (3s; hung user code?)" in log.read_text()


async def test_a_failed_server_is_probed_back_and_health_follows_the_pool(vllm_server, tiny_model: Path) -> None:
    """A server that failed once used to be skipped until every server had failed, even after
    it recovered; and health said SERVING with no server answering."""
    upstream = urlparse(vllm_server.url)
    first, second = KillableProxy(upstream.hostname, upstream.port), KillableProxy(upstream.hostname, upstream.port)
    await first.start()
    await second.start()
    settings = service_settings([first.url, second.url], tiny_model, scheduler={"max_inflight": 4})
    async with service_with_client(settings) as (service, client):
        metrics = service.service.metrics.registry

        def requests_to(url: str) -> float:
            return metrics.get_sample_value("rollout_engine_request_seconds_count", {"server": url}) or 0.0

        async def health() -> int:
            async with grpc.aio.insecure_channel(service.grpc_target) as channel:
                response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            return response.status

        run = await client.create_run(dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=2, max_tokens=8))
        consumer = asyncio.ensure_future(consume(client, run.run_id, "c"))  # keeps the run generating
        await first.kill()
        await wait_until(lambda: _ge(dropped(client, run.run_id), 1), 60, "a request to the killed server to fail")
        assert await health() == health_pb2.HealthCheckResponse.SERVING  # the second server still works
        await second.kill()

        async def not_serving() -> bool:
            return await health() == health_pb2.HealthCheckResponse.NOT_SERVING

        await wait_until(not_serving, 60, "health to say NOT_SERVING with no server answering")
        assert "no vLLM server is answering" in (await client.get_run(run.run_id)).error  # the run says why
        await first.start()
        await second.start()

        async def serving_again() -> bool:
            return await health() == health_pb2.HealthCheckResponse.SERVING

        await wait_until(serving_again, 30, "health to say SERVING again")
        assert (await client.get_run(run.run_id)).error == ""
        before = requests_to(first.url)
        await wait_until(lambda: requests_to(first.url) > before + 2, 60, "the first server to take requests again")
        consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)
        await client.delete_run(run.run_id)
    await first.kill()
    await second.kill()


async def test_a_hung_server_is_given_up_at_once_and_comes_back_when_it_answers(
    vllm_server, tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A server that keeps connections open but answers nothing used to hold its requests'
    slots for up to (retries + 1) x read_timeout_s (4 x 300 s)."""
    upstream = urlparse(vllm_server.url)
    hung, healthy = KillableProxy(upstream.hostname, upstream.port), KillableProxy(upstream.hostname, upstream.port)
    await hung.start()
    await healthy.start()
    engine = {"probe_interval_s": 0.5, "health_timeout_s": 2.0}  # read_timeout_s and the deadline stay at 300+ s
    settings = service_settings([hung.url, healthy.url], tiny_model, scheduler={"max_inflight": 8}, engine=engine)
    with caplog.at_level(logging.WARNING):
        async with service_with_client(settings) as (service, client):
            metrics = service.service.metrics.registry

            def sample(name: str, url: str) -> float:
                return metrics.get_sample_value(name, {"server": url}) or 0.0

            def inflight(url: str) -> float:
                return sample("rollout_engine_inflight_requests", url)

            spec = dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=2, max_tokens=64)
            run = await client.create_run(spec)
            consumer = asyncio.ensure_future(consume(client, run.run_id, "c"))  # keeps the run generating
            await wait_until(lambda: inflight(hung.url) > 0, 60, "requests on the server about to hang")
            hung.freeze()
            # Abandoned within a probe or two, not after the read timeout: slots are freed.
            await wait_until(lambda: inflight(hung.url) == 0, 30, "the hung server's requests to be abandoned")
            scored = (await client.get_run(run.run_id)).stats.groups_scored
            await wait_until(lambda: _ge(_scored(client, run.run_id), scored + 3), 60, "groups from the other server")
            assert inflight(hung.url) == 0  # nothing new was routed to it
            hung.thaw()
            before = sample("rollout_engine_request_seconds_count", hung.url)
            await wait_until(
                lambda: sample("rollout_engine_request_seconds_count", hung.url) > before + 2,
                60,
                "the thawed server to take requests again",
            )
            consumer.cancel()
            await asyncio.gather(consumer, return_exceptions=True)
            info = await client.get_run(run.run_id)
            await client.delete_run(run.run_id)
    await hung.kill()
    await healthy.kill()
    assert info.state == info.state.__class__(1)  # RUN_STATE_RUNNING
    assert info.stats.groups_dropped >= 1  # the groups in flight on the hung server
    warnings = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert any("did not answer /health within 2s" in m and "abandoning" in m for m in warnings), warnings[:5]


async def _scored(client: RolloutClient, run_id: str) -> int:
    return (await client.get_run(run_id)).stats.groups_scored


async def test_sigterm_lets_consumers_ack_what_they_hold_and_ends_early_once_they_have(
    vllm_server, tiny_model: Path, tmp_path: Path
) -> None:
    """At SIGTERM a trainer in the middle of a step used to lose its stream before it could
    ack the step; now the service stops producing, says NOT_SERVING and waits for the acks."""
    port = free_port()
    env = dict(
        os.environ,
        ROLLOUT_ENGINE__TOKENIZER=str(tiny_model),
        ROLLOUT_ENGINE__MODEL="tiny",
        ROLLOUT_SHUTDOWN_GRACE_S="60",
    )
    command = [sys.executable, "-m", "rollout_service.edge.cli", "serve", "--vllm-url", vllm_server.url]
    command += ["--port", str(port), "--metrics-port", "0"]
    log = tmp_path / "service.log"
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            *command, stdout=out, stderr=asyncio.subprocess.STDOUT, env=env, start_new_session=True
        )
    target = f"127.0.0.1:{port}"

    async def not_serving() -> bool:
        async with grpc.aio.insecure_channel(target) as channel:
            response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return response.status == health_pb2.HealthCheckResponse.NOT_SERVING

    try:
        await wait_until(lambda: serving(target), 60, "the service process to serve")
        async with RolloutClient(target) as client:
            spec = dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=2, max_tokens=4)
            run = await client.create_run(spec)
            stream = client.stream(run.run_id, "trainer", credits=2)
            groups = aiter(stream)
            async with asyncio.timeout(60):
                held = [await anext(groups), await anext(groups)]
            process.send_signal(signal.SIGTERM)
            await wait_until(not_serving, 30, "health to say NOT_SERVING")
            assert (await client.get_run(run.run_id)).stats.groups_leased == 2  # still answering, still held
            stream.ack([held[0].group_id])
            await wait_until(lambda: _trained(client, run.run_id, 1), 30, "the first ack to count during shutdown")
            stream.ack([held[1].group_id])
            # Nothing is leased any more: the service stops long before its 60 s grace.
            returncode = await asyncio.wait_for(process.wait(), 40)
    finally:
        if process.returncode is None:
            os.killpg(process.pid, signal.SIGKILL)
            await asyncio.wait_for(process.wait(), 10)
    text = " ".join(log.read_text().split())  # the console handler wraps long lines
    assert returncode == 0, text[-2000:]
    assert "up to 60s for consumers to ack their 2 leased groups" in text
    assert "still leased" not in text


async def _trained(client: RolloutClient, run_id: str, count: int) -> bool:
    return (await client.get_run(run_id)).stats.groups_trained >= count


async def test_the_watchdog_reports_a_run_whose_only_server_died_and_its_trainer_stops(
    vllm_server, tiny_model: Path
) -> None:
    """Within stall_timeout_s of the server's death, GetRun and the metrics say the run
    stopped generating and why, and the trainer's feed raises with that reason instead of
    waiting for groups that do not come."""
    upstream = urlparse(vllm_server.url)
    proxy = KillableProxy(upstream.hostname, upstream.port)
    await proxy.start()
    stall_timeout_s = 8.0  # above the first groups' latency on 2 busy cores
    settings = service_settings(
        [proxy.url],
        tiny_model,
        scheduler={"max_inflight": 4, "stall_timeout_s": stall_timeout_s},
        engine={"probe_interval_s": 0.5},
    )
    async with service_with_client(settings) as (service, client):
        spec = dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=2, max_tokens=8)
        spec.max_buffered_groups = 2
        credits = 2
        run = await client.create_run(spec)

        def train_until_it_stops() -> tuple[int, float, str]:
            """Take groups as a trainer would; kill the server after two; return when the feed raises."""
            with GroupFeed(service.grpc_target, run.run_id, "trainer", max_staleness=1, credits=credits) as feed:
                for _ in range(2):
                    feed.ack_trained([feed.next_fresh_group(timeout_s=60).group_id])
                asyncio.run_coroutine_threadsafe(proxy.kill(), loop).result(10)
                killed = time.monotonic()
                taken = 0
                try:
                    while True:  # what was buffered before the kill still comes
                        feed.ack_trained([feed.next_fresh_group(timeout_s=60).group_id])
                        taken += 1
                except RuntimeError as exc:
                    return taken, time.monotonic() - killed, str(exc)

        loop = asyncio.get_running_loop()
        taken, seconds, error = await asyncio.wait_for(asyncio.to_thread(train_until_it_stops), 90)
        # After the kill only what was already generated comes: the run's buffer of scored groups
        # and what the stream had already handed the feed (its credits).
        assert taken <= spec.max_buffered_groups + credits
        assert "stopped generating" in error and "no vLLM server is answering" in error
        assert seconds < stall_timeout_s + 10  # the timeout, plus a check interval, plus a probe and slack
        stall = (await client.get_run(run.run_id)).stall
        assert stall.kind == pb.STALL_KIND_GENERATION and stall.seconds >= stall_timeout_s
        registry = service.service.metrics.registry
        assert registry.get_sample_value("rollout_run_stalled", {"run": run.run_id, "kind": "generation"}) == 1
        async with grpc.aio.insecure_channel(service.grpc_target) as channel:
            runs_health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=RUNS_HEALTH_NAME), timeout=5
            )
        assert runs_health.status == health_pb2.HealthCheckResponse.NOT_SERVING
        await client.delete_run(run.run_id)


async def test_a_run_whose_every_environment_fails_pauses_between_groups_and_is_reported(vllm_server, tiny_model):
    """guess_number needs a 'secret' in each prompt's metadata and letters has none, so every
    episode fails at its reset, before any request. After 16 such groups in a row the run pauses
    between groups (doubling, up to 5 s) instead of starting and dropping them as fast as the loop
    turns, and the watchdog reports it stalled, pointing at the drops."""
    settings = service_settings([vllm_server.url], tiny_model, scheduler={"max_inflight": 8, "stall_timeout_s": 2})
    async with service_with_client(settings) as (service, client):
        spec = dataset_run_spec("letters", {"env_reward": 1.0}, group_size=2, max_tokens=8)
        spec.episode.CopyFrom(pb.EpisodeSpec(environment="guess_number", max_turns=3))
        run_id = (await client.create_run(spec)).run_id

        async def stalled() -> bool:
            return (await client.get_run(run_id)).HasField("stall")

        await wait_until(stalled, 60, "the run to be reported stalled")
        run = await client.get_run(run_id)
        assert run.state == pb.RUN_STATE_RUNNING  # an environment may come back: the run goes on, paced
        assert "groups were dropped since the last one scored" in run.stall.reason
        assert BACKOFF_AFTER_FAILURES <= run.stats.groups_dropped < 100  # unpaced, thousands in these seconds
        assert run.stats.groups_scored == run.stats.groups_refused == 0
        assert service.service.scheduler.failure_backoff_s(service.service.runs[run_id]) > 0
        await client.delete_run(run_id)
