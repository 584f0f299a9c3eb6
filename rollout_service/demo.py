"""``rollout-demo``: the embedded default end to end.

Builds the tiny model if needed, starts a managed vLLM server and the rollout service,
creates a run on the built-in ``letters`` task and consumes its stream as a trainer would
(acks and credits), showing a live table of groups and rewards. The trainer issue turns
this into a training run.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import deque
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Group as RichGroup
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from rollout_service.app import running_service
from rollout_service.cli import settings_from_cli, setup_logging
from rollout_service.errors import StartupError
from trainer_client.client import RolloutClient, dataset_run_spec


def _table(rows: deque[tuple[str, ...]]) -> Table:
    table = Table(title="streamed groups (newest last)", expand=True)
    for column in ("group", "policy v", "rewards (G)", "mean", "adv. mean", "tokens", "best completion"):
        table.add_column(column, overflow="ellipsis", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    return table


async def consume(target: str, groups: int, output_dir: Path, group_size: int, max_tokens: int) -> dict:
    progress = Progress(
        TextColumn("[bold]groups"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("{task.fields[rate]}"),
    )  # fmt: skip
    task = progress.add_task("groups", total=groups, rate="")
    rows: deque[tuple[str, ...]] = deque(maxlen=12)
    rewards: list[float] = []
    tokens = 0
    async with RolloutClient(target) as client:
        run = await client.create_run(
            dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=group_size, max_tokens=max_tokens)
        )
        stream = client.stream(run.run_id, "demo-consumer", credits=8)
        started = time.monotonic()
        with (
            Live(RichGroup(progress, _table(rows)), refresh_per_second=4) as live,
            open(output_dir / "groups.jsonl", "w") as log,  # noqa: ASYNC230 (small appends)
        ):
            received = 0
            async for group in stream:
                received += 1
                group_rewards = [s.reward for s in group.samples]
                rewards.extend(group_rewards)
                group_tokens = sum(len(s.completion_token_ids) for s in group.samples)
                tokens += group_tokens
                best = max(group.samples, key=lambda s: s.reward)
                rows.append((
                    group.group_id.split("/", 1)[1], str(group.policy_version),
                    " ".join(f"{r:.2f}" for r in group_rewards), f"{statistics.fmean(group_rewards):.3f}",
                    f"{statistics.fmean(s.advantage for s in group.samples):+.1e}", str(group_tokens),
                    repr(best.completion_text[:60]),
                ))  # fmt: skip
                log.write(json.dumps({"group_id": group.group_id, "rewards": group_rewards}) + "\n")
                stream.ack([group.group_id])
                elapsed = time.monotonic() - started
                progress.update(task, completed=received, rate=f"{tokens / elapsed:,.0f} tok/s")
                live.update(RichGroup(progress, _table(rows)))
                if received >= groups:
                    break
        await stream.aclose()
        stats = await client.stats()
        await client.delete_run(run.run_id)
    elapsed = time.monotonic() - started
    return {
        "groups": groups,
        "samples": len(rewards),
        "reward_mean": statistics.fmean(rewards),
        "tokens_per_s": tokens / elapsed,
        "max_slots_busy_seen": stats.max_slots_busy_seen,
        "seconds": elapsed,
    }


def main(
    groups: Annotated[int, typer.Option(help="Groups to stream before stopping")] = 60,
    group_size: Annotated[int, typer.Option(help="Completions per prompt (G)")] = 8,
    max_tokens: Annotated[int, typer.Option(help="Tokens per completion")] = 48,
    output_dir: Annotated[Path, typer.Option(help="Where the run's files go")] = Path("outputs/demo"),
    config: Annotated[Path | None, typer.Option(help="YAML settings for the service")] = None,
) -> None:
    """Run the embedded default: managed vLLM + rollout service + a streaming consumer."""
    setup_logging("WARNING")
    settings = settings_from_cli(config, {"port": 0, "metrics_port": 0})

    async def run() -> dict:
        typer.echo("starting vLLM (about a minute on CPU) and the rollout service ...")
        output_dir.mkdir(parents=True, exist_ok=True)
        async with running_service(settings) as service:
            typer.echo(f"service on {service.grpc_target}, vLLM on {service.engine_urls[0]}")
            return await consume(service.grpc_target, groups, output_dir, group_size, max_tokens)

    import uvloop

    try:
        summary = uvloop.run(run())
    except StartupError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    typer.echo(json.dumps(summary, indent=2))
    typer.echo(f"wrote {output_dir / 'groups.jsonl'} and {output_dir / 'summary.json'}")


def cli() -> None:
    typer.run(main)


if __name__ == "__main__":
    cli()
