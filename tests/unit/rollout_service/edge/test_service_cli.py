"""``rollout-service serve`` refuses a user module it cannot load with one line, before it
starts or reaches any vLLM server."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from rollout_service.edge.cli import app


@pytest.mark.parametrize(
    ("module_text", "message"),
    [
        (None, "cannot load user module 'my_rewards_xyz': No module named 'my_rewards_xyz'"),
        ("X = 1\n", "cannot load user module 'my_rewards_xyz': module my_rewards_xyz has no REWARD_FUNCTIONS dict"),
    ],
)
def test_a_reward_module_that_cannot_load_is_refused_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module_text: str | None, message: str
) -> None:
    if module_text is not None:
        (tmp_path / "my_rewards_xyz.py").write_text(module_text)
    monkeypatch.chdir(tmp_path)  # user modules are found in the working directory
    flags = ["--vllm-url", "http://127.0.0.1:9", "--port", "0", "--metrics-port", "0"]
    result = CliRunner().invoke(app, ["serve", *flags, "--reward-module", "my_rewards_xyz"])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert "Traceback" not in result.output
