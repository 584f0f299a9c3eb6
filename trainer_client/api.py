"""``AsyncGRPOTrainer``: TRL's ``GRPOTrainer`` API, trained asynchronously on a rollout service.

    from trainer_client import AsyncGRPOConfig, AsyncGRPOTrainer

    trainer = AsyncGRPOTrainer(
        model="Qwen/Qwen2.5-0.5B-Instruct",
        reward_funcs=["my_rewards:accuracy"],
        args=AsyncGRPOConfig(max_steps=200),
        train_dataset=dataset,  # rows with a "prompt" column, text or chat, as TRL's
    )
    trainer.train()

Without a service address (``RunOptions.target``) it starts one on this machine for the run.
A reward is a name the service knows, ``module:function``, or a top-level function of an
importable module (the service imports it by that name).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from trainer_client.grpo_config import AsyncGRPOConfig
from trainer_client.options import ModelOptions, RunOptions
from trainer_client.stream.prompts_file import PromptRows

RewardFunc = str | Callable[..., Any]


def reward_name(reward: RewardFunc) -> str:
    """A name as given, a function as the ``module:function`` the service imports."""
    if isinstance(reward, str):
        return reward
    module, name = getattr(reward, "__module__", None), getattr(reward, "__qualname__", "")
    if module in (None, "__main__") or not name.isidentifier():
        raise ValueError(
            f"reward function {name or reward!r} must be defined at the top level of an importable module "
            "(not __main__, not nested), so the service can import it; or give its name"
        )
    return f"{module}:{name}"


class AsyncGRPOTrainer:
    """TRL ``GRPOTrainer``'s constructor and ``train()``; the service's vLLM servers generate."""

    def __init__(
        self,
        model: str | None = None,
        reward_funcs: RewardFunc | Sequence[RewardFunc] | None = None,
        args: AsyncGRPOConfig | None = None,
        train_dataset: Iterable[Mapping[str, Any]] | None = None,
        *,
        run: RunOptions | None = None,
        model_options: ModelOptions | None = None,
    ) -> None:
        """``model``: a Hub id or folder (default: the served model); ``train_dataset``: rows with
        ``run.prompt_column`` (default ``prompt``), the other columns passed to the rewards;
        ``run``: the service, the run and its generation (``RunOptions``)."""
        self.args = args if args is not None else AsyncGRPOConfig()
        self.run = copy.copy(run) if run is not None else RunOptions()
        if reward_funcs is not None:
            rewards = [reward_funcs] if isinstance(reward_funcs, str) or callable(reward_funcs) else reward_funcs
            self.run.reward_funcs = [reward_name(reward) for reward in rewards]  # type: ignore[arg-type]
        if train_dataset is not None:
            self.run.prompt_rows = PromptRows.from_rows(train_dataset, self.run.prompt_column)
        self.model_options = copy.copy(model_options) if model_options is not None else ModelOptions()
        if model is not None:
            self.model_options.model_name_or_path = model
        self.summary: dict[str, Any] | None = None
        """What ``train`` returned: the run's id, steps, rewards, groups and time split."""

    def train(self) -> dict[str, Any]:
        """Train ``args.max_steps`` steps; the summary (also in ``args.output_dir``)."""
        from trainer_client.train.run import train

        self.summary = train(self.args, self.run, self.model_options)
        return self.summary
