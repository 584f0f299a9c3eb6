"""Bad input gets the right status code and a message that says what to fix."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from rollout_api import rollout_pb2 as pb
from rollout_api.client import RolloutClient, dataset_run_spec, health_status
from rollout_service.app import RunningService
from rollout_service.edge.server import SERVICE_NAME
from tests.integration.conftest import service_settings, service_with_client
from tests.integration.test_discovery import fetch_text
from tests.integration.test_stream import take_groups
from tests.support import wait_until, with_bad_utf8
from trainer_client.stream.feed import GroupFeed, StreamEnded

pytestmark = pytest.mark.integration
INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND


async def expect_error(call, code: grpc.StatusCode, *fragments: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code, info.value.details()
    for fragment in fragments:
        assert fragment in info.value.details()


def letters(**fields) -> pb.RunSpec:
    return dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=2, max_tokens=8, **fields)


async def test_unknown_run(client: RolloutClient) -> None:
    await expect_error(client.get_run("run-nope"), NOT_FOUND, "no run 'run-nope'")
    await expect_error(client.delete_run("run-nope"), NOT_FOUND, "no run")


@pytest.mark.parametrize(
    ("mutate", "fragments"),
    [
        (lambda s: setattr(s, "group_size", 1), ["group_size is 1", ">= 2"]),
        (lambda s: setattr(s, "max_staleness", -1), ["max_staleness is -1", ">= 0"]),
        (lambda s: s.reward_functions.add(name="nope"), ["unknown reward function 'nope'", "char_fraction"]),
        (lambda s: s.ClearField("reward_functions"), ["name at least one reward function"]),
        (lambda s: setattr(s.prompt_source, "dataset", "nope"), ["unknown dataset 'nope'", "letters"]),
        (lambda s: s.ClearField("prompt_source"), ["prompt_source is not set"]),
        (lambda s: setattr(s.sampling, "temperature", -1.0), ["sampling.temperature"]),
        # Non-finite or beyond vLLM's range: vLLM refused every request of such a run
        (lambda s: setattr(s.sampling, "temperature", float("nan")), ["sampling.temperature is nan", "[0, 2]"]),
        (lambda s: setattr(s.sampling, "temperature", float("inf")), ["sampling.temperature is inf"]),
        (lambda s: setattr(s.sampling, "temperature", -float("inf")), ["sampling.temperature is -inf"]),
        (lambda s: setattr(s.sampling, "temperature", 2.5), ["sampling.temperature is 2.5"]),
        (lambda s: setattr(s.sampling, "top_p", float("nan")), ["sampling.top_p is nan"]),
        (lambda s: setattr(s, "lease_timeout_seconds", float("inf")), ["lease_timeout_seconds is inf"]),
        (lambda s: s.sampling.stop.append(""), ["sampling.stop has an empty string"]),
        (lambda s: setattr(s.sampling, "seed", 2**63 - 1), ["sampling.seed is 9223372036854775807"]),
        # The proto says max_tokens must be > 0: 0 is refused, not mapped to a default
        (lambda s: setattr(s.sampling, "max_tokens", 0), ["sampling.max_tokens must be > 0"]),
        (lambda s: s.ClearField("sampling"), ["sampling.max_tokens must be > 0"]),
        (lambda s: setattr(s.sampling, "max_tokens", 5000), ["exceeds the model's context", "max_tokens"]),
        (lambda s: setattr(s, "max_inflight", 10_000), ["max_inflight 10000 exceeds"]),
        # Upper bounds on what sizes memory and work
        (lambda s: setattr(s, "group_size", 100_000), ["group_size is 100000", "<= 1024"]),
        (lambda s: setattr(s, "max_buffered_groups", 2**32 - 1), ["max_buffered_groups is 4294967295"]),
        (lambda s: setattr(s, "weight", 1e9), ["weight is 1000000000.0", "(0, 1000]"]),
        (lambda s: setattr(s.sampling, "max_tokens", 2**31), ["sampling.max_tokens is 2147483648"]),
        (lambda s: s.sampling.stop.extend(["x"] * 33), ["sampling.stop has 33 strings"]),
        (lambda s: setattr(s, "display_name", "n" * 1000), ["display_name has 1000 characters"]),
        # Non-finite or huge reward weights
        (lambda s: setattr(s.reward_functions[0], "weight", float("inf")), ["'char_fraction' has weight inf"]),
        (lambda s: setattr(s.reward_functions[0], "weight", float("nan")), ["has weight nan", "finite"]),
        (lambda s: setattr(s.reward_functions[0], "weight", 1e9), ["has weight 1000000000.0"]),
    ],
)
async def test_bad_run_specs_are_invalid_argument(client: RolloutClient, mutate, fragments: list[str]) -> None:
    spec = letters()
    mutate(spec)
    await expect_error(client.create_run(spec), INVALID, *fragments)


async def test_bad_prompts(client: RolloutClient) -> None:
    spec = pb.RunSpec(group_size=2, reward_functions=[pb.RewardFunctionSpec(name="char_fraction")])
    spec.sampling.max_tokens = 8
    spec.prompt_source.prompts.prompts.add(token_ids=pb.TokenIds(ids=[5, 10**6]))
    await expect_error(client.create_run(spec), INVALID, "prompt 0", "outside the vocabulary")
    spec.prompt_source.submitted.SetInParent()
    run = await client.create_run(spec)
    await expect_error(client.submit_prompts(run.run_id, [pb.Prompt()]), INVALID, "none of messages, text")
    await expect_error(client.submit_prompts(run.run_id, []), INVALID, "at least one prompt")
    # Refused by size before the tokenizer sees them (a 20 MB prompt once froze the service).
    huge = pb.Prompt(text="a" * (20 << 20))
    await expect_error(client.submit_prompts(run.run_id, [huge]), INVALID, "characters cannot fit", "shorten it")
    heavy = pb.Prompt(text="hi", metadata={"notes": "x" * (100 << 10)})
    await expect_error(client.submit_prompts(run.run_id, [heavy]), INVALID, "prompt metadata is 102405 bytes")
    # 64 MiB is over the service's gRPC receive limit: refused before it is parsed.
    over = pb.Prompt(text="a" * (64 << 20))
    await expect_error(client.submit_prompts(run.run_id, [over]), grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max")
    accepted = await client.submit_prompts(run.run_id, [pb.Prompt(text="hi")])  # the service goes on
    assert (accepted.accepted, accepted.queued) == (1, 1)
    dataset_run = await client.create_run(letters())
    await expect_error(
        client.submit_prompts(dataset_run.run_id, [pb.Prompt(text="hi")]),
        grpc.StatusCode.FAILED_PRECONDITION,
        "prompt_source.submitted",
    )


async def open_stream(client: RolloutClient, *messages: pb.StreamSamplesRequest) -> grpc.aio.AioRpcError:
    """Send messages on a raw stream and return the error it ends with."""

    async def requests():
        for message in messages:
            yield message
        await asyncio.Event().wait()  # keep the request side open, as a consumer does

    call = client.stub.StreamSamples(requests(), timeout=30)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in call:
            pass
    return info.value


def subscribe(run_id: str, consumer: str = "c", credits: int = 0) -> pb.StreamSamplesRequest:
    return pb.StreamSamplesRequest(subscribe=pb.Subscribe(run_id=run_id, consumer_id=consumer, initial_credits=credits))


@pytest.mark.parametrize(
    ("messages", "code", "fragment"),
    [
        (lambda r: [pb.StreamSamplesRequest(credit=pb.Credit(groups=1))], INVALID, "first StreamSamplesRequest"),
        (lambda r: [subscribe("run-nope")], NOT_FOUND, "no run 'run-nope'"),
        (lambda r: [subscribe(r, consumer="")], INVALID, "consumer_id is empty"),
        (lambda r: [subscribe(r), pb.StreamSamplesRequest()], INVALID, "empty StreamSamplesRequest"),
        (lambda r: [subscribe(r), subscribe(r)], INVALID, "only be the first message"),
        (lambda r: [subscribe(r), pb.StreamSamplesRequest(credit=pb.Credit(groups=0))], INVALID, "credit.groups"),
        (lambda r: [subscribe(r, credits=5000)], INVALID, "at most 4096 credits"),
        (lambda r: [subscribe(r), pb.StreamSamplesRequest(credit=pb.Credit(groups=5000))], INVALID, "would hold 5000"),
        (
            lambda r: [subscribe(r), pb.StreamSamplesRequest(ack=pb.Ack(group_ids=["g-nope"]))],
            grpc.StatusCode.FAILED_PRECONDITION,
            "not leased",
        ),
    ],
)
async def test_malformed_stream_messages(client: RolloutClient, messages, code, fragment: str) -> None:
    run = await client.create_run(letters())
    error = await open_stream(client, *messages(run.run_id))
    assert error.code() == code, error.details()
    assert fragment in error.details()


async def test_duplicate_consumer_is_refused_and_the_live_stream_keeps_its_leases(client: RolloutClient) -> None:
    run = await client.create_run(letters())
    first = client.stream(run.run_id, "same", credits=2)
    received = aiter(first)
    async with asyncio.timeout(60):
        held = [(await anext(received)).group_id for _ in range(2)]
    for _ in range(2):  # a refused duplicate must not release the first stream's leases, twice over
        error = await open_stream(client, subscribe(run.run_id, consumer="same"))
        assert error.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "unique consumer_id" in error.details()
        stats = (await client.get_run(run.run_id)).stats
        assert (stats.groups_leased, stats.groups_returned) == (2, 0)
    first.ack(held)  # the first stream still owns them, and goes on
    async with asyncio.timeout(60):
        assert (await anext(received)).group_id not in held
    assert (await client.get_run(run.run_id)).stats.groups_trained == 2
    await first.aclose()
    await client.delete_run(run.run_id)


async def test_a_broken_stream_returns_its_leases_to_the_front_for_the_next_consumer(client: RolloutClient) -> None:
    run = await client.create_run(letters(max_buffered_groups=4))
    doomed = client.stream(run.run_id, "doomed", credits=2)
    received = aiter(doomed)
    async with asyncio.timeout(60):
        held = [(await anext(received)).group_id for _ in range(2)]
    doomed.cancel()  # as a killed process's connection would: no acks, no goodbye

    async def returned() -> bool:
        stats = (await client.get_run(run.run_id)).stats
        return stats.groups_returned == 2 and stats.groups_leased == 0

    await wait_until(returned, 30, "the broken stream's leases to return")
    heir = await take_groups(client, run.run_id, 2, consumer="heir")
    assert [group.group_id for group in heir] == held  # oldest first
    await client.delete_run(run.run_id)


async def test_deleted_run_ends_its_streams_and_refuses_new_ones(client: RolloutClient) -> None:
    run = await client.create_run(letters())
    deleted = await client.delete_run(run.run_id)
    assert deleted.state == pb.RUN_STATE_STOPPED
    error = await open_stream(client, subscribe(run.run_id))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "create a new run" in error.details()


async def test_deleting_a_run_frees_its_groups_and_series_and_tells_its_consumers(
    service: RunningService, client: RolloutClient
) -> None:
    run = await client.create_run(letters(max_buffered_groups=4))
    stream = client.stream(run.run_id, "c", credits=1)
    received = aiter(stream)
    async with asyncio.timeout(60):
        await anext(received)
    await wait_until(lambda: _buffered(client, run.run_id, 4), 60, "the buffer to fill")
    await client.delete_run(run.run_id)

    with pytest.raises(grpc.aio.AioRpcError) as info:  # the live stream is told why it ends
        async with asyncio.timeout(30):
            await anext(received)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "is stopped" in info.value.details() and "create a new run" in info.value.details()
    after = await client.get_run(run.run_id)  # still readable, its groups freed
    assert after.state == pb.RUN_STATE_STOPPED
    assert (after.stats.groups_buffered, after.stats.groups_leased) == (0, 0)
    assert run.run_id not in [r.run_id for r in (await client.stub.ListRuns(pb.ListRunsRequest(), timeout=10)).runs]
    assert run.run_id not in (await client.stats()).runs
    metrics = await asyncio.to_thread(fetch_text, f"http://127.0.0.1:{service.metrics_port}/metrics")
    assert f'run="{run.run_id}"' not in metrics
    assert (await client.delete_run(run.run_id)).state == pb.RUN_STATE_STOPPED  # twice: a no-op


async def _buffered(client: RolloutClient, run_id: str, groups: int) -> bool:
    return (await client.get_run(run_id)).stats.groups_buffered >= groups


async def test_what_an_outside_attack_sent_is_refused_and_the_service_stays_serving(
    service: RunningService, client: RolloutClient
) -> None:
    # A string that is not UTF-8 on the wire: INVALID_ARGUMENT naming the field, not UNKNOWN.
    request = pb.CreateRunRequest(spec=letters(display_name="name-abcdef"))
    async with grpc.aio.insecure_channel(service.grpc_target) as channel:
        create = channel.unary_unary(
            f"/{SERVICE_NAME}/CreateRun",
            request_serializer=lambda raw: raw,
            response_deserializer=pb.CreateRunResponse.FromString,
        )
        await expect_error(
            create(with_bad_utf8(request, "name-abcdef"), timeout=10),
            INVALID,
            "CreateRunRequest.spec.display_name is not valid UTF-8",
        )
        assert (await create(request.SerializeToString(), timeout=30)).run.spec.display_name == "name-abcdef"
    # A 1 MB run id: NOT_FOUND, and the message quotes 128 characters of it, not a megabyte.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.get_run("r" * (1 << 20))
    assert info.value.code() == NOT_FOUND and info.value.details().startswith("no run 'rrrr")
    assert len(info.value.details()) < 1024
    # A role the proto does not list, in a run's prompts and in submitted ones.
    wizard = pb.Prompt(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="wizard", content="hi")]))
    spec = letters()
    spec.prompt_source.prompts.prompts.append(wizard)
    allowed = "use one of system, user, assistant, tool"
    await expect_error(client.create_run(spec), INVALID, "prompt 0: message 0 has role 'wizard'", allowed)
    spec.prompt_source.submitted.SetInParent()
    run = await client.create_run(spec)
    await expect_error(client.submit_prompts(run.run_id, [wizard]), INVALID, "role 'wizard'", allowed)
    for each in await client.list_runs():
        await client.delete_run(each.run_id)
    assert await health_status(service.grpc_target, timeout_s=10) == "SERVING"


async def test_a_greedy_run_samples_its_groups(client: RolloutClient) -> None:
    """vLLM refuses n > 1 when greedy, and a group is one request of n: the client asks once and copies."""
    spec = letters()
    spec.sampling.temperature = 0.0
    run = await client.create_run(spec)
    [group] = await take_groups(client, run.run_id, 1)
    first, second = group.samples
    assert list(first.completion_token_ids) == list(second.completion_token_ids) and first.completion_token_ids
    assert (await client.get_run(run.run_id)).stats.groups_dropped == 0
    await client.delete_run(run.run_id)


async def test_a_run_whose_every_request_vllm_refuses_fails_and_tells_its_consumers(
    vllm_server, tiny_model, tmp_path
) -> None:
    """The service is told the servers take longer prompts than they do (the tests' take 1024
    tokens): vLLM refuses every request of a run of 2000-token prompts, and the run fails with
    vLLM's reason instead of dropping its groups for ever. A restart on its state store keeps it
    failed, rather than starting the storm again."""
    store = tmp_path / "state.db"
    settings = service_settings([vllm_server.url], tiny_model, engine={"max_model_len": 8192}, state_store=str(store))
    async with service_with_client(settings) as (service, client):
        spec = pb.RunSpec(group_size=2, reward_functions=[pb.RewardFunctionSpec(name="char_fraction")])
        spec.prompt_source.prompts.prompts.append(pb.Prompt(token_ids=pb.TokenIds(ids=[5] * 2000)))
        spec.sampling.max_tokens = 8
        run = await client.create_run(spec)
        stream = client.stream(run.run_id, "c", credits=1)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async with asyncio.timeout(60):
                await anext(aiter(stream))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"run {run.run_id} failed: vLLM refused" in info.value.details()
        assert "maximum model length" in info.value.details()  # vLLM's own words
        after = await client.get_run(run.run_id)
        assert after.state == pb.RUN_STATE_FAILED and after.error in info.value.details()

        def train() -> None:
            with GroupFeed(service.grpc_target, run.run_id, "trainer", max_staleness=1) as feed:
                feed.next_fresh_group(timeout_s=60)

        with pytest.raises(StreamEnded) as ended:  # what the trainer's command line prints, without a traceback
            await asyncio.wait_for(asyncio.to_thread(train), 90)
        assert (
            str(ended.value)
            == f"the sample stream of run {run.run_id} ended: FAILED_PRECONDITION: {info.value.details()}"
        )
        # 16 refusals fail it; groups that come back refused before the stop reaches them count too
        assert 16 <= after.stats.groups_refused == after.stats.groups_dropped <= 16 + after.max_inflight
        assert after.stats.groups_scored == 0

    async with service_with_client(settings) as (_, client):
        restored = await client.get_run(run.run_id)
        assert restored.state == pb.RUN_STATE_FAILED and restored.error == after.error
        with pytest.raises(grpc.aio.AioRpcError) as again:
            async with asyncio.timeout(60):
                await anext(aiter(client.stream(run.run_id, "c", credits=1)))
        assert (again.value.code(), again.value.details()) == (info.value.code(), info.value.details())
        assert (await client.get_run(run.run_id)).stats.groups_started == 0  # no group was started again
