"""The trainer CLI refuses bad options with one line that says what to change."""

import inspect
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trainer_client.cli import app, main
from trainer_client.train import RunOptions, buffered_groups, cpu_training_config
from trainer_client.trainer import AsyncGRPOConfig


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--vllm-is-mode", "sequence"], "choose one of token_truncate, token_mask, sequence_truncate, sequence_mask"),
        (["--vllm-is-cap", "0.5"], "it must be > 1"),
        (["--eval-every", "2", "--no-push"], "drop --eval-every with --no-push or --lora-serving adapter"),
        (
            ["--eval-every", "2", "--lora-rank", "4", "--lora-serving", "adapter"],
            "evaluations pin the base weights this trainer pushes",
        ),
    ],
)
def test_options_that_cannot_work_together_are_refused_before_anything_starts(
    tmp_path: Path, flags: list[str], message: str
) -> None:
    (tmp_path / "config.json").write_text("{}")
    result = CliRunner().invoke(app, ["--model", str(tmp_path), "--output-dir", str(tmp_path / "out"), *flags])
    assert result.exit_code == 2
    text = " ".join(re.sub("[│╭╮╰╯─]", " ", result.output).split())  # rich wraps it in a box
    assert message in text


def test_the_cli_the_demo_and_the_config_class_default_to_the_same_staleness(tmp_path: Path) -> None:
    """The CLI keeps its own literal (importing the trainer would slow ``--help``), so a
    change of the default must reach all three places."""
    cli_default = inspect.signature(main).parameters["max_staleness"].default
    assert cli_default == cpu_training_config(tmp_path, 1).max_staleness == AsyncGRPOConfig.max_staleness == 2


@pytest.mark.parametrize(
    ("requested", "max_staleness", "groups_per_step", "buffer"),
    [(0, 2, 8, 16), (0, 2, 4, 8), (0, 3, 4, 12), (0, 0, 4, 4), (0, 1, 8, 8), (5, 2, 8, 5)],
)
def test_the_run_buffer_holds_what_staleness_lets_start(
    requested: int, max_staleness: int, groups_per_step: int, buffer: int
) -> None:
    """Staleness admission starts up to max_staleness steps' worth of groups ahead of the step
    being trained; the default buffer holds them all (a fixed 8 held one step's at 8 a step)."""
    assert buffered_groups(requested, max_staleness, groups_per_step) == buffer


def test_the_cli_and_run_options_leave_the_buffer_to_staleness() -> None:
    assert inspect.signature(main).parameters["max_buffered_groups"].default == 0 == RunOptions.max_buffered_groups


def test_none_turns_the_correction_off(tmp_path: Path) -> None:
    config = cpu_training_config(tmp_path, 1, vllm_is_mode="none")
    assert not config.vllm_importance_sampling_correction
    config = cpu_training_config(tmp_path, 1, vllm_is_mode="token_truncate", vllm_is_cap=2.0)
    assert config.vllm_importance_sampling_correction
    assert (config.vllm_importance_sampling_mode, config.vllm_importance_sampling_cap) == ("token_truncate", 2.0)


def test_a_bad_prompts_file_is_refused_with_its_line(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tasks.jsonl").write_text('{"question": "2+3?"}\n')
    flags = ["--prompts-file", str(tmp_path / "tasks.jsonl")]
    result = CliRunner().invoke(app, ["--model", str(tmp_path), "--output-dir", str(tmp_path / "out"), *flags])
    assert result.exit_code == 2
    text = " ".join(re.sub("[│╭╮╰╯─]", " ", result.output).split())
    assert "tasks.jsonl:1 has no 'prompt' column" in text
