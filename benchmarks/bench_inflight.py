"""How ``scheduler.max_inflight`` trades throughput against vLLM preemptions, on one vLLM
server with long completions.

Too few sequences in flight leave vLLM's batch small; too many overfill its KV cache, and
vLLM preempts running sequences, which recompute their cache later. The KV cache is made
small on purpose (``--num-gpu-blocks-override``), as a large model's is on a real GPU, so
that the trade shows on the tiny model.

Each mode (``fixed-N``: N slots) is a service of its own on the same vLLM server, with a run
on the built-in dataset whose groups are acked as they arrive (the trainer is never the
bottleneck). Modes alternate over rounds. Per mode it reports generated tokens/s in the
measured window, vLLM's preemptions in the window and in its second half (the steady
state), mean KV usage, and mean sequences running; it plots KV usage and sequences running
over time.

Usage::

    python benchmarks/bench_inflight.py --output outputs/bench_inflight/result.json
    python benchmarks/bench_inflight.py --modes fixed-8,fixed-64 --kv-blocks 128 --seconds 30
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table

from rollout_api.client import RolloutClient, dataset_run_spec
from rollout_common.tiny_model import build_tiny_model
from rollout_service.app import running_service
from rollout_service.config import DEFAULT_MODEL_DIR, ManagedServerSettings, load_settings
from rollout_service.engine.managed import ManagedVLLMServer
from rollout_service.engine.server_load import parse_server_load
from trainer_client.svg_plot import line_plot

logger = logging.getLogger("bench_inflight")
SAMPLE_EVERY_S = 0.5


@dataclass
class Trace:
    """vLLM's load, sampled through a phase."""

    t: list[float] = field(default_factory=list)
    kv_usage: list[float] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    preemptions: list[float] = field(default_factory=list)

    def between(self, start: float, end: float) -> list[int]:
        return [i for i, t in enumerate(self.t) if start <= t <= end]


@dataclass
class Phase:
    mode: str
    round: int
    window_s: float
    tokens: int
    preemptions: float
    steady_preemptions: float
    """In the second half of the window."""
    mean_kv_usage: float
    mean_running: float
    trace: Trace

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.window_s


def settings_for(mode: str, server: ManagedVLLMServer, args: argparse.Namespace) -> Any:
    """``fixed-N``: N slots."""
    scheduler: dict[str, Any] = {"max_inflight": int(mode.removeprefix("fixed-"))}
    engine = {"urls": [server.url], "tokenizer": str(args.model_dir), "model": "tiny"}
    return load_settings(port=0, metrics_port=None, engine=engine, scheduler=scheduler)


async def sample(session: aiohttp.ClientSession, url: str, origin: float, trace: Trace) -> None:
    while True:
        async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=5)) as response:
            load = parse_server_load(await response.text())
        trace.t.append(time.monotonic() - origin)
        trace.kv_usage.append(load.kv_cache_usage)
        trace.running.append(load.running)
        trace.preemptions.append(load.preemptions)
        await asyncio.sleep(SAMPLE_EVERY_S)  # a sampling period, not synchronisation


async def run_phase(server: ManagedVLLMServer, args: argparse.Namespace, mode: str, round_: int) -> Phase:
    trace = Trace()
    async with (
        running_service(settings_for(mode, server, args)) as service,
        RolloutClient(service.grpc_target, timeout_s=30) as client,
        aiohttp.ClientSession() as session,
    ):
        spec = dataset_run_spec(
            "letters", {"char_fraction": 1.0}, group_size=args.group_size, max_tokens=args.max_tokens
        )
        spec.sampling.temperature = 1.0
        run = await client.create_run(spec)
        origin = time.monotonic()
        stream = client.stream(run.run_id, f"bench-{mode}", credits=256)

        async def consume() -> None:
            async for group in stream:
                stream.ack([group.group_id])

        tasks = [
            asyncio.create_task(consume()),
            asyncio.create_task(sample(session, server.url, origin, trace)),
        ]
        try:
            await asyncio.sleep(args.warmup)
            before = (await client.get_run(run.run_id)).stats.tokens_generated
            start = time.monotonic() - origin
            await asyncio.sleep(args.seconds)
            after = (await client.get_run(run.run_id)).stats.tokens_generated
            end = time.monotonic() - origin
        finally:
            stream.cancel()
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            await client.delete_run(run.run_id)
    window = trace.between(start, end)
    second_half = trace.between((start + end) / 2, end)

    def grew(indices: list[int]) -> float:
        return trace.preemptions[indices[-1]] - trace.preemptions[indices[0]] if indices else 0.0

    return Phase(
        mode, round_, end - start, after - before, grew(window), grew(second_half),
        statistics.fmean(trace.kv_usage[i] for i in window), statistics.fmean(trace.running[i] for i in window),
        trace,
    )  # fmt: skip


async def benchmark(args: argparse.Namespace) -> list[Phase]:
    settings = ManagedServerSettings(
        model=args.model_dir,
        cpu_placement="off",
        extra_args=["--num-gpu-blocks-override", str(args.kv_blocks)],
    )
    phases: list[Phase] = []
    with ManagedVLLMServer(settings, served_model_name="tiny") as server:
        for round_ in range(args.rounds):
            for mode in args.modes if round_ % 2 == 0 else list(reversed(args.modes)):
                logger.info("round %d: %s", round_, mode)
                phase = await run_phase(server, args, mode, round_)
                logger.info("%s: %.0f tok/s, %d preemptions", mode, phase.tokens_per_s, phase.preemptions)
                phases.append(phase)
    return phases


def report(phases: list[Phase], args: argparse.Namespace, console: Console) -> dict[str, dict[str, float]]:
    table = Table(title=f"max_inflight, {args.kv_blocks} KV blocks of 32 tokens, {args.max_tokens}-token completions")
    for column in [
        "mode",
        "tok/s",
        "vs best",
        "preemptions",
        "steady preemptions",
        "KV usage",
        "running",
    ]:
        table.add_column(column, justify="right")
    summary: dict[str, dict[str, float]] = {}
    for mode in args.modes:
        mine = [p for p in phases if p.mode == mode]
        summary[mode] = {
            "tokens_per_s": sum(p.tokens for p in mine) / sum(p.window_s for p in mine),
            "preemptions": sum(p.preemptions for p in mine) / len(mine),
            "steady_preemptions": sum(p.steady_preemptions for p in mine) / len(mine),
            "mean_kv_usage": statistics.fmean(p.mean_kv_usage for p in mine),
            "mean_running": statistics.fmean(p.mean_running for p in mine),
        }
    best = max(s["tokens_per_s"] for s in summary.values())
    for mode, s in summary.items():
        table.add_row(
            mode, f"{s['tokens_per_s']:.0f}", f"{s['tokens_per_s'] / best:.2f}x", f"{s['preemptions']:.0f}",
            f"{s['steady_preemptions']:.0f}", f"{s['mean_kv_usage']:.2f}", f"{s['mean_running']:.1f}",
        )  # fmt: skip
    console.print(table)
    return summary


def plot(phases: list[Phase], path: Path) -> None:
    usage = {f"{p.mode}#{p.round}": list(zip(p.trace.t, p.trace.kv_usage, strict=True)) for p in phases}
    line_plot(usage, path.with_suffix(".kv_usage.svg"), "vLLM KV-cache usage", "seconds into the phase")
    running = {f"{p.mode}#{p.round}": list(zip(p.trace.t, p.trace.running, strict=True)) for p in phases}
    line_plot(running, path.with_suffix(".running.svg"), "sequences running in vLLM", "seconds into the phase")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument(
        "--modes", default="fixed-8,fixed-32,fixed-64,fixed-128", help="fixed-N (N slots), comma-separated"
    )
    parser.add_argument("--kv-blocks", type=int, default=256, help="vLLM's KV-cache blocks (32 tokens each)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--warmup", type=float, default=15.0, help="unmeasured seconds at the start of a phase")
    parser.add_argument("--seconds", type=float, default=40.0, help="measured window per phase")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--output", type=Path, help="JSON of the phases; SVG plots go next to it")
    args = parser.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for mode in args.modes:
        count = mode.removeprefix("fixed-")
        if not (mode.startswith("fixed-") and count.isdigit() and int(count) >= 1):
            parser.error(f"--modes: {mode!r} is not fixed-N with N >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level="INFO", format="%(message)s", handlers=[RichHandler(console=Console(stderr=True))])
    logging.getLogger("rollout_service").setLevel(logging.WARNING)
    if not (args.model_dir / "config.json").exists():
        build_tiny_model(args.model_dir)
    phases = asyncio.run(benchmark(args))
    summary = report(phases, args, Console(width=160))
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        payload = {"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary}
        args.output.write_text(json.dumps({**payload, "phases": [asdict(p) for p in phases]}, indent=2))
        plot(phases, args.output)


if __name__ == "__main__":
    main()
