"""How long a large SubmitPrompts holds up the service's other RPCs.

Why: a client may submit a whole dataset at once. Converting, rendering (chat template and
tokenizer) and storing 100k prompts takes seconds; while it does, every other RPC (a
trainer's GetStats, its stream's acks) must still be answered promptly. This starts the
real service core and gRPC edge (no vLLM: its engine never answers, so nothing is
generated), submits N chat prompts in one call from another process, and meanwhile sends
GetStats every 10 ms.
It prints the submit's seconds and the worst GetStats latency and event-loop lag, with the
memory and the SQLite state store, without and with the objects of start-up frozen out of the
garbage collector's passes, as the service does (``freeze_startup_objects``).

Usage::

    python benchmarks/bench_prompt_submission.py                  # 100k prompts
    python benchmarks/bench_prompt_submission.py --prompts 20000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from rich.console import Console
from rich.table import Table
from transformers import AutoTokenizer

from rollout_api import rollout_pb2 as pb
from rollout_api.client import RolloutClient
from rollout_common.tiny_model import build_tiny_model
from rollout_service.app import freeze_startup_objects
from rollout_service.config import SchedulerSettings
from rollout_service.delivery.state_store import MemoryStore, SqliteStore, StateStore
from rollout_service.edge.group_wire import WireCodec
from rollout_service.edge.server import start_grpc_server
from rollout_service.generation.prompts import PromptRenderer
from rollout_service.metrics import ServiceMetrics
from rollout_service.scoring.rewards import RewardRegistry
from rollout_service.service import RolloutService, ServiceInfo
from rollout_service.types import Completion, SamplingParams

PROBE_INTERVAL_S = 0.01


class SilentEngine:
    """An engine that never answers: the benchmark measures submission, not generation."""

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *, affinity: str | None = None):
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def generate_many(
        self, prompt_ids: list[int], params: SamplingParams, n: int, *, affinity: str | None = None
    ) -> list[Completion]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


def submit_in_a_process(target: str, run_id: str, prompts: int) -> float:
    """Build ``prompts`` chat prompts and submit them in one call; the call's seconds."""

    async def submit() -> float:
        batch = [
            pb.Prompt(
                messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=f"Write the letter a {i}")])
            )
            for i in range(prompts)
        ]
        async with RolloutClient(target, timeout_s=600) as client:
            started = time.perf_counter()
            await client.submit_prompts(run_id, batch)
            return time.perf_counter() - started

    return asyncio.run(submit())


async def probe(client: RolloutClient, latencies: list[float], lags: list[float], stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        started = loop.time()
        await client.stats()
        latencies.append(loop.time() - started)
        slept_from = loop.time()
        await asyncio.sleep(PROBE_INTERVAL_S)  # the probe's period
        lags.append(loop.time() - slept_from - PROBE_INTERVAL_S)


async def one_sitting(store: StateStore, tokenizer, prompts: int, freeze: bool) -> dict[str, float]:  # type: ignore[no-untyped-def]
    service = RolloutService(
        engine=SilentEngine(),  # type: ignore[arg-type]
        renderer=PromptRenderer(tokenizer, max_model_len=1024),
        rewards=RewardRegistry(),
        metrics=ServiceMetrics(),
        settings=SchedulerSettings(max_inflight=4),
        info=ServiceInfo(model="tiny", engine_urls=[], max_inflight=4),
        store=store,
    )
    server, port, _ = await start_grpc_server(service, "127.0.0.1", 0)
    with contextlib.ExitStack() as stack:
        if freeze:
            freeze_startup_objects(stack)  # as the service's start-up ends
        return await submitted(service, server, port, prompts)


async def submitted(service: RolloutService, server, port: int, prompts: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    try:
        async with RolloutClient(f"127.0.0.1:{port}", timeout_s=600) as client:
            spec = pb.RunSpec(group_size=2, reward_functions=[pb.RewardFunctionSpec(name="char_fraction")])
            spec.prompt_source.submitted.SetInParent()
            spec.sampling.max_tokens = 16
            run = await client.create_run(spec)
            latencies: list[float] = []
            lags: list[float] = []
            stop = asyncio.Event()
            probing = asyncio.ensure_future(probe(client, latencies, lags, stop))
            # The submitting client runs in a process of its own: building and encoding its
            # request is its cost, not the service's.
            submitter = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
            try:
                seconds = await asyncio.get_running_loop().run_in_executor(
                    submitter, submit_in_a_process, f"127.0.0.1:{port}", run.run_id, prompts
                )
                stop.set()
                await probing
            finally:  # after the probe: joining the process blocks, and is not the service's lag
                submitter.shutdown()
            return {"submit_s": seconds, "max_rpc_s": max(latencies), "max_lag_s": max(lags), "probes": len(latencies)}
    finally:
        await server.stop(1)
        await service.close()
        service.store.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=100_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(Path(scratch) / "tiny"))
        rows = []
        for freeze in (False, True):
            for name in ("memory", "sqlite"):
                store: StateStore = (
                    MemoryStore() if name == "memory" else SqliteStore(Path(scratch) / "s.db", WireCodec())
                )
                rows.append((name, freeze, await one_sitting(store, tokenizer, args.prompts, freeze)))
    table = Table(title=f"SubmitPrompts of {args.prompts} chat prompts, GetStats every {PROBE_INTERVAL_S * 1e3:g} ms")
    columns = ("store", "start-up objects frozen", "submit s", "worst GetStats ms", "worst loop lag ms", "GetStats")
    for column in columns:
        table.add_column(column, justify="right")
    for name, freeze, row in rows:
        table.add_row(
            name,
            "yes" if freeze else "no",
            f"{row['submit_s']:.2f}",
            f"{row['max_rpc_s'] * 1e3:.0f}",
            f"{row['max_lag_s'] * 1e3:.0f}",
            str(int(row["probes"])),
        )
    Console().print(table)


if __name__ == "__main__":
    asyncio.run(main())
