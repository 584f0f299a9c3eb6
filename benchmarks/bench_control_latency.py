"""How long a call through vLLM's control path takes, idle and while a training run generates.

Why: a weight push makes two such calls on every server (``/update_weights`` and
``/finish_weight_update``, after ``/start_weight_update`` opened ahead), each crossing vLLM's
API server, its engine core (which takes utility calls between engine steps) and its worker.
The worker's own part of a push is a few milliseconds of receive and apply (its log says
how many), yet a push lasts tens of milliseconds. This times three calls that do no work of
their own, each going one step further:

- ``GET /health``: the API server only;
- ``GET /is_sleeping``: the API server and the engine core;
- ``POST /collective_rpc`` (the worker's ``check_health``): all three. A managed server pinned
  to one core runs its worker in the engine core's process
  (``engine.managed.worker_in_engine_process``), so there the last step is a call, not a process.

It starts the rollout service with its managed vLLM (as ``bench_vs_trl.py`` does), times the
calls with nothing running, then starts ``bench_vs_trl.py``'s ``rollout-trainer`` run (its
task and settings) and times them again once it has trained 15 steps.

Usage::

    python benchmarks/bench_control_latency.py                    # the small benchmark model
    python benchmarks/bench_control_latency.py --probes 100
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

HERE = Path(__file__).resolve().parent
DEFAULT_MODEL = HERE.parent / "models" / "small-qwen2"
CALLS = {
    "GET /health": "API server",
    "GET /is_sleeping": "API server, engine core",
    "POST /collective_rpc check_health": "API server, engine core, worker",
}
PROBE_GAP_S = 0.023
"""Pause between rounds of probes, so they sample the run rather than crowd it."""


async def call(session: aiohttp.ClientSession, url: str, name: str) -> float:
    method, path = name.split()[:2]
    body = {"method": "check_health"} if path == "/collective_rpc" else None
    started = time.perf_counter()
    async with session.request(method, url + path, json=body) as response:
        await response.read()
        response.raise_for_status()
    return time.perf_counter() - started


async def probe(url: str, rounds: int) -> dict[str, list[float]]:
    """Each call ``rounds`` times, in turn."""
    seconds: dict[str, list[float]] = {name: [] for name in CALLS}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for _ in range(rounds):
            for name in CALLS:
                seconds[name].append(await call(session, url, name))
            await asyncio.sleep(PROBE_GAP_S)  # a sampling rate, not a wait for an event
    return seconds


async def trained_steps(process: asyncio.subprocess.Process, steps: int, timeout_s: float) -> None:
    """Read the trainer's log until it reports ``steps`` steps (its INFO line per step)."""
    assert process.stderr is not None
    marker = f"step {steps}:"
    while True:
        line = await asyncio.wait_for(process.stderr.readline(), timeout_s)
        if not line:
            raise RuntimeError(f"the trainer ended before its step {steps} (exit code {await process.wait()})")
        if marker in line.decode(errors="replace"):
            return


async def measure(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    sys.path.insert(0, str(HERE))  # the service imports the reward module by name; bench_vs_trl's trainer
    import bench_vs_trl
    from vs_trl.project_side import trainer_command

    from rollout_service.app import running_service
    from rollout_service.config import load_settings

    engine = {"managed": {"model": str(args.model_dir)}}
    settings = load_settings(port=0, metrics_port=None, engine=engine, reward_modules=["bench_rewards"])
    async with running_service(settings) as service:
        url = service.engine_urls[0]
        measured = {"idle": await probe(url, args.probes)}
        run = bench_vs_trl.parse_args(["--model-dir", str(args.model_dir), "--steps", str(args.steps)])
        with tempfile.TemporaryDirectory(prefix="bench-control-") as out:
            trainer = await asyncio.create_subprocess_exec(
                *trainer_command(run, service.grpc_target, Path(out)),
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
            )
            try:
                await trained_steps(trainer, 15, args.timeout_s)
                drain = asyncio.create_task(trainer.stderr.read())  # type: ignore[union-attr]
                measured["in a run"] = await probe(url, args.probes)
                await asyncio.wait_for(trainer.wait(), args.timeout_s)
                await drain
            finally:
                if trainer.returncode is None:
                    trainer.kill()
                    await trainer.wait()
    return measured


def report(measured: dict[str, dict[str, list[float]]], probes: int) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"vLLM control calls, ms: median (10th-90th percentile) of {probes}")
    table.add_column("call")
    table.add_column("crosses")
    for situation in measured:
        table.add_column(situation, justify="right")
    for name, crosses in CALLS.items():
        cells = []
        for seconds in measured.values():
            deciles = statistics.quantiles(seconds[name], n=10)
            cells.append(
                f"{1e3 * statistics.median(seconds[name]):.1f} ({1e3 * deciles[0]:.1f}-{1e3 * deciles[-1]:.1f})"
            )
        table.add_row(name, crosses, *cells)
    Console().print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL, help="a Qwen2-shaped checkpoint")
    parser.add_argument("--probes", type=int, default=40, help="rounds of the three calls, idle and in the run")
    parser.add_argument("--steps", type=int, default=200, help="the run's steps (it must outlast the probes)")
    parser.add_argument("--timeout-s", type=float, default=300)
    args = parser.parse_args()
    if not args.model_dir.is_dir():
        sys.exit(f"{args.model_dir} is not a checkpoint folder; build one with bench_vs_trl.py --model-size small")
    os.environ.setdefault("LOG_LEVEL", "WARNING")
    report(asyncio.run(measure(args)), args.probes)


if __name__ == "__main__":
    main()
