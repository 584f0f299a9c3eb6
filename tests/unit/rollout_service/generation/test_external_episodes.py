"""External episodes against a scripted engine with the tiny model's real tokenizer and chat
template: tool calls in OpenAI's form, groups per task, rewards from the client or the run,
and the HTTP layer's refusals (the proof with vLLM and the openai client is
tests/integration/test_openai_endpoint.py)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from pydantic import SecretStr

from rollout_service.config import PrincipalSettings, SchedulerSettings
from rollout_service.edge.openai_api import openai_app
from rollout_service.edge.security import TokenTable
from rollout_service.errors import FailedPrecondition, InvalidArgument, NotFound
from rollout_service.eval_tally import EvalSpec
from rollout_service.generation.external_conversation import TextRequest, TurnRequest
from rollout_service.generation.prompts import PromptRenderer
from rollout_service.metrics import ServiceMetrics
from rollout_service.runs import RunSpec
from rollout_service.scoring.rewards import RewardRegistry
from rollout_service.service import RolloutService, ServiceInfo
from rollout_service.types import Completion, EpisodeSpec, SamplingParams

pytestmark = pytest.mark.timeout(60)
QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]
TOOL_TURN = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


class ScriptEngine:
    """Answers each request with the next scripted text (then EOS); logprob -0.5 per token.
    With ``gate`` set, requests wait for it."""

    def __init__(self, tokenizer: Any, texts: list[str]) -> None:
        self.tokenizer, self.texts = tokenizer, list(texts)
        self.gate: asyncio.Event | None = None
        self.prompts: list[list[int]] = []
        self.arrived = asyncio.Event()

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *, affinity: str | None = None):
        self.prompts.append(list(prompt_ids))
        self.arrived.set()
        if self.gate is not None:
            await self.gate.wait()
        ids = [*self.tokenizer.encode(self.texts.pop(0), add_special_tokens=False), self.tokenizer.eos_token_id]
        return Completion(ids, [-0.5] * len(ids), "stop", "scripted")


def service_for(tokenizer: Any, engine: ScriptEngine) -> RolloutService:
    return RolloutService(
        engine=engine,  # type: ignore[arg-type]
        renderer=PromptRenderer(tokenizer, max_model_len=1024),
        rewards=RewardRegistry(),
        metrics=ServiceMetrics(),
        settings=SchedulerSettings(max_inflight=4),
        info=ServiceInfo(model="tiny", engine_urls=[], max_inflight=4),
    )


def external(group_size: int = 2, **kw: Any) -> RunSpec:
    kw.setdefault("rewards", (("completion_length", 1.0),))
    return RunSpec(source_kind="external", group_size=group_size, sampling=SamplingParams(max_tokens=32), **kw)


def turn(episode: str, messages: list[dict[str, Any]], task: str = "t1", **kw: Any) -> TurnRequest:
    return TurnRequest(episode_id=episode, task_id=task, messages=messages, **kw)


async def test_a_tool_call_comes_back_in_openai_form_and_its_result_extends_the_ids(tokenizer: Any) -> None:
    engine = ScriptEngine(tokenizer, ["Let me add. " + TOOL_TURN, "It is 5."])
    service = service_for(tokenizer, engine)
    run = await service.create_run(external())
    reply = await service.external.turn(run, turn("e1", QUESTION))
    assert reply.finish_reason == "tool_calls" and reply.content == "Let me add."
    [call] = reply.tool_calls
    assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == {"a": 2, "b": 3}
    assistant = {"role": "assistant", "content": reply.content, "tool_calls": reply.tool_calls}
    tool = {"role": "tool", "tool_call_id": call["id"], "content": "5"}
    second = await service.external.turn(run, turn("e1", [*QUESTION, assistant, tool]))
    assert second.finish_reason == "stop" and second.content == "It is 5."
    # The second request is the first one's ids, the model's turn as generated, then the
    # tool result as the template renders it after an assistant turn: nothing re-tokenized.
    first_prompt, second_prompt = engine.prompts
    assert second_prompt[: len(first_prompt) + len(reply.token_ids)] == first_prompt + reply.token_ids
    assert "<tool_response>\n5\n</tool_response>" in tokenizer.decode(second_prompt[len(first_prompt) :])


async def test_a_task_of_g_closed_episodes_is_one_group_scored_by_the_run(tokenizer: Any) -> None:
    engine = ScriptEngine(tokenizer, ["short", "a longer answer here"])
    service = service_for(tokenizer, engine)
    run = await service.create_run(external())
    for episode in ("e1", "e2"):
        await service.external.turn(run, turn(episode, QUESTION))
    assert await service.external.close(run, "e1", None) == 1
    assert not run.broker.buffered
    assert await service.external.close(run, "e2", None) == 0
    [group] = run.broker.buffered
    assert group.reward_components.keys() == {"completion_length"}
    assert group.rewards[0] < group.rewards[1] and group.advantages[0] < 0 < group.advantages[1]
    assert [e.mask.count(1) for e in group.episodes] == [
        len(tokenizer.encode(t)) + 1 for t in ("short", "a longer answer here")
    ]
    assert run.counters.groups_scored == 1


async def test_client_rewards_make_the_group_and_cannot_be_mixed_with_the_runs(tokenizer: Any) -> None:
    engine = ScriptEngine(tokenizer, ["a", "b", "c", "d"])
    service = service_for(tokenizer, engine)
    run = await service.create_run(external())
    for episode in ("e1", "e2", "e3"):
        await service.external.turn(run, turn(episode, QUESTION))
    await service.external.turn(run, turn("other", [{"role": "user", "content": "What is 4 + 4?"}]))
    await service.external.close(run, "e1", 1.0)
    with pytest.raises(InvalidArgument, match="starts from other messages than the episodes of task 't1'"):
        await service.external.close(run, "other", 1.0)
    with pytest.raises(InvalidArgument, match="closed with a reward; close every episode of a group the same way"):
        await service.external.close(run, "e2", None)
    await service.external.close(run, "e3", 0.0)
    [group] = run.broker.buffered
    assert group.rewards == [1.0, 0.0] and group.reward_components == {"client": [1.0, 0.0]}


async def test_closing_what_cannot_be_trained_is_refused(tokenizer: Any) -> None:
    engine = ScriptEngine(tokenizer, ["a"])
    service = service_for(tokenizer, engine)
    run = await service.create_run(external())
    with pytest.raises(NotFound, match="no open episode 'e1'"):
        await service.external.close(run, "e1", None)
    with pytest.raises(InvalidArgument, match="name its task"):
        await service.external.turn(run, turn("e1", QUESTION, task=""))
    with pytest.raises(InvalidArgument, match="an episode starts from system and user messages"):
        await service.external.turn(run, turn("e1", [{"role": "assistant", "content": "hi"}]))
    engine.gate = asyncio.Event()
    running = asyncio.ensure_future(service.external.turn(run, turn("e1", QUESTION)))
    await asyncio.wait_for(engine.arrived.wait(), 5)
    with pytest.raises(FailedPrecondition, match="still running"):
        await service.external.close(run, "e1", None)
    engine.gate.set()
    await asyncio.wait_for(running, 5)


async def test_a_text_episode_appends_only_what_each_prompt_adds(tokenizer: Any) -> None:
    engine = ScriptEngine(tokenizer, [" four", " six", "x"])
    service = service_for(tokenizer, engine)
    run = await service.create_run(external())
    first = await service.external.complete(run, TextRequest("e1", "t1", "Two plus two is"))
    held = "Two plus two is" + tokenizer.decode(first.token_ids)
    assert first.content == tokenizer.decode(first.token_ids)
    with pytest.raises(InvalidArgument, match="does not start with the text so far of episode 'e1'"):
        await service.external.complete(run, TextRequest("e1", "", "Two plus three is"))
    with pytest.raises(InvalidArgument, match="is a text episode; continue it with completions"):
        await service.external.turn(run, turn("e1", QUESTION))
    second = await service.external.complete(run, TextRequest("e1", "", held + " Three plus three is"))
    added = tokenizer.encode(" Three plus three is", add_special_tokens=False)
    assert engine.prompts[1] == engine.prompts[0] + first.token_ids + added  # nothing re-tokenized
    await service.external.complete(run, TextRequest("e2", "t1", "Two plus two is"))
    await service.external.close(run, "e1", 1.0)
    await service.external.close(run, "e2", 0.0)
    [group] = run.broker.buffered
    episode = group.episodes[0]
    assert episode.mask == [1] * len(first.token_ids) + [0] * len(added) + [1] * len(second.token_ids)


def test_external_runs_refuse_settings_that_cannot_apply() -> None:
    with pytest.raises(InvalidArgument, match="not external prompts"):
        external(eval=EvalSpec()).validate()
    with pytest.raises(InvalidArgument, match="its client runs the conversation and its tools"):
        external(episode=EpisodeSpec(tools=("calculator",))).validate()


async def test_the_http_layer_answers_in_openai_error_form_with_the_grpc_tokens(tokenizer: Any) -> None:
    service = service_for(tokenizer, ScriptEngine(tokenizer, ["hello"]))
    tokens = TokenTable(
        {
            "alice": PrincipalSettings(token=SecretStr("alice-token-0123456789")),
            "bob": PrincipalSettings(token=SecretStr("bob-token-0123456789ab")),
        }
    )
    run = await service.create_run(external(), owner="alice")
    async with TestClient(TestServer(openai_app(service, tokens))) as http:
        url = f"/v1/runs/{run.run_id}/chat/completions"
        body = {"model": "tiny", "messages": QUESTION, "episode_id": "e1", "task_id": "t1"}
        response = await http.post(url, json=body)
        assert response.status == 401
        assert (await response.json())["error"]["type"] == "authentication_error"
        response = await http.post(url, json=body, headers={"Authorization": "Bearer bob-token-0123456789ab"})
        assert response.status == 404  # another principal's run is not there for bob
        alice = {"Authorization": "Bearer alice-token-0123456789"}
        response = await http.post(url, json={**body, "n": 2}, headers=alice)
        assert response.status == 400 and "n must be 1" in (await response.json())["error"]["message"]
        response = await http.post(url, data=b"not json", headers=alice)
        assert response.status == 400 and "not JSON" in (await response.json())["error"]["message"]
        response = await http.post(url, json=body, headers=alice)
        reply = await response.json()
        assert response.status == 200 and reply["object"] == "chat.completion"
        assert reply["choices"][0]["message"] == {"role": "assistant", "content": "hello"}
        assert reply["choices"][0]["finish_reason"] == "stop"
        assert reply["usage"]["completion_tokens"] == len(reply["choices"][0]["rollout"]["token_ids"])


async def test_a_streamed_turn_comes_as_openai_chunks_then_done(tokenizer: Any) -> None:
    service = service_for(tokenizer, ScriptEngine(tokenizer, ["Let me add. " + TOOL_TURN]))
    run = await service.create_run(external())
    async with TestClient(TestServer(openai_app(service, TokenTable({})))) as http:
        body = {"messages": QUESTION, "episode_id": "e1", "task_id": "t1", "stream": True}
        response = await http.post(f"/v1/runs/{run.run_id}/chat/completions", json=body)
        assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
        events = [line[len("data: ") :] for line in (await response.text()).splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    first, calls, last = (chunk["choices"][0] for chunk in chunks)
    assert first["delta"] == {"role": "assistant", "content": "Let me add."}
    assert calls["delta"]["tool_calls"][0]["index"] == 0
    assert calls["delta"]["tool_calls"][0]["function"]["name"] == "add"
    assert last["finish_reason"] == "tool_calls" and last["rollout"]["token_ids"]
    assert chunks[-1]["usage"]["completion_tokens"] == len(last["rollout"]["token_ids"])


async def test_a_streamed_text_completion_comes_as_text_chunks_then_done(tokenizer: Any) -> None:
    service = service_for(tokenizer, ScriptEngine(tokenizer, [" four"]))
    run = await service.create_run(external())
    async with TestClient(TestServer(openai_app(service, TokenTable({})))) as http:
        body = {"prompt": "Two plus two is", "episode_id": "e1", "task_id": "t1", "stream": True}
        response = await http.post(f"/v1/runs/{run.run_id}/completions", json=body)
        assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
        events = [line[len("data: ") :] for line in (await response.text()).splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text, last = (json.loads(event) for event in events[:-1])
    assert text["object"] == last["object"] == "text_completion"
    ids = last["choices"][0]["rollout"]["token_ids"]
    assert text["choices"][0]["text"] == tokenizer.decode(ids) and text["choices"][0]["text"].startswith(" four")
    assert text["choices"][0]["finish_reason"] is None
    assert last["choices"][0]["text"] == "" and last["choices"][0]["finish_reason"] == "stop"
    assert last["usage"]["completion_tokens"] == len(ids)
    assert run.source.open["e1"].text == "Two plus two is" + tokenizer.decode(ids)  # the episode goes on from here


async def test_a_group_the_runs_rewards_cannot_score_is_dropped_counted_and_said(tokenizer: Any) -> None:
    service = service_for(tokenizer, ScriptEngine(tokenizer, ["a", "b"]))

    def boom(completions: list[Any], **kwargs: Any) -> list[float]:
        raise ValueError("no answer column")

    service.rewards.register("boom", boom)
    run = await service.create_run(external(rewards=(("boom", 1.0),)))
    for episode in ("e1", "e2"):
        await service.external.turn(run, turn(episode, QUESTION))
    await service.external.close(run, "e1", None)
    with pytest.raises(FailedPrecondition, match="could not be scored by the run's reward functions"):
        await service.external.close(run, "e2", None)
    assert run.counters.groups_dropped == 1 and not run.broker.buffered and run.broker.reserved == 0
    sample = service.metrics.registry.get_sample_value
    assert sample("rollout_groups_dropped_total", {"run": run.run_id, "reason": "reward"}) == 1


async def test_a_changed_assistant_turn_is_refused_with_its_index_and_a_re_serialized_one_is_not(
    tokenizer: Any,
) -> None:
    engine = ScriptEngine(tokenizer, ["Let me add. " + TOOL_TURN, "It is 5."])
    service = service_for(tokenizer, engine)
    run = await service.create_run(external())
    reply = await service.external.turn(run, turn("e1", QUESTION))
    [call] = reply.tool_calls
    tool = {"role": "tool", "tool_call_id": call["id"], "content": "5"}
    function = {"name": "add", "arguments": '{"b":3,"a":2}'}  # re-encoded, as clients do
    changes = [
        {"content": "Let me subtract."},
        {"tool_calls": [{**call, "function": {"name": "add", "arguments": '{"a": 2, "b": 4}'}}]},
        {"tool_calls": [{**call, "function": {**call["function"], "name": "multiply"}}]},
        {"tool_calls": []},
    ]
    for change in changes:
        changed = {"role": "assistant", "content": reply.content, "tool_calls": reply.tool_calls, **change}
        with pytest.raises(InvalidArgument, match=r"^message 1 of episode 'e1' differs from the conversation"):
            await service.external.turn(run, turn("e1", [*QUESTION, changed, tool]))
    assert len(engine.prompts) == 1  # nothing was generated from a changed conversation
    copy = {
        "role": "assistant",
        "content": [{"type": "text", "text": reply.content}],
        "tool_calls": [{"id": "call_other", "type": "function", "function": function}],
    }
    second = await service.external.turn(run, turn("e1", [*QUESTION, copy, tool]))
    assert second.content == "It is 5." and len(engine.prompts) == 2


async def test_a_message_too_long_for_the_context_is_refused_before_the_chat_template_reads_it(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = service_for(tokenizer, ScriptEngine(tokenizer, ["hello"]))
    run = await service.create_run(external())

    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the tokenizer read a message that cannot fit")

    monkeypatch.setattr(tokenizer, "apply_chat_template", never)
    monkeypatch.setattr(tokenizer, "encode", never)
    huge = [{"role": "user", "content": "a" * (5 << 20)}]
    with pytest.raises(InvalidArgument, match=r"^messages of 5242880 characters cannot fit the model's context"):
        await service.external.turn(run, turn("e1", huge))
    with pytest.raises(InvalidArgument, match=r"^prompt of 5242880 characters cannot fit"):
        await service.external.complete(run, TextRequest(episode_id="e2", task_id="t1", prompt="a" * (5 << 20)))
    assert not run.source.open  # type: ignore[attr-defined]
