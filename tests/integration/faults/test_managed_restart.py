"""The service's own vLLM server is SIGKILLed mid-run: it is restarted, brought back to the
run's policy before it takes a request (a resend of the trainer's current version, which
keeps the version), and the trainer finishes with no group lost or trained twice.

The server killed is the session's shared one (a second vLLM would double the suite's
start-up): the test's service supervises it, and the restart leaves it on the same port
for the tests after this one, on base weights again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from pathlib import Path

import pytest

from rollout_api.client import RolloutClient
from rollout_service.app import running_service
from rollout_service.engine.managed import ManagedVLLMServer
from tests.integration.conftest import restore_base_weights, service_settings
from tests.integration.test_shared_capacity import (
    _trained_steps,
    groups_per_step,
    kill_if_running,
    start,
    trainer_command,
)
from tests.support import wait_until

pytestmark = pytest.mark.integration

STEPS, GROUPS_PER_STEP = 8, 2


@pytest.mark.timeout(600)
async def test_a_killed_managed_server_is_restarted_and_the_trainer_finishes(
    vllm_server, tiny_model: Path, tmp_path: Path
) -> None:
    if not isinstance(vllm_server, ManagedVLLMServer):
        pytest.skip("the session's vLLM server is external (ROLLOUT_TEST_VLLM_URL): nothing to restart")
    settings = service_settings([vllm_server.url], tiny_model, scheduler={"max_inflight": 8})
    async with (
        running_service(settings, managed=vllm_server) as running,
        RolloutClient(running.grpc_target, timeout_s=30) as client,
    ):
        out = tmp_path / "trainer"
        options = (*groups_per_step(GROUPS_PER_STEP), "--max-steps", str(STEPS), "--max-staleness", "1")
        trainer = await start(trainer_command(running.grpc_target, tiny_model, out, *options), tmp_path / "t.log")
        try:
            await wait_until(lambda: _trained_steps(out, 2), 180, "the trainer's first steps")
            (run_id,) = running.service.runs
            version_at_kill = (await client.get_run(run_id)).policy_version
            old_group, api_server = vllm_server.pid, vllm_server.api_server_pid
            assert old_group is not None and api_server is not None
            os.kill(api_server, signal.SIGKILL)  # the API server only: its guard ends the rest of the group
            await asyncio.wait_for(trainer.wait(), 400)  # restart (about a minute), then the steps left
        finally:
            kill_if_running(trainer)
        try:
            log = (tmp_path / "t.log").read_text()
            assert trainer.returncode == 0, log[-3000:]

            assert vllm_server.pid not in (None, old_group)
            assert not _alive_in_group(old_group), "the killed server's engine or worker outlived it"
            run = running.service.runs.require(run_id)
            assert run.admission.weights_requests >= 1  # the trainer was asked for its weights ...
            assert "pushing the weights now, as the service asks" in log  # ... and pushed them
            assert not running.service.scheduler.engine.held  # the restarted server takes requests again
            info = await client.get_run(run_id)
            assert info.policy_version > version_at_kill
            service_stats = await client.stats()
            # The version counts new weights only: the restarted server's push, when the
            # trainer's weights had not moved since vLLM's last commit, was a resend of that
            # version. It had moved only if the push in flight at the kill failed.
            assert info.policy_version == service_stats.weight_updates_committed
            words = " ".join(log.split())  # rich wraps the trainer's log lines
            resends = words.count("(a resend of the version vLLM serves)")
            assert service_stats.weight_updates_resent == resends
            if "weight push failed" not in words:
                assert resends >= 1
            trained = json.loads((out / "rank0.json").read_text())["trained_group_ids"]
            stats = info.stats
            assert len(trained) == len(set(trained))  # none twice
            # Every step trained its groups, less any that the push for the restarted server made
            # stale: it is answered at once, even between fetching a step's groups and training them.
            assert STEPS * GROUPS_PER_STEP - stats.groups_dropped_stale <= len(trained) <= STEPS * GROUPS_PER_STEP
            assert stats.groups_trained == len(trained)
            assert stats.groups_leased == 0
            assert stats.groups_scored == stats.groups_trained + stats.groups_dropped_stale + stats.groups_buffered
        finally:  # pass or fail, the tests after this one sample from the base weights
            await restore_base_weights(client, run_id, tiny_model)


def _alive_in_group(pgid: int) -> bool:
    """Whether a live (not zombie) process is still in the process group ``pgid``."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{pid}/stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                return True
    return False
