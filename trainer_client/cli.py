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
from typing import Annotated

import typer
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
    target: Annotated[str, typer.Option(help="The rollout service, host:port")] = "127.0.0.1:50051",
    model: Annotated[Path, typer.Option(help="Checkpoint the service's vLLM serves")] = Path("models/tiny-qwen2"),
    run_id: Annotated[str | None, typer.Option(help="Consume this existing run instead of creating one")] = None,
    dataset: Annotated[str, typer.Option(help="Built-in dataset of the run")] = "repeat_a",
    prompts_file: Annotated[
        Path | None,
        typer.Option(help="JSONL prompts in TRL's format ('prompt' + columns passed to rewards); replaces --dataset"),
    ] = None,
    reward: Annotated[list[str] | None, typer.Option(help="NAME[=WEIGHT], repeatable")] = None,
    group_size: Annotated[int, typer.Option(help="Completions per prompt (G)")] = 8,
    groups_per_step: Annotated[int, typer.Option(help="Groups per optimizer step")] = 8,
    max_tokens: Annotated[int, typer.Option(help="Tokens per completion")] = 32,
    max_steps: Annotated[int, typer.Option(help="Optimizer steps")] = 60,
    learning_rate: Annotated[float, typer.Option()] = 5e-3,
    max_staleness: Annotated[
        int, typer.Option(help="Drop groups older than this many versions (1 reached the target fastest)")
    ] = 1,
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
    max_buffered_groups: Annotated[int, typer.Option(help="Service-side buffer of the run")] = 8,
    max_inflight: Annotated[
        int, typer.Option(min=0, help="Episodes of the run generating at once (0: the service's slots)")
    ] = 0,
    background_push: Annotated[
        bool,
        typer.Option(help="Push while the next step trains (needs --max-staleness >= 1); --no-background-push waits"),
    ] = True,
    admission: Annotated[
        str, typer.Option(help="staleness: generate only what trains within max-staleness; buffer: fill the buffer")
    ] = "staleness",
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
    torch_threads: Annotated[
        int,
        typer.Option(
            min=0,
            help="Torch threads; 0: the cores the managed vLLM leaves free when the service is on this host "
            "(half of them), else all",
        ),
    ] = 0,
    log_level: Annotated[str, typer.Option()] = "INFO",
) -> None:
    """Train on the service's stream and print the summary as JSON."""
    logging.basicConfig(level=log_level.upper(), format="%(message)s", handlers=[RichHandler(show_path=False)])
    from trainer_client.step_timing import format_split
    from trainer_client.train import ADMISSION_MODES, LoraOptions, RunOptions, cpu_training_config, train

    if not (model / "config.json").exists():
        if model != Path("models/tiny-qwen2"):
            raise typer.BadParameter(f"--model {model} has no config.json; give the checkpoint vLLM serves")
        from rollout_common.tiny_model import build_tiny_model

        build_tiny_model(model)
    try:
        config = cpu_training_config(
            output_dir,
            max_steps,
            group_size=group_size,
            groups_per_step=groups_per_step,
            learning_rate=learning_rate,
            max_staleness=max_staleness,
            weight_sync_steps=weight_sync_steps,
            loss_type=loss_type,
            max_tokens=max_tokens,
            beta=beta,
            background_push=background_push,
            vllm_is_mode=vllm_is_mode,
            vllm_is_cap=vllm_is_cap,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    if lora_rank < 0:
        raise typer.BadParameter(f"--lora-rank is {lora_rank}; give 0 (full model) or a positive rank")
    targets = [name.strip() for name in lora_target_modules.split(",") if name.strip()]
    if lora_serving not in ("merged", "adapter"):
        raise typer.BadParameter(f"--lora-serving {lora_serving!r}: choose merged or adapter")
    lora = LoraOptions(lora_rank, lora_alpha, targets, lora_serving) if lora_rank else None  # type: ignore[arg-type]
    if admission not in ADMISSION_MODES:
        raise typer.BadParameter(f"--admission {admission!r}: choose {' or '.join(ADMISSION_MODES)}")
    prompts = None
    if prompts_file is not None:
        from trainer_client.prompts_file import PromptsFileError, load_prompts_file

        try:
            prompts = load_prompts_file(prompts_file)
        except PromptsFileError as exc:
            raise typer.BadParameter(str(exc), param_hint="--prompts-file") from None
    from trainer_client.advertised_address import AddressError, advertised_address

    try:
        trainer_address = advertised_address(trainer_address, target)
    except AddressError as exc:
        raise typer.BadParameter(str(exc), param_hint="--trainer-address") from None
    options = RunOptions(
        dataset,
        _rewards(reward or ["char_fraction"]),
        max_tokens,
        max_buffered_groups,
        admission,  # type: ignore[arg-type]
        max_inflight=max_inflight,
        prompts=prompts,
    )
    summary = train(
        target,
        str(model),
        config,
        options,
        run_id=run_id,
        trainer_address=trainer_address,
        lora=lora,
        push=push,
        torch_threads=torch_threads,
    )
    if config.process_index == 0:
        typer.echo(json.dumps(summary, indent=2))
        typer.echo(f"time split: {format_split(summary['time_split'])}", err=True)


if __name__ == "__main__":
    app()
