"""``rollout-trainer``: train a policy on a rollout service's stream.

Options are the fields of ``AsyncGRPOConfig``, ``RunOptions`` and ``ModelOptions``, parsed as
``trl grpo`` parses its own (flags or ``--config`` YAML). A TRL setting that means nothing here
is accepted with a warning. Data parallel: the same command on every rank under ``torchrun``.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from rich.console import Console
from rich.logging import RichHandler
from transformers import HfArgumentParser

from rollout_common.settings_file import SettingsFileError, read_settings_file
from trainer_client.grpo_config import AsyncGRPOConfig
from trainer_client.options import ModelOptions, RunOptions

logger = logging.getLogger(__name__)

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
            "max_prompt_length",
            "ds3_gather_for_generation",
            "chat_template_kwargs",
            "max_tool_calling_iterations",
            "num_generations_eval",
        ],
        _GENERATION,
    ),
    "num_iterations": "each group trains once here (one optimizer step per batch of groups)",
    "shuffle_dataset": "the service draws the prompts",
    **dict.fromkeys(
        ["dataset_name", "dataset_config", "dataset_train_split", "dataset_test_split", "dataset_streaming"],
        "give --prompts (a file or a saved dataset) or --dataset (built-in) instead",
    ),
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
            "dtype",
            "torch_dtype",
            "attn_implementation",
            "lora_dropout",
            "lora_task_type",
            "use_rslora",
            "use_dora",
            "load_in_4bit",
            "load_in_8bit",
        ],
        _NOT_HERE,
    ),
}
"""Settings a TRL ``GRPOConfig``/``ModelConfig``/script YAML may carry that have no effect here, and why."""


class TrainerArgumentParser(HfArgumentParser):
    """transformers' parser over the trainer's three dataclasses, plus ``--config``."""

    def __init__(self) -> None:
        super().__init__(
            (RunOptions, AsyncGRPOConfig, ModelOptions),
            prog="rollout-trainer",
            description=__doc__.split("\n\n")[0] if __doc__ else None,
            allow_abbrev=False,  # a misspelt flag is an error, not some other option it begins
        )
        self.add_argument("--config", help="A YAML of these options (TRL's GRPO YAMLs work); flags win over it.")

    def error(self, message: str) -> NoReturn:
        """One line, not the usage of some 200 options."""
        line = " ".join(message.split())
        self.exit(2, f"{self.prog}: error: {line} (rollout-trainer --help lists every option)\n")

    def parse(self, argv: Sequence[str]) -> tuple[RunOptions, AsyncGRPOConfig, ModelOptions]:
        argv = list(argv)
        pre = argparse.ArgumentParser(add_help=False)
        pre.add_argument("--config", type=Path)
        config_path = pre.parse_known_args(argv)[0].config
        if config_path is not None:
            self.set_defaults(**self._file_settings(config_path))
        self._ignore_trl_flags(self.parse_known_args(argv)[1])  # an unknown flag first: it may be the bad value's
        try:
            # The three dataclasses, a namespace of --config, and what nothing took (said above).
            run, config, model, _, _ = self.parse_args_into_dataclasses(argv, return_remaining_strings=True)
        except (ValueError, TypeError) as exc:  # a dataclass refused a value; its message says which
            self.error(str(exc))
        return run, config, model

    def _file_settings(self, path: Path) -> dict[str, Any]:
        try:
            data = read_settings_file(path)
        except SettingsFileError as exc:
            self.error(f"--config: {exc}")
        actions = {action.dest: action for action in self._actions if action.dest not in ("help", "config")}
        settings: dict[str, Any] = {}
        ignored = []
        for key, value in data.items():
            if key in actions:
                settings[key] = self._file_value(path, key, value, actions[key])
            elif key in IGNORED_TRL_SETTINGS:
                ignored.append(key)
            else:
                close = difflib.get_close_matches(key, [*actions, *IGNORED_TRL_SETTINGS], n=1)
                self.error(
                    f"--config: {path}: unknown setting {key!r}" + (f"; did you mean {close[0]!r}?" if close else "")
                )
        _warn_ignored(ignored, str(path))
        return settings

    def _file_value(self, path: Path, key: str, value: Any, action: argparse.Action) -> Any:
        """A file's value is checked by its flag's own type, as on the command line (YAML's 3.7 is no
        int); a mapping or list goes through as it is (``liger_kernel_config``), but not to a number
        or a choice."""
        convert = action.type
        if value is None or not callable(convert) or convert is str or action.nargs is not None:
            return [value] if key == "reward_funcs" and isinstance(value, str) else value
        if convert is int and isinstance(value, float) and value.is_integer():
            value = int(value)
        structured = isinstance(value, list | dict)
        if structured and convert not in (int, float) and not action.choices:
            return value
        try:
            if structured:
                raise TypeError
            return convert(value if isinstance(value, str) else str(value))
        except (TypeError, ValueError):
            name = getattr(convert, "__name__", "<lambda>")
            if name != "<lambda>":
                expected = f"a valid {name}"
            elif action.choices:
                expected = f"one of {', '.join(map(str, action.choices))}"
            else:
                expected = "a valid value"
            self.error(f"--config: {path}: {key}: {value!r} is not {expected}")

    def _ignore_trl_flags(self, rest: list[str]) -> None:
        """Flags left over: TRL's that mean nothing here are warned about, others refused."""
        ignored = []
        for token in rest:
            if not token.startswith("--"):
                continue  # a value of the flag before it
            name = token[2:].split("=", 1)[0].replace("-", "_")
            if name not in IGNORED_TRL_SETTINGS:
                known = [action.dest for action in self._actions]
                close = difflib.get_close_matches(name, known, n=1)
                self.error(f"unknown option {token!r}" + (f"; did you mean --{close[0]}?" if close else ""))
            ignored.append(name)
        _warn_ignored(ignored, "the command line")


def _warn_ignored(keys: list[str], where: str) -> None:
    if keys:
        reasons = "; ".join(f"{key}: {IGNORED_TRL_SETTINGS[key]}" for key in keys)
        logger.warning("%s: ignoring TRL settings that mean nothing here (%s)", where, reasons)


def main(argv: Sequence[str] | None = None) -> None:
    """Train on the service's stream and print the summary as JSON."""
    # Logs on stderr: stdout is the summary JSON (rollout-trainer > summary.json).
    handler = RichHandler(show_path=False, console=Console(stderr=True))
    logging.basicConfig(level=logging.INFO, format="%(message)s", handlers=[handler])
    parser = TrainerArgumentParser()
    run, config, model = parser.parse(sys.argv[1:] if argv is None else argv)
    if config.log_level != "passive":
        logging.getLogger().setLevel(config.log_level.upper())
    from rollout_api.client import ServiceNotServing
    from trainer_client.advertised_address import AddressError
    from trainer_client.local_service import LocalServiceError
    from trainer_client.step_timing import format_split
    from trainer_client.stream.feed import RunStalled, StreamEnded
    from trainer_client.train.checkpoints import CheckpointError
    from trainer_client.train.run import ModelNotFound, RunRefused, train

    if run.eval_every and (not run.push or model.serves_adapter):
        parser.error(
            "--eval_every: evaluations pin the base weights this trainer pushes, and with --no_push or "
            "--lora_serving adapter it pushes none; drop --eval_every"
        )
    if config.output_dir_given:
        try:
            Path(config.output_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            parser.error(f"--output_dir {config.output_dir}: {exc.strerror or exc}; give a folder this user can write")
    try:
        summary = train(config, run, model)
    except (CheckpointError, AddressError, ModelNotFound, RunRefused) as exc:
        parser.error(str(exc))
    except (RunStalled, StreamEnded, ServiceNotServing, LocalServiceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    if config.process_index == 0:
        print(json.dumps(summary, indent=2))
        print(f"time split: {format_split(summary['time_split'])}", file=sys.stderr)


app = main  # the rollout-trainer entry point

if __name__ == "__main__":
    app()
