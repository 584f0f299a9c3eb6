"""Stream throughput through the broker with the durable state store on and off.

Why: the store writes every scored group before a consumer may take it, and every ack,
so a restart loses nothing (``rollout_service.delivery.state_store``). The question is what
that costs the stream. This pushes groups of G samples through one run's broker as fast as
a producer and a consumer on one event loop can (put, take, ack: the path a scored group
takes, without vLLM), with the memory store and with SQLite (WAL, batched transactions),
alternated over rounds, and prints groups per second and the ratio. Target: at least 0.9x
of memory.

The default measure is the stream as a consumer gets it: each delivered group becomes its
StreamSamples response bytes. A group is encoded once (``edge.group_wire``): the SQLite store
does it at put, since it stores those bytes, and with memory the first delivery does. So
``--no-wire`` (the broker alone) charges SQLite with the encoding that memory leaves to the
stream; it shows the store's whole cost, not what a consumer sees.

Usage::

    python benchmarks/bench_state_store.py                       # G = 8, 64-token samples, 3 rounds
    python benchmarks/bench_state_store.py --no-wire             # the broker alone, no wire message
    python benchmarks/bench_state_store.py --groups 5000 --tokens 256 --output outputs/state_store.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from rollout_service.delivery.broker import ACK_TRAINED, RunBroker
from rollout_service.delivery.state_store import MemoryStore, SqliteStore, StateStore
from rollout_service.edge.group_wire import WireCodec, delivery_response
from rollout_service.metrics import ServiceMetrics
from rollout_service.types import EpisodeResult, PromptItem, ScoredGroup


def make_group(index: int, group_size: int, tokens: int) -> ScoredGroup:
    episodes = [
        EpisodeResult(
            completion_ids=list(range(tokens)),
            logprobs=[-0.5] * tokens,
            mask=[1] * tokens,
            finish_reason="length",
            text="x" * tokens,
            policy_version_first=1,
            policy_version_last=1,
        )
        for _ in range(group_size)
    ]
    return ScoredGroup(
        group_id=f"run-bench/{index}",
        run_id="run-bench",
        prompt=PromptItem(index, list(range(32)), "prompt " * 8),
        episodes=episodes,
        rewards=[float(i) for i in range(group_size)],
        reward_components={"r": [float(i) for i in range(group_size)]},
        reward_weights={"r": 1.0},
        advantages=[0.0] * group_size,
        generation_seconds=1.0,
        requested_size=group_size,
    )


async def stream(store: StateStore, groups: list[ScoredGroup], buffer: int, wire: bool = False) -> float:
    """Groups per second from the first put to the last ack; ``wire``: the consumer also
    turns each group into its StreamSamples response bytes, as the stream does (encoded once
    per group: by the SQLite store at put, else here at the first delivery)."""
    broker = RunBroker("run-bench", buffer, ServiceMetrics(), store=store)
    broker.subscribe("consumer")

    async def produce() -> None:
        """As the scheduler does: each scored group is put by its own task."""
        puts = set()
        for group in groups:
            assert await broker.reserve()
            task = asyncio.create_task(broker.put(group))
            puts.add(task)
            task.add_done_callback(puts.discard)
        await asyncio.gather(*puts)

    async def consume() -> None:
        for _ in groups:
            group = await broker.take("consumer")
            assert group is not None
            if wire:
                delivery_response(group, 1)
            broker.ack("consumer", [group.group_id], ACK_TRAINED)

    started = time.perf_counter()
    await asyncio.gather(produce(), consume())
    return len(groups) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--groups", type=int, default=10000,
        help="groups per round; the default takes ~2 s, so the SQLite rounds include WAL checkpoints (one per second)",
    )  # fmt: skip
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64, help="completion tokens per sample")
    parser.add_argument("--buffer", type=int, default=32, help="the run's max_buffered_groups")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--wire", action=argparse.BooleanOptionalAction, default=True,
        help="also turn each delivered group into its wire message, as the stream does (--no-wire: the broker alone)",
    )  # fmt: skip
    parser.add_argument("--output", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args()
    rates: dict[str, list[float]] = {"memory": [], "sqlite": []}
    flushes: list[float] = []  # writes per transaction, per SQLite round
    checkpoints: list[int] = []
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            for name in ("memory", "sqlite") if round_ % 2 == 0 else ("sqlite", "memory"):
                store: StateStore = (
                    MemoryStore() if name == "memory" else SqliteStore(Path(scratch) / f"r{round_}.db", WireCodec())
                )
                groups = [make_group(i, args.group_size, args.tokens) for i in range(args.groups)]  # none encoded yet
                try:
                    rates[name].append(asyncio.run(stream(store, groups, args.buffer, args.wire)))
                finally:
                    store.close()
                if isinstance(store, SqliteStore):
                    flushes.append(store.writes / max(store.flushes, 1))
                    checkpoints.append(store.checkpoints)
    what = "stream (broker + wire message)" if args.wire else "broker alone"
    table = Table(title=f"{what}, G = {args.group_size}, {args.tokens}-token samples, {args.groups} groups")
    for column in ("store", "groups/s (median)", "rounds", "vs memory"):
        table.add_column(column, justify="right")
    memory = statistics.median(rates["memory"])
    results = {}
    for name, values in rates.items():
        median = statistics.median(values)
        results[name] = {"groups_per_s": values, "median": median, "ratio": median / memory}
        table.add_row(name, f"{median:,.0f}", ", ".join(f"{v:,.0f}" for v in values), f"{median / memory:.2f}x")
    # Each round ran both stores back to back: the ratio within a round is spared the
    # machine's slower spells, which move both.
    paired = statistics.median(s / m for s, m in zip(rates["sqlite"], rates["memory"], strict=True))
    results["sqlite"]["paired_ratio"] = paired
    console = Console()
    console.print(table)
    console.print(f"SQLite vs memory within each round (median): {paired:.2f}x")
    console.print(
        f"SQLite: {statistics.median(flushes):.0f} writes per transaction (groups and acks), "
        f"{min(checkpoints)}-{max(checkpoints)} WAL checkpoints per round"
    )
    results["sqlite"] |= {"writes_per_transaction": flushes, "checkpoints": checkpoints}
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({"args": vars(args) | {"output": str(args.output)}, **results}, indent=2))


if __name__ == "__main__":
    main()
