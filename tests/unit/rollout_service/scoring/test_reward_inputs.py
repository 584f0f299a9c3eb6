"""Reward functions get TRL's inputs: completions decoded without special tokens, wrapped as
``[{"role": "assistant", ...}]`` for conversational prompts, the prompt's messages, dataset
columns and TRL's extra kwargs, all passed as keyword arguments. Scripted engine, the tiny
model's real tokenizer. (tests/integration/test_trl_rewards.py runs it on real vLLM.)"""

from __future__ import annotations

from typing import Any

import pytest
from trl.rewards import get_repetition_penalty_reward, get_soft_overlong_punishment, think_format_reward

from rollout_service.config import SchedulerSettings
from rollout_service.generation.environments import EnvironmentRegistry
from rollout_service.generation.episode import MultiTurnConfig, TurnTemplate, run_episode, run_single_turn
from rollout_service.generation.prompts import PromptRenderer, PromptSpec
from rollout_service.generation.tools import ToolRegistry
from rollout_service.metrics import ServiceMetrics
from rollout_service.runs import RunSpec
from rollout_service.scoring.rewards import (
    RewardInputs,
    RewardRegistry,
    call_reward,
    char_fraction,
    exact_answer,
    reward_inputs,
)
from rollout_service.service import RolloutService, ServiceInfo
from rollout_service.types import Completion, EpisodeResult, EpisodeSpec, PromptItem, SamplingParams
from tests.support import wait_until

pytestmark = pytest.mark.timeout(60)

USER = {"role": "user", "content": "What is 2 + 3?"}
ADD_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


class TextEngine:
    """Answers each request with the next scripted text's ids, then EOS (finish ``stop``)."""

    def __init__(self, tokenizer: Any, *texts: str) -> None:
        self.tokenizer = tokenizer
        self.texts = list(texts)
        self.calls = 0

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *, affinity: str | None = None):
        text = self.texts[min(self.calls, len(self.texts) - 1)]
        self.calls += 1
        ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]
        return Completion(ids, [-0.5] * len(ids), "stop", "scripted")


def chat_prompt(tokenizer: Any, tools: Any = None, **metadata: str) -> PromptItem:
    ids = tokenizer.apply_chat_template([USER], tools=tools, add_generation_prompt=True, return_dict=False)
    return PromptItem(0, list(ids), tokenizer.decode(ids), metadata, (USER,))


def text_prompt(tokenizer: Any, text: str = "The answer is", **metadata: str) -> PromptItem:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return PromptItem(0, ids, tokenizer.decode(ids), metadata)


async def single_turns(tokenizer: Any, prompt: PromptItem, *texts: str) -> list[EpisodeResult]:
    engine = TextEngine(tokenizer, *texts)
    params = SamplingParams(max_tokens=32)
    return [await run_single_turn(engine, prompt, params, lambda: 0, tokenizer.decode) for _ in texts]


def trl_completions(tokenizer: Any, completion_ids: list[list[int]], conversational: bool) -> list[Any]:
    """What TRL's GRPOTrainer._generate builds from completion ids (no response schema)."""
    contents = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    if conversational:
        return [[{"role": "assistant", "content": c}] for c in contents]
    return contents


async def test_conversational_single_turn_gets_trl_message_lists_without_special_tokens(tokenizer) -> None:
    prompt = chat_prompt(tokenizer, answer="42")
    episodes = await single_turns(tokenizer, prompt, "42", "<think>hm</think>7")
    # The sample is unchanged: its ids end with EOS and its text keeps <|im_end|>.
    assert all(e.completion_ids[-1] == tokenizer.eos_token_id for e in episodes)
    assert episodes[0].text == "42<|im_end|>"
    inputs = reward_inputs(prompt, episodes)
    ids = [e.completion_ids for e in episodes]
    assert inputs.completions == trl_completions(tokenizer, ids, conversational=True)
    assert inputs.completions == [
        [{"role": "assistant", "content": "42"}],
        [{"role": "assistant", "content": "<think>hm</think>7"}],
    ]
    assert inputs.prompts == [[USER], [USER]]
    assert inputs.completion_ids == ids
    kwargs = inputs.kwargs
    assert kwargs["answer"] == ["42", "42"] and kwargs["trainer_state"] is None
    assert callable(kwargs["log_extra"]) and callable(kwargs["log_metric"])
    assert kwargs["completion_messages"] == inputs.completions
    assert kwargs["messages"][0] == [USER, {"role": "assistant", "content": "42"}]
    assert (kwargs["num_turns"], kwargs["env_reward"]) == ([1, 1], [None, None])


async def test_text_prompt_single_turn_gets_strings(tokenizer) -> None:
    prompt = text_prompt(tokenizer)
    episodes = await single_turns(tokenizer, prompt, " 42", " 7")
    inputs = reward_inputs(prompt, episodes)
    assert inputs.completions == [" 42", " 7"]
    assert inputs.completions == trl_completions(tokenizer, [e.completion_ids for e in episodes], False)
    assert inputs.prompts == ["The answer is", "The answer is"]
    # A multi-turn run's completions are message lists whatever the prompt's form.
    multi = reward_inputs(prompt, episodes, multi_turn=True)
    assert multi.completions == [[{"role": "assistant", "content": " 42"}], [{"role": "assistant", "content": " 7"}]]


async def test_trl_reward_functions_run_unchanged_and_score_as_in_trl(tokenizer) -> None:
    prompt = chat_prompt(tokenizer)
    episodes = await single_turns(tokenizer, prompt, "<think>a</think>b", "<think>a", "x x x x x x")
    inputs = reward_inputs(prompt, episodes)
    ids = [e.completion_ids for e in episodes]
    trl_inputs = {"prompts": [[USER]] * 3, "completions": trl_completions(tokenizer, ids, True), "completion_ids": ids}
    functions = {
        "think_format_reward": think_format_reward,
        "repetition_penalty": get_repetition_penalty_reward(ngram_size=2),
        "soft_overlong": get_soft_overlong_punishment(max_completion_len=6, soft_punish_cache=4),
    }
    for name, function in functions.items():
        got = await call_reward(name, function, inputs, 5.0)
        assert got == function(**trl_inputs), name
    assert await call_reward("think", think_format_reward, inputs, 5.0) == [1.0, 0.0, 0.0]


async def test_exact_match_reward_does_not_see_im_end(tokenizer) -> None:
    """A reward comparing the whole completion with the answer: a stopped completion used to
    carry ``<|im_end|>`` and never matched."""

    def exact_match(prompts, completions, completion_ids, answer, **kwargs):
        return [float(c[0]["content"] == a) for c, a in zip(completions, answer, strict=True)]

    prompt = chat_prompt(tokenizer, answer="5")
    episodes = await single_turns(tokenizer, prompt, "5", "6")
    assert await call_reward("exact_match", exact_match, reward_inputs(prompt, episodes), 5.0) == [1.0, 0.0]


async def test_async_callable_class_is_awaited() -> None:
    class Judge:
        async def __call__(self, completions, **kwargs):
            return [float(len(c)) for c in completions]

    inputs = RewardInputs(["p", "q"], ["ab", "c"], [[1], [2]], {})
    assert await call_reward("judge", Judge(), inputs, 5.0) == [2.0, 1.0]


async def test_metadata_named_like_an_input_is_not_passed(tokenizer) -> None:
    prompt = chat_prompt(tokenizer, completions="not a column", answer="5", num_turns="9")
    episodes = await single_turns(tokenizer, prompt, "5")
    inputs = reward_inputs(prompt, episodes)
    assert "completions" not in inputs.kwargs and inputs.kwargs["num_turns"] == [1]  # the service's own name wins
    assert await call_reward("exact_answer", exact_answer, inputs, 5.0) == [1.0]


async def test_tool_episode_completion_is_trl_conversation(tokenizer) -> None:
    registry = ToolRegistry()
    toolset = registry.toolset(["add"], "hermes", 5.0)
    prompt = chat_prompt(tokenizer, toolset.schemas(), answer="5")
    config = MultiTurnConfig(TurnTemplate(tokenizer, toolset.schemas()), 1024, max_turns=4, tools=toolset)
    engine = TextEngine(tokenizer, ADD_CALL, "It is 5")
    try:
        result = await run_episode(engine, prompt, SamplingParams(max_tokens=64), config, lambda: 0, tokenizer.decode)
    finally:
        registry.close()
    assert result.num_tool_calls == 1 and result.finish_reason == "stop"
    tool_message = {"role": "tool", "name": "add", "content": "5"}
    # The template's view keeps the special tokens (and is what the sample's ids render) ...
    assert list(result.messages) == [
        {"role": "assistant", "content": ADD_CALL},
        tool_message,
        {"role": "assistant", "content": "It is 5"},
    ]
    # ... rewards get TRL's: each turn's ids decoded without special tokens, the parsed call.
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    first_turn = [*tokenizer.encode(ADD_CALL, add_special_tokens=False), tokenizer.eos_token_id]
    assert list(result.reward_messages) == [
        {"role": "assistant", "content": tokenizer.decode(first_turn, skip_special_tokens=True), "tool_calls": [call]},
        tool_message,
        {"role": "assistant", "content": "It is 5"},
    ]
    assert "<" not in result.reward_messages[0]["content"]  # <tool_call> and <|im_end|> are special here
    inputs = reward_inputs(prompt, [result], multi_turn=True)
    assert inputs.completions == [list(result.reward_messages)]
    assert inputs.kwargs["messages"] == [[USER, *result.reward_messages]]
    assert await call_reward("exact_answer", exact_answer, inputs, 5.0) == [1.0]
    written = result.reward_messages[0]["content"] + "It is 5"  # the model's turns, not the tool's "5"
    assert await call_reward("chars", char_fraction, inputs, 5.0) == char_fraction([], [written], [[]])


def test_builtin_rewards_read_strings_and_message_lists() -> None:
    as_text = ["a a b", "a sum is 42", "7"]
    as_messages = [[{"role": "assistant", "content": t}] for t in as_text]
    for completions in (as_text, as_messages):
        assert char_fraction([], completions, [[]] * 3, target_char=["a", "a", "7"]) == [
            pytest.approx(2 / 3),
            pytest.approx(1 / 8),
            1.0,
        ]
        assert exact_answer([], completions, [[]] * 3, answer=["1", "42", None]) == [0.0, 1.0, None]
    # exact_answer reads the model's last message of a conversation, char_fraction all it wrote.
    conversation = [
        {"role": "assistant", "content": "call 2"},
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "assistant", "content": "5"},
    ]
    assert exact_answer([], [conversation], [[]], answer=["5"]) == [1.0]
    assert char_fraction([], [conversation], [[]], target_char=["5"]) == [pytest.approx(1 / 6)]


async def test_service_scores_a_chat_run_with_trl_inputs(tokenizer) -> None:
    seen: list[dict[str, Any]] = []

    def record(**kwargs: Any) -> list[float]:
        seen.append(kwargs)
        return [0.0] * len(kwargs["completions"])

    rewards = RewardRegistry()
    rewards.register("record", record)
    service = RolloutService(
        engine=TextEngine(tokenizer, "5"),
        renderer=PromptRenderer(tokenizer, max_model_len=1024),
        rewards=rewards,
        metrics=ServiceMetrics(),
        settings=SchedulerSettings(max_inflight=2, default_max_buffered_groups=1),
        info=ServiceInfo(model="scripted", engine_urls=[], max_inflight=2),
        tools=ToolRegistry(),
        environments=EnvironmentRegistry(),
    )
    spec = RunSpec(
        source_kind="prompts",
        prompts=(PromptSpec(messages=[USER], metadata={"answer": "5"}),),
        sampling=SamplingParams(max_tokens=8),
        group_size=2,
        rewards=(("exact_answer", 1.0), ("record", 0.0)),
        episode=EpisodeSpec(),
    )
    run = await service.create_run(spec)
    try:
        await wait_until(lambda: len(run.broker.buffered) == 1, 10, "a scored group")
        group = run.broker.buffered[0]
    finally:
        await service.close()
    assert group.rewards == [1.0, 1.0]
    assert seen[0]["completions"] == [[{"role": "assistant", "content": "5"}]] * 2
    assert seen[0]["prompts"] == [[USER]] * 2 and seen[0]["answer"] == ["5", "5"]
    assert group.episodes[0].text == "5<|im_end|>"  # the sample's text keeps its special tokens
