"""``rollout-service serve`` refuses a user module it cannot load with one line, before it
starts or reaches any vLLM server."""

from __future__ import annotations

import socket
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


def serve(*flags: str) -> str:
    """``rollout-service serve`` with ``flags``, which must fail at once: its one-line error."""
    result = CliRunner().invoke(app, ["serve", *flags])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    return " ".join(result.output.split())


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"engine: [1, 2\n", "is not YAML: while parsing a flow sequence"),
        (b"- port\n- 1\n", "must be a mapping of settings (key: value), not a list"),
        (b"\x80\xff\x00\x01", "is not a text file; give a YAML file of settings"),
    ],
)
def test_a_config_file_that_is_not_a_mapping_of_settings_says_what_it_is(
    tmp_path: Path, content: bytes, message: str
) -> None:
    (tmp_path / "settings.yaml").write_bytes(content)
    assert message in serve("--config", str(tmp_path / "settings.yaml"))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--port", "70000"], "port: Input should be less than or equal to 65535"),
        (["--metrics-port", "-1"], "metrics_port: Input should be greater than or equal to 0"),
        (["--vllm-url", "localhost:8000"], "--vllm-url: 'localhost:8000' is not a server's base URL; write http://"),
    ],
)
def test_a_port_out_of_range_or_a_url_without_its_scheme_is_refused(flags: list[str], message: str) -> None:
    assert message in serve(*flags)


def test_a_taken_port_is_refused_before_anything_starts() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        message = serve("--vllm-url", "http://127.0.0.1:9", "--port", str(port), "--metrics-port", "0")
    assert f"port {port} cannot be bound on 127.0.0.1 (Address already in use); pick another port" in message


def test_a_state_store_that_cannot_be_opened_says_what_to_give(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("not a database, and not a folder")
    flags = ("--vllm-url", "http://127.0.0.1:9", "--port", "0", "--metrics-port", "0")
    for store in (tmp_path / "afile" / "state.db", tmp_path / "afile"):
        message = serve(*flags, "--state-store", str(store))
        assert f"state_store {store} cannot be opened" in message and "in a writable folder, or memory" in message


def test_a_tokenizer_that_cannot_be_loaded_says_which_setting_to_change(tmp_path: Path) -> None:
    missing = tmp_path / "no-tokenizer"
    (tmp_path / "settings.yaml").write_text(
        f"engine: {{urls: ['http://127.0.0.1:9'], model: tiny, tokenizer: '{missing}'}}\nport: 0\nmetrics_port: 0\n"
    )
    message = serve("--config", str(tmp_path / "settings.yaml"))
    assert f"cannot load the tokenizer of {missing}" in message and "set engine.tokenizer to a folder" in message
