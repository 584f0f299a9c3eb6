"""Throughput of the rollout service against a plain client, on the same vLLM server.

Why: the service exists to keep vLLM saturated while groups are scored and streamed. The
only honest check is a side-by-side: the same server, the same prompts, the same sampling
parameters, the same number of requests in flight, once driven by a bare aiohttp client
(the ceiling) and once through the service and its gRPC stream (what a trainer gets).

Phases alternate (raw, service, raw, service, ...) so drift in the machine's load hits both
sides alike. Each phase has a warm-up that is not measured, a steady-state window that is,
and a drain afterwards that is not. During every phase vLLM's own ``/metrics`` is polled for
``vllm:num_requests_running``: if the service keeps its slots full, that count matches the
raw client's. Even the raw client does not sit at ``--max-inflight`` all the time: requests
of equal length finish on the same engine step and their successors need an HTTP round
trip to be admitted, so the raw phase's fraction is the reference for the service's.

Completions can stop at EOS (``ignore_eos`` is not part of the service's API), so lengths
vary; the comparison is therefore in generated tokens per second, not requests per second.

Usage::

    python benchmarks/bench_throughput.py --vllm-url http://127.0.0.1:8000 --model-dir /path/to/model
    python benchmarks/bench_throughput.py            # builds and serves the tiny model itself
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import statistics
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table

from rollout_api import rollout_pb2 as pb
from rollout_api.client import RolloutClient, dataset_run_spec
from rollout_service.app import describe_model, load_tokenizer, running_service
from rollout_service.config import DEFAULT_MODEL_DIR, ManagedServerSettings, load_settings
from rollout_service.engine.vllm_client import completion_body, parse_completion
from rollout_service.generation.prompts import PromptRenderer, builtin_dataset
from rollout_service.types import SamplingParams

logger = logging.getLogger("bench_throughput")

DATASET = "letters"
REWARDS = {"char_fraction": 1.0}
POLL_INTERVAL_S = 0.1
METRICS_TIMEOUT_S = 2.0
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 120.0
DRAIN_TIMEOUT_S = 60.0
SERVICE_TARGET_RATIO = 0.95
SLOT_FILL_TARGET = 0.95
STARVED_SAMPLE_FRACTION = 0.7
STARVED_LOOP_LAG_S = 0.5


# -- results -------------------------------------------------------------------------------
@dataclass
class PhaseResult:
    """One measured phase; times are seconds since the phase started."""

    phase: str
    round: int
    window_s: float
    tokens: int
    tokens_per_s: float
    completions: int
    mean_running: float
    fraction_at_limit: float
    samples_in_window: int
    max_loop_lag_s: float
    bench_cpu_cores: float
    """CPU this process used in the window, in cores: the client, and for phase b the service too."""
    """Worst event-loop stall of this process in the window (the in-process service shares the loop)."""
    delivered_tokens_per_s: float | None = None
    """Service only: tokens of groups received by the consumer in the window (group granularity)."""
    window_start_s: float = 0.0
    window_end_s: float = 0.0
    running_trace: list[tuple[float, float, float]] = field(default_factory=list)
    """(t, running, waiting) for every /metrics sample of the phase, warm-up and tail included."""


# -- vLLM /metrics -------------------------------------------------------------------------
def parse_vllm_gauges(text: str) -> tuple[float, float]:
    """Running and waiting requests from vLLM's Prometheus text, summed over engines."""
    running = waiting = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            running += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:num_requests_waiting{") or line.startswith("vllm:num_requests_waiting "):
            waiting += float(line.rsplit(" ", 1)[1])
    return running, waiting


async def read_vllm_gauges(session: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=METRICS_TIMEOUT_S)) as resp:
        resp.raise_for_status()
        return parse_vllm_gauges(await resp.text())


def fetch_vllm_gauges(url: str) -> tuple[float, float]:
    """Blocking variant of ``read_vllm_gauges`` for the poller thread."""
    with urllib.request.urlopen(url + "/metrics", timeout=METRICS_TIMEOUT_S) as resp:
        return parse_vllm_gauges(resp.read().decode())


class RunningPoller:
    """Samples vLLM's running/waiting gauges every ~100 ms from a thread of its own.

    A thread, not a task: the service under test shares this process's event loop, and a
    poller on that loop would go quiet exactly when the loop is overloaded, hiding the dips
    it exists to show. Timestamps are taken when each answer arrives.
    """

    def __init__(self, url: str, origin: float) -> None:
        self.url = url
        self.origin = origin
        self.samples: list[tuple[float, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="vllm-metrics-poller", daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                running, waiting = fetch_vllm_gauges(self.url)
                self.samples.append((time.monotonic() - self.origin, running, waiting))
            except (OSError, ValueError) as exc:  # URLError and timeouts are OSErrors
                logger.debug("metrics poll failed: %s", exc)
            self._stop.wait(max(0.0, POLL_INTERVAL_S - (time.monotonic() - started)))

    def start(self) -> None:
        self._thread.start()

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.to_thread(self._thread.join, METRICS_TIMEOUT_S + 1)

    def window_stats(self, start: float, end: float, limit: int) -> tuple[float, float, int]:
        """Mean running, fraction of samples at the slot limit, and sample count in [start, end]."""
        running = [r for t, r, _ in self.samples if start <= t <= end]
        if not running:
            return float("nan"), float("nan"), 0
        return statistics.fmean(running), sum(r >= limit for r in running) / len(running), len(running)


class LoopLagMonitor:
    """Event-loop stalls and this process's CPU use, sampled every 50 ms.

    Both say whether the client side (for phase b: the in-process service) is the bottleneck;
    on a small CPU box every core this process takes is one vLLM does not get.
    """

    def __init__(self) -> None:
        self.samples: list[tuple[float, float, float]] = []  # (monotonic time, lag s, process CPU s)
        self._task: asyncio.Task[None] | None = None

    async def _loop(self) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(0.05)
            now = time.monotonic()
            self.samples.append((now, now - before - 0.05, time.process_time()))

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="loop-lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def max_lag(self, start: float, end: float) -> float:
        """Worst lag between two monotonic times."""
        return max((lag for t, lag, _ in self.samples if start <= t <= end), default=0.0)

    def cpu_cores(self, start: float, end: float) -> float:
        """Cores this process used on average between two monotonic times (all its threads)."""
        inside = [(t, cpu) for t, _, cpu in self.samples if start <= t <= end]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return float("nan")
        return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


async def wait_for_drain(session: aiohttp.ClientSession, url: str, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
    """Wait until vLLM has nothing running or waiting, so one phase cannot feed the next."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            running, waiting = await read_vllm_gauges(session, url)
            if running == 0 and waiting == 0:
                return
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            logger.debug("metrics poll failed while draining: %s", exc)
        await asyncio.sleep(POLL_INTERVAL_S)
    logger.warning("vLLM still had requests after %.0fs of draining; the next phase may start loaded", timeout_s)


# -- the request mix -----------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """What both sides generate: the rendered dataset, G completions per prompt, the same sampling."""

    url: str
    model: str
    prompts: list[list[int]]
    params: SamplingParams
    group_size: int
    max_inflight: int
    warmup_s: float
    seconds: float

    def request_order(self) -> Iterator[list[int]]:
        """Prompts in the order the service issues them: each prompt G times, cycling over the dataset."""
        return itertools.cycle([ids for ids in self.prompts for _ in range(self.group_size)])


def render_prompts(model_dir: str, max_model_len: int, max_tokens: int) -> list[list[int]]:
    """Token ids of the dataset exactly as the service renders them (same renderer, same tokenizer)."""
    renderer = PromptRenderer(load_tokenizer(model_dir), max_model_len)
    return [renderer.render(spec, max_tokens)[0] for spec in builtin_dataset(DATASET)]


# -- phase (a): plain client ---------------------------------------------------------------
async def raw_phase(work: Workload, round_index: int, metrics_session: aiohttp.ClientSession) -> PhaseResult:
    """``max_inflight`` workers, each re-posting the moment its previous completion returns."""
    origin = time.monotonic()
    window_start, window_end = work.warmup_s, work.warmup_s + work.seconds
    finished: list[tuple[float, int]] = []  # (t, tokens) per completion
    order = work.request_order()
    timeout = aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S, sock_read=READ_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=work.max_inflight + 8, limit_per_host=work.max_inflight + 8)

    async def worker(session: aiohttp.ClientSession) -> None:
        while True:
            body = completion_body(work.model, next(order), work.params)
            async with session.post(work.url + "/v1/completions", json=body) as resp:
                if resp.status >= 400:
                    raise RuntimeError(f"vLLM answered HTTP {resp.status}: {(await resp.text())[:300]}")
                completion = parse_completion(await resp.read(), work.url)
            finished.append((time.monotonic() - origin, len(completion.token_ids)))

    poller, lag = RunningPoller(work.url, origin), LoopLagMonitor()
    poller.start()
    lag.start()
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        workers = [asyncio.create_task(worker(session), name=f"raw-{i}") for i in range(work.max_inflight)]
        try:
            done, _ = await asyncio.wait(workers, timeout=window_end, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()  # a worker that died is a broken benchmark, not a slow one
        finally:
            await poller.stop()
            await lag.stop()
            for task in workers:
                task.cancel()  # closing the connections makes vLLM abort the requests
            await asyncio.gather(*workers, return_exceptions=True)
    await wait_for_drain(metrics_session, work.url)

    in_window = [tokens for t, tokens in finished if window_start <= t <= window_end]
    mean_running, at_limit, n = poller.window_stats(window_start, window_end, work.max_inflight)
    return PhaseResult(
        phase="raw",
        round=round_index,
        window_s=work.seconds,
        tokens=sum(in_window),
        tokens_per_s=sum(in_window) / work.seconds,
        completions=len(in_window),
        mean_running=mean_running,
        fraction_at_limit=at_limit,
        samples_in_window=n,
        max_loop_lag_s=lag.max_lag(origin + window_start, origin + window_end),
        bench_cpu_cores=lag.cpu_cores(origin + window_start, origin + window_end),
        window_start_s=window_start,
        window_end_s=window_end,
        running_trace=poller.samples,
    )


# -- phase (b): through the service --------------------------------------------------------
async def service_phase(
    work: Workload, round_index: int, target: str, metrics_session: aiohttp.ClientSession
) -> PhaseResult:
    """A run on the dataset, consumed and acked as fast as groups arrive.

    The window's tokens are the run's own ``tokens_generated`` counter (incremented as each
    completion returns, like the raw side), read at the window's start and end.
    """
    origin = time.monotonic()
    window_start = work.warmup_s
    received: list[tuple[float, int]] = []  # (t, tokens) per group delivered
    # Enough credits that the consumer is never what holds a group back.
    credits = max(64, 4 * -(-work.max_inflight // work.group_size))

    poller, lag = RunningPoller(work.url, origin), LoopLagMonitor()
    async with RolloutClient(target) as client:
        spec = dataset_run_spec(DATASET, REWARDS, group_size=work.group_size, max_tokens=work.params.max_tokens)
        spec.sampling.temperature = work.params.temperature
        run = await client.create_run(spec)
        poller.start()
        lag.start()
        stream = client.stream(run.run_id, f"bench-{round_index}", credits=credits)

        async def consume() -> None:
            async for group in stream:
                received.append((time.monotonic() - origin, sum(len(s.completion_token_ids) for s in group.samples)))
                stream.ack([group.group_id])

        async def read_stats() -> tuple[pb.RunStats, float]:
            """The run's counters and when they were read: the middle of the RPC, off by at most half of it."""
            before = time.monotonic()
            stats = (await client.get_run(run.run_id)).stats
            after = time.monotonic()
            if after - before > 0.2:
                logger.warning("GetRun took %.0f ms; the window's edges are that uncertain", (after - before) * 1e3)
            return stats, (before + after) / 2 - origin

        consumer = asyncio.create_task(consume(), name="service-consumer")
        try:
            await asyncio.sleep(window_start)
            start_stats, measured_start = await read_stats()
            await asyncio.sleep(max(0.0, measured_start + work.seconds - (time.monotonic() - origin)))
            stats, measured_end = await read_stats()
            if consumer.done():
                consumer.result()  # the stream ended early: surface why
                raise RuntimeError("the group stream ended before the window did")
        finally:
            await poller.stop()
            await lag.stop()
            stream.cancel()  # the run is deleted next; unacked groups do not matter
            consumer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await consumer
            await client.delete_run(run.run_id)  # frees its slots before the next raw phase
    await wait_for_drain(metrics_session, work.url)

    window = measured_end - measured_start
    tokens = stats.tokens_generated - start_stats.tokens_generated
    delivered = sum(tokens for t, tokens in received if measured_start <= t <= measured_end)
    mean_running, at_limit, n = poller.window_stats(measured_start, measured_end, work.max_inflight)
    return PhaseResult(
        phase="service",
        round=round_index,
        window_s=window,
        tokens=tokens,
        tokens_per_s=tokens / window,
        completions=sum(1 for t, _ in received if measured_start <= t <= measured_end) * work.group_size,
        mean_running=mean_running,
        fraction_at_limit=at_limit,
        samples_in_window=n,
        max_loop_lag_s=lag.max_lag(origin + measured_start, origin + measured_end),
        bench_cpu_cores=lag.cpu_cores(origin + measured_start, origin + measured_end),
        delivered_tokens_per_s=delivered / window,
        window_start_s=measured_start,
        window_end_s=measured_end,
        running_trace=poller.samples,
    )


# -- reporting -----------------------------------------------------------------------------
def summarize(results: list[PhaseResult], max_inflight: int) -> dict[str, Any]:
    """Means over rounds and the two targets: service >= 95% of raw, vLLM slots >= 95% full."""

    def mean_of(phase: str, attr: str) -> float:
        return statistics.fmean(getattr(r, attr) for r in results if r.phase == phase)

    raw_tps, service_tps = mean_of("raw", "tokens_per_s"), mean_of("service", "tokens_per_s")
    ratio = service_tps / raw_tps if raw_tps > 0 else float("nan")
    service_at_limit = mean_of("service", "fraction_at_limit")
    return {
        "max_inflight": max_inflight,
        "raw_tokens_per_s": raw_tps,
        "service_tokens_per_s": service_tps,
        "ratio_service_over_raw": ratio,
        "raw_fraction_at_limit": mean_of("raw", "fraction_at_limit"),
        "service_fraction_at_limit": service_at_limit,
        "raw_mean_running": mean_of("raw", "mean_running"),
        "service_mean_running": mean_of("service", "mean_running"),
        "throughput_target_met": ratio >= SERVICE_TARGET_RATIO,
        "slot_target_met": service_at_limit >= SLOT_FILL_TARGET,
        "starved_phases": [f"{r.phase} {r.round}" for r in results if is_starved(r)],
    }


def print_report(console: Console, results: list[PhaseResult], summary: dict[str, Any]) -> None:
    table = Table(title=f"generated tokens/s, max_inflight={summary['max_inflight']}")
    columns = (
        "phase", "round", "tokens/s", "mean vLLM running", "fraction at slot limit", "samples",
        "max loop lag", "bench CPU",
    )  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column == "phase" else "right")
    for r in results:
        table.add_row(
            r.phase,
            str(r.round),
            f"{r.tokens_per_s:,.1f}",
            f"{r.mean_running:.2f}",
            f"{r.fraction_at_limit:.1%}",
            str(r.samples_in_window),
            f"{r.max_loop_lag_s * 1000:.0f} ms",
            f"{r.bench_cpu_cores:.2f} cores",
        )
    console.print(table)

    def verdict(ok: bool) -> str:
        return "[green]met[/green]" if ok else "[red]not met[/red]"

    console.print(
        f"raw {summary['raw_tokens_per_s']:,.1f} tok/s, service {summary['service_tokens_per_s']:,.1f} tok/s: "
        f"ratio service/raw = [bold]{summary['ratio_service_over_raw']:.3f}[/bold] "
        f"(target >= {SERVICE_TARGET_RATIO}: {verdict(summary['throughput_target_met'])})"
    )
    console.print(
        f"vLLM at the slot limit: raw {summary['raw_fraction_at_limit']:.1%}, "
        f"service [bold]{summary['service_fraction_at_limit']:.1%}[/bold] of samples "
        f"(mean running {summary['raw_mean_running']:.2f} vs {summary['service_mean_running']:.2f}; "
        f"target >= {SLOT_FILL_TARGET:.0%}: {verdict(summary['slot_target_met'])})"
    )
    starved = [r for r in results if is_starved(r)]
    if starved:
        names = ", ".join(f"{r.phase} {r.round}" for r in starved)
        console.print(
            f"[yellow]caution: {names} ran on a starved machine (the poller got under "
            f"{STARVED_SAMPLE_FRACTION:.0%} of its samples or the event loop stalled over "
            f"{STARVED_LOOP_LAG_S:.1f}s; see the bench CPU column): other load, not the code under "
            "test, may dominate those numbers; rerun on a quiet machine.[/yellow]"
        )


def is_starved(r: PhaseResult) -> bool:
    """Whether a phase's numbers say more about other load on the machine than about the code.

    The poller thread asks for a sample every 100 ms; getting far fewer, or the loop stalling
    for long, means the OS did not schedule this process (or vLLM's) when it was due.
    """
    expected = r.window_s / POLL_INTERVAL_S
    return r.samples_in_window < STARVED_SAMPLE_FRACTION * expected or r.max_loop_lag_s > STARVED_LOOP_LAG_S


def write_outputs(path: Path, args: argparse.Namespace, results: list[PhaseResult], summary: dict[str, Any]) -> None:
    """JSON of everything, and a PNG of vLLM's running requests per phase when matplotlib is there."""
    path.parent.mkdir(parents=True, exist_ok=True)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    document = {"config": config, "summary": summary, "phases": [asdict(r) for r in results]}
    path.write_text(json.dumps(document, indent=2))
    logger.info("wrote %s", path)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(len(results), 1, figsize=(10, 2.2 * len(results)), sharex=True, squeeze=False)
    for ax, r in zip(axes[:, 0], results, strict=True):
        ax.plot([t for t, _, _ in r.running_trace], [x for _, x, _ in r.running_trace], lw=1, label="running")
        ax.plot([t for t, _, _ in r.running_trace], [w for _, _, w in r.running_trace], lw=1, label="waiting")
        ax.axhline(summary["max_inflight"], color="red", ls="--", lw=0.8, label="max_inflight")
        ax.axvspan(r.window_start_s, r.window_end_s, color="grey", alpha=0.15, label="measured")
        ax.set_ylabel("requests")
        ax.set_title(f"{r.phase} round {r.round}: {r.tokens_per_s:,.0f} tok/s", fontsize=9)
    axes[0, 0].legend(loc="lower right", fontsize=7)
    axes[-1, 0].set_xlabel("seconds since phase start")
    fig.tight_layout()
    png = path.with_suffix(".png")
    fig.savefig(png, dpi=100)
    plt.close(fig)
    logger.info("wrote %s", png)


# -- main ----------------------------------------------------------------------------------
async def benchmark(args: argparse.Namespace, url: str) -> tuple[list[PhaseResult], dict[str, Any]]:
    model, max_model_len = await describe_model(url)
    prompts = await asyncio.to_thread(render_prompts, str(args.model_dir), max_model_len, args.max_tokens)
    work = Workload(
        url=url.rstrip("/"),
        model=model,
        prompts=prompts,
        params=SamplingParams(max_tokens=args.max_tokens, temperature=1.0),
        group_size=args.group_size,
        max_inflight=args.max_inflight,
        warmup_s=args.warmup,
        seconds=args.seconds,
    )
    settings = load_settings(
        engine={"urls": [url], "tokenizer": str(args.model_dir)},
        port=0,
        metrics_port=0,
        scheduler={"max_inflight": args.max_inflight},
    )
    results: list[PhaseResult] = []
    async with aiohttp.ClientSession() as metrics_session, running_service(settings) as service:
        await wait_for_drain(metrics_session, work.url)
        for round_index in range(1, args.rounds + 1):
            logger.info("round %d/%d: raw client", round_index, args.rounds)
            results.append(await raw_phase(work, round_index, metrics_session))
            logger.info("raw: %.1f tok/s", results[-1].tokens_per_s)
            logger.info("round %d/%d: rollout service", round_index, args.rounds)
            results.append(await service_phase(work, round_index, service.grpc_target, metrics_session))
            logger.info("service: %.1f tok/s", results[-1].tokens_per_s)
    return results, summarize(results, args.max_inflight)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-url", help="running vLLM server; absent: serve --model-dir with a managed server")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR, help="model/tokenizer directory")
    parser.add_argument("--max-inflight", type=int, default=32, help="requests in flight (the service's slots)")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--max-tokens", type=int, default=64, help="max tokens per completion")
    parser.add_argument("--seconds", type=float, default=20.0, help="measured window per phase")
    parser.add_argument("--warmup", type=float, default=3.0, help="unmeasured seconds at the start of each phase")
    parser.add_argument("--rounds", type=int, default=2, help="raw+service rounds")
    parser.add_argument("--output", type=Path, help="JSON of the results (a .png plot goes next to it)")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    if min(args.max_inflight, args.group_size, args.max_tokens, args.rounds) < 1 or args.seconds <= 0:
        parser.error("--max-inflight, --group-size, --max-tokens, --rounds and --seconds must be positive")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(message)s",
        datefmt="[%X]",
        handlers=[RichHandler(show_path=False, console=Console(stderr=True))],
    )
    logging.getLogger("rollout_service").setLevel(max(logging.WARNING, logging.getLogger().level))

    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run

    with contextlib.ExitStack() as stack:
        url = args.vllm_url
        if url is None:
            from rollout_service.engine.managed import ManagedVLLMServer

            if args.model_dir == DEFAULT_MODEL_DIR:
                from rollout_common.tiny_model import build_tiny_model

                build_tiny_model(args.model_dir)
            logger.info("starting a managed vLLM server for %s (about a minute on CPU)", args.model_dir)
            url = stack.enter_context(ManagedVLLMServer(ManagedServerSettings(model=args.model_dir))).url
        results, summary = run(benchmark(args, url))

    # Off a terminal (CI logs, files) rich would wrap at 80 columns; the table needs more.
    print_report(Console(width=None if sys.stdout.isatty() else 140), results, summary)
    if args.output is not None:
        write_outputs(args.output, args, results, summary)


if __name__ == "__main__":
    main()
