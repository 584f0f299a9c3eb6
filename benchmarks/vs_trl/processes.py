"""The benchmark's child processes: on which cores they start, with which flags, and how their
output is read.

Why: TRL, each ``rollout-trainer`` run and each alone measurement run in a process of its own,
so that its torch thread count and its CPU use are its own; they all start from the same
entry point (``ENTRY``, in a worker mode) and on the cores the benchmark had before its
service moved it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections import deque
from collections.abc import Callable
from pathlib import Path

from rollout_common.cpu_budget import available_cores

ENTRY = Path(__file__).resolve().parents[1] / "bench_vs_trl.py"
"""The benchmark's script: its worker modes (``trl-worker``, ``train-alone``,
``generate-alone``) are the children's entry points."""
BENCHMARKS = ENTRY.parent
"""On a child's ``PYTHONPATH``: the reward module (``bench_rewards``) is imported by name."""

HOST_CORES = available_cores()
"""This process's cores at start: the service it runs moves it off vLLM's cores
(``engine.managed.cpu_placement`` auto), and TRL, the trainers and the alone measurements
start on all of them again, as from a shell."""


def on_host_cores() -> None:
    """``preexec_fn`` of every child: ``HOST_CORES``."""
    os.sched_setaffinity(0, HOST_CORES)


def leading_env_settings(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """A variant's leading ``KEY=VALUE`` words (set in the trainer's environment, as a shell
    would) and the flags after them."""
    settings: dict[str, str] = {}
    for index, word in enumerate(words):
        key, equals, value = word.partition("=")
        if word.startswith("-") or not equals or not key.isidentifier():
            return settings, words[index:]
        settings[key] = value
    return settings, []


async def run_subprocess(
    command: list[str],
    env: dict[str, str],
    timeout_s: float,
    name: str,
    on_line: Callable[[str], None] = lambda line: None,
) -> None:
    """Run ``command`` to its end, handing each line of its output (stdout and stderr) to
    ``on_line`` as it comes; a failure raises with the output's tail."""
    process = await asyncio.create_subprocess_exec(
        *command, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, preexec_fn=on_host_cores
    )
    tail: deque[str] = deque(maxlen=100)

    async def read() -> None:
        assert process.stdout is not None
        async for raw in process.stdout:
            line = raw.decode(errors="replace")
            tail.append(line)
            on_line(line)
        await process.wait()

    try:
        await asyncio.wait_for(read(), timeout_s)
    except TimeoutError:
        process.kill()
        raise RuntimeError(f"{name} did not finish within {timeout_s:.0f}s") from None
    if process.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {process.returncode}):\n{''.join(tail)[-4000:]}")


def shared_flags(args: argparse.Namespace) -> list[str]:
    """The flags every child gets: the same model, task and hyperparameters on every side."""
    return [
        "--model-dir", str(args.model_dir), "--dataset", args.dataset, "--steps", str(args.steps),
        "--group-size", str(args.group_size), "--prompts-per-step", str(args.prompts_per_step),
        "--max-tokens", str(args.max_tokens), "--learning-rate", str(args.learning_rate),
    ]  # fmt: skip
