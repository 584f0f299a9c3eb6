"""The rollout service's own ceiling: how many generated tokens per second one service process
carries, and what each token costs it, as the pool grows to 64 servers and 4096 episodes.

Why: on these machines vLLM is always the bottleneck, so the service's cost per token was never
seen; a pool of 64 GPUs generates about a million tokens per second, and every token is parsed,
scored, encoded, leased, streamed and acked by one Python process.

What runs, per configuration, each in its own processes:

- N stand-in vLLM servers (``standin_vllm.py``, a load generator that answers vLLM's endpoints
  at a set speed with valid token ids and logprobs, at near-zero cost);
- ``rollout-service serve`` against them, on one run over the built-in ``arithmetic`` dataset
  (G = 8, 256-token completions), with the real scorer: a trivial reward (``completion_length``)
  or a realistic one (``exact_answer`` and TRL's ``think_format_reward`` over the decoded text);
- C consumers in this process, streaming over gRPC and acking every group at once.

After a warm-up it measures a window and reports: generated tokens/s through the service, the
service process's CPU seconds per million tokens (its threads included), event-loop lag p50/p99
(the service's ``rollout_event_loop_lag_seconds``), group latency p50/p99 (first request to
scoring, against the stand-ins' own time), the cores the stand-ins and the consumers used, and
the stream's integrity: groups delivered once, acked once, none lost. ``--profile`` runs the
service of the first configuration under cProfile and prints where its CPU went.

Usage::

    python benchmarks/bench_service_ceiling.py --quick       # 16 servers, 1024 in flight, 4 consumers
    python benchmarks/bench_service_ceiling.py --output outputs/ceiling --profile
    python benchmarks/bench_service_ceiling.py --configs 1x1024x4,64x1024x4 --reward realistic
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import pstats
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import psutil
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))  # standin_vllm, run as a script

from standin_vllm import StandinFleet

from rollout_api.client import RolloutClient, dataset_run_spec, wait_until_serving
from rollout_common.ports import free_port
from rollout_common.tiny_model import build_tiny_model
from rollout_service.config import DEFAULT_MODEL_DIR

logger = logging.getLogger("bench_service_ceiling")
REWARDS = {
    "trivial": {"completion_length": 1.0},
    "realistic": {"exact_answer": 1.0, "trl.rewards:think_format_reward": 0.1},
}
REWARD_MODULES = {"realistic": ["trl.rewards:think_format_reward"]}
QUICK = "16x1024x4"
SWEEP = "1x1024x4,4x1024x4,16x1024x4,64x1024x4,16x64x4,16x256x4,16x4096x4,16x1024x1,16x1024x16"
LAG_METRIC = "rollout_event_loop_lag_seconds"
GROUP_SIZE = 8


@dataclass(frozen=True)
class Config:
    servers: int
    inflight: int
    consumers: int

    @classmethod
    def parse(cls, text: str) -> Config:
        servers, inflight, consumers = (int(part) for part in text.split("x"))
        return cls(servers, inflight, consumers)

    def __str__(self) -> str:
        return f"{self.servers}x{self.inflight}x{self.consumers}"


@dataclass
class Consumed:
    """What the consumers saw."""

    received: int = 0
    redelivered: int = 0
    ids: set[str] = field(default_factory=set)
    duplicates: int = 0
    acked: int = 0
    latencies: list[tuple[float, float]] = field(default_factory=list)
    """(arrival time, the group's first request to scoring in seconds)."""


@dataclass
class Result:
    config: str
    reward: str
    window_s: float
    tokens_per_s: float
    service_cores: float
    cpu_s_per_mtok: float
    slots_busy: float
    lag_p50_ms: float
    lag_p99_ms: float
    latency_p50_s: float
    latency_p99_s: float
    standin_latency_s: float
    standin_cores: float
    consumer_cores: float
    groups_scored: int
    groups_trained: int
    received: int
    duplicates: int
    redelivered: int
    lost: int
    lag_histogram: dict[str, float]
    """Loop-lag samples in the window, cumulative by upper bound in seconds."""


def histogram_quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """Prometheus' histogram_quantile over cumulative (upper bound, count) pairs: linear within a bucket."""
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return float("nan")
    rank, lower, below = q * total, 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if upper == float("inf"):
                return lower
            return lower + (upper - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = upper, count
    return lower


@dataclass
class Scrape:
    """What the window needs of the service's ``/metrics``."""

    lag: dict[float, float]
    """The loop-lag histogram's cumulative counts by upper bound."""
    slots_busy: float


def parse_scrape(text: str) -> Scrape:
    scrape = Scrape({}, 0.0)
    for family in text_string_to_metric_families(text):
        if family.name == LAG_METRIC:
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    scrape.lag[float(sample.labels["le"])] = sample.value
        elif family.name == "rollout_slots_busy":
            scrape.slots_busy = family.samples[0].value
    return scrape


async def scrape(session: aiohttp.ClientSession, url: str) -> Scrape:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as response:
        return parse_scrape(await response.text())


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = psutil.Process(pid).cpu_times()
            total += times.user + times.system
    return total


def service_command(config: Config, args: argparse.Namespace, urls: list[str], ports: tuple[int, int]) -> list[str]:
    grpc_port, metrics_port = ports
    command = [sys.executable]
    if args.profile_to is not None:
        command += ["-m", "cProfile", "-o", str(args.profile_to)]
    command += ["-m", "rollout_service.edge.cli", "serve", "--config", str(args.settings_file)]
    command += ["--port", str(grpc_port), "--metrics-port", str(metrics_port), "--max-inflight", str(config.inflight)]
    for url in urls:
        command += ["--vllm-url", url]
    if args.state_store:
        command += ["--state-store", str(args.workdir / f"state-{config}.sqlite")]
    for module in REWARD_MODULES.get(args.reward, []):
        command += ["--reward-module", module]
    return [*command, "--log-level", args.service_log_level]


def write_settings(path: Path, model_dir: Path) -> None:
    """The service's settings beyond its flags: the stand-ins' tokenizer and model name."""
    path.write_text(f"engine:\n  tokenizer: {model_dir}\n  model: standin\nmetrics_host: 127.0.0.1\n")


async def consume(client: RolloutClient, run_id: str, name: str, seen: Consumed, stop: asyncio.Event) -> None:
    stream = client.stream(run_id, name, credits=64)
    async for group in stream:
        if group.group_id in seen.ids:
            seen.duplicates += 1
        seen.ids.add(group.group_id)
        seen.received += 1
        seen.redelivered += group.delivery_attempt > 1
        seen.latencies.append((time.monotonic(), group.generation_seconds))
        stream.ack([group.group_id], regrant=not stop.is_set())
        seen.acked += 1
        if stop.is_set():
            break
    await stream.flushed()
    await stream.aclose()


async def wait_for_acks(client: RolloutClient, run_id: str, acked: int, timeout_s: float = 30.0) -> None:
    """Until the service counts every ack the consumers sent (polled: another process's state)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if (await client.get_run(run_id)).stats.groups_trained >= acked or time.monotonic() > deadline:
            return
        await asyncio.sleep(0.2)


async def measure(config: Config, args: argparse.Namespace) -> Result:
    ports = (free_port(), free_port())
    target = f"127.0.0.1:{ports[0]}"
    metrics_url = f"http://127.0.0.1:{ports[1]}/metrics"
    fleet = StandinFleet(
        config.servers,
        model="standin",
        vocab_size=args.vocab_size,
        eos_token_id=args.eos_token_id,
        length=args.lengths or str(args.max_tokens),
        ttft_s=args.ttft_s,
        tokens_per_s=0.0,
        max_seq_tokens_per_s=args.seq_tokens_per_s,
    )
    async with fleet:
        service = await asyncio.create_subprocess_exec(*service_command(config, args, fleet.urls, ports))
        try:
            return await drive(config, args, target, metrics_url, service.pid, fleet.pids)
        finally:
            if service.returncode is None:
                service.send_signal(signal.SIGINT)
                try:
                    await asyncio.wait_for(service.wait(), 60)
                except TimeoutError:
                    service.kill()
                    await service.wait()


async def drive(
    config: Config, args: argparse.Namespace, target: str, metrics_url: str, service_pid: int, standin_pids: list[int]
) -> Result:
    await wait_until_serving(target, timeout_s=120, poll_s=0.5)
    me = [os.getpid()]
    async with RolloutClient(target, timeout_s=30) as client, aiohttp.ClientSession() as session:
        spec = dataset_run_spec("arithmetic", REWARDS[args.reward], group_size=GROUP_SIZE, max_tokens=args.max_tokens)
        spec.sampling.temperature = 1.0
        spec.max_buffered_groups = 2 * config.inflight // GROUP_SIZE  # room for every slot's group, and as many ready
        run = await client.create_run(spec)
        seen, stop = Consumed(), asyncio.Event()
        consumers = [
            asyncio.create_task(consume(client, run.run_id, f"consumer-{i}", seen, stop))
            for i in range(config.consumers)
        ]
        await asyncio.sleep(args.warmup)  # the unmeasured warm-up
        tokens0 = (await client.get_run(run.run_id)).stats.tokens_generated
        before, start = await scrape(session, metrics_url), time.monotonic()
        cpu0 = [cpu_seconds([service_pid]), cpu_seconds(standin_pids), cpu_seconds(me)]
        busy = []
        while time.monotonic() < start + args.seconds:
            await asyncio.sleep(1.0)  # the measured window, sampling the busy slots each second
            busy.append((await scrape(session, metrics_url)).slots_busy)
        window = time.monotonic() - start
        cpu1 = [cpu_seconds([service_pid]), cpu_seconds(standin_pids), cpu_seconds(me)]
        tokens1 = (await client.get_run(run.run_id)).stats.tokens_generated
        after = await scrape(session, metrics_url)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*consumers), 60)
        await wait_for_acks(client, run.run_id, seen.acked)
        stats = (await client.get_run(run.run_id)).stats
        await client.delete_run(run.run_id)
    service_cpu, standin_cpu, consumer_cpu = (after - before for before, after in zip(cpu0, cpu1, strict=True))
    tokens = tokens1 - tokens0
    lag = [(upper, after.lag[upper] - before.lag.get(upper, 0.0)) for upper in sorted(after.lag)]
    latencies = [seconds for arrived, seconds in seen.latencies if start <= arrived <= start + window]
    held = stats.groups_trained + stats.groups_buffered + stats.groups_leased + stats.groups_dropped_stale
    return Result(
        config=str(config),
        reward=args.reward,
        window_s=window,
        tokens_per_s=tokens / window,
        service_cores=service_cpu / window,
        cpu_s_per_mtok=service_cpu / max(tokens, 1) * 1e6,
        slots_busy=statistics.fmean(busy),
        lag_p50_ms=histogram_quantile(lag, 0.5) * 1e3,
        lag_p99_ms=histogram_quantile(lag, 0.99) * 1e3,
        latency_p50_s=percentile(latencies, 0.5),
        latency_p99_s=percentile(latencies, 0.99),
        standin_latency_s=args.ttft_s + args.max_tokens / args.seq_tokens_per_s,
        lag_histogram={str(upper): count for upper, count in lag},
        standin_cores=standin_cpu / window,
        consumer_cores=consumer_cpu / window,
        groups_scored=stats.groups_scored,
        groups_trained=stats.groups_trained,
        received=seen.received,
        duplicates=seen.duplicates,
        redelivered=seen.redelivered,
        lost=stats.groups_scored - held,
    )


def report(results: list[Result], console: Console) -> None:
    table = Table(title="The service's ceiling (servers x in flight x consumers; G = 8)")
    columns = [
        "config", "reward", "tokens/s", "service cores", "CPU s / Mtok", "slots busy", "lag p50 ms", "lag p99 ms",
        "latency p50 s", "latency p99 s", "stand-in s", "stand-in cores", "consumer cores", "received",
        "acked", "dup", "lost",
    ]  # fmt: skip
    for column in columns:
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(
            r.config, r.reward, f"{r.tokens_per_s:,.0f}", f"{r.service_cores:.2f}", f"{r.cpu_s_per_mtok:.1f}",
            f"{r.slots_busy:.0f}", f"{r.lag_p50_ms:.1f}", f"{r.lag_p99_ms:.1f}", f"{r.latency_p50_s:.2f}",
            f"{r.latency_p99_s:.2f}",
            f"{r.standin_latency_s:.2f}", f"{r.standin_cores:.2f}", f"{r.consumer_cores:.2f}", str(r.received),
            str(r.groups_trained), str(r.duplicates), str(r.lost),
        )  # fmt: skip
    console.print(table)


def print_profile(path: Path, console: Console, top: int = 25) -> None:
    stats = pstats.Stats(str(path))
    total = stats.total_tt  # type: ignore[attr-defined]
    table = Table(title=f"Where the service's CPU went (cProfile, own time, {total:.1f} s in all)")
    for column in ["function", "own s", "share", "calls", "with callees s"]:
        table.add_column(column, justify="right" if column != "function" else "left")
    rows = sorted(stats.stats.items(), key=lambda item: item[1][2], reverse=True)[:top]  # type: ignore[attr-defined]
    for (filename, line, name), (_, calls, own, cumulative, _) in rows:
        where = f"{Path(filename).name}:{line}:{name}" if line else name
        table.add_row(where, f"{own:.2f}", f"{own / total:.1%}", str(calls), f"{cumulative:.2f}")
    console.print(table)


async def benchmark(args: argparse.Namespace) -> list[Result]:
    results = []
    for index, config in enumerate(args.configs):
        args.profile_to = args.workdir / "service.prof" if args.profile and index == 0 else None
        logger.info("measuring %s (%s reward)", config, args.reward)
        result = await measure(config, args)
        logger.info("%s: %.0f tokens/s, %.1f CPU s per Mtok", config, result.tokens_per_s, result.cpu_s_per_mtok)
        results.append(result)
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=SWEEP, help="SERVERSxINFLIGHTxCONSUMERS, comma-separated")
    parser.add_argument("--quick", action="store_true", help=f"one configuration ({QUICK}), a short window")
    parser.add_argument("--reward", choices=sorted(REWARDS), default="trivial")
    parser.add_argument("--max-tokens", type=int, default=256, help="every completion's length")
    parser.add_argument("--lengths", help="completion lengths A:B, uniform (default: every one --max-tokens)")
    parser.add_argument("--ttft-s", type=float, default=0.02, help="the stand-ins' time to first token")
    parser.add_argument(
        "--seq-tokens-per-s", type=float, default=1000.0, help="the stand-ins' speed per sequence (no batch limit)"
    )
    parser.add_argument(
        "--state-store", action="store_true", help="keep runs and unacked groups in SQLite (default: memory)"
    )
    parser.add_argument("--warmup", type=float, default=10.0, help="unmeasured seconds after the run starts")
    parser.add_argument("--seconds", type=float, default=20.0, help="the measured window")
    parser.add_argument("--profile", action="store_true", help="run the first configuration's service under cProfile")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR, help="the tokenizer the service uses")
    parser.add_argument("--output", type=Path, help="a folder for results.json (and service.prof)")
    parser.add_argument("--service-log-level", default="ERROR", help="the service's --log-level")
    args = parser.parse_args(argv)
    if args.quick:
        args.configs, args.warmup, args.seconds = QUICK, 8.0, 15.0
    try:
        args.configs = [Config.parse(part) for part in args.configs.split(",") if part.strip()]
    except ValueError:
        parser.error(f"--configs: {args.configs!r} is not a list of SERVERSxINFLIGHTxCONSUMERS, e.g. {QUICK}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(message)s")
    if not (args.model_dir / "config.json").exists():
        build_tiny_model(args.model_dir)
    config = json.loads((args.model_dir / "config.json").read_text())
    args.vocab_size, args.eos_token_id = int(config["vocab_size"]), int(config.get("eos_token_id") or 0)
    with tempfile.TemporaryDirectory() as scratch:
        args.workdir = args.output or Path(scratch)
        args.workdir.mkdir(parents=True, exist_ok=True)
        args.settings_file = args.workdir / "service.yaml"
        write_settings(args.settings_file, args.model_dir)
        results = asyncio.run(benchmark(args))
        console = Console(width=200)
        report(results, console)
        if args.profile:
            print_profile(args.workdir / "service.prof", console)
        if args.output:
            payload = {"args": {k: str(v) for k, v in vars(args).items()}, "results": [asdict(r) for r in results]}
            (args.output / "results.json").write_text(json.dumps(payload, indent=2))
    print(f"service tokens/s: {statistics.fmean(r.tokens_per_s for r in results):.0f}")


if __name__ == "__main__":
    main()
