"""GRPO-family policy losses as pure torch functions, mirroring TRL 1.16's ``GRPOTrainer._compute_loss``
with no model, optimizer, distributed call or host sync.

Shapes: ``B`` completions, ``T`` completion positions (right-padded). ``mask`` is 0 for padding *and* for
tokens the model did not produce (tool output), TRL's ``completion_mask * tool_mask``; values at mask-0
positions never reach the loss or the gradients, even if NaN or infinite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trainer_client.loss.config import (
    CLIPPED_LOSS_TYPES,
    DPPO_KL_TAU,
    LossConfig,
    VllmImportanceSamplingMode,
)
from trainer_client.loss.metrics import clip_metrics, dppo_metrics, masked_mean, mismatch_metrics, sampling_metrics


@dataclass(frozen=True)
class LossOutput:
    """Result of :func:`compute_loss`: ``loss`` to backpropagate (divided for gradient accumulation),
    ``policy_loss`` detached before that division, ``metrics`` detached 0-d tensors with TRL's names."""

    loss: torch.Tensor
    policy_loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


def zero_masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` [B, T] with mask-0 positions replaced by 0: selecting, unlike TRL's multiplying, keeps NaN/inf
    at padding out of the loss."""
    return torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))


def vllm_importance_sampling_ratio(
    old_logps: torch.Tensor,
    behaviour_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: VllmImportanceSamplingMode,
    clip_min: float | None,
    clip_max: float | None,
) -> torch.Tensor:
    """Truncated/masked importance ratio pi_old_trainer / pi_vllm correcting the sampler-trainer mismatch.

    Inputs [B, T]; returns [B, T] for ``token_*`` modes, [B, 1] for ``sequence_*`` modes. NaN behaviour log-probs
    and mask-0 positions get ratio 1. No gradient, as in TRL.
    """
    diff = zero_masked(old_logps.detach() - behaviour_logps.detach(), mask)
    diff = torch.nan_to_num(diff, nan=0.0)
    if mode.startswith("sequence_"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("_truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    lower = clip_min if clip_min is not None else -math.inf
    upper = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < lower) | (ratio > upper), 0.0)


def off_policy_sequence_mask(
    advantages: torch.Tensor, logps: torch.Tensor, behaviour_logps: torch.Tensor, mask: torch.Tensor, threshold: float
) -> torch.Tensor:
    """OPSM keep-mask [B, 1] (1 keep, 0 drop), TRL's ``get_off_policy_mask``: a sequence is dropped iff its
    advantage is negative and its mean per-token ``behaviour_logps - logps`` (NaN: 0) exceeds ``threshold``."""
    kl = torch.nan_to_num(zero_masked(behaviour_logps.detach() - logps.detach(), mask), nan=0.0)
    avg_seq_kl = (kl * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    keep = (advantages >= 0) | (avg_seq_kl <= threshold)
    return keep.to(dtype=mask.dtype)


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi_theta || pi_ref): exp(r) - r - 1 with r = ref - logps. [B, T] -> [B, T]."""
    log_ref_ratio = ref_logps - logps
    return torch.exp(log_ref_ratio) - log_ref_ratio - 1


def clipped_surrogate_loss(
    coef_1: torch.Tensor, advantages: torch.Tensor, epsilon_low: float, epsilon_high: float, delta: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's pessimistic clipped objective, negated: -min(r A, clip(r, 1-eps_low, 1+eps_high) A).

    ``coef_1`` is the ratio r, capped at ``delta`` if given (INTELLECT-2). Returns the per-token loss and the
    (possibly capped) ratio, which TRL's clip metrics use.
    """
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    if delta is not None:
        coef_1 = torch.clamp(coef_1, max=delta)
    return -torch.min(coef_1 * advantages, coef_2 * advantages), coef_1


def cispo_loss(
    coef_1: torch.Tensor, advantages: torch.Tensor, logps: torch.Tensor, epsilon_high: float
) -> torch.Tensor:
    """CISPO (MiniMax-M1): -sg(min(r, eps_high)) A log pi. Clips the weight, not the update, so every token keeps a
    gradient. ``coef_1`` [B, T] or [B, 1]; ``logps`` [B, T]; returns [B, T]."""
    return -torch.clamp(coef_1, max=epsilon_high).detach() * advantages * logps


def sapo_loss(
    coef_1: torch.Tensor, advantages: torch.Tensor, temperature_pos: float, temperature_neg: float
) -> torch.Tensor:
    """SAPO: -(4/tau) sigmoid(tau (r - 1)) A, a smooth gate whose gradient at r = 1 equals the unclipped one and
    fades off-policy; tau is ``temperature_pos`` where A > 0, else ``temperature_neg``."""
    temperatures = torch.where(advantages > 0, temperature_pos, temperature_neg)
    return -(torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures) * advantages


@torch.no_grad()
def dppo_masks(
    logps: torch.Tensor, sampler_logps: torch.Tensor, advantages: torch.Tensor, mask_low: float, mask_high: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """prime-rl's DPPO trust region on d = pi - pi_sampler per token: ``(masked, low, high)`` [B, T], ``high``
    where d > mask_high, ``low`` where d < -mask_low, ``masked`` = ``high`` for A > 0 else ``low``.

    A probability difference, unlike a ratio, does not mask a rare token for a small absolute move.
    """
    probs_diff = torch.exp(logps) - torch.exp(sampler_logps)
    high = probs_diff > mask_high
    low = probs_diff < -mask_low
    return torch.where(advantages > 0, high, low), low, high


@torch.no_grad()
def vespo_gamma_weights(
    advantages: torch.Tensor,
    log_ratio_per_token: torch.Tensor,
    mask: torch.Tensor,
    importance_sampling_ratio: torch.Tensor | None,
    config: LossConfig,
) -> torch.Tensor:
    """VESPO's detached weight phi(w) = e^lambda w^k e^(-lambda w) of the sequence ratio w, [B, 1].

    w = exp(sum of clamped per-token log(pi/pi_old) + sum of log vLLM IS ratios), computed in log space and
    clamped to [log 1e-8, 20] exactly as TRL's ``get_gamma_weights``; phi(1) = 1. ``log_ratio_per_token`` and
    ``mask`` [B, T], ``importance_sampling_ratio`` [B, T] (token modes) or None, ``advantages`` [B, 1].
    """
    lower_clamp = math.log(1e-8)
    log_ratio_clamped = torch.clamp(log_ratio_per_token, -20.0, 20.0)
    seq_log_ratio = torch.sum(log_ratio_clamped * mask, dim=-1, keepdim=True)
    if importance_sampling_ratio is not None:
        log_is_ratio = torch.clamp(torch.log(importance_sampling_ratio), lower_clamp, 20.0)
        seq_log_ratio = seq_log_ratio + torch.sum(log_is_ratio, dim=-1, keepdim=True)
    log_w_seq = torch.clamp(seq_log_ratio, lower_clamp, 20.0)
    w_seq = torch.exp(log_w_seq)
    is_nonneg_adv = advantages >= 0
    k_seq = torch.where(is_nonneg_adv, config.vespo_k_pos, config.vespo_k_neg)
    lambda_seq = torch.where(is_nonneg_adv, config.vespo_lambda_pos, config.vespo_lambda_neg).clamp(min=1e-4)
    log_phi = lambda_seq + k_seq * log_w_seq - lambda_seq * w_seq
    return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def aggregate_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig,
    num_items_in_batch: torch.Tensor | float | None,
    gradient_accumulation_steps: int,
    num_processes: int,
    steps_per_generation: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, policy_loss)`` of ``LossOutput`` from the per-token loss [B, T] (or [B, 1]):

    - grpo, sapo: mean over each sequence's mask-1 tokens, then over sequences; / gradient_accumulation_steps.
    - bnpo: sum / mask-1 tokens of this micro-batch; / gradient_accumulation_steps.
    - dr_grpo: sum / (B * max_completion_length); / gradient_accumulation_steps.
    - luspo: per-sequence sums, mean over sequences; / gradient_accumulation_steps.
    - dapo, cispo, vespo, dppo: sum / (num_items_in_batch / num_processes * gradient_accumulation_steps /
      steps_per_generation), ``num_items_in_batch`` being TRL's mask-1 tokens of the generation batch over all
      processes (``None``: this micro-batch's).
    """
    masked = per_token_loss * mask
    loss_type = config.loss_type
    if loss_type in ("grpo", "sapo"):
        loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = masked.sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        assert config.max_completion_length is not None  # LossConfig checks it
        loss = masked.sum() / (per_token_loss.size(0) * config.max_completion_length)
    elif loss_type == "luspo":
        loss = masked.sum(-1).mean()
    else:  # GLOBAL_TOKEN_NORMALISED
        items = mask.sum() if num_items_in_batch is None else num_items_in_batch
        items = torch.as_tensor(items, dtype=per_token_loss.dtype, device=per_token_loss.device)
        normalizer = items.clamp(min=1.0) / num_processes
        normalizer = normalizer * gradient_accumulation_steps / steps_per_generation
        loss = masked.sum() / normalizer
        return loss, loss.detach()
    return loss / gradient_accumulation_steps, loss.detach()


def compute_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    behaviour_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    config: LossConfig,
    *,
    ref_logps: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | float | None = None,
    gradient_accumulation_steps: int = 1,
    num_processes: int = 1,
    steps_per_generation: int = 1,
) -> LossOutput:
    """The GRPO-family loss of one micro-batch, as TRL's ``GRPOTrainer._compute_loss`` computes it.

    Args:
        logps: [B, T] log pi_theta of the completion tokens under the model being trained (requires grad).
        old_logps: [B, T] log-probs the clipping is centred on; ``None``: on-policy, ``logps.detach()``.
        behaviour_logps: [B, T] vLLM's log-probs of the sampled tokens (NaN where unavailable); needed by
            ``config.vllm_importance_sampling_correction``, preferred by OPSM.
        advantages: [B] (or [B, T]) advantages of each completion.
        completion_mask: [B, T] 1 for tokens the model generated, 0 for padding and tool output.
        ref_logps: [B, T] reference-model log-probs; required iff ``config.beta != 0``.
        num_items_in_batch: dapo/cispo/vespo/dppo only: mask-1 tokens of the generation batch over all processes.
        gradient_accumulation_steps, num_processes, steps_per_generation: TRL's normalisation factors
            (see :func:`aggregate_loss`); all 1 for a single process stepping the optimizer every micro-batch.

    Per-token loss pipeline (order as TRL): policy loss of ``loss_type`` -> x OPSM keep-mask -> x vLLM IS ratio
    (not for vespo, which folds it into its weights; for dppo whole, 0 where it masks) -> + dppo's
    ``DPPO_KL_TAU * (log pi - log pi_vllm)^2`` -> + beta * KL -> ``aggregate_loss``.
    """
    mask = completion_mask.to(logps.dtype)
    logps = zero_masked(logps, mask)
    old_logps = logps.detach() if old_logps is None else zero_masked(old_logps.detach(), mask)
    if behaviour_logps is not None:
        behaviour_logps = zero_masked(behaviour_logps.detach(), mask)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    advantages = advantages.to(logps.dtype)
    metrics: dict[str, torch.Tensor] = {}

    if behaviour_logps is not None:  # the mismatch, whether or not the loss corrects it
        metrics.update(mismatch_metrics(old_logps, behaviour_logps, mask))
    is_ratio = None  # the vLLM-vs-trainer ratio the per-token loss is multiplied by
    sampler_logps = old_logps  # dppo's pi_vllm: the policy its trust region and squared log-ratio refer to
    if config.vllm_importance_sampling_correction:
        if behaviour_logps is None:
            raise ValueError(
                "vllm_importance_sampling_correction needs behaviour_logps (the sampler's log-probs); pass them "
                "or disable the correction."
            )
        mode = config.vllm_importance_sampling_mode
        clip_min, clip_max = config.vllm_importance_sampling_clip_min, config.vllm_importance_sampling_clip_max
        if config.loss_type == "dppo":  # the whole ratio: DPPO's probability mask is its trust region
            mode, clip_min, clip_max = "token_mask", None, None
            sampler_logps = torch.where(torch.isnan(behaviour_logps), old_logps, behaviour_logps)  # ratio 1 there
        is_ratio = vllm_importance_sampling_ratio(old_logps, behaviour_logps, mask, mode, clip_min, clip_max)
        metrics.update(sampling_metrics(old_logps, behaviour_logps, mask, is_ratio))

    keep = None
    if config.off_policy_mask_threshold is not None:
        # The behaviour policy sees both sources of off-policyness: optimizer drift and the vLLM mismatch.
        sampler_logps = behaviour_logps if behaviour_logps is not None else old_logps
        keep = off_policy_sequence_mask(advantages, logps, sampler_logps, mask, config.off_policy_mask_threshold)
        metrics["opsm/dropped_fraction"] = 1.0 - keep.float().mean()

    log_ratio = logps - old_logps
    # the ratio pi_theta / pi_old: [B, T] at token level, [B, 1] at sequence level (GSPO: mean over mask-1 tokens)
    if config.importance_sampling_level == "token":
        coef_1 = torch.exp(log_ratio)
    else:
        coef_1 = torch.exp((log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0))

    per_token_kl = None
    if config.beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta != 0 needs ref_logps.")
        per_token_kl = k3_kl(logps, zero_masked(ref_logps.detach(), mask))
        if config.use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1

    eps_low, eps_high = config.epsilon, config.resolved_epsilon_high
    if config.loss_type == "cispo":
        metrics["cispo_clip_ratio"] = masked_mean(((coef_1 > eps_high) & (advantages > 0)).float(), mask)
        per_token_loss = cispo_loss(coef_1, advantages, logps, eps_high)
    elif config.loss_type in CLIPPED_LOSS_TYPES:
        per_token_loss, capped_coef_1 = clipped_surrogate_loss(coef_1, advantages, eps_low, eps_high, config.delta)
        metrics.update(clip_metrics(capped_coef_1, advantages, mask, eps_low, eps_high))
    elif config.loss_type == "sapo":
        per_token_loss = sapo_loss(coef_1, advantages, config.sapo_temperature_pos, config.sapo_temperature_neg)
    elif config.loss_type == "dppo":
        masked, low, high = dppo_masks(logps, sampler_logps, advantages, eps_low, eps_high)
        metrics.update(dppo_metrics(masked, low, high, advantages, mask))
        per_token_loss = torch.where(masked, 0.0, -coef_1 * advantages)
        if is_ratio is not None:  # selecting: a masked token's ratio may be infinite
            is_ratio = torch.where(masked, 0.0, is_ratio)
    else:  # vespo
        phi_seq = vespo_gamma_weights(advantages, log_ratio, mask, is_ratio, config)
        metrics["vespo/phi_seq_mean"] = masked_mean(phi_seq, mask)
        per_token_loss = -phi_seq * advantages * logps
    if keep is not None:
        per_token_loss = per_token_loss * keep
    if is_ratio is not None and config.loss_type != "vespo":
        per_token_loss = per_token_loss * is_ratio
    if config.loss_type == "dppo":
        per_token_loss = per_token_loss + DPPO_KL_TAU * (logps - sampler_logps) ** 2
    if per_token_kl is not None:
        per_token_loss = per_token_loss + config.beta * per_token_kl
        metrics["kl"] = masked_mean(per_token_kl.detach(), mask)

    loss, policy_loss = aggregate_loss(
        per_token_loss,
        mask,
        config,
        num_items_in_batch,
        gradient_accumulation_steps,
        num_processes,
        steps_per_generation,
    )
    metrics["policy_loss"] = policy_loss
    return LossOutput(loss=loss, policy_loss=policy_loss, metrics={k: v.detach() for k, v in metrics.items()})
