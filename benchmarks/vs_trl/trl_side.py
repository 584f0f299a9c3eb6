"""TRL's side: a ``GRPOTrainer`` run in a process of its own, so that its torch thread count
is its own (``trl-<N>t`` in float32, ``trl-<N>t-bf16`` in TRL's default bf16 autocast).

The worker times each step's generation (TRL's trainer idles while it generates) and its
completion tokens, and the parent reads the curve back as a ``RunResult``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from vs_trl.outcomes import RunResult, steady_fraction
from vs_trl.processes import BENCHMARKS, ENTRY, run_subprocess, shared_flags


def trl_worker(args: argparse.Namespace) -> None:
    """Train with TRL's GRPOTrainer and write the per-step curve as JSON to ``args.out``."""
    import torch

    torch.set_num_threads(args.threads)
    from bench_rewards import vowel_share
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rollout_service.generation.prompts import builtin_dataset
    from trainer_client.train.precision import loading_kwargs

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
    command = [sys.executable, str(ENTRY), "trl-worker", "--threads", str(threads), "--seed", str(seed)]
    command += ["--out", str(out), *shared_flags(args), *(["--bf16"] if name.endswith("-bf16") else [])]
    path = os.pathsep.join(filter(None, [str(BENCHMARKS), os.environ.get("PYTHONPATH")]))  # a worktree's own code
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": path}
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
