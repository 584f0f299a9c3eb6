"""Stale drops and training throughput: paced against staleness admission.

Why: staleness admission generates as far ahead as ``max_staleness`` lets a group still
train in time; paced admission only as far as keeps the trainer busy. The question is what
each costs in training throughput, and what it saves in drops. Both modes run side by side,
alternating, in one invocation, each a real ``rollout-trainer`` process against one service
(in this process) and one vLLM.

Per phase it reports groups generated (scored), trained and dropped as stale, the drop
fraction, trained groups per second of wall time, generated tokens per second, and the
fraction of generated tokens that were trained.

It also reports the groups aborted in flight (the trainer moved past them while they
generated) and vLLM's own count of generated tokens, aborted requests included, per trained
group: the generation that went to waste.

Usage::

    python benchmarks/bench_admission.py --vllm-url http://127.0.0.1:8011 --model-dir /tmp/tiny
    python benchmarks/bench_admission.py --steps 20 --rounds 2 --max-staleness 1 --output outputs/admission.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from rollout_api.client import RolloutClient
from rollout_common.tiny_model import build_tiny_model, tiny_model_flags
from rollout_service.app import running_service
from rollout_service.config import DEFAULT_MODEL_DIR, load_settings

MODES = ("paced", "staleness")


@dataclass
class Phase:
    mode: str
    round: int
    seconds: float
    scored: int
    trained: int
    dropped_stale: int
    tokens: int
    aborted: int = 0
    """Groups aborted in flight (``stale_inflight``)."""
    vllm_tokens: int = 0
    """Tokens vLLM generated in the phase, aborted requests included."""

    @property
    def drop_fraction(self) -> float:
        return self.dropped_stale / self.scored if self.scored else 0.0

    @property
    def trained_per_s(self) -> float:
        return self.trained / self.seconds


def vllm_generated_tokens(url: str) -> int:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return int(sum(float(v) for v in re.findall(r"^vllm:generation_tokens_total(?:\{[^}]*\})? (\S+)$", text, re.M)))


async def run_phase(service, args: argparse.Namespace, mode: str, round_: int, out: Path) -> Phase:
    """One trainer process on a fresh run, in ``mode``."""
    target, url = service.grpc_target, service.service.info.engine_urls[0]
    tokens_before = vllm_generated_tokens(url)
    command = [sys.executable, "-m", "trainer_client.cli", "--target", target, "--model", str(args.model_dir)]
    command += ["--dataset", "repeat_a"]  # the task it has always run (the trainer's default dataset once)
    command += tiny_model_flags(
        max_steps=args.steps,
        num_generations=args.group_size,
        per_device_train_batch_size=args.groups_per_step * args.group_size,
        max_completion_length=args.max_tokens,
        max_staleness=args.max_staleness,
    )
    command += ["--max_buffered_groups", str(args.max_buffered_groups), "--admission", mode]
    command += ["--output_dir", str(out), "--log_level", "warning"]
    started = time.monotonic()
    trainer = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    output, _ = await asyncio.wait_for(trainer.communicate(), args.timeout_s)
    seconds = time.monotonic() - started
    if trainer.returncode != 0:
        raise RuntimeError(f"trainer ({mode}) failed:\n{output.decode()[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    aborted = service.service.metrics.registry.get_sample_value(
        "rollout_groups_dropped_total", {"run": summary["run_id"], "reason": "stale_inflight"}
    )  # read before the run is deleted, with its metrics
    async with RolloutClient(target) as client:
        run = await client.get_run(summary["run_id"])
        await client.delete_run(summary["run_id"])
    stats = run.stats
    return Phase(
        mode, round_, seconds, stats.groups_scored, stats.groups_trained, stats.groups_dropped_stale,
        stats.tokens_generated, int(aborted or 0), vllm_generated_tokens(url) - tokens_before,
    )  # fmt: skip


async def benchmark(args: argparse.Namespace) -> list[Phase]:
    engine = {"urls": [args.vllm_url], "tokenizer": str(args.model_dir), "model": "tiny"} if args.vllm_url else {}
    if not args.vllm_url:
        engine = {"managed": {"model": str(args.model_dir)}}
    settings = load_settings(port=0, metrics_port=None, engine=engine)
    phases: list[Phase] = []
    with tempfile.TemporaryDirectory(prefix="bench-admission-") as tmp:
        async with running_service(settings) as service:
            modes = MODES
            for round_ in range(args.rounds):
                for mode in modes if round_ % 2 == 0 else reversed(modes):
                    phase = await run_phase(service, args, mode, round_, Path(tmp) / f"{mode}-{round_}")
                    phases.append(phase)
                    logging.info("%s", phase)
    return phases


def report(phases: list[Phase], console: Console) -> dict[str, dict[str, float]]:
    modes = MODES
    table = Table(title="paced admission vs staleness admission")
    columns = ["mode", "round", "s", "generated", "trained", "dropped stale", "drop %", "trained/s", "tok/s"]
    columns += ["aborted", "vLLM tok", "vLLM tok / trained"]
    for column in columns:
        table.add_column(column, justify="right")
    for p in phases:
        row = [
            p.mode, str(p.round), f"{p.seconds:.1f}", str(p.scored), str(p.trained), str(p.dropped_stale),
            f"{100 * p.drop_fraction:.1f}", f"{p.trained_per_s:.2f}", f"{p.tokens / p.seconds:.0f}",
            str(p.aborted), str(p.vllm_tokens), f"{p.vllm_tokens / max(1, p.trained):.0f}",
        ]  # fmt: skip
        table.add_row(*row)
    console.print(table)
    summary = {}
    for mode in modes:
        mine = [p for p in phases if p.mode == mode]
        seconds = sum(p.seconds for p in mine)
        summary[mode] = {
            "drop_fraction": sum(p.dropped_stale for p in mine) / max(1, sum(p.scored for p in mine)),
            "trained_per_s": sum(p.trained for p in mine) / seconds,
            "generated_tokens_per_s": sum(p.tokens for p in mine) / seconds,
            "vllm_tokens_per_trained_group": sum(p.vllm_tokens for p in mine) / max(1, sum(p.trained for p in mine)),
            "aborted": sum(p.aborted for p in mine),
        }
        console.print(
            f"{mode:>9}: drops {100 * summary[mode]['drop_fraction']:.1f}% of generated groups, "
            f"{summary[mode]['trained_per_s']:.2f} groups trained/s, "
            f"{summary[mode]['generated_tokens_per_s']:.0f} generated tok/s"
        )
    first, second = modes
    ratio = summary[first]["trained_per_s"] / summary[second]["trained_per_s"]
    console.print(f"trained/s, {first} / {second}: {ratio:.3f}")
    waste = summary[first]["vllm_tokens_per_trained_group"] / summary[second]["vllm_tokens_per_trained_group"]
    console.print(f"vLLM tokens per trained group, {first} / {second}: {waste:.3f}")
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-url", help="a running vLLM server (weight transfer on); default: a managed one")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR, help="the checkpoint vLLM serves")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=2, help="phases per mode, alternating")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--groups-per-step", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--max-buffered-groups", type=int, default=16)
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--output", type=Path, help="write the phases and summary as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=os.environ.get("LOG_LEVEL", "WARNING"))
    args = parse_args(argv)
    if not (args.model_dir / "config.json").exists():
        build_tiny_model(args.model_dir)
    phases = asyncio.run(benchmark(args))
    summary = report(phases, Console(width=160))
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        payload = {"args": {k: str(v) for k, v in vars(args).items()}, "phases": [asdict(p) for p in phases]}
        args.output.write_text(json.dumps({**payload, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
