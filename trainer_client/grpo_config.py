"""``AsyncGRPOConfig``: the trainer's options, as TRL keeps ``GRPOConfig`` beside ``GRPOTrainer``."""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields

from transformers import TrainingArguments

from rollout_common.staleness import DEFAULT_MAX_STALENESS
from trainer_client.loss.config import VLLM_IMPORTANCE_SAMPLING_MODES, LossConfig
from trainer_client.options import SCALE_REWARDS
from trainer_client.train import precision

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class AsyncGRPOConfig(TrainingArguments):
    """Training arguments plus the stream, weight-sync, sampling and loss settings, with TRL
    ``GRPOConfig``'s names and defaults wherever the setting means the same here."""

    num_generations: int = 8
    """Completions per prompt (G); the per-device batch must hold whole groups."""
    learning_rate: float = 1e-6
    logging_steps: float = 10
    bf16: bool | None = None  # type: ignore[assignment]
    """bf16 autocast over float32 weights; None: where the hardware has native bf16 (``precision``)."""
    max_staleness: int = DEFAULT_MAX_STALENESS
    """Groups whose oldest token is more than this many policy versions old are dropped."""
    weight_sync_steps: int = 1
    """Push weights into vLLM after every this many optimizer steps."""
    background_push: bool = True
    """Push a snapshot of the weights while the next step trains. That step trains a version
    ahead of vLLM, so this needs ``max_staleness >= 1``; with 0, data-parallel ranks, or
    adapter pushes the push stays on the step's path."""
    temperature: float = 1.0
    """Sampling temperature of the run: log-probs are computed on logits / temperature, as vLLM's."""
    top_p: float = 1.0
    """Nucleus sampling mass of the run (1: off)."""
    top_k: int = 0
    """Top-k sampling of the run (0: off)."""
    scale_rewards: str = "group"
    """Advantage denominator: group (its std), batch, or none (Dr. GRPO)."""
    logprob_chunk_size: int = 1024
    """Positions per chunk of the log-prob computation (bounds the [chunk, vocab] logits)."""
    share_prompt_forward: bool = True
    """Run each distinct prompt of a batch through the model once, where that pays
    (``prompt_sharing``); not under gradient checkpointing or data parallelism."""
    stream_credits: int = 0
    """Groups the service may send ahead of acks; 0: one step's worth. More credits mean older
    groups in flight."""
    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    beta: float = 0.0
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: str = "token_truncate"
    """Not TRL's ``sequence_mask``: here the ratio also carries a version of policy change, so
    over a whole sequence it masks exactly the samples the last step made likelier."""
    vllm_importance_sampling_clip_max: float | None = 3.0
    vllm_importance_sampling_clip_min: float | None = None
    vllm_importance_sampling_cap: float | None = None
    """TRL's deprecated name of ``vllm_importance_sampling_clip_max``: set, it sets that."""
    off_policy_mask_threshold: float | None = None
    max_completion_length: int = 512
    remove_unused_columns: bool = False
    ignore_data_skip: bool = True
    """The stream has no position to fast-forward to: a resumed trainer trains on what comes next."""

    def __post_init__(self) -> None:
        self.output_dir_given = self.output_dir is not None
        """False: the trainer writes to ``outputs/<run id>`` once it knows the run (``train``)."""
        device = precision.device_type(self.use_cpu)
        self.bf16 = precision.resolve_bf16(self.bf16, device)
        if self.bf16 and device == "cpu":  # TrainingArguments takes bf16 without a GPU for the CPU's only if told
            self.use_cpu = True
        if isinstance(self.scale_rewards, bool) or self.scale_rewards in ("true", "false"):  # TRL's older spelling
            self.scale_rewards = "group" if self.scale_rewards in (True, "true") else "none"
        super().__post_init__()
        if self.num_generations < 2:
            raise ValueError(f"num_generations is {self.num_generations}; it must be >= 2")
        if not (isinstance(self.max_completion_length, int) and self.max_completion_length > 0):  # None too
            raise ValueError(f"max_completion_length is {self.max_completion_length}; it must be > 0")
        if not (isinstance(self.temperature, int | float) and self.temperature > 0):  # None and NaN too
            raise ValueError(
                f"temperature is {self.temperature}; it must be > 0 (log-probs are of logits / temperature)"
            )
        if self.per_device_train_batch_size <= 0:
            raise ValueError(f"per_device_train_batch_size is {self.per_device_train_batch_size}; it must be > 0")
        if self.per_device_train_batch_size % self.num_generations:
            raise ValueError(
                f"per_device_train_batch_size {self.per_device_train_batch_size} must be a multiple of "
                f"num_generations {self.num_generations}, so that every batch holds whole groups"
            )
        if self.max_steps <= 0:
            raise ValueError("set max_steps (> 0): the sample stream has no length, so epochs cannot end a run")
        if self.scale_rewards not in SCALE_REWARDS:
            raise ValueError(f"scale_rewards is {self.scale_rewards!r}; choose one of {', '.join(SCALE_REWARDS)}")
        if self.beta < 0:
            raise ValueError(f"beta is {self.beta}; the KL coefficient must be >= 0")
        if self.vllm_importance_sampling_mode not in VLLM_IMPORTANCE_SAMPLING_MODES:
            raise ValueError(
                f"vllm_importance_sampling_mode is {self.vllm_importance_sampling_mode!r}; "
                f"choose one of {', '.join(VLLM_IMPORTANCE_SAMPLING_MODES)}"
            )
        if self.vllm_importance_sampling_cap is not None:
            logger.warning("vllm_importance_sampling_cap is deprecated in TRL; use vllm_importance_sampling_clip_max")
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
        clip_max, clip_min = self.vllm_importance_sampling_clip_max, self.vllm_importance_sampling_clip_min
        if clip_max is not None and clip_max <= 1:
            raise ValueError(
                f"vllm_importance_sampling_clip_max is {clip_max}; it must be > 1 (the ratio of equal policies)"
            )
        if clip_min is not None and not 0 <= clip_min < 1:
            raise ValueError(f"vllm_importance_sampling_clip_min is {clip_min}; it must be in [0, 1)")

    def pushes_in_background(self, pushes_full_weights: bool) -> bool:
        """Whether a trainer with these settings overlaps its pushes with the next step."""
        return self.background_push and self.max_staleness >= 1 and self.world_size == 1 and pushes_full_weights

    @property
    def groups_per_step(self) -> int:
        return self.per_device_train_batch_size * self.gradient_accumulation_steps // self.num_generations

    @property
    def effective_stream_credits(self) -> int:
        return max(self.stream_credits, self.groups_per_step)

    def loss_config(self) -> LossConfig:
        """The loss settings: those named alike here."""
        shared = {f.name for f in fields(LossConfig)} & {f.name for f in fields(self)}
        return LossConfig(**{name: getattr(self, name) for name in shared})
