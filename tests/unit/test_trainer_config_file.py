"""``rollout-trainer --config``: a TRL GRPO YAML reaches the trainer with the fewest edits,
the command line wins over the file, and a bad key or value is one line that says what to change."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from rollout_api import rollout_pb2 as pb
from trainer_client import train as train_module
from trainer_client.cli import app

TRL_YAML = """
model_name_or_path: {model}
num_generations: 4
max_completion_length: 16
per_device_train_batch_size: 16
learning_rate: 1.0e-4
loss_type: grpo
beta: 0.01
epsilon_high: 0.28
importance_sampling_level: sequence
temperature: 0.9
top_p: 0.95
seed: 7
warmup_steps: 2
lr_scheduler_type: cosine
reward_funcs: [char_fraction, completion_length]
reward_weights: [1.0, 0.5]
scale_rewards: false
max_steps: 3
use_vllm: true
vllm_mode: server
"""


def flat(output: str) -> str:
    return " ".join(re.sub("[│╭╮╰╯─]", " ", output).split())  # rich wraps errors in a box


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    return tmp_path / "model"


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What the CLI would train with (the training itself is the integration tests' job)."""
    calls: dict[str, Any] = {}

    def fake_train(target: str, model_path: str, config: Any, options: Any, **kwargs: Any) -> dict[str, Any]:
        calls.update(target=target, model=model_path, config=config, options=options, **kwargs)
        return {"time_split": {"fraction": {}, "steps": 0}}

    monkeypatch.setattr(train_module, "train", fake_train)
    monkeypatch.setattr("trainer_client.step_timing.format_split", lambda split: "")
    return calls


def test_a_trl_yaml_configures_the_run_and_the_loss(tmp_path, model_dir, captured, caplog) -> None:
    (tmp_path / "trl.yaml").write_text(TRL_YAML.format(model=model_dir))
    with caplog.at_level(logging.WARNING):
        result = CliRunner().invoke(app, ["--config", str(tmp_path / "trl.yaml"), "--output-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"time_split": {"fraction": {}, "steps": 0}}  # stdout: the summary alone
    config, options = captured["config"], captured["options"]
    assert captured["model"] == str(model_dir)
    assert (config.group_size, config.per_device_train_batch_size, config.max_steps) == (4, 16, 3)
    assert (config.learning_rate, config.loss_type, config.beta) == (1e-4, "grpo", 0.01)
    assert (config.epsilon_high, config.importance_sampling_level, config.temperature) == (0.28, "sequence", 0.9)
    assert (config.seed, config.warmup_steps, config.lr_scheduler_type) == (7, 2, "cosine")
    assert config.max_completion_length == options.max_tokens == 16
    assert options.rewards == {"char_fraction": 1.0, "completion_length": 0.5}
    assert (options.top_p, options.scale_rewards) == (0.95, "none")
    assert train_module.SCALE_REWARDS[options.scale_rewards] == pb.ADVANTAGE_SCALING_NONE
    ignored = " ".join(r.getMessage() for r in caplog.records)
    assert "ignoring use_vllm (the rollout service generates" in ignored
    assert "ignoring vllm_mode" in ignored


def test_flags_win_over_the_file_in_either_spelling(tmp_path, model_dir, captured) -> None:
    (tmp_path / "trl.yaml").write_text(TRL_YAML.format(model=model_dir))
    flags = ["--max-tokens", "8", "--num-generations", "2", "--learning-rate", "0.5"]
    result = CliRunner().invoke(app, ["--config", str(tmp_path / "trl.yaml"), "--output-dir", str(tmp_path), *flags])
    assert result.exit_code == 0, result.output
    config, options = captured["config"], captured["options"]
    assert (options.max_tokens, config.group_size, config.learning_rate) == (8, 2, 0.5)
    assert config.per_device_train_batch_size == 16  # the file's, now 8 groups of 2


def test_trls_accumulation_makes_a_step_of_its_micro_batches(tmp_path, model_dir, captured) -> None:
    """As in TRL, a step is ``per_device_train_batch_size`` x ``gradient_accumulation_steps``
    completions: here 4 micro-batches of 4 groups of 4."""
    (tmp_path / "trl.yaml").write_text(TRL_YAML.format(model=model_dir) + "gradient_accumulation_steps: 4\n")
    result = CliRunner().invoke(app, ["--config", str(tmp_path / "trl.yaml"), "--output-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    config = captured["config"]
    assert (config.per_device_train_batch_size, config.gradient_accumulation_steps) == (16, 4)
    assert config.groups_per_step == 16


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("num_generation: 4\n", "unknown setting 'num_generation'; did you mean 'num_generations'?"),
        ("num_generations: many\n", "group_size: Input should be a valid integer"),
        ("num_generations: 4\nper_device_train_batch_size: 6\n", "must be a positive multiple of the group size 4"),
        ("gradient_accumulation_steps: 3\n", "--gradient-accumulation-steps 3 must divide --groups-per-step 8"),
        ("reward_funcs: [a, b]\nreward_weights: [1.0]\n", "reward_weights must be a list with one number per"),
        ("- a\n- b\n", "must be a mapping of settings (key: value), not list"),
        ("num_generations: [\n", "is not YAML"),
    ],
)
def test_a_bad_file_is_refused_with_what_to_change(tmp_path, model_dir, captured, text: str, message: str) -> None:
    (tmp_path / "bad.yaml").write_text(text)
    args = ["--config", str(tmp_path / "bad.yaml"), "--model", str(model_dir), "--output-dir", str(tmp_path)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert message in flat(result.output)
    assert "Traceback" not in result.output
    assert not captured


@pytest.mark.parametrize(
    ("flags", "yaml", "expected"),
    [
        (["--no-bf16"], None, False),
        (["--bf16"], None, True),
        ([], "bf16: false\n", False),
        (["--bf16"], "bf16: false\n", True),  # the command line wins over the file
    ],
)
def test_the_cli_and_a_trl_yaml_choose_the_precision(
    monkeypatch, tmp_path, model_dir, captured, flags: list[str], yaml: str | None, expected: bool
) -> None:
    # the CPU's default would be the other precision
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: not expected)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    args = ["--model", str(model_dir), "--output-dir", str(tmp_path / "out"), *flags]
    if yaml is not None:
        (tmp_path / "trainer.yaml").write_text(yaml)
        args += ["--config", str(tmp_path / "trainer.yaml")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert captured["config"].bf16 is expected
