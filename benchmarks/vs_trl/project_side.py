"""The project's side: one ``rollout-trainer`` process per run against the benchmark's service.

A run's curve comes from the trainer's own ``metrics.jsonl`` (each step's seconds and reward,
the seconds it waited for groups). ``training_window.TrainingWindow`` reads the rest from the
end of its first step to the end of its last: the service's counters (slots busy, pauses,
admission's holds), vLLM's engine steps and the cores' work. The managed vLLM server's log
gives what each push cost it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from vllm_push_log import PushLog

from rollout_common.tiny_model import tiny_model_flags
from vs_trl.cpu_use import engine_steps, engine_steps_per_step
from vs_trl.outcomes import RunResult, correction_over_run, service_window, steady_fraction
from vs_trl.processes import leading_env_settings, run_subprocess
from vs_trl.training_window import TrainingWindow


def trainer_command(args: argparse.Namespace, target: str, output_dir: Path) -> list[str]:
    """``rollout-trainer`` on the benchmark's task and settings, logging a line per step (info:
    ``TrainingWindow`` and ``bench_control_latency.py`` read them). The tiny model's training
    settings (constant learning rate, a metrics record every step, no checkpoints) under the
    benchmark's own, on the CPU as TRL's side (``use_cpu``)."""
    command = [sys.executable, "-m", "trainer_client.cli", "--target", target, "--model", str(args.model_dir)]
    command += ["--dataset", args.dataset, "--reward_funcs", "vowel_share"]
    command += tiny_model_flags(
        num_generations=args.group_size,
        per_device_train_batch_size=args.group_size * args.prompts_per_step,
        max_completion_length=args.max_tokens,
        learning_rate=args.learning_rate,
        loss_type="dapo",
        max_steps=args.steps,
        use_cpu=True,
    )
    return [*command, "--output_dir", str(output_dir), "--log_level", "info"]


async def run_project(
    args: argparse.Namespace,
    target: str,
    engine_url: str,
    name: str,
    flags: list[str],
    seed: int,
    work: Path,
    push_log: PushLog | None,
) -> RunResult:
    """One run of contender ``name`` (the project's defaults plus ``flags``) to its last step."""
    from rollout_api.client import RolloutClient

    out = work / f"{name}-{seed}"
    env_settings, flags = leading_env_settings(flags)
    command = [*trainer_command(args, target, out), *flags]
    async with RolloutClient(target) as client:
        window = TrainingWindow(args.steps, {"engine": lambda: engine_steps(engine_url), "service": client.stats})
        if push_log is not None:
            push_log.mark()
        await run_subprocess(command, {**os.environ, **env_settings}, args.timeout_s, name, window.on_line)
        engine_readings = await window.readings("engine")
        service_readings = await window.readings("service")
        push_cost = push_log.since_mark() if push_log is not None else None
        after = await client.stats()
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((out / "summary.json").read_text())
        run = await client.get_run(summary["run_id"])
        await client.delete_run(summary["run_id"])
    service: dict[str, Any] = service_window(*service_readings) if service_readings else {}
    service["last_update"] = {
        field.name: value for field, value in after.last_weight_update.ListFields() if field.name.endswith("seconds")
    }
    engine = engine_steps_per_step(*engine_readings, args.steps - 1) if engine_readings else None
    wall, elapsed = [], 0.0
    for record in records:
        elapsed += record["seconds"]["step"]
        wall.append(elapsed)
    waits = [r["seconds"]["wait_groups"] for r in records]
    return RunResult(
        name,
        seed,
        wall,
        [r["reward_mean"] for r in records],
        idle_fraction=sum(waits) / elapsed,
        generated_tokens=run.stats.tokens_generated,
        steady_idle_fraction=steady_fraction(waits, wall),
        extra={
            "time_split": summary["time_split"],
            "dropped_stale": summary["groups_dropped_stale"],
            "service": service,
            "core_s_per_step_by_process": window.per_step(),
            "busy_fraction_by_cpu": window.busy_fraction_by_cpu(),
            "engine": engine,
            "vllm_push": push_cost.to_dict() if push_cost is not None else None,
            "correction": correction_over_run(records),
            "lookahead_versions": run.stats.lookahead_versions,
            "staleness_trained": statistics.fmean(r["mean_staleness_trained"] for r in records[1:] or records),
            "mismatch_kl": [r.get("sampling/mismatch_kl", float("nan")) for r in records],
            "staleness_by_step": [r["mean_staleness_trained"] for r in records],
            "goodput": run.stats.ledger.goodput,
            "control": {field.name: value for field, value in run.stats.ledger.control.ListFields()},
        },
    )
