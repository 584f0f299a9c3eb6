"""One training run against a rollout service: create (or join) a run, train, report.

Used by the ``rollout-trainer`` CLI and by the demo. Writes to the output directory:
``metrics.jsonl`` (one record per optimizer step, over all ranks: step, policy_version,
reward_mean, dropped_stale, ...), ``summary.json`` and ``reward_curve.svg``, and per rank
``rank<N>.json`` (the groups it trained and a fingerprint of its weights, which must agree
across data-parallel ranks).

Data parallelism: launch the same command on every rank (``torchrun --nproc-per-node N -m
trainer_client.cli ...``). Rank 0 creates the run and broadcasts its id; each rank is its
own consumer of the run, so the service hands the ranks disjoint groups.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import statistics
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from accelerate.utils import broadcast_object_list
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from rollout_api import rollout_pb2 as pb
from rollout_common.cpu_budget import pin_local_trainer, trainer_threads
from trainer_client import fsdp, precision
from trainer_client.checkpoints import RunInCheckpoint, drop_records_after, find_checkpoint
from trainer_client.client import RolloutClient, dataset_run_spec, paced_lookahead, wait_until_serving
from trainer_client.evaluator import PinnedEvaluator
from trainer_client.prompt_feeder import feed_prompts, fits_inline
from trainer_client.prompts_file import PROMPT_COLUMN, PromptRows
from trainer_client.step_timing import summarize_seconds, with_lookahead
from trainer_client.stream import GroupFeed
from trainer_client.svg_plot import line_plot
from trainer_client.trainer import AsyncGRPOConfig, AsyncGRPOTrainer
from trainer_client.weight_push import AdapterPusher, WeightPusher

logger = logging.getLogger(__name__)
ADMISSION_MODES = {
    "staleness": pb.ADMISSION_MODE_STALENESS,
    "paced": pb.ADMISSION_MODE_PACED,
    "buffer": pb.ADMISSION_MODE_BUFFER,
}
"""``RunOptions.admission`` -> the proto's AdmissionMode (the one list of the trainer's names)."""
SCALE_REWARDS = {
    "group": pb.ADVANTAGE_SCALING_GROUP,
    "batch": pb.ADVANTAGE_SCALING_BATCH,
    "none": pb.ADVANTAGE_SCALING_NONE,
}
"""``RunOptions.scale_rewards`` (TRL's spellings) -> the proto's AdvantageScaling."""


@dataclass
class RunOptions:
    """What to generate when the trainer creates the run itself."""

    dataset: str = "letters"
    rewards: dict[str, float] = field(default_factory=lambda: {"char_fraction": 1.0})
    max_tokens: int = 32
    max_buffered_groups: int = 0
    """Groups the service may hold started or scored but not yet handed to this trainer; 0:
    ``buffered_groups``' default, what ``max_staleness`` lets start ahead of the step being
    trained."""
    admission: Literal["staleness", "paced", "buffer"] = "paced"
    """paced: the service generates only what this trainer trains within max_staleness, and no
    further ahead than keeps it busy; staleness: as far ahead as max_staleness allows; buffer:
    up to max_buffered_groups whatever their age (for comparison)."""
    max_inflight: int = 0
    """Episodes of this run generating at once; 0: as many as the service's slots allow."""
    group_deadline_s: float = 0.0
    """Seconds a group waits for its slowest members (0: all); then it is scored from those
    that finished if at least ``min_group_size`` did, else dropped (``RunSpec``)."""
    min_group_size: int = 0
    prompts: list[pb.Prompt] | PromptRows | Iterable[Mapping[str, Any]] | None = None
    """The run's own prompts instead of ``dataset``: ``pb.Prompt``s, ``PromptRows`` (a file),
    or rows with a ``prompt_column`` (a ``datasets.Dataset``, a list of dicts; the other
    columns reach the rewards as keyword arguments). Large sets stream (``prompt_feeder``)."""
    prompt_column: str = PROMPT_COLUMN
    top_p: float = 1.0
    """Nucleus sampling mass (1: off), as TRL's ``top_p``."""
    top_k: int = 0
    """Top-k sampling (0: off; TRL's ``top_k`` 0 or None)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Advantage denominator, as TRL's ``scale_rewards``."""
    eval_dataset: str = ""
    """Built-in dataset evaluated every ``eval_every_pushes`` pushes ("": no evaluation)."""
    eval_every_pushes: int = 0

    def __post_init__(self) -> None:
        prompts = self.prompts
        if prompts is None or isinstance(prompts, PromptRows):
            return
        if not (isinstance(prompts, list) and all(isinstance(p, pb.Prompt) for p in prompts)):
            self.prompts = PromptRows.from_rows(prompts, self.prompt_column)  # type: ignore[arg-type]

    @property
    def streams_prompts(self) -> bool:
        """Too many prompts for the run's spec: they go through SubmitPrompts instead."""
        return isinstance(self.prompts, PromptRows) and not fits_inline(self.prompts.count, self.prompts.bytes)


@dataclass
class LoraOptions:
    """Train a LoRA adapter (PEFT) instead of the full model.

    ``serving="merged"`` pushes base + adapter as full weights (the servers need no LoRA
    support; one trainer per server pool). ``"adapter"`` pushes only the adapter to a run
    that serves it (``serve_adapter``): several runs then train their own adapters on one
    shared base model, each with its own policy version.
    """

    rank: int = 16
    alpha: int = 32
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    serving: Literal["merged", "adapter"] = "merged"


def cpu_training_config(
    output_dir: Path,
    max_steps: int,
    *,
    group_size: int = 8,
    groups_per_step: int = 8,
    gradient_accumulation_steps: int = 1,
    learning_rate: float = 5e-3,
    max_staleness: int = 2,
    weight_sync_steps: int = 1,
    loss_type: str = "dapo",
    max_tokens: int = 32,
    beta: float = 0.0,
    background_push: bool = True,
    vllm_is_mode: str = "token_truncate",
    vllm_is_cap: float = 3.0,
    bf16: bool | None = None,
    **training_arguments: Any,
) -> AsyncGRPOConfig:
    """The settings the CLI and the demo train the embedded default with (constant LR, a log
    line and a metrics record every step, no checkpoints), then ``training_arguments``
    (other ``AsyncGRPOConfig`` fields, from a config file) over them. ``bf16`` None: bf16
    autocast where this CPU multiplies bf16 natively (``precision``). Raises ValueError on
    bad values."""
    correction = vllm_is_mode != "none"
    defaults: dict[str, Any] = dict(
        output_dir=str(output_dir),
        max_steps=max_steps,
        per_device_train_batch_size=groups_per_step // gradient_accumulation_steps * group_size,
        gradient_accumulation_steps=gradient_accumulation_steps,
        group_size=group_size,
        learning_rate=learning_rate,
        lr_scheduler_type="constant",
        max_staleness=max_staleness,
        weight_sync_steps=weight_sync_steps,
        loss_type=loss_type,
        beta=beta,
        background_push=background_push,
        vllm_importance_sampling_correction=correction,
        vllm_importance_sampling_mode=vllm_is_mode if correction else AsyncGRPOConfig.vllm_importance_sampling_mode,
        vllm_importance_sampling_cap=vllm_is_cap,
        max_completion_length=max_tokens,
        logging_steps=1,
        save_strategy="no",
        use_cpu=True,
        bf16=precision.resolve_bf16(bf16, "cpu"),
    )
    if "save_steps" in training_arguments:
        defaults["save_strategy"] = "steps"
    return AsyncGRPOConfig(**{**defaults, **training_arguments})


def buffered_groups(requested: int, max_staleness: int, groups_per_step: int) -> int:
    """The run's service-side buffer: ``requested``, or for 0 ``max_staleness`` steps' worth
    of groups (one step's at 0; ``groups_per_step`` counts every data-parallel rank's).
    Staleness admission lets that many start ahead of the step being trained
    (``rollout_service.delivery.admission``); a smaller buffer would silently cap it. A fixed
    8 did: at 8 groups a step, ``max_staleness`` 2 generated one step ahead, not two, and in
    the benchmark (4 groups a step) 3 was no different from 2."""
    return requested or max(1, max_staleness) * groups_per_step


async def _create_run(
    target: str, config: AsyncGRPOConfig, options: RunOptions, serve_adapter: bool, pushes: bool
) -> str:
    async with RolloutClient(target) as client:
        spec = dataset_run_spec(
            options.dataset,
            options.rewards,
            group_size=config.group_size,
            max_tokens=options.max_tokens,
            max_staleness=config.max_staleness,
            max_buffered_groups=buffered_groups(  # every data-parallel rank trains its own groups
                options.max_buffered_groups, config.max_staleness, config.groups_per_step * config.world_size
            ),
            max_inflight=options.max_inflight,
            group_deadline_seconds=options.group_deadline_s,
            min_group_size=options.min_group_size,
        )
        if options.streams_prompts:
            spec.prompt_source.submitted.SetInParent()  # replaces the dataset (a oneof); fed by prompt_feeder
        elif options.prompts is not None:
            spec.prompt_source.prompts.prompts.extend(options.prompts)  # type: ignore[arg-type]
        _sample_as_trained(spec, config, options)
        spec.serve_adapter = serve_adapter
        spec.admission = ADMISSION_MODES[options.admission]
        # This trainer pushes before it trains and refuses groups of older weights: generating
        # before that push would only make groups to drop.
        spec.await_first_update = pushes
        return (await client.create_run(spec)).run_id


def _sample_as_trained(spec: pb.RunSpec, config: AsyncGRPOConfig, options: RunOptions) -> None:
    spec.sampling.temperature = config.temperature
    spec.sampling.top_p = options.top_p
    spec.sampling.top_k = options.top_k
    spec.scale_rewards = SCALE_REWARDS[options.scale_rewards]


def eval_run_spec(config: AsyncGRPOConfig, options: RunOptions) -> pb.RunSpec:
    """The evaluation runs' spec: the held-out dataset once, sampled and scored as training
    samples are; each evaluation pins it to the version it evaluates (``evaluator``)."""
    spec = dataset_run_spec(
        options.eval_dataset, options.rewards, group_size=config.group_size, max_tokens=options.max_tokens
    )
    _sample_as_trained(spec, config, options)
    spec.display_name = f"eval-{options.eval_dataset}"
    spec.eval.SetInParent()
    return spec


def train(
    target: str,
    model_path: str,
    config: AsyncGRPOConfig,
    options: RunOptions,
    run_id: str | None = None,
    trainer_address: str = "127.0.0.1",
    lora: LoraOptions | None = None,
    push: bool = True,
    torch_threads: int = 0,
    save_model: bool = False,
    wait_for_service_s: float = 0.0,
    shared_memory_push: bool = True,
) -> dict[str, Any]:
    """Train ``config.max_steps`` steps on a run of the service at ``target``; returns the summary.

    ``trainer_address`` is where vLLM's workers reach this process for the weight transfer.
    ``push=False`` makes a follower: it trains on its share of the run's groups but another
    trainer of the run pushes weights (its staleness follows the run's version).
    ``torch_threads`` 0 takes the host's CPU budget (``rollout_common.cpu_budget``).
    ``save_model`` writes the trained policy to ``output_dir/model`` at the end (``save_policy``).
    ``wait_for_service_s``: how long rank 0 first waits for the service to say SERVING.
    ``shared_memory_push``: push to servers on this host through shared memory (gloo backend).
    """
    checkpoint = None
    if config.resume_from_checkpoint:
        checkpoint = find_checkpoint(config.resume_from_checkpoint, Path(config.output_dir))
        if run_id is None and checkpoint.run_id is not None:
            run_id = checkpoint.run_id
            logger.info("resuming %s at step %d on its run %s", checkpoint.path, checkpoint.step, run_id)
    threads = use_torch_threads(trainer_threads(target, torch_threads))
    if torch_threads == 0 and (cores := pin_local_trainer(target)):
        logger.info("trainer pinned to cores %s, the CPU budget's share beside a local vLLM", list(cores))
    main = config.process_index == 0
    if main and wait_for_service_s > 0:
        asyncio.run(wait_until_serving(target, wait_for_service_s))
    if run_id is None and main:
        serve_adapter = lora is not None and lora.serving == "adapter"
        run_id = asyncio.run(_create_run(target, config, options, serve_adapter, pushes=push))
    if config.world_size > 1:
        run_id = broadcast_object_list([run_id], from_process=0)[0]
    assert run_id is not None
    model = load_policy(model_path, lora, config.bf16, config.device.type)
    logger.info("trainer computes in %s", precision.describe(config.bf16))
    output_dir = Path(config.output_dir)
    if main and checkpoint is not None:
        drop_records_after(output_dir / "metrics.jsonl", checkpoint.step)
    elif main:
        (output_dir / "metrics.jsonl").unlink(missing_ok=True)
    # Each process is its own consumer (the service hands consumers disjoint groups).
    consumer_id = f"trainer-{socket.gethostname()}-{os.getpid()}-rank{config.process_index}"
    with GroupFeed(target, run_id, consumer_id, config.max_staleness, config.effective_stream_credits) as feed:
        pusher = make_pusher(feed, run_id, trainer_address, lora, shared_memory_push) if push else None
        feeder = start_prompt_feeder(feed, run_id, options) if main else None
        evaluator = None
        if main and pusher is not None and options.eval_every_pushes:
            spec = eval_run_spec(config, options)
            evaluator = PinnedEvaluator(feed, spec, options.eval_every_pushes, output_dir / "evals.jsonl")
            (output_dir / "evals.jsonl").unlink(missing_ok=True)
        try:
            trainer = AsyncGRPOTrainer(model=model, args=config, feed=feed, pusher=pusher, evaluator=evaluator)
            trainer.add_callback(RunInCheckpoint(run_id))
            trainer.train(resume_from_checkpoint=str(checkpoint.path) if checkpoint else None)
        finally:
            if feeder is not None:
                feeder.cancel()
            if pusher is not None:
                pusher.close()
        counters = feed.counters
        totals, _ = trainer.over_ranks([counters.received, counters.trained, counters.dropped_stale], [])
    output_dir.mkdir(parents=True, exist_ok=True)
    if save_model:
        save_policy(trainer, model_path, output_dir / "model")
    rank_report = {
        "rank": config.process_index,
        "groups_trained": counters.trained,
        "groups_dropped_stale": counters.dropped_stale,
        "groups_duplicate_skipped": counters.duplicates,
        "trained_group_ids": list(counters.trained_group_ids),
        "weights_fingerprint": weights_fingerprint(trainer.model if trainer.is_fsdp_enabled else model),
        "sharded": fsdp.is_sharded(trainer.model),
    }
    (output_dir / f"rank{config.process_index}.json").write_text(json.dumps(rank_report))
    # The fingerprint above was the last collective: every rank meets the others and tears the
    # process group down (accelerate's end of training). A rank that exited with its gloo group
    # alive once aborted in C++ at shutdown ("terminate called without an active exception", the
    # second rank of a two-node FSDP run), and torchrun on the other node waited for it.
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()
    if not main:
        return rank_report  # rank 0 writes the run's summary
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    summary = summarize(records, run_id, *(int(total) for total in totals))
    lookahead = asyncio.run(paced_lookahead(target, run_id))
    summary["time_split"] = with_lookahead(summary["time_split"], lookahead, config.max_staleness)
    summary["torch_threads"] = threads
    summary["precision"] = precision.name(config.bf16)
    if evaluator is not None:
        summary["evals"] = evaluator.results
    if checkpoint is not None:
        summary["resumed_from"] = {"checkpoint": str(checkpoint.path), "step": checkpoint.step}
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    write_reward_curve(records, output_dir / "reward_curve.svg")
    return summary


def start_prompt_feeder(feed: GroupFeed, run_id: str, options: RunOptions) -> Future[None] | None:
    """Stream the prompts into the run when it takes them through SubmitPrompts (created so
    here, or an existing run joined with ``--run-id`` or from a checkpoint)."""
    if not isinstance(options.prompts, PromptRows):
        return None
    run = feed.call(feed.client.get_run(run_id))
    if run.spec.prompt_source.WhichOneof("source") != "submitted":
        return None
    logger.info("streaming %d prompts of %s into run %s", options.prompts.count, options.prompts.name, run_id)
    return feed.run_alongside(feed_prompts(feed.client, run_id, options.prompts), "the prompt feeder")


def make_pusher(
    feed: GroupFeed, run_id: str, trainer_address: str, lora: LoraOptions | None, shared_memory: bool = True
) -> WeightPusher | AdapterPusher:
    if lora is not None and lora.serving == "adapter":
        return AdapterPusher(feed.client, run_id)
    return WeightPusher(
        feed.client, run_id, trainer_address=trainer_address, clock=feed.clock, shared_memory=shared_memory
    )


def use_torch_threads(threads: int) -> int:
    """Set torch's intra-op threads (one inter-op thread: the trainer runs one op at a time)."""
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # only settable before the first parallel work
        torch.set_num_interop_threads(1)
    logger.info("trainer uses %d torch thread(s)", threads)
    return threads


def load_policy(model_path: str, lora: LoraOptions | None, bf16: bool, device_type: str) -> PreTrainedModel:
    """The float32 policy (a PEFT model for ``lora``), loaded as it trains in this precision on
    this device (``precision.loading_kwargs``)."""
    model = AutoModelForCausalLM.from_pretrained(model_path, **precision.loading_kwargs(bf16, device_type))
    if lora is None:
        return model
    from peft import LoraConfig, get_peft_model  # optional: only LoRA runs need peft

    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=lora.target_modules, task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def save_policy(trainer: AsyncGRPOTrainer, model_path: str, directory: Path) -> None:
    """The trained policy as ``from_pretrained`` and vLLM load it, with the tokenizer it was
    trained with (every rank must call this: a sharded model is gathered first). A LoRA model
    saves its adapter, as PEFT does."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    weights = fsdp.gathered_weights(trainer.model) if trainer.is_fsdp_enabled else None
    if not trainer.is_world_process_zero():
        return
    if weights is not None:
        model.save_pretrained(directory, state_dict=dict(weights))
    else:
        model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(model_path).save_pretrained(directory)
    logger.info("saved the trained policy to %s", directory)


def weights_fingerprint(model: torch.nn.Module) -> float:
    """Sum of |w| over all trainable weights: equal on every rank iff DDP kept them in step.
    A sharded (FSDP) model's is over its whole weights (every rank must call it then)."""
    with torch.no_grad():
        weights = (fsdp.whole_tensor(p) for p in model.parameters() if p.requires_grad)
        return float(sum(w.detach().abs().double().sum() for w in weights))


def summarize(records: list[dict[str, Any]], run_id: str, received: int, trained: int, dropped: int) -> dict[str, Any]:
    """The run in a few numbers; the group counts are over all ranks."""
    rewards = [r["reward_mean"] for r in records]
    fifth = max(1, len(rewards) // 5)
    return {
        "run_id": run_id,
        "steps": len(records),
        "final_policy_version": records[-1]["policy_version"] if records else 0,
        "reward_first_20pct": statistics.fmean(rewards[:fifth]) if rewards else None,
        "reward_last_20pct": statistics.fmean(rewards[-fifth:]) if rewards else None,
        "groups_received": received,
        "groups_trained": trained,
        "groups_dropped_stale": dropped,
        "max_staleness_trained": max((r["max_staleness_trained"] for r in records), default=0),
        "mean_staleness_trained": statistics.fmean(r["mean_staleness_trained"] for r in records) if records else 0.0,
        "time_split": summarize_seconds(records),
    }


def write_reward_curve(records: list[dict[str, Any]], path: Path) -> None:
    """reward_mean per step, as an SVG line plot."""
    line_plot({"reward_mean": [(r["step"], r["reward_mean"]) for r in records]}, path, "reward_mean per step", "step")
