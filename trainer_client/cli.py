"""``rollout-trainer``: train a policy on a rollout service's stream.

The trainer loads the same checkpoint the service's vLLM servers serve, consumes a run
(created here unless --run-id names one), and pushes its weights back every
--weight-sync-steps. Bad options print one line that says what to change (exit 2).

Data parallel: ``torchrun --nproc-per-node N -m trainer_client.cli ...`` (same options on
every rank; rank 0 creates the run and pushes). LoRA: ``--lora-rank 16`` trains a PEFT
adapter and pushes the merged weights.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.logging import RichHandler

app = typer.Typer(add_completion=False, help=__doc__)


def _rewards(specs: list[str]) -> dict[str, float]:
    rewards: dict[str, float] = {}
    for spec in specs:
        name, _, weight = spec.partition("=")
        try:
            rewards[name] = float(weight) if weight else 1.0
        except ValueError:
            raise typer.BadParameter(f"--reward {spec!r}: the weight after '=' must be a number") from None
    return rewards


@app.command()
def main(
    ctx: typer.Context,
    config: Annotated[
        Path | None,
        typer.Option(
            help="YAML of these options, also in TRL GRPOConfig's names (num_generations, max_completion_length, "
            "per_device_train_batch_size, reward_funcs, ...); flags given here win"
        ),
    ] = None,
    target: Annotated[str, typer.Option(help="The rollout service, host:port")] = "127.0.0.1:50051",
    model: Annotated[Path, typer.Option(help="Checkpoint the service's vLLM serves")] = Path("models/tiny-qwen2"),
    run_id: Annotated[str | None, typer.Option(help="Consume this existing run instead of creating one")] = None,
    dataset: Annotated[str, typer.Option(help="Built-in dataset of the run")] = "repeat_a",
    prompts_file: Annotated[
        Path | None,
        typer.Option(
            "--prompts",
            "--prompts-file",
            help="Your prompts in TRL's format: JSONL, Parquet, CSV, a folder of them, or a saved HF dataset "
            "(the prompt column + columns passed to rewards as keyword arguments); replaces --dataset",
        ),
    ] = None,
    prompt_column: Annotated[str, typer.Option(help="Column of --prompts holding the prompt (text or chat)")] = (
        "prompt"
    ),
    reward: Annotated[list[str] | None, typer.Option(help="NAME[=WEIGHT], repeatable")] = None,
    group_size: Annotated[
        int, typer.Option("--group-size", "--num-generations", help="Completions per prompt (G)")
    ] = 8,
    groups_per_step: Annotated[int, typer.Option(help="Groups per optimizer step")] = 8,
    per_device_train_batch_size: Annotated[
        int | None,
        typer.Option(
            help="Completions per micro-batch, as TRL counts them; sets --groups-per-step to this x "
            "--gradient-accumulation-steps / G"
        ),
    ] = None,
    gradient_accumulation_steps: Annotated[
        int,
        typer.Option(
            min=1,
            help="Micro-batches per optimizer step (it must divide --groups-per-step); each trains as soon as its "
            "groups arrive, while the step's later groups generate",
        ),
    ] = 1,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", "--max-completion-length", help="Tokens per completion")
    ] = 32,
    top_p: Annotated[float, typer.Option(min=0, max=1, help="Nucleus sampling mass (1: off)")] = 1.0,
    top_k: Annotated[int, typer.Option(min=0, help="Top-k sampling (0: off)")] = 0,
    scale_rewards: Annotated[
        str, typer.Option(help="Advantage denominator, as TRL's: group (std), batch, or none (Dr. GRPO)")
    ] = "group",
    max_steps: Annotated[int, typer.Option(help="Optimizer steps")] = 60,
    learning_rate: Annotated[float, typer.Option()] = 5e-3,
    max_staleness: Annotated[
        int,
        typer.Option(
            help="Drop groups older than this many versions (2 reached the target fastest where generation is "
            "the slower side; where the summary says training-bound, 1 was faster, in fewer steps)"
        ),
    ] = 2,
    weight_sync_steps: Annotated[int, typer.Option(help="Push weights every this many steps")] = 1,
    loss_type: Annotated[str, typer.Option(help="grpo, bnpo, dr_grpo, dapo, cispo, sapo, ...")] = "dapo",
    beta: Annotated[float, typer.Option(help="KL coefficient to the starting policy (0: no reference model)")] = 0.0,
    vllm_is_mode: Annotated[
        str,
        typer.Option(
            help="Correction of pi_trainer / pi_vllm: sequence_mask, sequence_truncate, token_mask, token_truncate "
            "(TRL's vllm_importance_sampling_mode), or none"
        ),
    ] = "token_truncate",
    vllm_is_cap: Annotated[float, typer.Option(help="Ratio above which the correction truncates or masks")] = 3.0,
    lora_rank: Annotated[int, typer.Option(help="Train a LoRA adapter of this rank (0: the full model)")] = 0,
    lora_alpha: Annotated[int, typer.Option(help="LoRA scaling numerator")] = 32,
    lora_target_modules: Annotated[str, typer.Option(help="Comma-separated module names to adapt")] = (
        "q_proj,k_proj,v_proj,o_proj"
    ),
    lora_serving: Annotated[
        str, typer.Option(help="merged: push base+adapter weights; adapter: vLLM serves the run's adapter")
    ] = "merged",
    max_buffered_groups: Annotated[
        int,
        typer.Option(
            min=0,
            help="Service-side buffer of the run in groups (0: --max-staleness x --groups-per-step, at least one step)",
        ),
    ] = 0,
    max_inflight: Annotated[
        int, typer.Option(min=0, help="Episodes of the run generating at once (0: the service's slots)")
    ] = 0,
    group_deadline_s: Annotated[
        float,
        typer.Option(min=0, help="Stragglers: seconds a group waits for its slowest members (0: all of them)"),
    ] = 0.0,
    min_group_size: Annotated[
        int, typer.Option(min=0, help="With a deadline: score a group from this many finished members (0: drop it)")
    ] = 0,
    background_push: Annotated[
        bool,
        typer.Option(help="Push while the next step trains (needs --max-staleness >= 1); --no-background-push waits"),
    ] = True,
    admission: Annotated[
        str,
        typer.Option(
            help="paced: generate only what trains within max-staleness, and only as far ahead as keeps this "
            "trainer busy (fresher groups where training is the slower side); staleness: as far ahead as "
            "max-staleness allows; buffer: fill the buffer"
        ),
    ] = "paced",
    output_dir: Annotated[Path, typer.Option(help="metrics.jsonl, summary.json, reward_curve.svg")] = Path(
        "outputs/train"
    ),
    trainer_address: Annotated[
        str,
        typer.Option(
            help="Address vLLM's workers reach this trainer at, for the weight transfer; auto: the local "
            "address this host reaches the service from (the address the service sees)"
        ),
    ] = "auto",
    push: Annotated[
        bool, typer.Option(help="Push weights (--no-push: a follower of a run that another trainer pushes for)")
    ] = True,
    shared_memory_push: Annotated[
        bool,
        typer.Option(
            help="Push to vLLM servers on this host through shared memory (one more copy of the weights in RAM); "
            "--no-shared-memory-push sends every byte over gloo, as to a server on another host"
        ),
    ] = True,
    wait_for_service: Annotated[
        float,
        typer.Option(
            min=0,
            help="Seconds to wait at start for the service to say SERVING (it does once a vLLM server "
            "answers); 0: do not wait",
        ),
    ] = 600.0,
    save_model: Annotated[
        bool,
        typer.Option(
            help="At the end, save the trained policy (with the tokenizer) to OUTPUT_DIR/model, "
            "as vLLM and from_pretrained load it (a LoRA run saves its adapter)"
        ),
    ] = False,
    torch_threads: Annotated[
        int,
        typer.Option(
            min=0,
            help="Torch threads; 0: the cores the managed vLLM leaves free when the service is on this host "
            "(half of them), else all",
        ),
    ] = 0,
    bf16: Annotated[
        bool | None,
        typer.Option(
            "--bf16/--no-bf16",
            help="Compute in bf16 autocast over float32 weights, as TRL's default does (the weights, optimizer "
            "and pushes stay float32); default: where the hardware multiplies bf16 natively (AMX or AVX512-BF16)",
        ),
    ] = None,
    eval_every: Annotated[
        int,
        typer.Option(
            min=0,
            help="Evaluate every this many weight pushes (0: never): --eval-dataset once, all at the version just "
            "pushed, which the service holds meanwhile; results in metrics.jsonl, evals.jsonl and the summary",
        ),
    ] = 0,
    eval_dataset: Annotated[str, typer.Option(help="Built-in dataset --eval-every evaluates")] = "letters",
    save_steps: Annotated[
        int, typer.Option(min=0, help="Save a checkpoint (model, optimizer, run id) every this many steps (0: none)")
    ] = 0,
    resume_from_checkpoint: Annotated[
        str | None,
        typer.Option(help="A checkpoint-N folder, or latest (the newest in --output-dir): restore it, re-join its run"),
    ] = None,
    log_level: Annotated[str, typer.Option()] = "INFO",
) -> None:
    """Train on the service's stream and print the summary as JSON."""
    # Logs on stderr: stdout is the summary JSON (rollout-trainer > summary.json).
    handler = RichHandler(show_path=False, console=Console(stderr=True))
    logging.basicConfig(level=log_level.upper(), format="%(message)s", handlers=[handler])
    training_arguments: dict[str, Any] = {}
    if config is not None:
        training_arguments = _apply_config_file(ctx, config)
    _train(SimpleNamespace(**ctx.params), training_arguments)


def _apply_config_file(ctx: typer.Context, path: Path) -> dict[str, Any]:
    """Fill ``ctx.params`` from the file where the command line did not set them; returns
    the file's pass-through training arguments."""
    from trainer_client.config_file import ConfigFileError, read_config_file

    parameters = {param.name: param for param in ctx.command.params if param.name}
    try:
        settings = read_config_file(path, set(parameters) - {"config"})
    except ConfigFileError as exc:
        raise typer.BadParameter(str(exc), param_hint="--config") from None
    for name, value in settings.options.items():
        source = ctx.get_parameter_source(name)
        if source is not None and source.name == "COMMANDLINE":  # typer's own click: compare by name
            continue
        try:
            ctx.params[name] = parameters[name].process_value(ctx, value)
        except typer.BadParameter as exc:
            raise typer.BadParameter(f"{path}: {name}: {exc.message}", param_hint="--config") from None
    return settings.training_arguments


def _train(o: SimpleNamespace, training_arguments: dict[str, Any]) -> None:
    """The command's work, on its options after the config file (``o``)."""
    from trainer_client.advertised_address import AddressError, advertised_address
    from trainer_client.checkpoints import CheckpointError
    from trainer_client.client import ServiceNotServing
    from trainer_client.step_timing import format_split
    from trainer_client.stream import RunStalled
    from trainer_client.train import ADMISSION_MODES, SCALE_REWARDS, LoraOptions, RunOptions, cpu_training_config, train

    if not (o.model / "config.json").exists():
        if o.model != Path("models/tiny-qwen2"):
            raise typer.BadParameter(f"--model {o.model} has no config.json; give the checkpoint vLLM serves")
        from rollout_common.tiny_model import build_tiny_model

        build_tiny_model(o.model)
    groups_per_step = o.groups_per_step
    if o.per_device_train_batch_size is not None:
        if o.per_device_train_batch_size <= 0 or o.per_device_train_batch_size % o.group_size:
            raise typer.BadParameter(
                f"--per-device-train-batch-size {o.per_device_train_batch_size} must be a positive multiple of "
                f"the group size {o.group_size} (whole groups per micro-batch)"
            )
        groups_per_step = o.per_device_train_batch_size // o.group_size * o.gradient_accumulation_steps
    if groups_per_step % o.gradient_accumulation_steps:
        raise typer.BadParameter(
            f"--gradient-accumulation-steps {o.gradient_accumulation_steps} must divide --groups-per-step "
            f"{groups_per_step} (whole groups per micro-batch)"
        )
    if o.save_steps:
        training_arguments.update(save_steps=o.save_steps)
    if o.resume_from_checkpoint:
        training_arguments.update(resume_from_checkpoint=o.resume_from_checkpoint)
    try:
        config = cpu_training_config(
            o.output_dir,
            o.max_steps,
            group_size=o.group_size,
            groups_per_step=groups_per_step,
            gradient_accumulation_steps=o.gradient_accumulation_steps,
            learning_rate=o.learning_rate,
            max_staleness=o.max_staleness,
            weight_sync_steps=o.weight_sync_steps,
            loss_type=o.loss_type,
            max_tokens=o.max_tokens,
            beta=o.beta,
            background_push=o.background_push,
            vllm_is_mode=o.vllm_is_mode,
            vllm_is_cap=o.vllm_is_cap,
            bf16=o.bf16,
            **training_arguments,
        )
    except (ValueError, TypeError) as exc:
        raise typer.BadParameter(str(exc)) from None
    if o.lora_rank < 0:
        raise typer.BadParameter(f"--lora-rank is {o.lora_rank}; give 0 (full model) or a positive rank")
    targets = [name.strip() for name in o.lora_target_modules.split(",") if name.strip()]
    if o.lora_serving not in ("merged", "adapter"):
        raise typer.BadParameter(f"--lora-serving {o.lora_serving!r}: choose merged or adapter")
    lora = LoraOptions(o.lora_rank, o.lora_alpha, targets, o.lora_serving) if o.lora_rank else None
    if o.eval_every and (not o.push or (lora is not None and lora.serving == "adapter")):
        raise typer.BadParameter(
            "evaluations pin the base weights this trainer pushes; drop --eval-every with --no-push or "
            "--lora-serving adapter",
            param_hint="--eval-every",
        )
    if o.admission not in ADMISSION_MODES:
        raise typer.BadParameter(f"--admission {o.admission!r}: choose {', '.join(ADMISSION_MODES)}")
    if o.scale_rewards not in SCALE_REWARDS:
        raise typer.BadParameter(f"--scale-rewards {o.scale_rewards!r}: choose {', '.join(SCALE_REWARDS)}")
    prompts = None
    if o.prompts_file is not None:
        from trainer_client.prompts_file import PromptRows, PromptsFileError

        try:
            prompts = PromptRows.from_path(o.prompts_file, o.prompt_column)
        except PromptsFileError as exc:
            raise typer.BadParameter(str(exc), param_hint="--prompts") from None
    try:
        trainer_address = advertised_address(o.trainer_address, o.target)
    except AddressError as exc:
        raise typer.BadParameter(str(exc), param_hint="--trainer-address") from None
    options = RunOptions(
        o.dataset,
        _rewards(o.reward or ["char_fraction"]),
        o.max_tokens,
        o.max_buffered_groups,
        o.admission,
        max_inflight=o.max_inflight,
        group_deadline_s=o.group_deadline_s,
        min_group_size=o.min_group_size,
        prompts=prompts,
        prompt_column=o.prompt_column,
        top_p=o.top_p,
        top_k=o.top_k,
        scale_rewards=o.scale_rewards,
        eval_dataset=o.eval_dataset,
        eval_every_pushes=o.eval_every,
    )
    try:
        summary = train(
            o.target,
            str(o.model),
            config,
            options,
            run_id=o.run_id,
            trainer_address=trainer_address,
            lora=lora,
            push=o.push,
            shared_memory_push=o.shared_memory_push,
            torch_threads=o.torch_threads,
            save_model=o.save_model,
            wait_for_service_s=o.wait_for_service,
        )
    except CheckpointError as exc:
        raise typer.BadParameter(str(exc), param_hint="--resume-from-checkpoint") from None
    except (RunStalled, ServiceNotServing) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    if config.process_index == 0:
        typer.echo(json.dumps(summary, indent=2))
        typer.echo(f"time split: {format_split(summary['time_split'])}", err=True)


if __name__ == "__main__":
    app()
