"""Detached metrics of one loss computation over the local batch, with TRL's names; left on
device so that computing them does not force a host sync."""

from __future__ import annotations

import math

import torch


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """TRL's ``global_masked_mean`` on one process: mean over mask-1 tokens; [B, 1] values over sequences."""
    if values.shape[-1] == 1:
        return values.float().mean()
    return (values * mask).sum().float() / mask.sum().float().clamp(min=1.0)


def masked_sequence_means(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence mean of [B, T] values over mask-1 tokens, NaN for empty rows; [B, 1] values pass through: [B]."""
    if values.shape[-1] == 1:
        return values.squeeze(-1)
    return (values * mask).sum(-1) / mask.sum(-1)


def _nan_extreme(values: torch.Tensor, largest: bool) -> torch.Tensor:
    finite = values[~torch.isnan(values)]
    if finite.numel() == 0:
        return torch.tensor(math.nan, dtype=values.dtype, device=values.device)
    return finite.max() if largest else finite.min()


def sampling_metrics(
    old_logps: torch.Tensor, behaviour_logps: torch.Tensor, mask: torch.Tensor, is_ratio: torch.Tensor
) -> dict[str, torch.Tensor]:
    """TRL's ``sampling/*`` metrics of the vLLM mismatch: |old - behaviour| over mask-1 non-NaN tokens, and the
    final (truncated/masked) IS ratio over mask-1 tokens (token modes) or sequences (sequence modes). Plus the
    fractions of those ratios set to zero by a ``*_mask`` mode and capped by a ``*_truncate`` mode."""
    keep = mask.bool()
    delta = torch.abs(old_logps.detach() - behaviour_logps.detach())[keep]
    delta = delta[~torch.isnan(delta)]
    zero = torch.zeros((), dtype=delta.dtype, device=delta.device)
    flat_ratio = is_ratio.flatten() if is_ratio.shape[-1] == 1 else is_ratio[keep]
    masked = (flat_ratio == 0).float().mean() if flat_ratio.numel() else zero
    log_ratio = torch.nan_to_num((old_logps.detach() - behaviour_logps.detach()) * mask, nan=0.0)  # as the ratio's
    raw = torch.exp(log_ratio.sum(-1)).flatten() if is_ratio.shape[-1] == 1 else torch.exp(log_ratio)[keep]
    truncated = ((flat_ratio != raw) & (flat_ratio != 0)).float().mean() if flat_ratio.numel() else zero
    return {
        "sampling/sampling_logp_difference/mean": delta.mean() if delta.numel() else zero,
        "sampling/sampling_logp_difference/max": delta.max() if delta.numel() else zero,
        "sampling/importance_sampling_ratio/min": flat_ratio.min() if flat_ratio.numel() else zero,
        "sampling/importance_sampling_ratio/mean": flat_ratio.mean() if flat_ratio.numel() else zero,
        "sampling/importance_sampling_ratio/max": flat_ratio.max() if flat_ratio.numel() else zero,
        "sampling/importance_sampling_masked_fraction": masked,
        "sampling/importance_sampling_truncated_fraction": truncated,
    }


def mismatch_metrics(
    old_logps: torch.Tensor, behaviour_logps: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """How far the trainer's policy is from the sampler's over the step's mask-1 tokens (NaN-free):
    prime-rl's ``mismatch_kl``, the k3 estimate of KL(pi_vllm || pi_trainer) from tokens vLLM
    sampled, and the effective sample size of the raw token importance weights pi_trainer / pi_vllm,
    normalised to (0, 1] (1: the weights are equal, the batch is as good as on-policy)."""
    log_ratio = (old_logps.detach() - behaviour_logps.detach())[mask.bool()]
    log_ratio = log_ratio[~torch.isnan(log_ratio)]
    if log_ratio.numel() == 0:
        nan = torch.tensor(math.nan, device=old_logps.device)
        return {"sampling/mismatch_kl": nan, "sampling/importance_sampling_ess": nan}
    weights = torch.exp(log_ratio.double())
    ess = weights.sum() ** 2 / (weights.numel() * (weights**2).sum())
    return {
        "sampling/mismatch_kl": (weights - log_ratio.double() - 1).mean().float(),
        "sampling/importance_sampling_ess": ess.float(),
    }


def dppo_metrics(
    masked: torch.Tensor, low: torch.Tensor, high: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """prime-rl's masked fractions of the DPPO loss over mask-1 tokens, with its names: ``is_masked`` (the tokens
    the loss drops, zero advantages judged by the low bound), ``is_masked_low`` (A < 0), ``is_masked_high`` (A > 0).
    ``masked``, ``low``, ``high`` [B, T] from ``losses.dppo_masks``."""
    count = mask.sum().float().clamp(min=1.0)
    fractions = {
        "is_masked": masked,
        "is_masked_low": low & (advantages < 0),
        "is_masked_high": high & (advantages > 0),
    }
    return {f"dppo/{name}": (values * mask).sum().float() / count for name, values in fractions.items()}


def clip_metrics(
    coef_1: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, epsilon_low: float, epsilon_high: float
) -> dict[str, torch.Tensor]:
    """TRL's ``clip_ratio/*``: fraction of tokens whose clipped branch is active (low: r < 1-eps_low with A < 0,
    high: r > 1+eps_high with A > 0), and the min/max over sequences of the per-sequence fractions."""
    low = ((coef_1 < 1 - epsilon_low) & (advantages < 0)).float()
    high = ((coef_1 > 1 + epsilon_high) & (advantages > 0)).float()
    region = torch.maximum(low, high)
    return {
        "clip_ratio/low_mean": masked_mean(low, mask),
        "clip_ratio/high_mean": masked_mean(high, mask),
        "clip_ratio/region_mean": masked_mean(region, mask),
        "clip_ratio/low_min": _nan_extreme(masked_sequence_means(low, mask), largest=False),
        "clip_ratio/high_max": _nan_extreme(masked_sequence_means(high, mask), largest=True),
    }
