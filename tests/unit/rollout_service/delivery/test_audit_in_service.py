"""The bias audit through the scheduler and the broker (scripted engine): a run whose long
prompts are also its slow ones, under max_staleness 1 with a trainer that trains the first four
groups to arrive per version, has them cut in flight and is flagged; the same prompts at random
speeds are cut at random and are not."""

from __future__ import annotations

import asyncio
import logging
import random

import pytest

from rollout_service.delivery.audit import COVERAGE
from rollout_service.delivery.broker import ACK_TRAINED
from rollout_service.types import Completion, SamplingParams
from tests.unit.rollout_service.builders import spec
from tests.unit.scripted import ScriptedEngine, make_service

pytestmark = pytest.mark.timeout(120)
LONG = 50
"""Prompts holding this token (one in four) get 16-token completions; the others 4."""
PROMPTS = [[LONG, i] if i % 4 == 0 else [i] for i in range(1, 21)]


class LengthEngine(ScriptedEngine):
    """Long prompts' completions are long, and with ``slow_long`` take longer to generate."""

    def __init__(self, slow_long: bool) -> None:
        super().__init__()
        self.slow_long = slow_long
        self.random = random.Random(0)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *, affinity: str | None = None):
        long = LONG in prompt_ids
        # the generation's time, not a wait: long prompts 50 ms, or every prompt alike (a few at random)
        seconds = (0.05 if long else 0.001) if self.slow_long else self.random.expovariate(200)
        await asyncio.sleep(seconds)
        n = 16 if long else 4
        return Completion([7] * n, [-0.5] * n, "length", "scripted")


async def train(service, run, steps: int, per_step: int = 4) -> None:
    """A trainer that trains the first ``per_step`` groups to arrive, then moves a version."""
    run.broker.subscribe("trainer", credits=per_step)
    for version in range(steps):
        for _ in range(per_step):
            group = await asyncio.wait_for(run.broker.take("trainer"), 10)
            assert group is not None
            run.broker.ack("trainer", [group.group_id], ACK_TRAINED, trained_at=version)
        service.versions.set_trainer(version + 1)
        service.set_policy_version(version + 1)


@pytest.mark.parametrize("slow_long", [True, False], ids=["long-prompts-slow", "random-speeds"])
async def test_drops_that_fall_on_slow_long_prompts_are_flagged(slow_long: bool, caplog) -> None:
    engine = LengthEngine(slow_long)
    service = make_service(engine, max_inflight=8)
    run = await service.create_run(spec(PROMPTS, group_size=2, max_staleness=1, admission="staleness"))
    try:
        with caplog.at_level(logging.WARNING):
            await train(service, run, 150)
        report = run.audit.report()
    finally:
        await service.delete_run(run.run_id)
    lengths = {d.feature: d for d in report.features}["completion_length"]
    cut = run.ledger.snapshot([], []).settled["aborted"].groups
    assert cut > 0  # both runs drop groups in flight
    if slow_long:
        assert COVERAGE in report.flagged or "completion_length" in report.flagged, report
        assert report.prompt_coverage < 0.8 or lengths.smd < -0.25, report
        assert f"run {run.run_id}: " in caplog.text and "drops are biased" in caplog.text
    else:
        assert report.flagged == () and abs(lengths.smd) < 0.25 and report.prompt_coverage > 0.9, report
        assert "drops are biased" not in caplog.text
