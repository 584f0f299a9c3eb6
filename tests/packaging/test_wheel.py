"""The trainer-only install: build the wheel, install ``[trainer]`` into a fresh venv, and
run the trainer there with vLLM and the service's packages absent."""

from __future__ import annotations

import os
import venv
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest

from tests.support import built_wheel
from tests.support import run_checked as run

SERVICE_ONLY = ("vllm", "aiohttp", "msgspec", "uvloop", "prometheus_client", "pydantic_settings", "grpc_reflection")


@pytest.fixture(scope="module")
def wheel() -> Path:
    return built_wheel()


def test_the_wheel_carries_the_generated_stubs(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for stub in ("rollout_pb2.py", "rollout_pb2_grpc.py", "rollout_pb2.pyi"):
        assert f"rollout_api/{stub}" in names
    assert "trainer_client/cli.py" in names and "rollout_service/edge/cli.py" in names


def test_the_trainer_extra_installs_and_runs_without_vllm_or_the_service(wheel: Path, tmp_path: Path) -> None:
    fresh = tmp_path / "venv"
    venv.create(fresh, with_pip=True)
    python = fresh / "bin" / "python"
    # The dev venv's torch (the CPU build here): left free, pip may pick a newer CUDA build.
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(f"torch=={version('torch')}\n")
    run([str(python), "-m", "pip", "install", "--quiet", "-c", str(constraints), f"{wheel}[trainer]"], 600)
    probe = (
        "import importlib.util as u, sys\n"
        f"present = [m for m in {SERVICE_ONLY!r} if u.find_spec(m)]\n"
        "assert not present, f'installed with the trainer: {present}'\n"
        "import trainer_client.train.run, trainer_client.cli, rollout_api.rollout_pb2_grpc, datasets\n"
        "print(trainer_client.train.run.__file__)\n"
    )
    location = run([str(python), "-c", probe], 120, cwd=tmp_path)
    assert location.startswith(str(fresh))  # the installed copy, not the checkout
    help_text = run(
        [str(fresh / "bin" / "rollout-trainer"), "--help"], 120, cwd=tmp_path, env={**os.environ, "COLUMNS": "200"}
    )
    assert "--resume-from-checkpoint" in help_text
