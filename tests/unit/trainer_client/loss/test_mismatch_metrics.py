"""The step's mismatch diagnostics, worked by hand: prime-rl's ``mismatch_kl`` (the k3 estimate
of KL(pi_vllm || pi_trainer)), the effective sample size of the token importance weights, and
the fractions of ratios the correction truncated or masked."""

from __future__ import annotations

import math

import pytest
import torch

from trainer_client.loss.config import LossConfig
from trainer_client.loss.losses import compute_loss, k3_kl
from trainer_client.loss.metrics import mismatch_metrics

pytestmark = pytest.mark.timeout(60)

TRAINER = torch.tensor([[math.log(0.5), math.log(0.4), math.log(0.9)]])
VLLM = torch.tensor([[math.log(0.5), math.log(0.2), float("nan")]])  # NaN: vLLM gave none
MASK = torch.tensor([[1.0, 1.0, 1.0]])


def test_mismatch_kl_and_ess_by_hand() -> None:
    # two tokens count: log ratios 0 and ln 2, weights 1 and 2
    metrics = mismatch_metrics(TRAINER, VLLM, MASK)
    k3 = (0.0 + (2.0 - math.log(2.0) - 1.0)) / 2
    assert float(metrics["sampling/mismatch_kl"]) == pytest.approx(k3, rel=1e-6)
    assert float(metrics["sampling/importance_sampling_ess"]) == pytest.approx((1 + 2) ** 2 / (2 * (1 + 4)), rel=1e-6)


def test_mismatch_kl_is_prime_rls_and_trls_k3_on_the_same_tensors() -> None:
    torch.manual_seed(0)
    trainer = torch.log_softmax(torch.randn(4, 16, 50), -1)[..., 0]
    vllm = trainer + 0.1 * torch.randn(4, 16)
    mask = (torch.rand(4, 16) > 0.2).float()
    ours = float(mismatch_metrics(trainer, vllm, mask)["sampling/mismatch_kl"])
    # prime-rl: log_importance_ratio = trainer - inference; token_mismatch_kl = ratio - log_ratio - 1, masked mean
    log_ratio = trainer - vllm
    prime_rl = float(((torch.exp(log_ratio) - log_ratio - 1) * mask).sum() / mask.sum())
    # TRL's k3 (its KL-to-reference term) with vLLM as the sampling policy and the trainer as the reference
    trl = float((k3_kl(vllm, trainer) * mask).sum() / mask.sum())
    assert ours == pytest.approx(prime_rl, rel=1e-5) and ours == pytest.approx(trl, rel=1e-5)


def test_equal_weights_give_full_ess_and_no_mismatch() -> None:
    metrics = mismatch_metrics(TRAINER, TRAINER, MASK)
    assert float(metrics["sampling/mismatch_kl"]) == 0.0
    assert float(metrics["sampling/importance_sampling_ess"]) == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("mode", "truncated", "masked"),
    [("token_truncate", 1 / 3, 0.0), ("token_mask", 0.0, 1 / 3), ("sequence_truncate", 1.0, 0.0)],
)
def test_the_loss_reports_what_the_correction_truncated_or_masked(mode: str, truncated: float, masked: float) -> None:
    # ratios 1, 2 (above the cap of 1.5) and 0.5 (within the floor of 0.25); a sequence ratio of 1
    trainer = torch.log(torch.tensor([[0.5, 0.4, 0.1]]))
    vllm = torch.log(torch.tensor([[0.5, 0.2, 0.2]]))
    config = LossConfig(
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_min=0.25,
        vllm_importance_sampling_clip_max=1.5,
    )
    if mode == "sequence_truncate":  # the sequence's ratio, 1 * 2 * 0.5 = 1, lies within; push it above the cap
        vllm = torch.log(torch.tensor([[0.5, 0.2, 0.05]]))
    logps = trainer.clone().requires_grad_(True)
    out = compute_loss(logps, trainer, vllm, torch.tensor([1.0]), MASK, config)
    assert float(out.metrics["sampling/importance_sampling_truncated_fraction"]) == pytest.approx(truncated)
    assert float(out.metrics["sampling/importance_sampling_masked_fraction"]) == pytest.approx(masked)
    assert "sampling/mismatch_kl" in out.metrics and "sampling/importance_sampling_ess" in out.metrics


def test_icepop_is_trls_token_mask_with_both_bounds() -> None:
    """IcePop (two-sided token masking): each token's gradient is weighted by k = pi_train / pi_infer
    when alpha <= k <= beta, else by 0. That is TRL's ``token_mask`` mode with clip_min alpha and
    clip_max beta: the same weights token by token, so no separate loss is needed."""
    from trainer_client.loss.losses import vllm_importance_sampling_ratio

    torch.manual_seed(1)
    trainer = torch.log_softmax(torch.randn(3, 12, 40), -1)[..., 0]
    vllm = trainer + 0.8 * torch.randn(3, 12)  # a wide mismatch, so that both bounds bite
    mask = torch.ones(3, 12)
    alpha, beta = 0.5, 5.0  # IcePop's published bounds
    k = torch.exp(trainer - vllm)
    icepop = torch.where((k >= alpha) & (k <= beta), k, torch.zeros_like(k))
    ours = vllm_importance_sampling_ratio(trainer, vllm, mask, "token_mask", alpha, beta)
    assert bool(((k < alpha) | (k > beta)).any()) and bool(((k >= alpha) & (k <= beta)).any())
    torch.testing.assert_close(ours, icepop)
