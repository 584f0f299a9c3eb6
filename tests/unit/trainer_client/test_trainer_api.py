"""``AsyncGRPOTrainer``'s TRL-shaped constructor: what it hands ``train``, and the rewards
the service will import (the training itself: ``tests/integration/test_doc_commands.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

import trainer_client
from trainer_client.api import AsyncGRPOTrainer, reward_name
from trainer_client.grpo_config import AsyncGRPOConfig
from trainer_client.local_service import service_command
from trainer_client.options import RunOptions
from trainer_client.stream.prompts_file import PromptRows


def top_level_reward(prompts, completions, **kwargs):  # type: ignore[no-untyped-def]
    return [1.0 for _ in completions]


def test_the_package_exports_the_trl_shaped_api() -> None:
    assert trainer_client.AsyncGRPOTrainer is AsyncGRPOTrainer
    assert trainer_client.AsyncGRPOConfig is AsyncGRPOConfig
    with pytest.raises(AttributeError):
        trainer_client.NoSuchThing  # noqa: B018


def test_the_constructor_fills_the_run_and_the_model(tmp_path: Path) -> None:
    args = AsyncGRPOConfig(output_dir=str(tmp_path), max_steps=2)
    trainer = AsyncGRPOTrainer(
        model="Qwen/Qwen2.5-0.5B-Instruct",
        reward_funcs=["char_fraction", top_level_reward],
        args=args,
        train_dataset=[{"prompt": "Say a.", "letter": "a"}],
        run=RunOptions(target="host:1"),
    )
    assert trainer.args is args and trainer.model_options.model_name_or_path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert trainer.run.target == "host:1"
    assert trainer.run.reward_funcs == ["char_fraction", "tests.unit.trainer_client.test_trainer_api:top_level_reward"]
    assert isinstance(trainer.run.prompt_rows, PromptRows) and trainer.run.prompt_rows.count == 1


def test_a_reward_the_service_cannot_import_is_refused_with_what_to_do() -> None:
    def nested(prompts, completions, **kwargs):  # type: ignore[no-untyped-def]
        return [0.0 for _ in completions]

    with pytest.raises(ValueError, match="must be defined at the top level of an importable module"):
        reward_name(nested)
    with pytest.raises(ValueError, match="must be defined at the top level"):
        reward_name(lambda prompts, completions, **kwargs: [])


def test_the_local_service_serves_the_model_and_imports_module_function_rewards(tmp_path: Path) -> None:
    command = service_command(4242, "Qwen/Qwen2.5-0.5B-Instruct", ["char_fraction", "my_rewards:fn"], None)
    assert command[1:4] == ["-m", "rollout_service.edge.cli", "serve"]
    assert command[command.index("--port") + 1] == "4242"
    assert command[command.index("--model") + 1] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert command.count("--reward-module") == 1 and command[command.index("--reward-module") + 1] == "my_rewards:fn"
