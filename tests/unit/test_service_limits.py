"""Limits on what sizes the service's memory: runs, consumers per run."""

from __future__ import annotations

import pytest

from rollout_service.errors import ResourceExhausted
from rollout_service.prompts import PromptSpec
from rollout_service.runs import RunSpec
from rollout_service.server import ConsumerSession
from rollout_service.types import SamplingParams
from tests.unit.scripted import ScriptedEngine, make_service


def spec() -> RunSpec:
    return RunSpec(
        source_kind="prompts",
        prompts=(PromptSpec(token_ids=[1]),),
        sampling=SamplingParams(max_tokens=2),
        group_size=2,
        rewards=(("completion_length", 1.0),),
    )


async def test_runs_beyond_the_limit_are_refused_until_one_is_deleted() -> None:
    service = make_service(ScriptedEngine(), max_runs=2)
    runs = [await service.create_run(spec()) for _ in range(2)]
    with pytest.raises(ResourceExhausted, match="holds 2 runs, its limit"):
        await service.create_run(spec())
    await service.delete_run(runs[0].run_id)
    runs.append(await service.create_run(spec()))
    for run in runs[1:]:
        await service.delete_run(run.run_id)


async def test_consumers_beyond_the_limit_are_refused() -> None:
    service = make_service(ScriptedEngine(), max_consumers_per_run=1)
    run = await service.create_run(spec())
    ConsumerSession(service, run.run_id, "first", 1).check_limits()
    run.broker.subscribe("first", 1)
    with pytest.raises(ResourceExhausted, match="has 1 consumers, the limit"):
        ConsumerSession(service, run.run_id, "second", 1).check_limits()
    await service.delete_run(run.run_id)
