"""The LLM judge's own logic against a local stand-in for an OpenAI-compatible endpoint: the
message it sends, the score it reads, the cache, the concurrency cap and each failure, counted.
That it grades with a real vLLM judge: tests/integration/test_llm_judge.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web

from rollout_service.config import JudgeSettings
from rollout_service.errors import RewardError
from rollout_service.metrics import ServiceMetrics
from rollout_service.scoring.judge import JudgeError, LLMJudge
from rollout_service.scoring.rewards import RewardInputs, call_reward
from tests.unit.rollout_service.engine.vllm_http import serving

pytestmark = pytest.mark.timeout(60)


class StandIn:
    """Answers each chat request with ``reply(body)``; records the bodies and the peak concurrency."""

    def __init__(self, reply: Any = "Score: 7", status: int = 200, held: bool = False) -> None:
        self.reply, self.status, self.held = reply, status, held
        self.bodies: list[dict[str, Any]] = []
        self.inflight = self.peak = 0
        self._released: asyncio.Event | None = None  # made in the test's loop
        self._arrived: dict[int, asyncio.Event] = {}

    async def arrived(self, count: int) -> None:
        """Until ``count`` requests have come in."""
        if len(self.bodies) < count:
            await self._arrived.setdefault(count, asyncio.Event()).wait()

    def release(self) -> None:
        self.held = False
        if self._released is not None:
            self._released.set()

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        if (event := self._arrived.get(len(self.bodies))) is not None:
            event.set()
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)
        try:
            if self.held:
                self._released = self._released or asyncio.Event()
                await self._released.wait()
            if self.status != 200:
                return web.Response(status=self.status, text="overloaded")
            text = self.reply(body) if callable(self.reply) else self.reply
            return web.json_response({"choices": [{"message": {"role": "assistant", "content": text}}]})
        finally:
            self.inflight -= 1

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        return app


def judge(url: str, metrics: ServiceMetrics | None = None, **settings: Any) -> LLMJudge:
    return LLMJudge("grader", JudgeSettings(url=f"{url}/v1", **settings), list, "served", metrics)


def outcome(metrics: ServiceMetrics, name: str) -> float:
    return metrics.registry.get_sample_value("rollout_judge_calls_total", {"judge": "grader", "outcome": name}) or 0


async def test_it_sends_the_filled_template_constrained_and_reads_the_score() -> None:
    stand_in = StandIn("Score: 7")
    async with serving(stand_in.app()) as url:
        grader = judge(url, model="judge-model", template="{rubric} | {prompt} | {completion} | {answer} /{max_score}")
        chat = [{"role": "user", "content": "2+2?"}]
        scores = await grader([chat], [[{"role": "assistant", "content": "4"}]], [[1]], answer=["4"], num_turns=[1])
        await grader.close()
    assert scores == [0.7]
    [body] = stand_in.bodies
    assert body["model"] == "judge-model" and body["temperature"] == 0.0
    assert body["messages"] == [{"role": "user", "content": f"{JudgeSettings().rubric} | user: 2+2? | 4 | 4 /10"}]
    assert body["structured_outputs"] == {"regex": "Score: (10|9|8|7|6|5|4|3|2|1|0)"}


async def test_a_free_reply_counts_its_last_score_clamped_and_a_prompts_rubric_wins() -> None:
    stand_in = StandIn(lambda body: "Score: 3 at first... final Score: 12" if "strict" in str(body) else "score = 2")
    async with serving(stand_in.app()) as url:
        grader = judge(url, constrain_output=False, max_score=5)
        scores = await grader(["q", "q"], ["a", "b"], [[1], [1]], rubric=["strict", "lenient"])
        await grader.close()
    assert scores == [1.0, 0.4]
    assert "structured_outputs" not in stand_in.bodies[0]


async def test_a_completion_graded_once_is_cached_and_calls_are_capped() -> None:
    metrics = ServiceMetrics()
    stand_in = StandIn("Score: 5", held=True)
    async with serving(stand_in.app()) as url:
        grader = judge(url, metrics, max_concurrency=2)
        pending = asyncio.ensure_future(grader(["q"] * 6, ["a", "b", "c", "d", "e", "f"], [[1]] * 6))
        await stand_in.arrived(2)
        await asyncio.sleep(0.05)  # time for a third call to arrive, were the cap not there
        stand_in.release()
        assert await pending == [0.5] * 6
        assert await grader(["q"], ["c"], [[1]]) == [0.5]
        await grader.close()
    assert stand_in.peak == 2 and len(stand_in.bodies) == 6
    assert (outcome(metrics, "graded"), outcome(metrics, "cached")) == (6, 1)


@pytest.mark.parametrize(
    ("stand_in", "settings", "says", "counted"),
    [
        (StandIn(status=503), {}, "answered HTTP 503: overloaded", "error"),
        (StandIn("I like it"), {"constrain_output": False}, "gave no 'Score: N'", "unparsed"),
        (StandIn(held=True), {"timeout_s": 0.2}, "no grade from .* within 0.2s", "timeout"),
    ],
)
async def test_a_failed_grade_fails_the_group_as_a_reward_failure_and_is_counted(
    stand_in: StandIn, settings: dict[str, Any], says: str, counted: str
) -> None:
    metrics = ServiceMetrics()
    async with serving(stand_in.app()) as url:
        grader = judge(url, metrics, **settings)
        with pytest.raises(RewardError, match=says):
            await call_reward("grader", grader, RewardInputs(["q"], ["a"], [[1]], {}), timeout_s=30)
        stand_in.release()
        await grader.close()
    assert outcome(metrics, counted) == 1


async def test_without_a_url_it_grades_on_the_pools_servers_in_turn() -> None:
    first, second = StandIn("Score: 1"), StandIn("Score: 9")
    async with serving(first.app()) as one, serving(second.app()) as two:
        grader = LLMJudge("grader", JudgeSettings(), lambda: [one, two], "served", None)
        assert sorted(await grader(["q", "q"], ["a", "b"], [[1], [1]])) == [0.1, 0.9]
        await grader.close()
    assert first.bodies[0]["model"] == second.bodies[0]["model"] == "served"
    with pytest.raises(JudgeError, match="the pool has none now"):
        await LLMJudge("grader", JudgeSettings(), list, "served", None)(["q"], ["a"], [[1]])


def test_a_template_without_the_completion_is_refused() -> None:
    with pytest.raises(ValueError, match=r"must contain \{completion\}"):
        JudgeSettings(template="Grade {prompt}")
