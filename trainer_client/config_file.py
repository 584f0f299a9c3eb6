"""``rollout-trainer --config trainer.yaml``: the trainer's options from a file, in TRL's names.

A TRL user's GRPO YAML should work with the fewest edits, so a key may be:
- a ``rollout-trainer`` option (``group_size``, ``max_tokens``, ``dataset``, ...);
- TRL's name for one (``num_generations``, ``max_completion_length``,
  ``per_device_train_batch_size`` in completions as TRL counts it, ``reward_funcs`` with
  ``reward_weights``, ``vllm_importance_sampling_mode``, ``model_name_or_path``, ...);
- any other field of the training arguments (``AsyncGRPOConfig``: transformers'
  ``TrainingArguments`` plus the loss knobs, e.g. ``seed``, ``epsilon``, ``epsilon_high``,
  ``importance_sampling_level``, ``temperature``, ``warmup_steps``, ``save_steps``,
  ``report_to``), passed through as it is;
- a TRL setting that has no meaning here (the service generates, so ``use_vllm``,
  ``vllm_mode``, ``generation_batch_size``, ...): skipped with a warning that says why.

Anything else is an error that names the closest known key. Options given on the command
line win over the file.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trainer_client.trainer import AsyncGRPOConfig

logger = logging.getLogger(__name__)

TRL_OPTION_NAMES = {
    "num_generations": "group_size",
    "max_completion_length": "max_tokens",
    "model_name_or_path": "model",
    "vllm_importance_sampling_mode": "vllm_is_mode",
    "vllm_importance_sampling_cap": "vllm_is_cap",
    "lora_r": "lora_rank",
    "prompts": "prompts_file",
}
"""TRL's (and TRL scripts') names of options this trainer has under its own name."""

OPTIONS_SET_FROM_THE_COMMAND = {
    "output_dir",
    "bf16",
    "max_steps",
    "learning_rate",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "group_size",
    "max_staleness",
    "weight_sync_steps",
    "loss_type",
    "beta",
    "background_push",
    "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode",
    "vllm_importance_sampling_cap",
    "max_completion_length",
}
"""Training-argument fields that ``cpu_training_config`` sets from options, so the file
reaches them through the options (or their TRL names), not as pass-through fields."""

_GENERATION = "the rollout service generates; configure its vLLM servers instead"
_NOT_HERE = "not supported by rollout-trainer"
IGNORED_TRL_SETTINGS: dict[str, str] = {
    **dict.fromkeys(
        [
            "use_vllm",
            "vllm_mode",
            "vllm_server_base_url",
            "vllm_server_host",
            "vllm_server_port",
            "vllm_server_timeout",
            "vllm_group_port",
            "vllm_gpu_memory_utilization",
            "vllm_tensor_parallel_size",
            "vllm_max_model_length",
            "vllm_model_impl",
            "vllm_enable_sleep_mode",
            "vllm_structured_outputs_regex",
            "generation_batch_size",
            "steps_per_generation",
            "generation_kwargs",
            "cache_implementation",
            "use_transformers_paged",
            "use_transformers_continuous_batching",
            "transformers_continuous_batching_config",
            "ds3_gather_for_generation",
            "chat_template_kwargs",
            "max_tool_calling_iterations",
            "num_generations_eval",
        ],
        _GENERATION,
    ),
    "num_iterations": "each group trains once here (one optimizer step per batch of groups)",
    "shuffle_dataset": "the service draws the prompts",
    "dataset_name": "give --prompts-file (JSONL) or --dataset (built-in) instead",
    "use_peft": "give lora_rank (> 0) to train a LoRA adapter",
    **dict.fromkeys(
        [
            "min_p",
            "repetition_penalty",
            "mask_truncated_completions",
            "disable_dropout",
            "sync_ref_model",
            "ref_model_mixup_alpha",
            "ref_model_sync_steps",
            "top_entropy_quantile",
            "entropy_coef",
            "use_bias_correction_kl",
            "cast_lm_head_to_fp32",
            "log_completions",
            "num_completions_to_print",
            "multi_objective_aggregation",
            "model_init_kwargs",
            "trust_remote_code",
        ],
        _NOT_HERE,
    ),
}
"""TRL settings a TRL YAML may carry that have no effect here, and why."""


class ConfigFileError(ValueError):
    """The file cannot be used; the message names the key and what to change."""


@dataclass
class TrainerConfigFile:
    """A config file split by where each value goes."""

    options: dict[str, Any] = field(default_factory=dict)
    """``rollout-trainer`` options by their parameter name (``group_size``, ``reward``, ...)."""
    training_arguments: dict[str, Any] = field(default_factory=dict)
    """Other ``AsyncGRPOConfig`` fields, passed through."""
    ignored: dict[str, str] = field(default_factory=dict)
    """TRL settings skipped, with the reason."""


def training_argument_names() -> set[str]:
    return {f.name for f in dataclasses.fields(AsyncGRPOConfig) if f.init}


def read_config_file(path: Path, option_names: Iterable[str]) -> TrainerConfigFile:
    """Split ``path`` (YAML or JSON) into options, pass-through training arguments and
    ignored TRL settings. ``option_names``: the CLI's parameter names."""
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigFileError(f"cannot read {path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigFileError(f"{path} is not YAML: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"{path} must be a mapping of settings (key: value), not {type(data).__name__}")
    return split_settings(data, set(option_names), where=str(path))


def split_settings(data: dict[str, Any], option_names: set[str], where: str) -> TrainerConfigFile:
    result = TrainerConfigFile()
    passthrough = training_argument_names() - OPTIONS_SET_FROM_THE_COMMAND
    rewards = data.pop("reward_funcs", None)
    weights = data.pop("reward_weights", None)
    batch = data.pop("per_device_train_batch_size", None)
    correction = data.pop("vllm_importance_sampling_correction", None)
    for key, value in data.items():
        name = TRL_OPTION_NAMES.get(key, key)
        if name in option_names:
            result.options[name] = value
        elif key in passthrough:
            result.training_arguments[key] = value
        elif key in IGNORED_TRL_SETTINGS:
            result.ignored[key] = IGNORED_TRL_SETTINGS[key]
        else:
            known = option_names | passthrough | set(TRL_OPTION_NAMES) | set(IGNORED_TRL_SETTINGS)
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigFileError(f"{where}: unknown setting {key!r}{hint}")
    if rewards is not None:
        result.options["reward"] = _reward_specs(rewards, weights, where)
    elif weights is not None:
        raise ConfigFileError(f"{where}: reward_weights needs reward_funcs (the names they weigh)")
    if isinstance(result.options.get("scale_rewards"), bool):  # TRL's older spelling
        result.options["scale_rewards"] = "group" if result.options["scale_rewards"] else "none"
    if correction is False:
        result.options["vllm_is_mode"] = "none"
    if batch is not None:
        result.options["per_device_train_batch_size"] = batch
    for key, reason in result.ignored.items():
        logger.warning("%s: ignoring %s (%s)", where, key, reason)
    return result


def _reward_specs(names: Any, weights: Any, where: str) -> list[str]:
    """TRL's ``reward_funcs`` (names of the service's reward functions) and
    ``reward_weights`` -> ``--reward NAME=WEIGHT`` specs."""
    names = [names] if isinstance(names, str) else names
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConfigFileError(f"{where}: reward_funcs must be a name or a list of names of the service's rewards")
    if weights is None:
        return list(names)
    if not isinstance(weights, list) or len(weights) != len(names):
        raise ConfigFileError(f"{where}: reward_weights must be a list with one number per reward_funcs entry")
    return [f"{name}={weight}" for name, weight in zip(names, weights, strict=True)]
