"""The benchmark stand-in vLLM server (``benchmarks/standin_vllm.py``) is read by the service's own
clients as a vLLM server is, at the lengths, pauses and process lifetimes it is configured for.

Why: the CPU-ceiling benchmark drives the service against these stand-ins; an answer the service
parsed differently from vLLM's, or a fleet that leaked processes, would make its figures wrong.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import msgspec
import pytest

from rollout_service.config import EngineSettings
from rollout_service.engine.control import VLLMControlClient
from rollout_service.engine.server_load import parse_server_load
from rollout_service.engine.vllm_client import COMPLETIONS_PATH, GENERATE_PATH, VLLMServerClient, served_models
from rollout_service.metrics import ServiceMetrics
from rollout_service.types import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))  # as the benchmark scripts run

from standin_vllm import SERVER, StandinConfig, StandinFleet, StandinServer, start

pytestmark = pytest.mark.timeout(30)

VOCAB = 1000
EOS = 7
WAIT_S = 5.0
GENERATE_BODY = msgspec.json.encode({"token_ids": [1], "sampling_params": {"n": 1, "max_tokens": 8, "logprobs": 0}})


@pytest.fixture
async def standin(request: pytest.FixtureRequest) -> AsyncIterator[tuple[StandinServer, str]]:
    """A stand-in served in-process (``request.param``: its config), and its URL."""
    config = getattr(request, "param", None) or StandinConfig(model="m", vocab_size=VOCAB, eos_token_id=EOS)
    runner, url = await start(config)
    try:
        yield runner.app[SERVER], url
    finally:
        await runner.cleanup()


@pytest.fixture
async def client(standin: tuple[StandinServer, str]) -> AsyncIterator[VLLMServerClient]:
    _, url = standin
    client = VLLMServerClient(url, "m", EngineSettings(urls=[url], max_retries=0), ServiceMetrics(), max_connections=8)
    await client.start()
    try:
        yield client
    finally:
        await client.close()


def config(**fields: object) -> StandinConfig:
    return StandinConfig(**{"model": "m", "vocab_size": VOCAB, "eos_token_id": EOS, **fields})  # type: ignore[arg-type]


def check_completions(completions: list, lengths: range, max_tokens: int) -> None:
    assert len(completions) == 8
    for completion in completions:
        assert len(completion.token_ids) in lengths
        assert len(completion.logprobs) == len(completion.token_ids)
        assert all(0 <= token < VOCAB and token != EOS for token in completion.token_ids)
        assert all(-8.0 < logprob < 0.0 for logprob in completion.logprobs)
        expected = "length" if len(completion.token_ids) == max_tokens else "stop"
        assert completion.finish_reason == expected
    assert len({tuple(completion.token_ids) for completion in completions}) == 8


@pytest.mark.parametrize("standin", [config(length=(16, 16), max_model_len=4096)], indirect=True)
async def test_the_services_client_reads_both_endpoints_models_and_metrics(standin, client) -> None:
    server, url = standin
    prompt = list(range(100, 130))

    generated = await client.generate_many(prompt, SamplingParams(max_tokens=16, seed=3), 8)
    check_completions(generated, range(16, 17), max_tokens=16)
    with_stop = await client.generate_many(prompt, SamplingParams(max_tokens=32, stop=("\n",)), 8)
    check_completions(with_stop, range(16, 17), max_tokens=32)
    assert server.requests == {GENERATE_PATH: 1, COMPLETIONS_PATH: 1}

    [model] = await served_models(url)
    assert (model["id"], model["object"], model["max_model_len"]) == ("m", "model", 4096)

    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as resp:
        text = await resp.text()
    load = parse_server_load(text)
    assert (load.running, load.waiting) == (0, 0)
    assert load.prefix_cache_queries == 2 * 8 * len(prompt)
    [tokens] = [line for line in text.splitlines() if line.startswith("vllm:generation_tokens_total")]
    assert float(tokens.rsplit(" ", 1)[1]) == 2 * 8 * 16


@pytest.mark.parametrize("standin", [config(length=(3, 9))], indirect=True)
async def test_a_length_range_is_drawn_per_sequence_and_capped_at_max_tokens(standin, client) -> None:
    capped = [c for _ in range(8) for c in await client.generate_many([1, 2], SamplingParams(max_tokens=6), 8)]
    lengths = [len(completion.token_ids) for completion in capped]
    assert min(lengths) == 3 and max(lengths) == 6
    assert all(c.finish_reason == ("length" if len(c.token_ids) == 6 else "stop") for c in capped)

    free = [c for _ in range(8) for c in await client.generate_many([1, 2], SamplingParams(max_tokens=100), 8)]
    assert {len(completion.token_ids) for completion in free} == set(range(3, 10))
    assert {completion.finish_reason for completion in free} == {"stop"}


async def test_a_paused_server_holds_requests_until_resumed(standin, client) -> None:
    server, url = standin
    control = VLLMControlClient(url)
    await control.start()
    try:
        await control.pause("keep", WAIT_S)
        assert await control.is_paused(WAIT_S)
        request = asyncio.ensure_future(client.generate_many([1, 2, 3], SamplingParams(max_tokens=4), 8))
        await asyncio.wait_for(server.wait_until(lambda: server.waiting == 8), WAIT_S)
        assert not request.done() and server.running == 0
        await control.resume(WAIT_S)
        completions = await asyncio.wait_for(request, WAIT_S)
        assert [len(completion.token_ids) for completion in completions] == [4] * 8
        assert not await control.is_paused(WAIT_S)
    finally:
        await control.close()


@pytest.mark.parametrize("standin", [config(ttft_s=600.0)], indirect=True)
async def test_pausing_with_abort_ends_the_requests_in_flight(standin, client) -> None:
    server, url = standin
    control = VLLMControlClient(url)
    await control.start()
    try:
        request = asyncio.ensure_future(client.generate_many([1, 2, 3], SamplingParams(max_tokens=4), 2))
        await asyncio.wait_for(server.wait_until(lambda: server.running == 2), WAIT_S)
        await control.pause("abort", WAIT_S)
        completions = await asyncio.wait_for(request, WAIT_S)
        assert [(c.token_ids, c.finish_reason) for c in completions] == [([], "abort")] * 2
        assert server.running == 0
        await control.resume(WAIT_S)
    finally:
        await control.close()


@pytest.mark.parametrize("standin", [config(ttft_s=600.0)], indirect=True)
async def test_a_client_that_goes_away_frees_its_sequences(standin, client) -> None:
    server, _ = standin
    request = asyncio.ensure_future(client.generate_many([1, 2, 3], SamplingParams(max_tokens=4), 8))
    await asyncio.wait_for(server.wait_until(lambda: server.running == 8), WAIT_S)
    request.cancel()  # closes the connection, as the service does to a request it abandons
    await asyncio.wait_for(server.wait_until(lambda: server.running == 0), WAIT_S)
    assert server.generated == 0


def test_token_ids_are_every_id_of_the_vocabulary_but_eos() -> None:
    tape = StandinServer(config(vocab_size=50, eos_token_id=7)).tape
    assert set(tape.token_ids) == set(range(50)) - {7}
    assert all(-8.0 < logprob < 0.0 for logprob in tape.logprobs)


async def test_weight_control_calls_answer_and_keep_the_label(standin) -> None:
    _, url = standin
    control = VLLMControlClient(url)
    await control.start()
    try:
        assert await control.world_size(WAIT_S) == 1
        assert await control.weight_version(WAIT_S) == "default"
        await control.init_weight_transfer({"master_address": "x"}, WAIT_S)
        await control.start_weight_update(WAIT_S)
        await control.update_weights({"names": ["w"]}, WAIT_S)
        await control.finish_weight_update(None, WAIT_S)
        assert await control.weight_version(WAIT_S) == "default"
        await control.finish_weight_update("3", WAIT_S)
        assert await control.weight_version(WAIT_S) == "3"
        await control.set_weight_version("4", WAIT_S)
        assert await control.weight_version(WAIT_S) == "4"
        await control.shutdown_weight_transfer(WAIT_S)
    finally:
        await control.close()
    body = {"token_ids": [1], "sampling_params": {"n": 1, "max_tokens": 2, "logprobs": 0}}
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + GENERATE_PATH, data=msgspec.json.encode(body)) as resp,
    ):
        answer = msgspec.json.decode(await resp.read())
    assert answer["choices"][0]["weight_versions"] == [{"version": "4", "start": 0, "end": 2}]


async def test_a_fleet_serves_from_separate_processes_and_leaves_none_behind() -> None:
    fleet = StandinFleet(2, model="m", vocab_size=VOCAB, eos_token_id=EOS, length="8", ready_timeout_s=20)
    async with fleet, aiohttp.ClientSession() as session:
        assert len(set(fleet.urls)) == 2 and len(set(fleet.pids)) == 2 and os.getpid() not in fleet.pids
        for url in fleet.urls:
            async with session.get(url + "/health") as resp:
                assert resp.status == 200
        seeded = [await (await session.post(url + GENERATE_PATH, data=GENERATE_BODY)).read() for url in fleet.urls]
        assert seeded[0] != seeded[1]  # seeds differ
    assert fleet.returncodes == [0, 0]  # each ended on SIGTERM, cleanly
    for pid in fleet.pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


async def test_a_stand_in_that_cannot_start_is_named_with_its_stderr() -> None:
    fleet = StandinFleet(2, model="m", vocab_size=0, eos_token_id=EOS, length="8", ready_timeout_s=20)
    named = r"(?s)stand-in [01] \(pid \d+, seed [01]\) exited with status 1.*ValueError"
    with pytest.raises(RuntimeError, match=named):
        await fleet.__aenter__()
