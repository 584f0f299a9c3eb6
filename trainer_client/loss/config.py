"""The policy loss's settings, with TRL 1.16 ``GRPOConfig``'s names, defaults and advice: one
definition for the trainer's config, its CLI and the loss. Loss types TRL lacks take their formulas
from another trainer and reuse TRL's options rather than adding their own."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal, get_args

TrlLossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
AnchorLossType = Literal["dppo"]
LossType = Literal[TrlLossType, AnchorLossType]
ImportanceSamplingLevel = Literal["token", "sequence"]
VllmImportanceSamplingMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]

LOSS_TYPES: tuple[str, ...] = get_args(TrlLossType)
"""TRL 1.16's loss types, each computed as ``GRPOTrainer._compute_loss`` computes it."""
ANCHOR_LOSS_TYPES: tuple[str, ...] = get_args(AnchorLossType)
"""Loss types TRL lacks, each computed as the trainer it comes from computes it: ``dppo`` is prime-rl's default."""
VLLM_IMPORTANCE_SAMPLING_MODES: tuple[str, ...] = get_args(VllmImportanceSamplingMode)
DPPO_KL_TAU = 1e-3
"""Weight of ``dppo``'s squared log-ratio to the sampler: prime-rl's ``kl_tau`` default, fixed here since
``LossConfig`` keeps to TRL's options."""
# Loss types that share the PPO-style clipped surrogate (and its clip-ratio metrics).
CLIPPED_LOSS_TYPES: tuple[str, ...] = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
# Loss types normalised by the number of loss tokens in the global batch (``num_items_in_batch``).
GLOBAL_TOKEN_NORMALISED: tuple[str, ...] = ("dapo", "cispo", "vespo", "dppo")


class LossConfigWarning(UserWarning):
    """A legal but probably unintended combination of options (TRL logs the same advice)."""


@dataclass(frozen=True)
class LossConfig:
    """Every knob of the policy loss. Names and defaults are those of TRL 1.16's ``GRPOConfig``."""

    loss_type: LossType = "dapo"
    """Per-token loss and its normalisation (``losses.compute_loss``, ``losses.aggregate_loss``). Besides TRL's,
    ``dppo``: prime-rl's default loss, -A pi/pi_vllm on tokens whose probability has not risen (A > 0) or fallen
    (A <= 0) past its bound from the sampler's (``losses.dppo_masks``), plus ``DPPO_KL_TAU`` (log pi/pi_vllm)^2,
    summed over the step's tokens."""
    importance_sampling_level: ImportanceSamplingLevel = "token"
    """``"token"``: one ratio pi/pi_old per token. ``"sequence"`` (GSPO): one ratio per sequence, the exp of the
    mean per-token log-ratio over its mask-1 tokens."""
    epsilon: float = 0.2
    """Lower clipping epsilon (TRL's ``epsilon_low``): the ratio is clipped from below at ``1 - epsilon``. For
    ``dppo`` it bounds the probability difference instead (prime-rl's ``dppo_mask_low``, also 0.2)."""
    epsilon_high: float | None = None
    """Upper clipping epsilon: clip from above at ``1 + epsilon_high``; ``None`` means ``epsilon``. DAPO uses 0.28.
    For ``cispo`` it is the absolute cap of the IS weight (ScaleRL's epsilon_max, recommended 5.0); for ``dppo``
    the upper bound of the probability difference (prime-rl's ``dppo_mask_high``, also 0.2)."""
    delta: float | None = None
    """Two-sided clipping (INTELLECT-2): the unclipped ratio is also capped at ``delta`` (> ``1 + epsilon_high``),
    bounding the loss of negative-advantage tokens. Clipped loss types only."""
    beta: float = 0.0
    """KL coefficient towards the reference policy; 0 disables the KL term (no reference log-probs needed)."""
    use_bias_correction_kl: bool = True
    """Multiply the per-token k3 KL by the IS ratio pi/pi_old, making its gradient the unbiased reverse-KL
    gradient (DeepSeek-V3.2). Only matters if beta != 0."""
    sapo_temperature_pos: float = 1.0
    """SAPO gate temperature for tokens with positive advantage."""
    sapo_temperature_neg: float = 1.05
    """SAPO gate temperature for tokens with non-positive advantage."""
    vespo_k_pos: float = 2.0
    """VESPO power exponent k for non-negative advantages (down-weights sequences with IS ratio < 1)."""
    vespo_lambda_pos: float = 3.0
    """VESPO decay lambda for non-negative advantages (down-weights sequences with IS ratio > 1)."""
    vespo_k_neg: float = 3.0
    """VESPO power exponent k for negative advantages."""
    vespo_lambda_neg: float = 2.0
    """VESPO decay lambda for negative advantages."""
    vllm_importance_sampling_correction: bool = True
    """Correct the mismatch between the sampler (vLLM) and the trainer by weighting each token's loss with
    ``exp(old_logps - behaviour_logps)``, truncated or masked (see the mode). Needs ``behaviour_logps``. ``dppo``
    takes the ratio whole, ignoring mode and bounds: its probability mask is the trust region."""
    vllm_importance_sampling_mode: VllmImportanceSamplingMode = "sequence_mask"
    """``token_truncate``: per-token ratio clamped to [clip_min, clip_max]. ``token_mask``: per-token ratio set to 0
    outside [clip_min, clip_max]. ``sequence_*``: the same on one ratio per sequence, exp of the *sum* of its
    per-token log differences, broadcast over its tokens."""
    vllm_importance_sampling_clip_max: float | None = 3.0
    """Upper bound C_max of the vLLM IS ratio (TRL's former ``vllm_importance_sampling_cap``); ``None``: unbounded."""
    vllm_importance_sampling_clip_min: float | None = None
    """Lower bound C_min of the vLLM IS ratio; ``None``: unbounded below."""
    off_policy_mask_threshold: float | None = None
    """OPSM (DeepSeek-V3.2 eq. 9): drop sequences with negative advantage whose mean per-token KL between the
    behaviour policy and the current policy exceeds this (e.g. 0.5). ``None`` disables it."""
    max_completion_length: int | None = 512
    """The constant of ``dr_grpo``'s denominator ``B * max_completion_length``: the sampling ``max_tokens``."""

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES + ANCHOR_LOSS_TYPES:
            raise ValueError(f"Unknown loss type {self.loss_type!r}; expected one of {LOSS_TYPES + ANCHOR_LOSS_TYPES}.")
        if self.importance_sampling_level not in get_args(ImportanceSamplingLevel):
            raise ValueError(f"Unknown importance sampling level {self.importance_sampling_level!r}.")
        if self.vllm_importance_sampling_mode not in VLLM_IMPORTANCE_SAMPLING_MODES:
            raise ValueError(
                f"Unknown vLLM importance sampling mode {self.vllm_importance_sampling_mode!r}; "
                f"expected one of {VLLM_IMPORTANCE_SAMPLING_MODES}."
            )
        clip_min, clip_max = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if clip_min is not None and clip_max is not None and clip_min >= clip_max:
            raise ValueError(f"vllm_importance_sampling_clip_min ({clip_min}) must be < clip_max ({clip_max}).")
        truncating = self.vllm_importance_sampling_mode in ("token_truncate", "sequence_truncate")
        if self.vllm_importance_sampling_correction and truncating and clip_min is None and clip_max is None:
            raise ValueError("A *_truncate vLLM importance sampling mode needs clip_min or clip_max.")
        if (
            self.loss_type == "vespo"
            and self.vllm_importance_sampling_correction
            and self.vllm_importance_sampling_mode not in ("token_truncate", "token_mask")
        ):
            raise ValueError("VESPO needs vllm_importance_sampling_mode 'token_truncate' or 'token_mask'.")
        if self.loss_type == "dppo":
            if self.importance_sampling_level != "token":
                raise ValueError("dppo masks tokens one by one; it needs importance_sampling_level='token'.")
            if self.epsilon < 0 or self.resolved_epsilon_high < 0:
                raise ValueError(
                    f"dppo's probability bounds epsilon ({self.epsilon}) and epsilon_high "
                    f"({self.resolved_epsilon_high}) must be >= 0."
                )
        if self.loss_type == "dr_grpo" and (self.max_completion_length is None or self.max_completion_length <= 0):
            raise ValueError("dr_grpo needs a positive max_completion_length.")
        if self.loss_type == "luspo" and self.importance_sampling_level != "sequence":
            warnings.warn("luspo is meant for importance_sampling_level='sequence'.", LossConfigWarning, stacklevel=3)
        if self.loss_type == "vespo" and self.importance_sampling_level != "token":
            warnings.warn("vespo computes sequence weights itself; use level 'token'.", LossConfigWarning, stacklevel=3)
        if self.importance_sampling_level == "sequence" and self.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
            warnings.warn(
                f"With importance_sampling_level='sequence', {self.loss_type!r} sums per-token contributions, so each "
                "sequence is weighted by its length; GSPO proper is loss_type='grpo'.",
                LossConfigWarning,
                stacklevel=3,
            )

    @property
    def resolved_epsilon_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high
