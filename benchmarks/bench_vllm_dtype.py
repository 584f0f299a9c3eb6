"""vLLM's dtype on a CPU: one training step's generation from a float32 and a bf16 server.

Why: a managed CPU server computes in bf16 where the CPU has bf16 instructions
(``engine.managed.dtype``, ``rollout_common.cpu_features``). This measures what that buys,
side by side: both servers are started as the service starts its own (the same pinned cores
and niceness), and the rounds alternate between them, so this machine's drift falls on both.

A step is one training step's groups of ``bench_vs_trl.py``: 4 prompts with n = 8 completions
of 32 tokens each (``ignore_eos``: every step the same length), one logprob a token, sent at
once. Each round times ``--steps-per-round`` steps on each server and reads the server's CPU
time (every process of its group, ``/proc``); the table gives medians over rounds.

Usage::

    python benchmarks/bench_vllm_dtype.py                      # the small model, 12 rounds
    python benchmarks/bench_vllm_dtype.py --model-size medium --rounds 6
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, installed or not
from bench_vs_trl import MODEL_SIZES

from rollout_common.tiny_model import TinyModelSpec, build_tiny_model
from rollout_service.config import ManagedServerSettings
from rollout_service.engine.managed import ManagedVLLMServer

PROMPTS, COMPLETIONS, TOKENS = 4, 8, 32
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=120)


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of every live process in process group ``pgid``."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) != pgid:
                continue
            with open(f"/proc/{entry.name}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:  # ended while we looked
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
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
    """Median wall and server CPU seconds a step, by dtype."""
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
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps-per-round", type=int, default=5)
    args = parser.parse_args()

    path, spec = MODEL_SIZES[args.model_size]
    model = build_tiny_model(Path(path), TinyModelSpec(**spec))
    logs = Path(tempfile.mkdtemp(prefix="bench-vllm-dtype-"))
    servers = {
        dtype: ManagedVLLMServer(
            ManagedServerSettings(model=model, dtype=dtype, log_file=logs / f"{dtype}.log"), served_model_name="bench"
        )
        for dtype in args.dtypes
    }
    try:
        for server in servers.values():
            server.start()
        results = asyncio.run(measure(servers, args.rounds, args.steps_per_round))
    finally:
        for server in servers.values():
            server.stop()

    first_wall, first_cpu = results[args.dtypes[0]]
    table = Table(
        title=f"one step's generation ({PROMPTS} x {COMPLETIONS} x {TOKENS} tokens), medians of {args.rounds} rounds"
    )
    for column in ("dtype", "wall ms a step", "", "server CPU ms a step", ""):
        table.add_column(column, justify="right")
    for dtype, (wall, cpu) in results.items():
        table.add_row(
            dtype, f"{1000 * wall:.1f}", f"{wall / first_wall:.2f}x", f"{1000 * cpu:.1f}", f"{cpu / first_cpu:.2f}x"
        )
    Console().print(table)


if __name__ == "__main__":
    main()
