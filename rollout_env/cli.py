"""``rollout-env``: run a standard environment format's rollouts into a run of the service."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from typing import Annotated, Any

import typer
import yaml

from rollout_env.verifiers_runner import VerifiersRun, run_verifiers

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Run a standard environment format's rollouts into a run of the service.",
)
INSTALL = "pip install 'rollout-service[verifiers]'"


@app.callback()
def main() -> None:
    """Environment runners: each drives a run of the rollout service from its own process."""


@app.command()
def verifiers(
    env_id: Annotated[str, typer.Argument(help="The verifiers environment: an importable module's id.")],
    target: Annotated[str, typer.Option(help="The rollout service's gRPC address.")] = "127.0.0.1:50051",
    openai_url: Annotated[
        str, typer.Option(help="The service's OpenAI-compatible endpoint.")
    ] = "http://127.0.0.1:8100",
    run_id: Annotated[str | None, typer.Option(help="An external run to feed; default: create one.")] = None,
    group_size: Annotated[int, typer.Option(help="Rollouts per task (G), for a run created here.")] = 8,
    max_tokens: Annotated[int, typer.Option(help="Most tokens of one model turn.")] = 512,
    temperature: Annotated[float, typer.Option(help="Sampling temperature.")] = 1.0,
    max_turns: Annotated[int, typer.Option(help="Most model turns of one rollout.")] = 10,
    groups_in_flight: Annotated[int, typer.Option(help="Tasks whose G rollouts run at once.")] = 4,
    groups: Annotated[int, typer.Option(help="Groups to run, then stop; 0: until the run is deleted.")] = 0,
    taskset: Annotated[
        list[str] | None, typer.Option(help="KEY=VALUE of the taskset's own settings (a YAML value); repeatable.")
    ] = None,
) -> None:
    """Run a verifiers environment's rollouts into an external run; the rubric's rewards close the episodes."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import verifiers  # noqa: F401
    except ImportError:
        raise typer.BadParameter(f"the verifiers package is not installed here: {INSTALL}") from None
    options = VerifiersRun(
        env_id, target, openai_url, run_id, group_size, max_tokens, temperature, max_turns, groups_in_flight, groups,
        taskset=dict(_setting(item) for item in taskset or []),
    )  # fmt: skip
    report = asyncio.run(run_verifiers(options))
    typer.echo(json.dumps(dataclasses.asdict(report)))


def _setting(item: str) -> tuple[str, Any]:
    key, equals, value = item.partition("=")
    if not equals or not key:
        raise typer.BadParameter(f"--taskset takes KEY=VALUE, not {item!r}")
    return key, yaml.safe_load(value)
