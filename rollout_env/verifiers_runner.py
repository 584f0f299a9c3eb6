"""A ``verifiers`` environment's rollouts as the groups of an external run.

prime-rl's users write their tasks as ``verifiers`` environments. This drives one the way
prime-rl's orchestrator does, from its own process: the environment's harness talks to the
service's OpenAI-compatible endpoint of an external run (so every token is sampled, and
recorded, by the service), G rollouts of one task form a group, and the rubric's reward closes
each episode and becomes its sample's reward. A trainer consumes the run as any other.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from rollout_api import rollout_pb2 as pb
from rollout_api.client import ClientSecurity, RolloutClient

logger = logging.getLogger(__name__)

TOKEN_VARIABLE = "ROLLOUT_TOKEN"
"""The verifiers client sends the value of this variable as its bearer token (``EMPTY`` unset)."""


@dataclass
class VerifiersRun:
    """What to run, against which service, and how much at once."""

    env_id: str
    target: str
    openai_url: str
    run_id: str | None = None
    group_size: int = 8
    max_tokens: int = 512
    temperature: float = 1.0
    max_turns: int = 10
    groups_in_flight: int = 4
    groups: int = 0
    """Groups to run before stopping; 0: cycle through the tasks until the run is deleted."""
    taskset: dict[str, Any] = field(default_factory=dict)
    """The taskset's own settings (``--env.taskset.*`` of ``vf-eval``)."""


@dataclass
class RunnerReport:
    run_id: str
    groups: int = 0
    episodes: int = 0
    failed: int = 0
    """Episodes that ended in an error: closed with reward 0, and logged."""
    rewards: list[float] = field(default_factory=list)


def load_environment(options: VerifiersRun) -> Any:
    """The environment, with the plain chat harness on this machine (not a coding agent in a sandbox)."""
    import verifiers.v1 as vf

    config = vf.resolve_env_config(
        {
            "taskset": {"id": options.env_id, **options.taskset},
            "agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}, "max_turns": options.max_turns},
        }
    )
    return vf.load_environment(config)


async def external_run(client: RolloutClient, options: VerifiersRun) -> str:
    spec = pb.RunSpec(group_size=options.group_size)
    spec.prompt_source.external.SetInParent()
    spec.sampling.max_tokens = options.max_tokens
    spec.reward_functions.add(name="env_reward")  # unused: each episode closes with the rubric's reward
    return (await client.create_run(spec)).run_id


def tasks_forever(env: Any) -> Iterator[Any]:
    """The taskset's tasks in order, over and over."""
    while True:
        empty = True
        for task in env.taskset:
            empty = False
            yield task
        if empty:
            raise ValueError("the environment's taskset has no tasks")


class RunGone(Exception):
    """The run was deleted (or is not the caller's): nothing more to generate for it."""


async def run_verifiers(options: VerifiersRun) -> RunnerReport:
    """Groups of the environment's rollouts into the run (made if not given) until ``options.groups``
    are done, or the run is deleted."""
    import verifiers.v1 as vf

    env = load_environment(options)
    security = ClientSecurity.from_env()
    async with RolloutClient(options.target, security=security) as client:
        run_id = options.run_id or await external_run(client, options)
    logger.info("running %s's rollouts into run %s", options.env_id, run_id)
    base = f"{options.openai_url.rstrip('/')}/v1/runs/{run_id}"
    report = RunnerReport(run_id)
    headers = {"Authorization": f"Bearer {security.token}"} if security.token else {}

    def context(episode_id: str, task_id: str) -> Any:
        client = vf.EvalClientConfig(base_url=base, api_key_var=TOKEN_VARIABLE)
        sampling = vf.SamplingConfig(
            temperature=options.temperature, max_tokens=options.max_tokens, episode_id=episode_id, task_id=task_id
        )  # extra fields travel in the request body: the endpoint's episode and task
        return vf.ModelContext(model="policy", client=client, sampling=sampling)

    async def group(http: aiohttp.ClientSession, number: int, task: Any) -> None:
        task_id = f"{run_id}-g{number}"
        slots = list(env.slots(task, options.group_size))
        ids = [f"{task_id}-e{k}" for k in range(len(slots))]
        plays = [env.run_slot(slot, context(episode, task_id)) for slot, episode in zip(slots, ids, strict=True)]
        for episode_id, episode in zip(ids, await asyncio.gather(*plays), strict=True):
            reward = episode.traces[0].reward if episode.ok and episode.traces else None
            if reward is None:
                report.failed += 1
                errors = [*episode.errors, *(error for trace in episode.traces for error in trace.errors)]
                logger.warning("episode %s failed, closed with reward 0: %s", episode_id, [e.message for e in errors])
            reward = 0.0 if reward is None else float(reward)
            await close(http, f"{base}/episodes/{episode_id}/close", reward)
            report.rewards.append(reward)
        report.groups += 1

    in_flight = asyncio.Semaphore(options.groups_in_flight)

    async def bounded(http: aiohttp.ClientSession, number: int, task: Any) -> None:
        try:
            await group(http, number, task)
        finally:
            in_flight.release()

    numbers = range(options.groups) if options.groups else itertools.count()
    try:
        session = aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=60))
        async with session as http, env.serving(), asyncio.TaskGroup() as running:
            for number, task in zip(numbers, tasks_forever(env), strict=False):  # the tasks never end
                await in_flight.acquire()
                running.create_task(bounded(http, number, task))
    except* RunGone:
        logger.info("run %s is gone; %d groups were generated", run_id, report.groups)
    return report


async def close(http: aiohttp.ClientSession, url: str, reward: float) -> None:
    async with http.post(url, json={"reward": reward}) as response:
        if response.status == 404:
            raise RunGone(await response.text())
        if response.status != 200:
            raise RuntimeError(f"closing an episode: {url} answered HTTP {response.status}: {await response.text()}")
