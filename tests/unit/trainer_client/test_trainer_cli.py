"""``rollout-trainer``'s options: generated from ``AsyncGRPOConfig``, ``RunOptions`` and
``ModelOptions`` as ``trl grpo``'s are, so TRL's flags and YAMLs work unchanged, and a bad
option is one line that says what to change."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from rollout_api import rollout_pb2 as pb
from tests.unit.rollout_service.edge.grpc_served import served
from trainer_client.cli import TrainerArgumentParser, main
from trainer_client.grpo_config import AsyncGRPOConfig
from trainer_client.options import SCALE_REWARDS, ModelOptions, RunOptions
from trainer_client.train import precision
from trainer_client.train import run as train_module
from trainer_client.train.run import ModelNotFound, RunRefused, buffered_groups

TRL_YAML = """
model_name_or_path: Qwen/Qwen2.5-0.5B-Instruct
model_revision: main
num_generations: 4
max_completion_length: 16
per_device_train_batch_size: 16
gradient_accumulation_steps: 2
learning_rate: 1.0e-4
lr_scheduler_type: cosine
warmup_steps: 2
weight_decay: 0.01
max_grad_norm: 0.5
loss_type: grpo
beta: 0.01
epsilon: 0.2
epsilon_high: 0.28
importance_sampling_level: sequence
temperature: 0.9
top_p: 0.95
top_k: 50
seed: 7
max_steps: 3
logging_steps: 5
save_steps: 100
report_to: none
gradient_checkpointing: true
reward_funcs: [char_fraction, completion_length]
reward_weights: [1.0, 0.5]
scale_rewards: false
output_dir: {out}
use_vllm: true
vllm_mode: server
dataset_name: trl-lib/DeepMath-103K
dataset_train_split: train
use_peft: true
lora_r: 8
lora_alpha: 16
"""


def parse(*argv: str) -> tuple[RunOptions, AsyncGRPOConfig, ModelOptions]:
    return TrainerArgumentParser().parse(["--max_steps", "1", *argv])


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse(*argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err  # one line
    return err


def test_a_trl_grpo_yaml_runs_unchanged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "trl.yaml").write_text(TRL_YAML.format(out=tmp_path / "out"))
    with caplog.at_level(logging.WARNING):
        run, config, model = TrainerArgumentParser().parse(["--config", str(tmp_path / "trl.yaml")])
    assert (model.model_name_or_path, model.use_peft, model.lora_r, model.lora_alpha) == (
        "Qwen/Qwen2.5-0.5B-Instruct",
        True,
        8,
        16,
    )
    assert (config.num_generations, config.per_device_train_batch_size, config.gradient_accumulation_steps) == (
        4,
        16,
        2,
    )
    assert config.groups_per_step == 8  # 2 micro-batches of 4 groups of 4, as TRL counts a step
    assert (config.learning_rate, config.lr_scheduler_type, config.warmup_steps) == (1e-4, "cosine", 2)
    assert (config.loss_type, config.beta, config.epsilon_high) == ("grpo", 0.01, 0.28)
    assert (config.importance_sampling_level, config.temperature, config.top_p, config.top_k) == (
        "sequence",
        0.9,
        0.95,
        50,
    )
    assert (config.seed, config.max_steps, config.max_completion_length, config.logging_steps) == (7, 3, 16, 5)
    assert (config.weight_decay, config.max_grad_norm, config.save_steps) == (0.01, 0.5, 100)
    assert config.gradient_checkpointing and config.output_dir == str(tmp_path / "out")
    assert config.scale_rewards == "none"  # TRL's older boolean spelling
    assert SCALE_REWARDS[config.scale_rewards] == pb.ADVANTAGE_SCALING_NONE
    assert run.rewards == {"char_fraction": 1.0, "completion_length": 0.5}
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "ignoring TRL settings that mean nothing here (use_vllm: the rollout service generates" in warning
    assert "dataset_train_split: give --prompts" in warning


@pytest.mark.parametrize("spelling", ["--learning_rate", "--learning-rate"])
def test_flags_in_either_spelling_win_over_the_file(tmp_path: Path, spelling: str) -> None:
    (tmp_path / "trl.yaml").write_text(TRL_YAML.format(out=tmp_path / "out"))
    _, config, model = TrainerArgumentParser().parse(
        ["--config", str(tmp_path / "trl.yaml"), spelling, "0.5", "--num-generations", "2", "--model", "m"]
    )
    assert (config.learning_rate, config.num_generations, model.model_name_or_path) == (0.5, 2, "m")
    assert config.per_device_train_batch_size == 16  # the file's, now 8 groups of 2


def test_every_training_arguments_flag_works() -> None:
    _, config, _ = parse("--report_to", "tensorboard", "--lr_scheduler_type", "constant", "--use_cpu", "--seed", "3")
    assert (config.report_to, config.lr_scheduler_type, config.use_cpu, config.seed) == (
        ["tensorboard"],
        "constant",
        True,
        3,
    )


def test_the_defaults_are_trls_for_real_models() -> None:
    run, config, model = parse()
    assert (config.learning_rate, config.num_generations, config.per_device_train_batch_size) == (1e-6, 8, 8)
    assert (config.max_completion_length, config.temperature, config.loss_type, config.logging_steps) == (
        512,
        1.0,
        "dapo",
        10,
    )
    assert model.model_name_or_path is None  # the model the service serves
    assert not config.output_dir_given  # outputs/<run id>, so two trainers never share a folder
    assert (run.dataset, run.reward_funcs, run.max_buffered_groups) == ("letters", ["char_fraction"], 0)
    # The Python API's defaults are the command line's: one declaration.
    assert config.max_staleness == AsyncGRPOConfig(max_steps=1).max_staleness
    assert run == RunOptions() and model == ModelOptions()


def test_the_trainer_follows_accelerates_device_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    _, config, _ = parse()
    assert config.device.type == "cpu"  # no flag needed here, where there is no GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert precision.device_type(use_cpu=False) == "cuda"
    assert precision.device_type(use_cpu=True) == "cpu"


@pytest.mark.parametrize(("flags", "expected"), [(["--bf16", "false"], False), (["--bf16", "true"], True), ([], None)])
def test_bf16_follows_the_flag_or_the_hardware(
    monkeypatch: pytest.MonkeyPatch, flags: list[str], expected: bool | None
) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    _, config, _ = parse(*flags)
    assert config.bf16 is (True if expected is None else expected)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--vllm_importance_sampling_mode", "sequence"], "choose one of token_truncate, token_mask"),
        (["--vllm_importance_sampling_clip_max", "0.5"], "it must be > 1"),
        (["--max_mismatch_kl", "0.1", "--admission", "staleness"], "bounds paced admission's lookahead"),
        (["--max_mismatch_kl", "-1"], "max_mismatch_kl is -1.0; give a KL >= 0"),
        (["--vllm_importance_sampling_cap", "0.5"], "vllm_importance_sampling_clip_max is 0.5; it must be > 1"),
        (["--vllm_importance_sampling_clip_min", "1.5"], "vllm_importance_sampling_clip_min is 1.5; it must be in"),
        (["--num_generations", "4", "--per_device_train_batch_size", "6"], "must be a multiple of num_generations 4"),
        (["--reward_funcs", "a", "b", "--reward_weights", "1"], "give one weight per reward function"),
        (["--num_generation", "4"], "unknown option '--num_generation'; did you mean --num_generations?"),
        (["--scale_rewards", "std"], "scale_rewards is 'std'; choose one of group, batch, none"),
        (["--per_device_train_batch_size", "0"], "per_device_train_batch_size is 0; it must be > 0"),
        (["--max_completion_length", "0"], "max_completion_length is 0; it must be > 0"),
        (["--temperature", "0"], "temperature is 0.0; it must be > 0 (log-probs are of logits / temperature)"),
        (["--max_step", "5", "--temperature", "0"], "unknown option '--max_step'; did you mean --max_steps?"),
        (["--target", "http://127.0.0.1:50051"], "give the service's gRPC host:port, without http(s)://"),
        (["--wait_for_service", "-1"], "wait_for_service is -1; give seconds >= 0 (0: do not wait)"),
    ],
)
def test_a_bad_option_is_one_line_that_says_what_to_change(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    assert message in refused(capsys, *flags)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("num_generation: 4\n", "unknown setting 'num_generation'; did you mean 'num_generations'?"),
        ("- a\n- b\n", "must be a mapping of settings (key: value), not a list"),
        ("num_generations: [\n", "is not YAML"),
        ("num_generations: many\n", "num_generations: 'many' is not a valid int"),
        ("max_steps: 3.7\n", "max_steps: 3.7 is not a valid int"),
        ("admission: [paced]\n", "admission: ['paced'] is not one of paced, staleness"),
        ("temperature: null\n", "temperature is None; it must be > 0"),
        ("per_device_train_batch_size: [1, 2]\n", "per_device_train_batch_size: [1, 2] is not a valid int"),
    ],
)
def test_a_bad_file_is_refused_with_what_to_change(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    (tmp_path / "bad.yaml").write_text(text)
    assert message in refused(capsys, "--config", str(tmp_path / "bad.yaml"))


def test_a_file_may_give_mappings_and_whole_floats_as_trl_s_yaml_does(tmp_path: Path) -> None:
    (tmp_path / "trl.yaml").write_text("liger_kernel_config: {rope: true}\nmax_steps: 1000.0\n")
    _, config, _ = TrainerArgumentParser().parse(["--config", str(tmp_path / "trl.yaml")])
    assert (config.liger_kernel_config, config.max_steps) == ({"rope": True}, 1000)


def test_a_config_that_is_not_text_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "model.bin").write_bytes(b"\x80\xff\x00\x01")
    assert "model.bin is not a text file; give a YAML file of settings" in refused(
        capsys, "--config", str(tmp_path / "model.bin")
    )


def test_an_output_dir_that_cannot_be_made_is_refused_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "afile").write_text("")
    monkeypatch.setattr(train_module, "train", lambda *args: pytest.fail("the run started"))
    with pytest.raises(SystemExit) as exit_info:
        main(["--max_steps", "1", "--output_dir", str(tmp_path / "afile" / "out")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "afile/out: Not a directory; give a folder this user can write" in err


async def test_a_run_the_service_refuses_is_one_line_with_its_reason() -> None:
    run, config, _ = parse("--dataset", "no_such_dataset")
    async with served() as (_, client):
        with pytest.raises(RunRefused, match=r"the service did not create the run: INVALID_ARGUMENT: unknown dataset"):
            await train_module._create_run(client.target, config, run, False)


def test_a_bad_prompts_file_is_refused_with_its_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "tasks.jsonl").write_text('{"question": "2+3?"}\n')
    assert "tasks.jsonl:1 has no 'prompt' column" in refused(capsys, "--prompts", str(tmp_path / "tasks.jsonl"))


def test_trl_flags_that_mean_nothing_here_are_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        parse("--use_vllm", "true", "--vllm-mode", "colocate")
    assert "ignoring TRL settings that mean nothing here (use_vllm: " in caplog.text and "vllm_mode" in caplog.text


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--eval_every", "2", "--no_push"], "with --no_push or --lora_serving adapter it pushes none; drop --eval"),
        (["--eval_every", "2", "--use_peft", "--lora_serving", "adapter"], "evaluations pin the base weights"),
    ],
)
def test_options_that_cannot_work_together_are_refused_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    monkeypatch.setattr(train_module, "train", lambda *args: pytest.fail("the run started"))
    with pytest.raises(SystemExit) as exit_info:
        main(["--max_steps", "1", *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_the_summary_alone_goes_to_stdout(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    trained: dict[str, Any] = {}

    def fake_train(config: AsyncGRPOConfig, run: RunOptions, model: ModelOptions) -> dict[str, Any]:
        trained.update(config=config, run=run, model=model)
        return {"time_split": {"fraction": {}, "steps": 0}}

    monkeypatch.setattr(train_module, "train", fake_train)
    monkeypatch.setattr("trainer_client.step_timing.format_split", lambda split: "")
    main(["--max_steps", "2", "--model", "m", "--run_id", "r"])
    assert json.loads(capsys.readouterr().out) == {"time_split": {"fraction": {}, "steps": 0}}
    assert (trained["config"].max_steps, trained["model"].model_name_or_path, trained["run"].run_id) == (2, "m", "r")


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


def test_the_correction_bounds_take_trls_names_and_its_deprecated_cap(caplog: pytest.LogCaptureFixture) -> None:
    """IcePop's and AReaL's lower bound needs clip_min; TRL's deprecated cap still sets clip_max."""
    _, config, _ = parse("--vllm_importance_sampling_clip_min", "0.5", "--vllm_importance_sampling_clip_max", "5")
    loss = config.loss_config()
    assert (loss.vllm_importance_sampling_clip_min, loss.vllm_importance_sampling_clip_max) == (0.5, 5.0)
    assert parse()[1].loss_config().vllm_importance_sampling_clip_max == 3.0  # TRL's default
    _, config, _ = parse("--vllm_importance_sampling_cap", "4")
    assert config.loss_config().vllm_importance_sampling_clip_max == 4.0
    assert "vllm_importance_sampling_cap is deprecated in TRL" in caplog.text


def test_a_model_path_that_does_not_exist_is_named_as_a_path(tmp_path: Path) -> None:
    served = pb.GetServerInfoResponse(model="tiny", model_signature="qwen2 d64 L2")
    missing = str(tmp_path / "no-model")
    with pytest.raises(
        ModelNotFound, match=f"--model_name_or_path {missing} does not exist; give a local model folder"
    ):
        train_module.policy_checkpoint(ModelOptions(model_name_or_path=missing), served)
