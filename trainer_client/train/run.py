"""One training run against a rollout service: create (or join) a run, train, report.

Writes ``metrics.jsonl``, ``summary.json`` and ``reward_curve.svg`` to the output directory, and
``rank<N>.json`` per rank. Under data parallelism rank 0 creates the run and broadcasts its id.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import os
import socket
import statistics
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import broadcast_object_list
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from rollout_api import rollout_pb2 as pb
from rollout_api.client import (
    RolloutClient,
    RpcError,
    ServiceNotServing,
    audit_record,
    dataset_run_spec,
    final_run,
    ledger_record,
    paced_lookahead,
    rpc_reason,
    unavailable,
    wait_until_serving,
)
from rollout_common.cpu_budget import pin_local_trainer, trainer_threads
from rollout_common.model_signature import signature_of
from trainer_client.advertised_address import advertised_address
from trainer_client.grpo_config import AsyncGRPOConfig
from trainer_client.local_service import LocalServiceError, local_service
from trainer_client.options import ADMISSION_MODES, SCALE_REWARDS, ModelOptions, RunOptions
from trainer_client.step_timing import summarize_seconds, with_lookahead
from trainer_client.stream.feed import GroupFeed
from trainer_client.stream.prompt_feeder import feed_prompts
from trainer_client.stream.prompts_file import PromptRows
from trainer_client.svg_plot import line_plot
from trainer_client.train import fsdp, precision
from trainer_client.train.checkpoints import RunInCheckpoint, drop_records_after, find_checkpoint
from trainer_client.train.evaluator import PinnedEvaluator
from trainer_client.train.step_callback import SyncAndAck
from trainer_client.train.trainer import StreamGRPOTrainer
from trainer_client.weights.push import AdapterPusher, WeightPusher

logger = logging.getLogger(__name__)


def buffered_groups(requested: int, max_staleness: int, groups_per_step: int) -> int:
    """The run's service-side buffer: ``requested``, or for 0 ``max_staleness`` steps' worth of
    groups (at least one step's), since a smaller buffer would silently cap staleness admission."""
    return requested or max(1, max_staleness) * groups_per_step


def _run_spec(config: AsyncGRPOConfig, dataset: str, rewards: dict[str, float], **fields: object) -> pb.RunSpec:
    """A run of ``dataset``, sampled and scored as this trainer trains."""
    spec = dataset_run_spec(
        dataset,
        rewards,
        group_size=config.num_generations,
        max_tokens=config.max_completion_length,
        scale_rewards=SCALE_REWARDS[config.scale_rewards],
        **fields,
    )
    spec.sampling.temperature = config.temperature
    spec.sampling.top_p = config.top_p
    spec.sampling.top_k = config.top_k
    return spec


async def _create_run(target: str, config: AsyncGRPOConfig, options: RunOptions, serve_adapter: bool) -> str:
    spec = _run_spec(
        config,
        options.dataset,
        options.rewards,
        max_staleness=config.max_staleness,
        max_buffered_groups=buffered_groups(  # every data-parallel rank trains its own groups
            options.max_buffered_groups, config.max_staleness, config.groups_per_step * config.world_size
        ),
        max_inflight=options.max_inflight,
        group_deadline_seconds=options.group_deadline_s,
        min_group_size=options.min_group_size,
        serve_adapter=serve_adapter,
        admission=ADMISSION_MODES[options.admission],
        max_mismatch_kl=options.max_mismatch_kl,
        await_first_update=options.push,  # groups made before this trainer's first push would only be dropped
    )
    if options.streams_prompts:
        spec.prompt_source.submitted.SetInParent()  # replaces the dataset (a oneof); fed by prompt_feeder
    elif options.prompt_rows is not None:
        spec.prompt_source.prompts.prompts.extend(options.prompt_rows)  # type: ignore[arg-type]
    async with RolloutClient(target) as client:
        try:
            return (await client.create_run(spec)).run_id
        except RpcError as exc:
            raise RunRefused(f"the service did not create the run: {rpc_reason(exc)}") from None


def eval_run_spec(config: AsyncGRPOConfig, options: RunOptions) -> pb.RunSpec:
    """The evaluation runs' spec: the held-out dataset once, sampled and scored as in training."""
    spec = _run_spec(config, options.eval_dataset, options.rewards, display_name=f"eval-{options.eval_dataset}")
    spec.eval.SetInParent()
    return spec


def default_output_dir(run_id: str | None, pushes: bool) -> str:
    """``outputs/<run id>``, or for a follower a folder of its own beside it."""
    assert run_id is not None
    name = run_id if pushes else f"{run_id}-follower-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    return str(Path("outputs") / name)


async def _served_model(target: str) -> pb.GetServerInfoResponse:
    try:
        async with RolloutClient(target) as client:
            return await client.server_info()
    except (RpcError, TimeoutError) as exc:
        if isinstance(exc, RpcError) and not unavailable(exc):  # it answered: a token, say, was refused
            raise ServiceNotServing(
                f"the rollout service at {target} refused GetServerInfo: {rpc_reason(exc)}"
            ) from None
        reason = rpc_reason(exc) if isinstance(exc, RpcError) else "no answer in time"
        raise ServiceNotServing(
            f"the rollout service at {target} does not answer ({reason}); is --target right?"
        ) from None


def policy_checkpoint(options: ModelOptions, served: pb.GetServerInfoResponse) -> str:
    """The model to train: ``options``' or, by default, the served one; another model is refused."""
    if options.model_name_or_path is None:
        return served.model
    if served.model_signature:
        try:
            mine = signature_of(options.model_name_or_path, options.model_revision)
        except (OSError, ValueError) as exc:
            raise cannot_load(options.model_name_or_path, exc) from None
        if mine != served.model_signature:
            raise ModelNotFound(
                f"--model_name_or_path {options.model_name_or_path} ({mine}) is not the model the service serves, "
                f"{served.model} ({served.model_signature}); leave --model_name_or_path out to train the served "
                "model, or serve this one"
            )
    return options.model_name_or_path


def train(config: AsyncGRPOConfig, options: RunOptions, model_options: ModelOptions) -> dict[str, Any]:
    """Train ``config.max_steps`` steps on a run of the service at ``options.target`` (None: one started
    here); returns the summary. ``options.push`` False makes a follower: another trainer of the run pushes."""
    if options.target is None:
        if config.world_size > 1:
            raise LocalServiceError("data-parallel ranks share one service: start it first and give its --target")
        log = Path(config.output_dir if config.output_dir_given else "outputs") / "local-service.log"
        with local_service(log, model_options.model_name_or_path, options.reward_funcs) as target:
            on_it = copy.copy(options)  # not dataclasses.replace: that would load the prompts again
            on_it.target = target
            return train(config, on_it, model_options)
    target = options.target
    run_id = options.run_id
    checkpoint = None
    if config.resume_from_checkpoint:
        output_dir = Path(config.output_dir) if config.output_dir_given else None
        checkpoint = find_checkpoint(config.resume_from_checkpoint, output_dir)
        if run_id is None and checkpoint.run_id is not None:
            run_id = checkpoint.run_id
            logger.info("resuming %s at step %d on its run %s", checkpoint.path, checkpoint.step, run_id)
    trainer_address = advertised_address(options.trainer_address, target)
    threads = use_torch_threads(trainer_threads(target, options.torch_threads))
    if options.torch_threads == 0 and (cores := pin_local_trainer(target)):
        logger.info("trainer pinned to cores %s, the CPU budget's share beside a local vLLM", list(cores))
    main = config.process_index == 0
    if main and options.wait_for_service > 0:
        asyncio.run(wait_until_serving(target, options.wait_for_service))
    model_path = policy_checkpoint(model_options, asyncio.run(_served_model(target)))  # before a run is made
    if run_id is None and main:
        run_id = asyncio.run(_create_run(target, config, options, model_options.serves_adapter))
        logger.info("created run %s", run_id)
    default_dir = None if config.output_dir_given or not main else default_output_dir(run_id, options.push)
    if config.world_size > 1:
        run_id, default_dir = broadcast_object_list([run_id, default_dir], from_process=0)
    assert run_id is not None
    if default_dir is not None:
        config.output_dir = default_dir
    logger.info("training on run %s; output in %s", run_id, config.output_dir)
    model = load_policy(model_path, model_options, config.bf16, config.device.type)
    kept_float32 = " (weights, optimizer state, log-softmax and pushes stay float32)" if config.bf16 else ""
    logger.info("trainer computes in %s%s", precision.name(config.bf16), kept_float32)
    output_dir = Path(config.output_dir)
    if main and checkpoint is not None:
        drop_records_after(output_dir / "metrics.jsonl", checkpoint.step)
    elif main:
        (output_dir / "metrics.jsonl").unlink(missing_ok=True)
    # Each process is its own consumer (the service hands consumers disjoint groups).
    consumer_id = f"trainer-{socket.gethostname()}-{os.getpid()}-rank{config.process_index}"
    with GroupFeed(target, run_id, consumer_id, config.max_staleness, config.effective_stream_credits) as feed:
        pusher: WeightPusher | AdapterPusher | None = None
        if options.push and model_options.serves_adapter:
            pusher = AdapterPusher(feed.client, run_id)
        elif options.push:
            pusher = WeightPusher(
                feed.client,
                run_id,
                trainer_address=trainer_address,
                clock=feed.clock,
                shared_memory=options.shared_memory_push,
                group_port=options.vllm_group_port,
            )
        feeder = start_prompt_feeder(feed, run_id, options) if main else None
        evaluator = None
        if main and pusher is not None and options.eval_every:
            spec = eval_run_spec(config, options)
            evaluator = PinnedEvaluator(feed, spec, options.eval_every, output_dir / "evals.jsonl")
            (output_dir / "evals.jsonl").unlink(missing_ok=True)
        try:
            trainer = StreamGRPOTrainer(model=model, args=config, feed=feed, pusher=pusher, evaluator=evaluator)
            trainer.add_callback(SyncAndAck(trainer))
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
    if options.save_model:
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
    # Tear the process group down together: a rank exiting with its gloo group alive can abort at shutdown.
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()
    if not main:
        return rank_report  # rank 0 writes the run's summary
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    summary = summarize(records, run_id, *(int(total) for total in totals))
    run = asyncio.run(final_run(target, run_id))
    summary["time_split"] = with_lookahead(summary["time_split"], paced_lookahead(run), config.max_staleness)
    summary["ledger"] = ledger_record(run.stats.ledger) if run is not None else None
    summary["audit"] = audit_record(run.stats.audit) if run is not None else None
    summary["torch_threads"] = threads
    summary["precision"] = precision.name(config.bf16)
    if evaluator is not None:
        summary["evals"] = evaluator.results
    if checkpoint is not None:
        summary["resumed_from"] = {"checkpoint": str(checkpoint.path), "step": checkpoint.step}
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    curve = {"reward_mean": [(r["step"], r["reward_mean"]) for r in records]}
    line_plot(curve, output_dir / "reward_curve.svg", "reward_mean per step", "step")
    return summary


def start_prompt_feeder(feed: GroupFeed, run_id: str, options: RunOptions) -> Future[None] | None:
    """Stream the prompts into the run when it takes them through SubmitPrompts."""
    rows = options.prompt_rows
    if not isinstance(rows, PromptRows):
        return None
    run = feed.call(feed.client.get_run(run_id))
    if run.spec.prompt_source.WhichOneof("source") != "submitted":
        return None
    logger.info("streaming %d prompts of %s into run %s", rows.count, rows.name, run_id)
    return feed.run_alongside(feed_prompts(feed.client, run_id, rows), "the prompt feeder")


def use_torch_threads(threads: int) -> int:
    """Set torch's intra-op threads (one inter-op thread: the trainer runs one op at a time)."""
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # only settable before the first parallel work
        torch.set_num_interop_threads(1)
    logger.info("trainer uses %d torch thread(s)", threads)
    return threads


def load_policy(model_path: str, options: ModelOptions, bf16: bool, device_type: str) -> PreTrainedModel:
    """The float32 policy (a PEFT model with ``use_peft``), loaded for this precision and device."""
    try:
        model = AutoModelForCausalLM.from_pretrained(
            model_path, revision=options.model_revision, **precision.loading_kwargs(bf16, device_type)
        )
    except OSError as exc:
        raise cannot_load(model_path, exc) from None
    if not options.use_peft:
        return model
    from peft import LoraConfig, get_peft_model  # optional: only LoRA runs need peft

    config = LoraConfig(
        r=options.lora_r,
        lora_alpha=options.lora_alpha,
        target_modules=options.lora_target_modules,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


class ModelNotFound(ValueError):
    """The policy cannot be loaded, or is not the served model; the message says what to give instead."""


def cannot_load(name: str, exc: Exception) -> ModelNotFound:
    if name.startswith(("/", ".", "~")) and not Path(name).expanduser().exists():  # a path, not a Hub id
        return ModelNotFound(f"--model_name_or_path {name} does not exist; give a local model folder or a Hub model id")
    return ModelNotFound(
        f"cannot load model {name!r}: {exc}; give --model_name_or_path a Hub model id or a local folder with "
        "config.json (offline, a model already in the Hugging Face cache)"
    )


class RunRefused(ValueError):
    """CreateRun was refused (a dataset, reward or sampling value the service does not take); says why."""


def save_policy(trainer: StreamGRPOTrainer, model_path: str, directory: Path) -> None:
    """The trained policy (a LoRA model's adapter) and its tokenizer; every rank must call this."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    weights = fsdp.gathered_weights(trainer.model) if trainer.is_fsdp_enabled else None
    if not trainer.is_world_process_zero():
        return
    model.save_pretrained(directory, state_dict=None if weights is None else dict(weights))
    AutoTokenizer.from_pretrained(model_path).save_pretrained(directory)
    logger.info("saved the trained policy to %s", directory)


def weights_fingerprint(model: torch.nn.Module) -> float:
    """Sum of |w| over all trainable weights: equal on every rank iff DDP kept them in step (a
    collective for a sharded model)."""
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
