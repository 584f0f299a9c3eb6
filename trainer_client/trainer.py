"""``AsyncGRPOTrainer``: a ``transformers.Trainer`` that learns from the rollout service's stream.

Generation never happens here. The train dataset is the service's stream of scored groups
(``GroupFeed``: stale groups are dropped and acked as such before they reach a batch); the
loss is the clipped importance-sampled surrogate of ``losses.py`` on log-probs computed in
chunks; after every ``weight_sync_steps`` optimizer steps the main process pushes its
weights into vLLM through the service (``WeightPusher``) and the feed's current policy
version advances, which is what staleness is judged against. Groups used by a step are
acked as trained when the step ends.

Being a ``Trainer`` subclass, checkpointing, logging integrations (``report_to``),
accelerate (DDP, FSDP, DeepSpeed) and PEFT come with it. Data-parallel ranks are each a
consumer of the same run (the broker hands them disjoint groups and each acks its own);
rank 0 alone pushes, and the new policy version is broadcast to the other ranks so all
judge staleness alike. The forward pass goes through the wrapped (e.g. DDP) model, asking
for the final hidden states instead of the full logits, so DDP's gradient all-reduce still
happens while the log-probs are made in chunks.

With ``beta > 0`` the loss adds the k3 KL to a reference policy: for a PEFT model that is
the base model with the adapter disabled (no extra memory); otherwise a frozen copy of the
model as it was when the trainer was built.
"""

from __future__ import annotations

import copy
import json
import logging
import statistics
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import broadcast_object_list
from torch.utils.data import DataLoader, IterableDataset
from transformers import PreTrainedModel, Trainer, TrainerCallback, TrainingArguments

from rollout_api import rollout_pb2 as pb
from trainer_client.logprobs import chunked_completion_logprobs
from trainer_client.losses import VLLM_IMPORTANCE_SAMPLING_MODES, LossConfig, compute_loss
from trainer_client.policy_weights import is_peft_model, policy_weights
from trainer_client.prompt_sharing import prompts_are_shared, shared_prompt_logprobs
from trainer_client.step_timing import step_seconds
from trainer_client.stream import GroupFeed
from trainer_client.weight_push import AdapterPusher, WeightPusher

logger = logging.getLogger(__name__)

PUSH_ATTEMPTS = 3
"""Failed pushes in a row a trainer lives through (a vLLM server that died mid-push fails
one; a server that cannot take weights fails every one)."""
PUSH_RETRY_DELAY_S = 2.0


@dataclass(kw_only=True)
class AsyncGRPOConfig(TrainingArguments):
    """Training arguments plus the stream, weight-sync and loss knobs (names as TRL's)."""

    group_size: int = 8
    """Completions per prompt (G); the per-device batch must hold whole groups."""
    max_staleness: int = 1
    """Groups whose oldest token is more than this many policy versions old are dropped."""
    weight_sync_steps: int = 1
    """Push weights into vLLM after every this many optimizer steps."""
    background_push: bool = True
    """Push a snapshot of the weights while the next step trains, instead of waiting for the
    push. That step's groups are then judged one version older (its weights are a version
    ahead of vLLM's until the push commits), so this needs ``max_staleness >= 1``; with 0,
    data-parallel ranks, or adapter pushes the push stays on the step's path."""
    temperature: float = 1.0
    """Sampling temperature of the run: log-probs are computed on logits / temperature, as vLLM's."""
    logprob_chunk_size: int = 1024
    share_prompt_forward: bool = True
    """Run each distinct prompt of a batch through the model once and the completions on its
    cache (``prompt_sharing``): same log-probs and gradients, a step of the benchmark model
    290 -> 175 ms. Off, or under gradient checkpointing or data parallelism, every sample
    runs its own prompt."""
    """Positions per chunk of the log-prob computation (bounds the [chunk, vocab] logits)."""
    stream_credits: int = 0
    """Groups the service may send ahead of acks; 0 means one step's worth (groups are fetched
    when the step starts and acked when it ends; the next step's arrive during the push). More
    credits mean older groups in flight, which staleness-aware admission then has to allow for."""
    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    beta: float = 0.0
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: str = "token_truncate"
    """Not TRL's ``sequence_mask``: here the ratio pi_trainer / pi_vllm also carries a version
    of policy change, and over a whole sequence it passes the cap for exactly the samples
    the last step made likelier, which masking then drops. Tiny model, max_staleness 1,
    3 seeds each (benchmarks/bench_vs_trl.py): 29 steps to the target with token_truncate,
    33 with sequence_mask, 31 with sequence_truncate or no correction; TRL's synchronous
    trainer took 28."""
    vllm_importance_sampling_cap: float | None = 3.0
    off_policy_mask_threshold: float | None = None
    max_completion_length: int = 512
    remove_unused_columns: bool = False
    report_to: str | list[str] = field(default="none")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.group_size < 2:
            raise ValueError(f"group_size is {self.group_size}; it must be >= 2")
        if self.per_device_train_batch_size % self.group_size:
            raise ValueError(
                f"per_device_train_batch_size {self.per_device_train_batch_size} must be a multiple of "
                f"group_size {self.group_size}, so that every batch holds whole groups"
            )
        if self.max_steps <= 0:
            raise ValueError("max_steps must be > 0: the sample stream has no length")
        if self.beta < 0:
            raise ValueError(f"beta is {self.beta}; the KL coefficient must be >= 0")
        if self.vllm_importance_sampling_mode not in VLLM_IMPORTANCE_SAMPLING_MODES:
            raise ValueError(
                f"vllm_importance_sampling_mode is {self.vllm_importance_sampling_mode!r}; "
                f"choose one of {', '.join(VLLM_IMPORTANCE_SAMPLING_MODES)}"
            )
        cap = self.vllm_importance_sampling_cap
        if cap is not None and cap <= 1:
            raise ValueError(f"vllm_importance_sampling_cap is {cap}; it must be > 1 (the ratio of equal policies)")

    def pushes_in_background(self, pushes_full_weights: bool) -> bool:
        """Whether a trainer with these settings overlaps its pushes with the next step."""
        return self.background_push and self.max_staleness >= 1 and self.world_size == 1 and pushes_full_weights

    @property
    def groups_per_step(self) -> int:
        return self.per_device_train_batch_size * self.gradient_accumulation_steps // self.group_size

    @property
    def effective_stream_credits(self) -> int:
        return max(self.stream_credits, self.groups_per_step)

    def loss_config(self) -> LossConfig:
        return LossConfig(
            loss_type=self.loss_type,  # type: ignore[arg-type]
            importance_sampling_level=self.importance_sampling_level,  # type: ignore[arg-type]
            epsilon=self.epsilon,
            epsilon_high=self.epsilon_high,
            delta=self.delta,
            beta=self.beta,
            vllm_importance_sampling_correction=self.vllm_importance_sampling_correction,
            vllm_importance_sampling_mode=self.vllm_importance_sampling_mode,  # type: ignore[arg-type]
            vllm_importance_sampling_clip_max=self.vllm_importance_sampling_cap,
            off_policy_mask_threshold=self.off_policy_mask_threshold,
            max_completion_length=self.max_completion_length,
        )


class StreamDataset(IterableDataset):
    """One item per sample, whole groups in order, fresh groups only."""

    def __init__(self, feed: GroupFeed) -> None:
        self.feed = feed

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while True:
            group = self.feed.next_fresh_group()
            for sample in group.samples:
                yield {"group": group, "sample": sample}


class GroupCollator:
    """Left-pads prompts so every completion starts at the same column; right-pads completions.

    Each distinct prompt appears once in ``prompt_ids`` (a group's G samples share one row,
    through ``prompt_index``), which lets the forward run it once (``prompt_sharing``). The
    plain per-sample layout (``input_ids``, ``attention_mask``) is built from the same rows.
    Position ids come from the attention mask, so left padding does not shift positions and
    the trainer's log-probs equal vLLM's for the same tokens.
    """

    def __init__(self, pad_token_id: int) -> None:
        self.pad = pad_token_id

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        samples: list[pb.Sample] = [item["sample"] for item in items]
        rows: dict[tuple[int, ...], int] = {}
        prompt_index = torch.tensor([rows.setdefault(tuple(s.prompt_token_ids), len(rows)) for s in samples])
        prompt_len = max(len(prompt) for prompt in rows)
        prompt_ids = torch.full((len(rows), prompt_len), self.pad, dtype=torch.long)
        prompt_attention = torch.zeros_like(prompt_ids)
        for row, prompt in enumerate(rows):
            prompt_ids[row, prompt_len - len(prompt) :] = torch.tensor(prompt)
            prompt_attention[row, prompt_len - len(prompt) :] = 1
        completion_len = max(len(s.completion_token_ids) for s in samples)
        batch = len(samples)
        completion_ids = torch.full((batch, completion_len), self.pad, dtype=torch.long)
        completion_attention = torch.zeros_like(completion_ids)
        completion_mask = torch.zeros((batch, completion_len), dtype=torch.float32)
        behaviour = torch.zeros((batch, completion_len), dtype=torch.float32)
        for i, s in enumerate(samples):
            n = len(s.completion_token_ids)
            completion_ids[i, :n] = torch.tensor(list(s.completion_token_ids))
            completion_attention[i, :n] = 1
            completion_mask[i, :n] = torch.tensor(list(s.completion_mask), dtype=torch.float32)
            behaviour[i, :n] = torch.tensor(list(s.completion_logprobs))
        attention = torch.cat([prompt_attention[prompt_index], completion_attention], dim=1)
        return {
            "input_ids": torch.cat([prompt_ids[prompt_index], completion_ids], dim=1),
            "attention_mask": attention,
            "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
            "prompt_length": prompt_len,
            "prompt_ids": prompt_ids,
            "prompt_attention": prompt_attention,
            "prompt_index": prompt_index,
            "completion_ids": completion_ids,
            "completion_attention": completion_attention,
            "completion_mask": completion_mask,
            "behaviour_logps": behaviour,
            "advantages": torch.tensor([s.advantage for s in samples], dtype=torch.float32),
            "rewards": [s.reward for s in samples],
            "staleness_versions": [item["group"].policy_version for item in items],
            "group_ids": [item["group"].group_id for item in items],
        }


def completion_logprobs(
    model: torch.nn.Module,
    inputs: dict[str, Any],
    lm_head_weight: torch.Tensor,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    share_prompts: bool = False,
) -> torch.Tensor:
    """log pi(token) of every completion position of a collated batch, [B, T].

    Through ``model``'s own forward, which may be wrapped (DDP): calling it, rather than its
    decoder, is what makes DDP all-reduce the gradients. ``logits_to_keep=1`` keeps the model
    from building the full [B, L, V] logits; the last hidden state (after the final norm) is
    projected onto ``lm_head_weight`` in chunks. With ``share_prompts`` and fewer distinct
    prompts than samples, each prompt goes through the model once (``prompt_sharing``).
    """
    if share_prompts and prompts_are_shared(inputs):
        return shared_prompt_logprobs(model, inputs, lm_head_weight, chunk_size, temperature)
    outputs = model(
        input_ids=inputs["input_ids"],
        attention_mask=inputs["attention_mask"],
        position_ids=inputs["position_ids"],
        output_hidden_states=True,
        logits_to_keep=1,
        use_cache=False,
    )
    hidden = outputs.hidden_states[-1]
    start, length = inputs["prompt_length"] - 1, inputs["completion_ids"].shape[1]
    return chunked_completion_logprobs(
        hidden[:, start : start + length],
        lm_head_weight,
        inputs["completion_ids"],
        chunk_size=chunk_size,
        temperature=temperature,
    )


def _output_embedding_weight(model: torch.nn.Module) -> torch.Tensor:
    """The lm_head weight [V, H] of an unwrapped (possibly PEFT) causal LM."""
    head = model.get_output_embeddings()
    if hasattr(head, "base_layer"):
        raise ValueError("LoRA on the output embedding (lm_head) is not supported: leave it out of target_modules")
    return head.weight


class _StepBook:
    """What the current optimizer step trained on, for acks and per-step metrics."""

    def __init__(self) -> None:
        self.group_ids: dict[str, None] = {}  # ordered set
        self.stale_group_ids: dict[str, None] = {}
        self.rewards: list[float] = []
        self.staleness: list[int] = []
        self.loss_metrics: dict[str, list[float]] = {}


class AsyncGRPOTrainer(Trainer):
    loss_is_scaled_for_ga = True
    """``compute_loss`` scales for gradient accumulation itself (``losses.aggregate_loss``), as
    TRL's GRPOTrainer does, so Trainer must not divide by the accumulation steps again."""

    def __init__(
        self,
        model: PreTrainedModel,
        args: AsyncGRPOConfig,
        feed: GroupFeed,
        pusher: WeightPusher | AdapterPusher | None,
        **kwargs: Any,
    ) -> None:
        pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        if pusher is None and args.world_size > 1:
            raise ValueError("every data-parallel rank needs the pusher (rank 0 pushes, the others learn its version)")
        super().__init__(
            model=model, args=args, train_dataset=StreamDataset(feed), data_collator=GroupCollator(pad), **kwargs
        )
        self.feed = feed
        self.pusher = pusher
        self.loss_config = args.loss_config()
        self.ref_model: torch.nn.Module | None = None
        if args.beta > 0 and not is_peft_model(model):
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False).to(self.args.device)
        self.book = _StepBook()
        self.clock = feed.clock
        self._forward_s = 0.0
        self.add_callback(_SyncAndAck(self))

    @property
    def pushes_in_background(self) -> bool:
        """Whether a push may overlap the next step (see ``AsyncGRPOConfig.background_push``)."""
        return self.args.pushes_in_background(isinstance(self.pusher, WeightPusher))

    def get_train_dataloader(self) -> DataLoader:
        """A plain loader over this rank's own stream.

        Each rank is its own consumer of the run, so its stream already is its shard.
        accelerate's prepared loader would either have rank 0 read and dispatch every batch
        (bypassing the per-rank leases and acks) or have every rank read everything and keep
        1/N, skipping groups that nobody then acks. It would also fetch a batch ahead, which
        makes staleness judged at fetch time one version early. Trainer moves each batch to
        the device itself.
        """
        return DataLoader(self.train_dataset, batch_size=self._train_batch_size, collate_fn=self._timed_collate)

    def _timed_collate(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        with self.clock.measure("collate"):
            return self.data_collator(items)

    def training_step(self, model, inputs, num_items_in_batch=None):  # type: ignore[override]
        """Trainer's step (forward via ``compute_loss``, then backward), timed phase by phase."""
        start = time.perf_counter()
        self._forward_s = 0.0
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.clock.add("backward", time.perf_counter() - start - self._forward_s)
        return loss

    def _get_num_items_in_batch(self, batch_samples: list[dict[str, Any]], device: torch.device) -> torch.Tensor:
        """TRL's ``num_items_in_batch``: the loss tokens of all of an optimizer step's
        micro-batches, summed over ranks. dapo, cispo and vespo divide by it, so under gradient
        accumulation every token of the step weighs the same, not each micro-batch's tokens."""
        tokens = sum(self._loss_mask(inputs, self._fresh(inputs)).sum() for inputs in batch_samples)
        tokens = torch.as_tensor(tokens, dtype=torch.float32, device=device)
        return self.accelerator.gather(tokens).sum() if self.args.world_size > 1 else tokens

    @property
    def _accumulation_steps(self) -> int:
        """Micro-batches of the current optimizer step (Trainer sets it per step; a shorter
        last step has fewer), or the configured count outside the training loop."""
        return getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)

    def _fresh(self, inputs: dict[str, Any]) -> list[bool]:
        """Which samples are within ``max_staleness``, judged against the version this step
        trains at (a batch of several accumulation steps, or a push between fetch and step).
        The others are masked out of the loss and their groups acked as dropped."""
        return [self.feed.is_fresh(v) for v in inputs["staleness_versions"]]

    @staticmethod
    def _loss_mask(inputs: dict[str, Any], fresh: list[bool]) -> torch.Tensor:
        mask = inputs["completion_mask"]
        return mask * torch.tensor(fresh, dtype=mask.dtype, device=mask.device)[:, None]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # type: ignore[override]
        start = time.perf_counter()
        loss = self._grpo_loss(model, inputs, num_items_in_batch)
        self._forward_s = time.perf_counter() - start
        self.clock.add("forward", self._forward_s)
        return loss

    def _grpo_loss(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | None = None
    ) -> torch.Tensor:
        versions = inputs["staleness_versions"]
        fresh = self._fresh(inputs)
        completion_mask = self._loss_mask(inputs, fresh)
        logps = self._completion_logprobs(model, inputs)
        ref_logps = self._reference_logprobs(inputs) if self.loss_config.beta > 0 else None
        output = compute_loss(
            logps,
            None,
            inputs["behaviour_logps"],
            inputs["advantages"],
            completion_mask,
            self.loss_config,
            ref_logps=ref_logps,
            num_items_in_batch=num_items_in_batch,
            # one optimizer step's micro-batches are TRL's generation batch
            gradient_accumulation_steps=self._accumulation_steps,
            steps_per_generation=self._accumulation_steps,
            num_processes=self.args.world_size,
        )
        for group_id, reward, version, keep in zip(
            inputs["group_ids"], inputs["rewards"], versions, fresh, strict=True
        ):
            if keep:
                self.book.group_ids.setdefault(group_id, None)
                self.book.rewards.append(reward)
                self.book.staleness.append(self.feed.training_version - version)
            else:
                self.book.stale_group_ids.setdefault(group_id, None)
        for name, value in output.metrics.items():
            self.book.loss_metrics.setdefault(name, []).append(float(value))
        return output.loss

    def _completion_logprobs(self, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        head = _output_embedding_weight(self.accelerator.unwrap_model(model))
        return completion_logprobs(
            model, inputs, head, self.args.logprob_chunk_size, self.args.temperature, self.shares_prompts
        )

    @property
    def shares_prompts(self) -> bool:
        """Whether the forward runs each distinct prompt once (see ``prompt_sharing`` for when
        it cannot)."""
        args = self.args
        return args.share_prompt_forward and args.world_size == 1 and not args.gradient_checkpointing

    @torch.no_grad()
    def _reference_logprobs(self, inputs: dict[str, Any]) -> torch.Tensor:
        policy = self.accelerator.unwrap_model(self.model)
        if self.ref_model is not None:
            return self._completion_logprobs(self.ref_model, inputs)
        with policy.disable_adapter():  # PEFT: the base model is the reference
            return self._completion_logprobs(policy, inputs)

    def step_record(self, step: int, book: _StepBook, version: int) -> dict[str, Any]:
        """The step's metrics over all data-parallel ranks (every rank must call this);
        ``version``: the policy version the step trained at."""
        counters = self.feed.counters
        sums, maxima = self.over_ranks(
            [
                sum(book.rewards),
                len(book.rewards),
                len(book.group_ids),
                counters.dropped_stale,
                counters.trained,
                counters.received,
            ],
            [max(book.staleness, default=0)],
        )
        reward_sum, rewards, groups, dropped, trained, received = (int(v) if i else v for i, v in enumerate(sums))
        record: dict[str, Any] = {
            "step": step,
            "policy_version": version,
            "reward_mean": reward_sum / rewards if rewards else float("nan"),
            "groups": groups,
            "group_ids": list(book.group_ids),  # this process's
            "max_staleness_trained": int(maxima[0]),
            "dropped_stale": dropped,
            "groups_trained": trained,
            "groups_received": received,
        }
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


class _SyncAndAck(TrainerCallback):
    """At the end of each optimizer step: ack its groups, push weights when due, log a record.

    A push in the background (``AsyncGRPOTrainer.pushes_in_background``) sends a snapshot of
    the weights while the next step trains; the next push first waits for it, so at most one
    is in flight and vLLM's weights are never more than one push behind the trainer's.
    """

    def __init__(self, trainer: AsyncGRPOTrainer) -> None:
        self.trainer = trainer
        self._push_in_flight: Future[int] | None = None
        self._step_started = time.perf_counter()
        self._failed_pushes = 0
        """Background pushes failed in a row (a vLLM server died mid-push); see ``_wait_for_push``."""

    def on_train_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        # vLLM may serve other weights than this trainer's checkpoint (an earlier run, a
        # restarted trainer): push first, so every trained sample comes from this policy's line.
        self._push(state)
        if self.trainer.pusher is not None and state.is_world_process_zero:
            self.trainer.feed.on_weights_wanted = self._push_on_request
        self.trainer.feed.min_version = self.trainer.feed.current_version
        self.trainer.clock.take()  # the first step's clock starts now
        self._step_started = time.perf_counter()
        return control

    def on_pre_optimizer_step(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self._optimizer_started = time.perf_counter()
        return control

    def on_optimizer_step(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.trainer.clock.add("optimizer", time.perf_counter() - self._optimizer_started)
        return control

    def _push(self, state) -> None:  # type: ignore[no-untyped-def]
        """Rank 0 pushes; every rank then trains against the version the push produced.

        A trainer without a pusher is a follower: another trainer of the run pushes, and this
        one judges staleness against the run's version as the service reports it.
        """
        trainer = self.trainer
        if trainer.pusher is None:
            run = trainer.feed.call(trainer.feed.client.get_run(trainer.feed.run_id))
            trainer.feed.current_version = run.policy_version
            return
        version = None
        if state.is_world_process_zero:
            model = trainer.accelerator.unwrap_model(trainer.model)
            version = trainer.feed.call(trainer.pusher.push_policy(model), timeout_s=self._push_timeout_s())
        if trainer.args.world_size > 1:
            version = broadcast_object_list([version], from_process=0)[0]
        trainer.feed.current_version = version

    def _push_timeout_s(self) -> float:
        """How long the training thread waits for one push: the transfer bound plus the RPCs'."""
        assert self.trainer.pusher is not None
        return self.trainer.pusher.timeout_s + 120

    def _push_in_background(self) -> None:
        """Snapshot the weights and start their push; the trainer goes on at once."""
        trainer = self.trainer
        assert isinstance(trainer.pusher, WeightPusher)
        self._wait_for_push()
        with trainer.clock.measure("push_snapshot"):
            model = trainer.accelerator.unwrap_model(trainer.model)
            snapshot = [(name, tensor.detach().clone()) for name, tensor in policy_weights(model)]
        trainer.feed.pushes_in_flight = 1
        self._push_in_flight = trainer.feed.submit(trainer.pusher.push(snapshot))

    def _push_on_request(self, reason: str) -> None:
        """The service asked for the weights (a restarted vLLM server waits for them, and
        with one server no group comes until it has them): push now, between groups.

        Rank 0 only, without the broadcast of ``_push``: the other ranks are elsewhere in
        their step, and learn the version at the next regular push."""
        logger.warning("pushing the weights now, as the service asks: %s", reason)
        self._wait_for_push()
        trainer = self.trainer
        assert trainer.pusher is not None
        model = trainer.accelerator.unwrap_model(trainer.model)
        for attempt in range(1, PUSH_ATTEMPTS + 1):
            try:
                trainer.feed.current_version = trainer.feed.call(
                    trainer.pusher.push_policy(model), timeout_s=self._push_timeout_s()
                )
                return
            except Exception as exc:
                if attempt == PUSH_ATTEMPTS:
                    raise
                logger.warning("push %d of %d failed (%s); trying again", attempt, PUSH_ATTEMPTS, exc)
                time.sleep(PUSH_RETRY_DELAY_S)  # backoff before retrying a push, not synchronisation

    def _wait_for_push(self) -> None:
        """Wait for the push in flight, if any, and train against the version it produced.

        A push that failed (the service aborted it: a vLLM server died or the trainer was
        too slow) leaves vLLM on the version before it, and the next push joins a fresh
        group; training goes on. ``PUSH_ATTEMPTS`` failures in a row raise here."""
        future, self._push_in_flight = self._push_in_flight, None
        if future is None:
            return
        trainer = self.trainer
        assert trainer.pusher is not None
        try:
            with trainer.clock.measure("push_wait"):
                version = future.result(timeout=self._push_timeout_s())
        except Exception as exc:
            if not future.done():  # still running: two pushes at once must never happen
                future.cancel()
                raise
            trainer.feed.pushes_in_flight = 0
            self._failed_pushes += 1
            if self._failed_pushes >= PUSH_ATTEMPTS:
                raise
            logger.warning(
                "weight push failed (%s); vLLM keeps policy version %d and the next push re-joins",
                exc, trainer.feed.current_version,
            )  # fmt: skip
            return
        self._failed_pushes = 0
        trainer.feed.current_version, trainer.feed.pushes_in_flight = version, 0

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        trainer = self.trainer
        book, trainer.book = trainer.book, _StepBook()
        trained_at = trainer.feed.training_version
        config: AsyncGRPOConfig = trainer.args
        background = trainer.pushes_in_background
        due = state.global_step % config.weight_sync_steps == 0
        if due and not background:
            # Push before acking: an ack frees admission for the next groups, which must
            # sample from the new weights (with max_staleness 0 the old ones are too old).
            self._push(state)
        trainer.feed.ack_trained(list(book.group_ids), trained_at)
        trainer.feed.ack_dropped_stale(list(book.stale_group_ids))
        trainer.feed.flush_acks()
        record = trainer.step_record(state.global_step, book, trained_at)
        if due and background:
            self._push_in_background()
        now = time.perf_counter()
        record["seconds"] = step_seconds(trainer.clock.take(), now - self._step_started, not background)
        self._step_started = now
        if state.is_world_process_zero:
            path = Path(args.output_dir) / "metrics.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as out:
                out.write(json.dumps(record) + "\n")
        logger.info(
            "step %d: reward %.3f, policy v%d, %d groups, dropped stale %d, %.3fs (waiting for groups %.3fs)",
            record["step"],
            record["reward_mean"],
            record["policy_version"],
            record["groups"],
            record["dropped_stale"],
            record["seconds"]["step"],
            record["seconds"]["wait_groups"],
        )
        return control

    def on_train_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self._wait_for_push()  # the last push lands before the run reports its version
        return control
