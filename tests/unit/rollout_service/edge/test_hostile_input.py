"""What an outside attack sent the API, refused with INVALID_ARGUMENT (or NOT_FOUND) and a
message that says what to change: non-finite and out-of-range numbers, max_tokens 0, unknown
chat roles, strings that are not UTF-8 on the wire, and huge ids echoed back. The gRPC cases
go over real gRPC to a service on a scripted engine; the real-vLLM proof is
tests/integration/test_api_errors.py."""

from __future__ import annotations

import math
from typing import Any

import grpc
import pytest

from rollout_api import rollout_pb2 as pb
from rollout_service.edge.convert import run_spec_from_pb
from rollout_service.edge.server import SERVICE_NAME
from rollout_service.errors import MAX_ECHO_CHARS, InvalidArgument, RequestRejected, echo
from rollout_service.generation.prompts import PromptRenderer, PromptSpec
from rollout_service.generation.scheduler import REFUSED_BEFORE_FAILING
from rollout_service.runs import MAX_SECONDS
from rollout_service.types import SamplingParams
from tests.support import wait_until, with_bad_utf8
from tests.unit.rollout_service.builders import one_prompt_spec as spec
from tests.unit.rollout_service.edge.grpc_served import served
from tests.unit.scripted import ScriptedEngine, ScriptedTokenizer, make_service

pytestmark = pytest.mark.timeout(60)
NAN, INF = math.nan, math.inf
HUGE = 3e38  # about float32's largest


def message(**sampling: Any) -> pb.RunSpec:
    """A valid spec on the wire; ``sampling`` overrides its sampling fields."""
    out = pb.RunSpec(group_size=2, reward_functions=[pb.RewardFunctionSpec(name="completion_length")])
    out.prompt_source.dataset = "letters"
    out.sampling.max_tokens = 4
    for name, value in sampling.items():
        setattr(out.sampling, name, value)
    return out


def set_field(path: str, value: Any) -> pb.RunSpec:
    out = message()
    *parents, name = path.split(".")
    target: Any = out
    for parent in parents:
        target = target.reward_functions[0] if parent == "reward_functions" else getattr(target, parent)
    setattr(target, name, value)
    if path.startswith("episode."):
        out.episode.tools.append("add")
    return out


FLOAT_FIELDS = {
    "sampling.temperature": [NAN, INF, -INF, -1.0, 2.5, HUGE],
    "sampling.top_p": [NAN, INF, -INF, -0.5, 1.5, HUGE],
    "reward_functions.weight": [NAN, INF, -INF, HUGE, -HUGE],
    "weight": [NAN, INF, -INF, -1.0, 1e9],
    "lease_timeout_seconds": [NAN, INF, -INF, -1.0, MAX_SECONDS + 1.0],
    "group_deadline_seconds": [NAN, INF, -INF, -1.0, MAX_SECONDS + 1.0],
    "episode.tool_timeout_seconds": [NAN, INF, -INF, -1.0, MAX_SECONDS + 1.0],
}
INT_FIELDS = {
    "sampling.max_tokens": [0, 2**32 - 1],
    "sampling.top_k": [-1, -(2**31)],
    "sampling.seed": [2**63 - 1, -(2**63)],
    "group_size": [0, 1, 2**32 - 1],
    "max_staleness": [-1, -(2**31)],
    "max_buffered_groups": [2**32 - 1],
    "min_group_size": [1, 3, 2**32 - 1],
    "eval.policy_version": [-1, -(2**63)],
}


def _cases(fields: dict[str, list[Any]]) -> list[tuple[str, Any]]:
    return [(path, value) for path, values in fields.items() for value in values]


@pytest.mark.parametrize(("path", "value"), _cases(FLOAT_FIELDS) + _cases(INT_FIELDS))
def test_every_number_out_of_its_range_is_refused_naming_the_field(path: str, value: Any) -> None:
    wire = set_field(path, value)
    if path == "min_group_size":
        wire.group_deadline_seconds = 5.0
    with pytest.raises(InvalidArgument) as info:
        run_spec_from_pb(wire).validate()
    named = path.replace("reward_functions.", "reward function 'completion_length' has ")
    assert named.split(".")[-1] in str(info.value), str(info.value)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("sampling.temperature", 0.0),
        ("sampling.temperature", 2.0),
        ("sampling.top_p", 1.0),
        ("sampling.top_k", 2**31 - 1),
        ("sampling.seed", 2**62),
        ("sampling.seed", -(2**62)),
        ("weight", 1000.0),
        ("lease_timeout_seconds", float(MAX_SECONDS)),
        ("group_deadline_seconds", 0.0),
        ("reward_functions.weight", -1e6),
    ],
)
def test_the_bounds_themselves_are_accepted(path: str, value: Any) -> None:
    run_spec_from_pb(set_field(path, value)).validate()


def test_max_tokens_0_is_refused_as_the_proto_says_not_mapped_to_a_default() -> None:
    with pytest.raises(InvalidArgument, match=r"sampling\.max_tokens must be > 0"):
        run_spec_from_pb(message(max_tokens=0)).validate()


def test_an_empty_stop_string_is_refused_as_vllm_would_refuse_every_request() -> None:
    wire = message()
    wire.sampling.stop.extend(["x", ""])
    with pytest.raises(InvalidArgument, match=r"sampling\.stop has an empty string"):
        run_spec_from_pb(wire).validate()


def test_echo_bounds_what_a_message_repeats_of_an_input() -> None:
    assert echo("run-1") == "'run-1'"
    long = echo("x" * (1 << 20))
    assert long == repr("x" * MAX_ECHO_CHARS + "…")
    assert len(long) == MAX_ECHO_CHARS + 3


@pytest.mark.parametrize("role", ["wizard", "", "System"])
def test_a_chat_role_outside_the_protos_four_is_refused_naming_them(role: str) -> None:
    renderer = PromptRenderer(ScriptedTokenizer(), max_model_len=64)
    prompt = PromptSpec(messages=[{"role": "user", "content": "1"}, {"role": role, "content": "2"}])
    with pytest.raises(InvalidArgument) as info:
        renderer.render(prompt, 4)
    assert str(info.value) == f"message 1 has role {role!r}; use one of system, user, assistant, tool"


def test_text_too_long_for_the_context_is_refused_before_tokenizing() -> None:
    renderer = PromptRenderer(ScriptedTokenizer(), max_model_len=16)
    renderer.check_chars(16 * 64, "messages")
    with pytest.raises(InvalidArgument, match=r"^messages of 1025 characters cannot fit .* context of 16 tokens"):
        renderer.check_chars(16 * 64 + 1, "messages")


async def raw_call(port: int, method: str, data: bytes) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(f"/{SERVICE_NAME}/{method}", request_serializer=lambda b: b)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(data, timeout=10)
    return info.value


async def test_invalid_utf8_is_invalid_argument_naming_the_field_in_unary_and_streaming_calls() -> None:
    creating = pb.CreateRunRequest(spec=message())
    creating.spec.display_name = "name-abcdef"
    creating.spec.prompt_source.ClearField("dataset")
    creating.spec.prompt_source.prompts.prompts.add(text="1 2")
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="content-xyz")])
    creating.spec.prompt_source.prompts.prompts.add(messages=chat)
    async with served() as (service, client):
        port = int(client.target.rsplit(":", 1)[1])
        error = await raw_call(port, "CreateRun", with_bad_utf8(creating, "name-abcdef"))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details() == "CreateRunRequest.spec.display_name is not valid UTF-8; send strings as UTF-8"
        error = await raw_call(port, "CreateRun", with_bad_utf8(creating, "content-xyz"))
        assert error.details() == (
            "CreateRunRequest.spec.prompt_source.prompts.prompts[1].messages.messages[0].content is not valid UTF-8; "
            "send strings as UTF-8"
        )
        error = await raw_call(port, "GetRun", b"\x0a\x05ab\xff\xfe\x01")
        assert (error.code(), error.details()) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "GetRunRequest.run_id is not valid UTF-8; send strings as UTF-8",
        )
        error = await raw_call(port, "GetRun", b"\x0a\x7f")  # truncated: no field to name
        assert error.details() == "the request is not a valid GetRunRequest; send it encoded as protobuf"

        run = await service.create_run(spec())  # type: ignore[attr-defined]
        subscribe = pb.StreamSamplesRequest(subscribe=pb.Subscribe(run_id=run.run_id, consumer_id="consumer-1"))
        async with grpc.aio.insecure_channel(client.target) as channel:
            stream = channel.stream_stream(f"/{SERVICE_NAME}/StreamSamples", request_serializer=lambda b: b)
            call = stream(iter([with_bad_utf8(subscribe, "consumer-1")]), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in call:
                    pass
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "StreamSamplesRequest.subscribe.consumer_id is not valid UTF-8" in info.value.details()
        assert (await client.get_run(run.run_id)).run_id == run.run_id  # the service goes on


async def test_a_huge_run_id_is_not_found_with_a_short_message() -> None:
    async with served() as (_service, client):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.get_run("r" * (1 << 20))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert info.value.details().startswith(f"no run {echo('r' * (1 << 20))}; runs: ")
    assert len(info.value.details()) < 200


class RefusingEngine(ScriptedEngine):
    """vLLM refusing every request as invalid (a 4xx)."""

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *, affinity: str | None = None):
        self.calls += 1
        raise RequestRejected("scripted", "vLLM refused the request: HTTP 400: temperature must be in [0, 2]")


async def test_refused_requests_drop_their_groups_counted_and_a_run_refused_from_the_start_fails() -> None:
    engine = RefusingEngine()
    service = make_service(engine, max_inflight=4)
    run = await service.create_run(spec())
    await wait_until(
        lambda: run.state == "failed" and service.scheduler.slots_busy == 0,
        10,
        "the run to fail and its requests to stop",
    )
    dropped = service.metrics.registry.get_sample_value(
        "rollout_groups_dropped_total", {"run": run.run_id, "reason": "rejected"}
    )
    refused = run.counters.groups_refused
    assert dropped == refused == run.counters.groups_dropped and run.counters.groups_scored == 0
    assert REFUSED_BEFORE_FAILING <= refused <= REFUSED_BEFORE_FAILING + 4  # and those in flight at the 16th
    assert service.scheduler.engine_failures == service.stats().engine_request_failures == refused
    assert run.state == "failed" and f"first {REFUSED_BEFORE_FAILING} groups" in run.error
    assert "temperature must be in [0, 2]" in run.error  # vLLM's own reason
    # Its feeder and groups are cancelled with the failure: no storm goes on.
    assert engine.calls <= run.spec.group_size * (refused + 4) and service.scheduler.slots_busy == 0
    await service.delete_run(run.run_id)
