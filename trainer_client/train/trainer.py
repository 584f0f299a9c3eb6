"""``StreamGRPOTrainer``: a ``transformers.Trainer`` that learns from the rollout service's stream.

The train dataset is the stream of scored groups (``GroupFeed``); pushes, acks and step records
happen between steps (``SyncAndAck``). Each data-parallel rank is its own consumer of the run.
"""

from __future__ import annotations

import copy
import logging
import math
import statistics
import time
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers import PreTrainedModel, ProgressCallback, Trainer

from trainer_client.grpo_config import AsyncGRPOConfig
from trainer_client.loss.config import GLOBAL_TOKEN_NORMALISED
from trainer_client.loss.losses import compute_loss
from trainer_client.step_timing import COMPUTE_CPU
from trainer_client.stream.arriving_batches import ArrivingBatches, DeferredTokenNormaliser
from trainer_client.stream.batches import (
    GroupCollator,
    StreamDataset,
    completion_logprobs,
    forward_completion_logprobs,
    output_embedding_weight,
)
from trainer_client.stream.feed import GroupFeed
from trainer_client.train import fsdp
from trainer_client.train.evaluator import PinnedEvaluator
from trainer_client.train.step_progress import StepProgress
from trainer_client.weights.policy_weights import is_peft_model
from trainer_client.weights.push import AdapterPusher, WeightPusher

logger = logging.getLogger(__name__)


class StepBook:
    """What the current optimizer step trained on, for acks and per-step metrics."""

    def __init__(self) -> None:
        self.group_ids: dict[str, None] = {}  # ordered set
        self.stale_group_ids: dict[str, None] = {}
        self.rewards: list[float] = []
        self.staleness: list[int] = []
        self.loss_metrics: dict[str, list[float]] = {}

    @property
    def mismatch_kl(self) -> float | None:
        """The step's sampler-trainer mismatch over this rank's micro-batches; None where vLLM gave no log-probs."""
        values = [v for v in self.loss_metrics.get("sampling/mismatch_kl", []) if math.isfinite(v)]
        return statistics.fmean(values) if values else None


class StreamGRPOTrainer(Trainer):
    loss_is_scaled_for_ga = True
    """``compute_loss`` scales for gradient accumulation itself, as TRL's GRPOTrainer does."""

    def __init__(
        self,
        model: PreTrainedModel,
        args: AsyncGRPOConfig,
        feed: GroupFeed,
        pusher: WeightPusher | AdapterPusher | None,
        evaluator: PinnedEvaluator | None = None,
    ) -> None:
        pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        if pusher is None and args.world_size > 1:
            raise ValueError("every data-parallel rank needs the pusher (rank 0 pushes, the others learn its version)")
        if args.fsdp:
            fsdp.check_supported(model)
        super().__init__(model=model, args=args, train_dataset=StreamDataset(feed), data_collator=GroupCollator(pad))
        self.feed = feed
        self.pusher = pusher
        self.evaluator = evaluator
        """Evaluates every N-th pushed version (rank 0 of a pushing trainer)."""
        self.loss_config = args.loss_config()
        self.ref_model: torch.nn.Module | None = None
        if args.beta > 0 and not is_peft_model(model):
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False).to(self.args.device)
        self.book = StepBook()
        self.step_metrics: dict[str, float] = {}
        """The last step's rollout metrics, for ``log`` (set by ``SyncAndAck``)."""
        self.clock = feed.clock
        self._forward_s = 0.0
        self._deferred: DeferredTokenNormaliser | None = None
        """The current step's token count, where its loss is normalised after its last micro-batch."""
        self.step_progress = StepProgress()
        if not args.disable_tqdm:
            self.remove_callback(ProgressCallback)
            self.add_callback(self.step_progress)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().train(*args, **kwargs)
        finally:  # a step that raised leaves no bar drawing over the error
            self.step_progress.close()

    def create_accelerator_and_postprocess(self) -> None:
        """Trainer's accelerator, with FSDP turned on for a CPU run too (``fsdp.enable_on_cpu``)."""
        super().create_accelerator_and_postprocess()
        if self.args.fsdp_plugin_args is not None and not self.is_fsdp_enabled:
            self.is_fsdp_enabled = fsdp.enable_on_cpu(self.accelerator, self.args.fsdp_plugin_args)
        if self.is_fsdp_enabled:
            logger.info(
                "FSDP%d: each of %d ranks holds a shard of every weight",
                self.accelerator.state.fsdp_plugin.fsdp_version,
                self.args.world_size,
            )

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Trainer's log record plus the last step's rollout metrics, for ``report_to`` integrations."""
        if self.step_metrics and "loss" in logs:
            logs = {**logs, **self.step_metrics}
            self.step_metrics = {}
        super().log(logs, start_time)

    @property
    def pushes_in_background(self) -> bool:
        """Whether a push may overlap the next step (see ``AsyncGRPOConfig.background_push``)."""
        return self.args.pushes_in_background(isinstance(self.pusher, WeightPusher))

    def get_train_dataloader(self) -> DataLoader:
        """A plain loader over this rank's own stream, which already is its shard: accelerate's
        prepared loader would skip or re-dispatch groups and fetch a batch ahead (judging
        staleness a version early)."""
        return DataLoader(self.train_dataset, batch_size=self._train_batch_size, collate_fn=self._timed_collate)

    def _timed_collate(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        with self.clock.measure("collate"):
            return self.data_collator(items)

    def get_batch_samples(self, epoch_iterator, num_batches, device):  # type: ignore[override]
        """A step's micro-batches, each fetched when the loop reaches it (``arriving_batches``).
        Data-parallel ranks, DeepSpeed and FSDP prefetch, as Trainer does: their token count is
        summed over ranks up front, or their gradients are where the deferred division cannot reach."""
        self._deferred = None
        if num_batches <= 1 or self.args.world_size > 1 or self.is_deepspeed_enabled or self.is_fsdp_enabled:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        if self.loss_config.loss_type in GLOBAL_TOKEN_NORMALISED:
            self._deferred = DeferredTokenNormaliser(num_batches)
        return ArrivingBatches(epoch_iterator, num_batches), None

    def training_step(self, model, inputs, num_items_in_batch=None):  # type: ignore[override]
        """Trainer's step (forward via ``compute_loss``, then backward), timed phase by phase."""
        start = time.perf_counter()
        self._forward_s = 0.0
        with self.clock.measure(COMPUTE_CPU, time.thread_time):
            loss = super().training_step(model, inputs, num_items_in_batch)
            loss = self._normalise_deferred(model, loss)
        self.clock.add("backward", time.perf_counter() - start - self._forward_s)
        return loss

    def _normalise_deferred(self, model: torch.nn.Module, loss: torch.Tensor) -> torch.Tensor:
        """With the token count deferred: zero until the step's last micro-batch, then the
        gradients and the step's loss divided by it."""
        deferred = self._deferred
        if deferred is None:
            return loss
        if not deferred.complete:
            return torch.zeros_like(loss)
        deferred.normalise_gradients(model)
        losses = deferred.normalised_losses()
        self.book.loss_metrics.setdefault("policy_loss", []).extend(losses)
        self._deferred = None
        return torch.full_like(loss, sum(losses))

    def _get_num_items_in_batch(self, batch_samples: list[dict[str, Any]], device: torch.device) -> torch.Tensor:
        """TRL's ``num_items_in_batch``: the loss tokens of an optimizer step's micro-batches over ranks."""
        tokens = sum(self._loss_mask(inputs, self._fresh(inputs)).sum() for inputs in batch_samples)
        tokens = torch.as_tensor(tokens, dtype=torch.float32, device=device)
        return self.accelerator.gather(tokens).sum() if self.args.world_size > 1 else tokens

    @property
    def _accumulation_steps(self) -> int:
        """Micro-batches of the current optimizer step, or the configured count outside the loop."""
        return getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)

    def _fresh(self, inputs: dict[str, Any]) -> list[bool]:
        """Which samples are within ``max_staleness`` of the version this step trains at; the
        others are masked out of the loss and their groups acked as dropped."""
        return [self.feed.is_fresh(v) for v in inputs["staleness_versions"]]

    @staticmethod
    def _loss_mask(inputs: dict[str, Any], fresh: list[bool]) -> torch.Tensor:
        mask = inputs["completion_mask"]
        return mask * torch.tensor(fresh, dtype=mask.dtype, device=mask.device)[:, None]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # type: ignore[override]
        start = time.perf_counter()
        fresh = self._fresh(inputs)
        completion_mask = self._loss_mask(inputs, fresh)
        logps = self._completion_logprobs(model, inputs)
        ref_logps = self._reference_logprobs(inputs) if self.loss_config.beta > 0 else None
        deferred = self._deferred
        accumulation_steps = 1 if deferred is not None else self._accumulation_steps
        output = compute_loss(
            logps,
            None,
            inputs["behaviour_logps"],
            inputs["advantages"],
            completion_mask,
            self.loss_config,
            ref_logps=ref_logps,
            # deferred: a sum over tokens, divided once the step's count is known
            num_items_in_batch=1.0 if deferred is not None else num_items_in_batch,
            # one optimizer step's micro-batches are TRL's generation batch
            gradient_accumulation_steps=accumulation_steps,
            steps_per_generation=accumulation_steps,
            num_processes=self.args.world_size,
        )
        metrics = output.metrics
        if deferred is not None:
            metrics = {k: v for k, v in metrics.items() if k != "policy_loss"}
            deferred.add(float(completion_mask.sum()), float(output.policy_loss))
        for group_id, reward, version, keep in zip(
            inputs["group_ids"], inputs["rewards"], inputs["staleness_versions"], fresh, strict=True
        ):
            if keep:
                self.book.group_ids.setdefault(group_id, None)
                self.book.rewards.append(reward)
                self.book.staleness.append(self.feed.training_version - version)
            else:
                self.book.stale_group_ids.setdefault(group_id, None)
        for name, value in metrics.items():
            self.book.loss_metrics.setdefault(name, []).append(float(value))
        self._forward_s = time.perf_counter() - start
        self.clock.add("forward", self._forward_s)
        return output.loss

    def _completion_logprobs(self, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """float32 log-probs [B, T], all in autocast under ``bf16`` (accelerate wraps only the forward)."""
        with self.accelerator.autocast():
            if self.is_fsdp_enabled and model is not self.ref_model:  # the lm_head weight is a shard out here
                return forward_completion_logprobs(model, inputs, self.args.temperature)
            head = output_embedding_weight(self.accelerator.unwrap_model(model))
            return completion_logprobs(
                model, inputs, head, self.args.logprob_chunk_size, self.args.temperature, self.shares_prompts
            )

    @property
    def shares_prompts(self) -> bool:
        args = self.args
        return args.share_prompt_forward and args.world_size == 1 and not args.gradient_checkpointing

    @torch.no_grad()
    def _reference_logprobs(self, inputs: dict[str, Any]) -> torch.Tensor:
        if self.ref_model is not None:
            return self._completion_logprobs(self.ref_model, inputs)
        policy = self.accelerator.unwrap_model(self.model)
        with policy.disable_adapter():  # PEFT: the base model is the reference
            return self._completion_logprobs(policy, inputs)

    def step_record(self, step: int, book: StepBook, version: int) -> dict[str, Any]:
        """The step's metrics over all data-parallel ranks (every rank must call this);
        ``version``: the policy version the step trained at."""
        counters = self.feed.counters
        sums, maxima = self.over_ranks(
            [
                sum(book.rewards),
                len(book.rewards),
                len(book.group_ids),
                len(book.stale_group_ids),
                counters.dropped_stale,
                counters.trained,
                counters.received,
                sum(book.staleness),
            ],
            [max(book.staleness, default=0)],
        )
        reward_sum, rewards, groups, masked, dropped, trained, received, staleness_sum = (
            int(v) if i else v for i, v in enumerate(sums)
        )
        record: dict[str, Any] = {
            "step": step,
            "policy_version": version,
            "reward_mean": reward_sum / rewards if rewards else float("nan"),
            "groups": groups,
            "group_ids": list(book.group_ids),  # this process's
            # fetched fresh, stale by the time the step trained: masked out and acked as dropped
            "groups_masked_stale": masked,
            "max_staleness_trained": int(maxima[0]),
            # per sample: paced admission lowers it where training is the slower side
            "mean_staleness_trained": staleness_sum / rewards if rewards else 0.0,
            "dropped_stale": dropped,
            "groups_trained": trained,
            "groups_received": received,
        }
        # samples trained at each staleness (versions behind), over all ranks: index k is staleness k
        counts = [sum(1 for lag in book.staleness if lag == k) for k in range(int(maxima[0]) + 1)]
        record["staleness_histogram"] = [int(n) for n in self.over_ranks(counts, [0.0])[0]] if rewards else []
        for name, values in book.loss_metrics.items():
            record[name] = statistics.fmean(values)  # this rank's
        return record

    def over_ranks(self, sums: list[float], maxima: list[float]) -> tuple[list[float], list[float]]:
        if self.args.world_size == 1:
            return sums, maxima
        summed = torch.tensor(sums, dtype=torch.float64, device=self.args.device)
        largest = torch.tensor(maxima, dtype=torch.float64, device=self.args.device)
        torch.distributed.all_reduce(summed, op=torch.distributed.ReduceOp.SUM)
        torch.distributed.all_reduce(largest, op=torch.distributed.ReduceOp.MAX)
        return summed.tolist(), largest.tolist()
