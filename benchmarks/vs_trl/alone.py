"""Each side alone, then both at once: the ideal steps/s, 1 / max(T_generate, T_train).

- ``train-alone``: the project's trainer math on one step's samples, in a loop, in its own
  process with the trainer's thread budget (T_train);
- ``generate-alone``: one step's groups through the service with nothing training, a
  consumer acking at once (T_generate), also with at most one step in flight;
- both at once, nothing coupling them: what sharing the cores costs each side.

Each is a worker mode of the benchmark's script (``processes.ENTRY``), measured again before
every seed's runs, since this machine's speed drifts between sittings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from typing import Any

from vs_trl.cpu_use import (
    busy_core_seconds,
    core_seconds_by_process,
    core_seconds_per_step,
    engine_steps,
    engine_steps_per_step,
)
from vs_trl.processes import ENTRY, HOST_CORES, on_host_cores, shared_flags


def train_alone_worker(args: argparse.Namespace) -> None:
    """Seconds of one optimizer step of the project's trainer math (collate, log-probs and loss,
    backward, AdamW) on a step's worth of samples, with nothing else running, at the trainer's
    default precision on this CPU; JSON to stdout."""
    import torch

    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout_api import rollout_pb2 as pb
    from rollout_service.generation.prompts import builtin_dataset
    from trainer_client.grpo_config import AsyncGRPOConfig
    from trainer_client.loss.config import LossConfig
    from trainer_client.loss.losses import compute_loss
    from trainer_client.stream.batches import GroupCollator, completion_logprobs
    from trainer_client.train.precision import loading_kwargs, resolve_bf16

    if args.service and args.pin:  # as rollout-trainer does next to a local service
        from rollout_common.cpu_budget import pin_local_trainer

        pin_local_trainer(args.service)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    bf16 = resolve_bf16(None, "cpu")  # as rollout-trainer's default
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, **loading_kwargs(bf16, "cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    prompts = [
        list(tokenizer.apply_chat_template(spec.messages, add_generation_prompt=True, tokenize=True)["input_ids"])
        for spec in builtin_dataset(args.dataset)
    ]
    group = pb.Group(group_id="g", policy_version=0)
    items = [
        {
            "group": group,
            "sample": pb.Sample(
                prompt_token_ids=prompts[(i // args.group_size) % len(prompts)],  # a group shares its prompt
                completion_token_ids=[(7 * i + t) % 900 + 10 for t in range(args.max_tokens)],
                completion_logprobs=[-6.9] * args.max_tokens,
                completion_mask=[1] * args.max_tokens,
                advantage=1.0 if i % 2 else -1.0,
            ),
        }
        for i in range(args.group_size * args.prompts_per_step)
    ]
    collate = GroupCollator(pad_token_id=0)
    config = LossConfig(loss_type="dapo", max_completion_length=args.max_tokens)
    head = model.get_output_embeddings().weight
    times: list[float] = []
    window: list[float] = []  # wall clock (epoch) at the first and last measured step
    step = 0
    while step < TRAIN_ALONE_MIN_STEPS or (args.seconds and time.time() - window[0] < args.seconds):
        if step == 5:  # warmed up
            busy = busy_core_seconds()
            window.append(time.time())
        step += 1
        start = time.perf_counter()
        batch = collate(items)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logps = completion_logprobs(model, batch, head, share_prompts=AsyncGRPOConfig.share_prompt_forward)
        out = compute_loss(logps, None, batch["behaviour_logps"], batch["advantages"], batch["completion_mask"], config)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    core_s = (busy_core_seconds() - busy) / len(times[5:])
    window.append(time.time())
    step_s = statistics.median(times[5:])
    print(json.dumps({"train_step_s": step_s, "train_core_s": core_s, "window": window, "train_bf16": bf16}))


async def generate_alone(args: argparse.Namespace, target: str) -> dict[str, Any]:
    """Seconds (and busy core-seconds) to generate one step's groups through the service with
    nothing training: a consumer acks every group at once (no pushes, so admission bounds nothing).

    ``--one-step-in-flight``: at most one step's groups generating at once, the most
    ``max_staleness`` 1 lets a run generate (the groups of the step after next wait for the
    push of the step being trained); otherwise as many as the service's slots hold."""
    from rollout_api.client import RolloutClient, dataset_run_spec

    async with RolloutClient(target) as client:
        spec = dataset_run_spec(args.dataset, {"vowel_share": 1.0}, group_size=args.group_size)
        spec.sampling.max_tokens = args.max_tokens
        if args.one_step_in_flight:
            spec.max_inflight = args.prompts_per_step * args.group_size  # episodes: one per sample
        run = await client.create_run(spec)
        stream = client.stream(run.run_id, "generate-alone", credits=64)
        started, arrivals = None, []  # arrivals: wall clock (epoch) of each group, since the clock started
        async for group in stream:
            stream.ack([group.group_id])
            arrivals.append(time.time())
            if started is None and len(arrivals) == 2 * args.prompts_per_step:  # warmed up: start the clock
                started, busy, arrivals = time.perf_counter(), busy_core_seconds(), []
                by_process = core_seconds_by_process(os.getppid())  # the service runs in the parent
                engine_before = await engine_steps(args.engine_url)
            elif started is not None and time.perf_counter() - started >= (args.seconds or 15.0):
                break
        elapsed, core_s = time.perf_counter() - started, busy_core_seconds() - busy
        after = core_seconds_by_process(os.getppid())
        engine_after = await engine_steps(args.engine_url)
        await stream.aclose()
        await client.delete_run(run.run_id)
    steps = len(arrivals) / args.prompts_per_step
    parts = core_seconds_per_step(by_process, after, steps)
    if args.one_step_in_flight:
        return {"generate_one_step_in_flight_s": elapsed / steps}
    return {
        "arrivals": arrivals,
        "generate_step_s": elapsed / steps,
        "generate_core_s": core_s / steps,
        "generate_core_s_by_process": parts,
        "generate_engine": engine_steps_per_step(engine_before, engine_after, steps),
    }


async def measure_alone(args: argparse.Namespace, target: str, engine_url: str, one_step: bool) -> dict[str, Any]:
    """Each side alone, with the trainer's thread budget, then both at once; ``one_step``: also
    generation with at most one step's groups in flight."""
    modes = [["train-alone"], ["generate-alone"]] + ([["generate-alone", "--one-step-in-flight"]] if one_step else [])
    measured: dict[str, Any] = {}
    for mode in modes:  # each in its own process, like the trainer
        measured.update(await measure_side(args, mode, target, engine_url))
    for timeline in ("window", "arrivals"):  # measure_together's, not needed here
        del measured[timeline]
    slowest = max(measured["train_step_s"], measured["generate_step_s"])
    # Both sides share the machine's cores: a step cannot take less than their busy
    # core-seconds spread over every core, however well they overlap.
    cores = os.cpu_count() or 1
    core_bound = cores / (measured["train_core_s"] + measured["generate_core_s"])
    together = await measure_together(args, target, engine_url, measured["train_step_s"])
    return {**measured, "ideal_steps_per_s": 1 / slowest, "core_bound_steps_per_s": core_bound, **together}


TRAIN_ALONE_MIN_STEPS = 25
"""``train-alone`` runs at least this many steps (the first 5 warm up, the rest are measured)."""
TOGETHER_SECONDS = {"generate-alone": 16.0, "train-alone": 8.0}
"""The shortest measured windows of the two sides run at once (``together_seconds``)."""
TRAINER_START_UP_S = 4.0
"""A ``train-alone`` process's start-up (imports, the model) on 2 busy cores."""


def together_seconds(train_step_s: float) -> dict[str, float]:
    """The measured windows of the two sides run at once, from a trainer step alone: the trainer's
    window (its start-up, then at least ``TRAIN_ALONE_MIN_STEPS`` steps, up to 1.5x slower beside
    generation) must fall inside generation's.

    Why: with fixed windows a slower model's trainer (a 1.2 s step: 30 s for its steps) outlasted
    generation's 16 s, which then covered 2-13% of it, and its rate read 50-140x its time alone."""
    trainer_s = max(TOGETHER_SECONDS["train-alone"], TRAIN_ALONE_MIN_STEPS * train_step_s)
    generate_s = max(TOGETHER_SECONDS["generate-alone"], TRAINER_START_UP_S + 1.5 * trainer_s)
    return {"generate-alone": generate_s, "train-alone": TOGETHER_SECONDS["train-alone"]}


async def measure_together(
    args: argparse.Namespace, target: str, engine_url: str, train_step_s: float
) -> dict[str, float]:
    """Both sides at once, nothing coupling them: generation through the service with every slot
    busy (no staleness bound, no pushes) and the trainer's math in a loop, pinned where
    ``rollout-trainer`` pins itself next to a local service; each side's seconds per step.

    Why: the ideal, 1 / max(T_generate, T_train), takes each side's step with the machine to
    itself, and on this box both want the same cores (vLLM's API server and the service float
    onto the trainer's). This shows what sharing them costs each side with nothing else in the
    way. It is not a bound on a run: a run holds generation back (admission), which leaves the
    trainer more of its core than here."""
    seconds = together_seconds(train_step_s)
    generate_mode = ["generate-alone", "--seconds", str(seconds["generate-alone"])]
    train_mode = ["train-alone", "--seconds", str(seconds["train-alone"]), "--pin"]
    generate, train = await asyncio.gather(
        measure_side(args, generate_mode, target, engine_url), measure_side(args, train_mode, target, engine_url)
    )
    start, end = train["window"]
    arrivals = generate["arrivals"]
    # Generation's rate while the trainer trained: the groups that arrived in the trainer's window.
    groups = sum(start <= t <= end for t in arrivals)
    generate_step_s = (end - start) * args.prompts_per_step / groups if groups else float("inf")
    return {
        "together_train_step_s": train["train_step_s"],
        "together_generate_step_s": generate_step_s,
        # the share of the trainer's window that generation's ran through (1.0: all of it)
        "together_overlap": max(0.0, min(arrivals[-1], end) - max(arrivals[0], start)) / (end - start),
    }


async def measure_side(args: argparse.Namespace, mode: list[str], target: str, engine_url: str) -> dict[str, Any]:
    """One side's measurement in its own process (``mode``: its command-line words), with the
    trainer's thread budget; what it prints as JSON."""
    from rollout_common.cpu_budget import CpuBudget

    threads = CpuBudget.split(HOST_CORES).trainer_threads
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    command = [sys.executable, str(ENTRY), *mode, "--threads", str(threads), "--service", target]
    command += ["--engine-url", engine_url, *shared_flags(args)]
    process = await asyncio.create_subprocess_exec(
        *command, env=env, stdout=asyncio.subprocess.PIPE, preexec_fn=on_host_cores
    )
    output, _ = await asyncio.wait_for(process.communicate(), args.timeout_s)
    return json.loads(output.decode().strip().splitlines()[-1])


def median_alone(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The rounds' medians, key by key (and part by part for the split by process)."""
    merged: dict[str, Any] = {}
    for key in dict.fromkeys(k for r in rounds for k in r):
        values = [r[key] for r in rounds if key in r]
        if isinstance(values[0], dict):
            merged[key] = {part: statistics.median(v.get(part, 0.0) for v in values) for part in values[0]}
        else:
            merged[key] = statistics.median(values)
    return merged
