"""Multi-turn episodes on a scripted engine with the tiny model's real tokenizer and chat
template: environments, guards and their finish reasons, policy versions, run validation,
what rewards see. (The proof against real vLLM is tests/integration/test_multiturn.py.)"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections.abc import Callable
from typing import Any

import pytest

from rollout_api import rollout_pb2 as pb
from rollout_service.config import SchedulerSettings
from rollout_service.edge.convert import run_spec_from_pb, run_spec_to_pb, server_info_to_pb
from rollout_service.edge.group_wire import group_to_pb
from rollout_service.engine.vllm_client import completion_body
from rollout_service.errors import EnvironmentFailure, FailedPrecondition, InvalidArgument
from rollout_service.generation.environments import EnvironmentRegistry, GuessNumber, StepResult
from rollout_service.generation.episode import (
    MultiTurnConfig,
    TurnTemplate,
    run_episode,
    run_single_turn,
    run_single_turn_group,
)
from rollout_service.generation.prompts import PromptRenderer, PromptSpec
from rollout_service.generation.tools import ToolRegistry
from rollout_service.metrics import ServiceMetrics
from rollout_service.runs import RunSpec
from rollout_service.scoring.rewards import RewardRegistry
from rollout_service.service import RolloutService, ServiceInfo
from rollout_service.types import Completion, EpisodeSpec, FinishReason, PromptItem, SamplingParams
from tests.support import wait_until
from tests.unit.scripted import ScriptedEngine, make_service

pytestmark = pytest.mark.timeout(60)

Turn = tuple[str, FinishReason]


class TurnEngine:
    """Answers turn n (counted from the assistant headers in the prompt) with ``script(n)``:
    the text's ids, then EOS when the turn stops; logprob -0.25 per token."""

    def __init__(self, tokenizer: Any, script: Callable[[int], Turn]) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.requests: list[tuple[list[int], SamplingParams]] = []

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *, affinity: str | None = None):
        self.requests.append((list(prompt_ids), params))
        text, finish = self.script(self.tokenizer.decode(prompt_ids).count("<|im_start|>assistant"))
        ids = self.tokenizer.encode(text, add_special_tokens=False)[: params.max_tokens]
        if finish == "stop":
            ids.append(self.tokenizer.eos_token_id)
        return Completion(ids, [-0.25] * len(ids), finish, "scripted")


def prompt_item(tokenizer: Any, content: str = "Guess my number.", tools: Any = None, **metadata: str) -> PromptItem:
    messages = [{"role": "user", "content": content}]
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, return_dict=False)
    return PromptItem(0, list(ids), tokenizer.decode(ids), metadata, tuple(messages))


async def episode(tokenizer: Any, script: Callable[[int], Turn], versions: Callable[[], int] = lambda: 0, **config):
    engine = TurnEngine(tokenizer, script)
    config.setdefault("max_model_len", 1024)
    config.setdefault("environment", GuessNumber)
    params = SamplingParams(max_tokens=config.pop("max_tokens", 16))
    cfg = MultiTurnConfig(TurnTemplate(tokenizer), **config)
    result = await run_episode(engine, prompt_item(tokenizer, secret="7"), params, cfg, versions, tokenizer.decode)
    return result, engine


def guesses(*texts: str) -> Callable[[int], Turn]:
    return lambda turn: (texts[min(turn, len(texts)) - 1], "stop")


async def test_environment_episode_until_done(tokenizer) -> None:
    result, engine = await episode(tokenizer, guesses("10", "I think 3", "7"), max_turns=5)
    assert result.finish_reason == "stop" and result.env_reward == 1.0
    assert result.num_turns == 3 and result.num_tool_calls == 0
    assert [m["content"] for m in result.messages] == ["10", "Lower.", "I think 3", "Higher.", "7"]
    # Token-exact: the sample is the template's rendering of the conversation, ending with EOS.
    conversation = [{"role": "user", "content": "Guess my number."}, *result.messages]
    rendered = tokenizer.apply_chat_template(conversation, return_dict=False)
    sample = engine.requests[0][0] + result.completion_ids
    assert sample == list(rendered[: len(sample)]) and tokenizer.decode(rendered[len(sample) :]) == "\n"
    assert engine.requests[2][0] == sample[: len(engine.requests[2][0])]  # each turn extends the last
    generated = [i for i, m in zip(result.completion_ids, result.mask, strict=True) if m]
    assert tokenizer.decode(generated) == "10<|im_end|>I think 3<|im_end|>7<|im_end|>"
    assert all(lp == (-0.25 if m else 0.0) for lp, m in zip(result.logprobs, result.mask, strict=True))


async def test_environment_not_done_by_max_turns(tokenizer) -> None:
    result, _ = await episode(tokenizer, guesses("1", "2", "3"), max_turns=3)
    assert result.finish_reason == "max_turns" and result.num_turns == 3 and result.env_reward == 0.0
    assert result.mask[-1] == 1  # the last turn's observation is not appended


async def test_policy_versions_are_those_of_the_first_and_last_turn(tokenizer) -> None:
    versions = iter(range(10, 20))
    result, engine = await episode(tokenizer, guesses("1", "2", "7"), lambda: next(versions), max_turns=5)
    assert (result.policy_version_first, result.policy_version_last) == (10, 13)  # read before turn 1, after turn 3
    # each turn shares vLLM's prefix cache only with requests made at its version
    assert [params.cache_salt for _, params in engine.requests] == ["policy-v10", "policy-v11", "policy-v12"]


async def test_episode_budget_lowers_max_tokens_and_ends_the_episode(tokenizer) -> None:
    result, engine = await episode(tokenizer, guesses("1", "2", "3", "4"), max_turns=8, max_episode_tokens=40)
    assert result.finish_reason == "max_episode_tokens"
    assert len(result.completion_ids) <= 40
    assert result.mask[-1] == 1  # the observation that did not fit was not appended
    assert len(engine.requests) == result.num_turns < 4

    long_turn = lambda turn: ("a b c d e f g h i j k l m n o p q r s t", "length")  # noqa: E731
    result, engine = await episode(tokenizer, long_turn, max_turns=8, max_episode_tokens=10)
    assert result.finish_reason == "max_episode_tokens" and len(result.completion_ids) == 10
    assert engine.requests[0][1].max_tokens == 10  # the turn got only what was left
    result, _ = await episode(tokenizer, long_turn, max_turns=8)
    assert result.finish_reason == "length" and len(result.completion_ids) == 16


async def test_context_length_bounds_the_episode(tokenizer) -> None:
    prompt_len = len(prompt_item(tokenizer).token_ids)
    result, engine = await episode(tokenizer, guesses("1", "2", "3"), max_turns=8, max_model_len=prompt_len + 30)
    assert result.finish_reason == "max_model_len"
    assert prompt_len + len(result.completion_ids) <= prompt_len + 30
    assert all(len(ids) + p.max_tokens <= prompt_len + 30 for ids, p in engine.requests)


async def test_an_aborted_turn_ends_the_episode_with_its_ids_kept(tokenizer) -> None:
    script = lambda turn: ("1", "stop") if turn == 1 else ("partial", "abort")  # noqa: E731
    result, _ = await episode(tokenizer, script, max_turns=5)
    assert result.finish_reason == "abort" and result.num_turns == 2
    assert result.completion_ids[-len(tokenizer.encode("partial")) :] == tokenizer.encode("partial")


async def test_async_environment_with_observation_none_ends_the_episode(tokenizer) -> None:
    class Grader:
        async def reset(self, prompt: PromptItem) -> None:
            self.turns = 0

        async def step(self, model_text: str) -> StepResult:
            self.turns += 1
            return StepResult("Again." if self.turns < 2 else None, reward=0.5)

    result, _ = await episode(tokenizer, guesses("x"), max_turns=5, environment=Grader)
    assert result.finish_reason == "stop" and result.num_turns == 2 and result.env_reward == 1.0


class HangsInStep:
    """A sync environment whose step never returns in time (a simulator stuck in C code)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        HANGING.append(self)

    def reset(self, prompt: PromptItem) -> None:
        pass

    def step(self, model_text: str) -> StepResult:
        self.release.wait(10)
        return StepResult("late")


class FailsInReset:
    def reset(self, prompt: PromptItem) -> None:
        raise KeyError("secret")

    def step(self, model_text: str) -> StepResult:
        raise AssertionError("never reached")


class HangsAsync:
    async def reset(self, prompt: PromptItem) -> None:
        await asyncio.Event().wait()

    def step(self, model_text: str) -> StepResult:
        raise AssertionError("never reached")


HANGING: list[HangsInStep] = []


@pytest.mark.parametrize(
    ("environment", "message"),
    [
        (HangsInStep, r"environment step took longer than 0\.3s \(scheduler.environment_timeout_s\)"),
        (HangsAsync, r"environment reset took longer than 0\.3s"),
        (FailsInReset, "environment reset raised KeyError: 'secret'"),
    ],
)
async def test_an_environment_that_hangs_or_raises_fails_its_episode_in_bounded_time(
    tokenizer, environment: type, message: str
) -> None:
    """A sync step used to run on the event loop: a hung one froze the whole service."""
    loop_ticks = 0

    async def ticking() -> None:
        nonlocal loop_ticks
        while True:
            loop_ticks += 1
            await asyncio.sleep(0.01)  # measures that the loop runs, not synchronisation

    ticker = asyncio.ensure_future(ticking())
    try:
        async with asyncio.timeout(10):
            with pytest.raises(EnvironmentFailure, match=message):
                await episode(tokenizer, guesses("5"), max_turns=3, environment=environment, environment_timeout_s=0.3)
    finally:
        ticker.cancel()
        for env in HANGING:
            env.release.set()
    if environment is not FailsInReset:
        assert loop_ticks > 5  # the loop kept running while the environment hung


# -- through the service --------------------------------------------------------------------


def real_service(tokenizer: Any, engine: Any, rewards: RewardRegistry | None = None) -> RolloutService:
    return RolloutService(
        engine=engine,
        renderer=PromptRenderer(tokenizer, max_model_len=1024),
        rewards=rewards or RewardRegistry(),
        metrics=ServiceMetrics(),
        settings=SchedulerSettings(max_inflight=4, default_max_buffered_groups=1),
        info=ServiceInfo(model="scripted", engine_urls=[], max_inflight=4),
        tools=ToolRegistry(),
        environments=EnvironmentRegistry(),
    )


def env_spec(rewards: tuple[tuple[str, float], ...] = (("env_reward", 1.0),), **episode: Any) -> RunSpec:
    return RunSpec(
        source_kind="dataset",
        dataset="guess_number",
        sampling=SamplingParams(max_tokens=8),
        group_size=2,
        rewards=rewards,
        episode=EpisodeSpec(**episode),
    )


async def test_rewards_see_the_whole_conversation_and_the_environment_reward(tokenizer) -> None:
    seen: list[dict[str, Any]] = []

    def record(prompts, completions, completion_ids, **kwargs):  # type: ignore[no-untyped-def]
        seen.append({**kwargs, "prompts": prompts, "completions": completions})
        return [0.0] * len(completions)

    rewards = RewardRegistry()
    rewards.register("seen", record)
    # Secrets of the dataset are 3, 7, 11, 14, 18: the first prompt's secret 3 is found on turn 2.
    service = real_service(tokenizer, TurnEngine(tokenizer, guesses("5", "3")), rewards)
    spec = env_spec((("env_reward", 1.0), ("seen", 0.0)), environment="guess_number", max_turns=4)
    run = await service.create_run(spec)
    try:
        await wait_until(lambda: len(run.broker.buffered) == 1, 10, "a scored group")
        group = run.broker.buffered[0]
    finally:
        await service.close()
    assert group.rewards == [1.0, 1.0]
    kwargs = seen[0]
    assert kwargs["secret"] == ["3", "3"] and kwargs["env_reward"] == [1.0, 1.0] and kwargs["num_turns"] == [2, 2]
    user = {"role": "user", "content": "Guess my number between 1 and 20. Answer with one number."}
    assert kwargs["messages"][0] == [
        user,
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "Lower."},
        {"role": "assistant", "content": "3"},
    ]
    assert kwargs["completion_messages"][0] == kwargs["messages"][0][1:]
    # TRL's form: the prompt's messages, the completion as its conversation.
    assert kwargs["prompts"][0] == [user] and kwargs["completions"][0] == kwargs["completion_messages"][0]
    sample = group_to_pb(group).samples[0]
    assert (sample.num_turns, sample.num_tool_calls, sample.finish_reason) == (2, 0, pb.FINISH_REASON_STOP)
    assert run.counters.turns == 4
    assert service.metrics.registry.get_sample_value("rollout_episode_turns_sum", {"run": run.run_id}) == 4


async def test_tool_schemas_reach_the_prompt(tokenizer) -> None:
    engine = TurnEngine(tokenizer, lambda turn: ("done", "stop"))
    service = real_service(tokenizer, engine)
    spec = RunSpec(
        source_kind="prompts",
        prompts=(PromptSpec(messages=[{"role": "user", "content": "hi"}]),),
        group_size=2,
        rewards=(("completion_length", 1.0),),
        episode=EpisodeSpec(tools=("calculator",)),
    )
    run = await service.create_run(spec)
    try:
        await wait_until(lambda: len(run.broker.buffered) == 1, 10, "a scored group")
    finally:
        await service.close()
    prompt = tokenizer.decode(engine.requests[0][0])
    assert "# Tools" in prompt and '"name": "calculator"' in prompt
    assert run.episode is not None and run.episode.max_turns == 8  # the default with tools
    assert run.broker.buffered[0].episodes[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("episode", "message"),
    [
        ({"tools": ("add", "search")}, "unknown tool 'search'; registered tools: add, calculator, multiply"),
        ({"tools": ("add",), "tool_parser": "mistral"}, "unknown tool parser 'mistral'; registered parsers"),
        ({"environment": "chess"}, "unknown environment 'chess'; registered: guess_number"),
        ({"tools": ("add", "add")}, "episode.tools names a tool twice"),
        ({"tools": ("add",), "max_turns": -1}, "episode.max_turns is -1"),
        ({"tools": ("add",), "max_episode_tokens": -5}, "episode.max_episode_tokens is -5"),
        ({"tools": ("add",), "tool_timeout_s": math.nan}, "episode.tool_timeout_seconds is nan"),
        ({"tools": ("add",), "tool_timeout_s": -1.0}, "episode.tool_timeout_seconds is -1.0"),
        ({"tool_timeout_s": 1.0, "environment": "guess_number"}, "episode.tools is empty"),
        ({"max_turns": 3}, "neither tools nor an environment"),
    ],
)
async def test_bad_episode_specs_are_invalid_arguments(tokenizer, episode: dict[str, Any], message: str) -> None:
    service = real_service(tokenizer, TurnEngine(tokenizer, guesses("1")))
    with pytest.raises(InvalidArgument, match=message.replace("(", r"\(").replace(")", r"\)")):
        await service.create_run(env_spec(**episode))
    assert not service.runs
    await service.close()


async def test_multi_turn_needs_a_chat_template() -> None:
    service = make_service(ScriptedEngine())  # a tokenizer without a chat template
    spec = RunSpec(
        source_kind="prompts",
        prompts=(PromptSpec(token_ids=[1, 2]),),
        group_size=2,
        rewards=(("completion_length", 1.0),),
        episode=EpisodeSpec(tools=("add",)),
    )
    with pytest.raises(FailedPrecondition, match="chat template"):
        await service.create_run(spec)
    await service.close()


def test_episode_spec_round_trips_through_proto(tokenizer) -> None:
    message = pb.RunSpec(group_size=2, reward_functions=[pb.RewardFunctionSpec(name="env_reward")])
    message.prompt_source.dataset = "guess_number"
    message.episode.tools.extend(["add", "calculator"])
    message.episode.tool_parser = "qwen"
    message.episode.tool_timeout_seconds = 2.5
    message.episode.max_turns = 5
    message.episode.max_episode_tokens = 300
    message.episode.environment = "guess_number"
    spec = run_spec_from_pb(message)
    assert spec.episode == EpisodeSpec(("add", "calculator"), "qwen", 2.5, 5, 300, "guess_number")
    assert run_spec_to_pb(spec).episode == message.episode
    assert not run_spec_to_pb(env_spec()).HasField("episode")  # single-turn runs leave it unset
    info = server_info_to_pb(real_service(tokenizer, None).server_info())
    assert "add" in info.tools and "hermes" in info.tool_parsers and list(info.environments) == ["guess_number"]


async def test_a_failing_environment_drops_its_groups_as_environment_and_the_run_goes_on(
    tokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    service = real_service(tokenizer, TurnEngine(tokenizer, guesses("5")))
    service.environments.register("fails_in_reset", FailsInReset)
    run = await service.create_run(env_spec(environment="fails_in_reset", max_turns=2))
    registry = service.metrics.registry

    def dropped() -> float:
        return registry.get_sample_value("rollout_groups_dropped_total", {"run": run.run_id, "reason": "environment"})

    try:
        await wait_until(lambda: (dropped() or 0) >= 3, 10, "three groups dropped for their environment")
    finally:
        await service.close()
    assert run.state == "stopped" and run.counters.groups_dropped >= 3  # it ran until the service closed
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # contained: a warning, not an error
    assert any("environment reset raised KeyError" in r.message for r in caplog.records)


async def test_single_turn_requests_salt_the_prefix_cache_with_their_version() -> None:
    """A request shares vLLM's cached prompt blocks only with requests of its policy version,
    so a pause-free update (whose prefix-cache reset vLLM refuses) leaves none to reuse."""
    seen: list[SamplingParams] = []

    class Recorder:
        async def generate(self, prompt_ids, params, *, affinity=None):  # type: ignore[no-untyped-def]
            seen.append(params)
            return Completion([5], [-1.0], "stop", "recorded")

        async def generate_many(self, prompt_ids, params, n, *, affinity=None):  # type: ignore[no-untyped-def]
            return [await self.generate(prompt_ids, params)] * n

    prompt = PromptItem(0, [1, 2], "x", {}, ())
    params = SamplingParams(max_tokens=4)
    await run_single_turn(Recorder(), prompt, params, lambda: 3, lambda ids, **_: "")
    await run_single_turn_group(Recorder(), prompt, params, 2, lambda: 5, lambda ids, **_: "")
    assert [p.cache_salt for p in seen] == ["policy-v3", "policy-v5"]  # one request per group
    assert params.cache_salt is None  # the run's own params stay as they were
    assert completion_body("m", [1, 2], seen[0])["cache_salt"] == "policy-v3"
    assert "cache_salt" not in completion_body("m", [1, 2], params)
