"""The anchors' off-policy corrections, each against a re-implementation of the anchor's own code:

- AReaL's decoupled PPO (``areal/utils/functional/functional.py``: ``ppo_actor_loss_fn`` with
  ``apply_rejection_sampling``, inclusionAI/AReaL at 4aef98d8) is TRL's clipped loss with pi_old the proximal
  policy and the ``token_*`` vLLM correction: no loss of its own.
- prime-rl's default loss (``src/prime_rl/trainer/rl/loss.py``: ``default_loss_fn`` and ``compute_loss``,
  PrimeIntellect-ai/prime-rl at 559b4477) is ``loss_type="dppo"``.

The reference functions copy the anchors' statements for the paths used (token level, padded 2-D tensors); nothing
from ``trainer_client.loss.losses`` is used on the reference side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from trainer_client.grpo_config import AsyncGRPOConfig
from trainer_client.loss.config import (
    ANCHOR_LOSS_TYPES,
    DPPO_KL_TAU,
    GLOBAL_TOKEN_NORMALISED,
    LOSS_TYPES,
    LossConfig,
)
from trainer_client.loss.losses import compute_loss, vllm_importance_sampling_ratio

pytestmark = pytest.mark.timeout(60)

ATOL = 1e-6
RTOL = 1e-5

# ----------------------------------------------------------------------------------------------------------------------
# AReaL
# ----------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rejection:
    """AReaL's ``RejectionSamplingConfig`` at ``level="token"``, ``metric="ratio"``."""

    action: str  # "mask" or "clamp"
    upper: float
    lower: float | None = None


def areal_rejection_sampling(
    proximal_logprobs: torch.Tensor, old_logprobs: torch.Tensor, loss_mask: torch.Tensor, config: Rejection
) -> tuple[torch.Tensor, torch.Tensor]:
    """AReaL ``apply_rejection_sampling`` (token level, ratio metric): the updated loss mask and behave_imp_weight."""
    log_ratio = proximal_logprobs.detach().float() - old_logprobs.detach().float()
    log_ratio = torch.where(torch.isfinite(log_ratio), log_ratio, 0.0)
    metric = torch.exp(log_ratio)
    behave_imp_weight = torch.exp(log_ratio)
    if config.action == "mask":
        # _check_bounds
        if config.lower is not None:
            in_bounds = (metric >= config.lower) & (metric <= config.upper)
        else:
            in_bounds = metric <= config.upper
        updated_mask = (loss_mask.bool() & in_bounds).to(loss_mask.dtype)
    else:
        # RejectionSamplingConfig.__post_init__ sets lower to 0.0 for clamp when unset
        behave_imp_weight = behave_imp_weight.clamp(
            min=config.lower if config.lower is not None else 0.0, max=config.upper
        )
        updated_mask = loss_mask
    behave_imp_weight = torch.where(updated_mask.bool(), behave_imp_weight, 0.0)
    return updated_mask, behave_imp_weight


def areal_ppo_actor_loss_fn(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    loss_mask: torch.Tensor,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    rejection_sampling: Rejection | None = None,
) -> torch.Tensor:
    """AReaL ``ppo_actor_loss_fn`` at ``importance_sampling_level="token"``: old_logprobs are the behaviour
    policy's (the inference engine's), proximal_logprobs the recomputed (or approximated) proximal policy's."""
    loss_mask_count = loss_mask.count_nonzero() or 1
    if rejection_sampling is not None:
        loss_mask, behave_imp_weight = areal_rejection_sampling(
            proximal_logprobs, old_logprobs, loss_mask, rejection_sampling
        )
    ratio = torch.where(loss_mask, torch.exp(logprobs - proximal_logprobs), 0)
    clipped_ratio = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + (eps_clip if eps_clip_higher is None else eps_clip_higher))
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * clipped_ratio
    pg_loss = torch.max(pg_loss1, pg_loss2)
    if c_clip is not None:
        assert c_clip > 1.0, c_clip
        pg_loss3 = torch.sign(advantages) * c_clip * advantages
        pg_loss = torch.min(pg_loss, pg_loss3)
    if rejection_sampling is not None:
        pg_loss = pg_loss * behave_imp_weight
    return torch.where(loss_mask, pg_loss, 0).sum() / loss_mask_count


def areal_loglinear_proximal(
    old_logp: torch.Tensor, logprobs: torch.Tensor, versions: torch.Tensor, current_version: int
) -> torch.Tensor:
    """AReaL ``compute_prox_logp_approximations`` (``areal/trainer/ppo/actor.py``), method "loglinear"."""
    v_proximal = current_version - 1
    v_behave = versions.float()
    v_theta = float(current_version)
    generated_tokens_mask = versions >= 0
    version_diff = v_theta - v_behave
    version_gap = v_proximal - v_behave
    alpha = torch.where(
        (version_diff > 0) & generated_tokens_mask, version_gap / version_diff, torch.zeros_like(v_behave)
    )
    alpha = torch.clamp(alpha, 0.0, 1.0)
    return old_logp + alpha * (logprobs - old_logp)


@dataclass
class Batch:
    logps: torch.Tensor  # [B, T] the policy being trained
    proximal: torch.Tensor  # [B, T] AReaL's proximal policy, our old_logps
    behaviour: torch.Tensor  # [B, T] the sampler's, NaN at padding and at one generated token
    advantages: torch.Tensor  # [B, T], per sequence
    mask: torch.Tensor  # [B, T] bool


def make_batch(seed: int, size: int = 6, length: int = 10, prox_noise: float = 0.3) -> Batch:
    """Probabilities spread over (0, 1), so that clipping, both caps and both DPPO bounds all bite."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([length, 3, 7, 0, length - 1, 5][:size])
    mask = torch.arange(length)[None, :] < lengths[:, None]
    mask[0, 3:5] = False  # tool output inside a completion
    probs = torch.rand(size, length, generator=gen) * 0.96 + 0.02
    logps = torch.log(probs)
    proximal = logps + prox_noise * torch.randn(size, length, generator=gen)
    behaviour_probs = (probs + 0.35 * torch.randn(size, length, generator=gen)).clamp(0.01, 0.99)
    behaviour = torch.log(behaviour_probs)
    behaviour[~mask] = float("nan")  # vLLM's log-probs stop where the completion does
    behaviour[2, 1] = float("nan")  # a generated token vLLM gave no log-prob for
    advantages = torch.tensor([1.3, -0.7, 0.0, 0.4, -1.1, 0.9][:size])[:, None].expand(size, length).clone()
    return Batch(logps, proximal, behaviour, advantages, mask)


AREAL_CASES = {
    "mask": (Rejection("mask", upper=2.0), {"vllm_importance_sampling_mode": "token_mask"}),
    "mask_two_sided": (
        Rejection("mask", upper=2.0, lower=0.5),
        {"vllm_importance_sampling_mode": "token_mask", "vllm_importance_sampling_clip_min": 0.5},
    ),
    "clamp": (Rejection("clamp", upper=2.0), {"vllm_importance_sampling_mode": "token_truncate"}),
    "clamp_two_sided": (
        Rejection("clamp", upper=2.0, lower=0.5),
        {"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_min": 0.5},
    ),
    "no_rejection": (None, {"vllm_importance_sampling_correction": False}),
}


def our_config_for_areal(
    rejection: Rejection | None, correction: dict, eps_clip: float, eps_clip_higher: float | None, c_clip: float | None
) -> LossConfig:
    upper = {} if rejection is None else {"vllm_importance_sampling_clip_max": rejection.upper}
    return LossConfig(
        loss_type="dapo", epsilon=eps_clip, epsilon_high=eps_clip_higher, delta=c_clip, **upper, **correction
    )


@pytest.mark.parametrize("proximal", ["recomputed_before_updates", "trainer"])
@pytest.mark.parametrize(("eps_clip_higher", "c_clip"), [(None, None), (0.28, None), (0.28, 1.5), (None, 3.0)])
@pytest.mark.parametrize("case", sorted(AREAL_CASES))
def test_decoupled_ppo_is_dapo_with_a_token_correction(
    case: str, eps_clip_higher: float | None, c_clip: float | None, proximal: str
) -> None:
    """Loss and gradient of AReaL's decoupled PPO equal ours with pi_old = AReaL's proximal policy.

    ``trainer``: what the trainer passes (``old_logps=None``, the step's own forward detached), AReaL with one PPO
    minibatch; ``recomputed_before_updates``: a proximal policy an update or more behind, so the ratio clips.
    """
    rejection, correction = AREAL_CASES[case]
    batch = make_batch(seed=1)
    prox = batch.logps.clone() if proximal == "trainer" else batch.proximal

    leaf = batch.logps.clone().requires_grad_(True)
    expected = areal_ppo_actor_loss_fn(
        leaf, prox, batch.behaviour, batch.advantages, 0.2, batch.mask, eps_clip_higher, c_clip, rejection
    )
    expected.backward()
    expected_grad = leaf.grad

    config = our_config_for_areal(rejection, correction, 0.2, eps_clip_higher, c_clip)
    ours_leaf = batch.logps.clone().requires_grad_(True)
    old = None if proximal == "trainer" else prox
    out = compute_loss(ours_leaf, old, batch.behaviour, batch.advantages, batch.mask.float(), config)
    out.loss.backward()

    torch.testing.assert_close(out.loss.detach(), expected.detach(), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(ours_leaf.grad, expected_grad, atol=ATOL, rtol=RTOL)
    assert float(expected.detach()) != 0.0
    if rejection is not None and rejection.action == "mask":  # the cap really rejected some tokens
        assert float(out.metrics["sampling/importance_sampling_masked_fraction"]) > 0
    if proximal != "trainer":
        assert float(out.metrics["clip_ratio/region_mean"]) > 0


def test_the_inputs_exercise_dual_clipping() -> None:
    """c_clip 1.5 bites: AReaL's loss moves when dual clipping is switched on, so the delta parity above is real."""
    batch = make_batch(seed=1)
    with_dual, without = (
        areal_ppo_actor_loss_fn(
            batch.logps, batch.proximal, batch.behaviour, batch.advantages, 0.2, batch.mask, 0.28, c, None
        )
        for c in (1.5, None)
    )
    assert abs(float(with_dual) - float(without)) > 1e-3


@pytest.mark.parametrize("rejection", [Rejection("mask", 2.0), Rejection("mask", 2.0, 0.5), Rejection("clamp", 2.0)])
def test_behaviour_weights_are_arealss_token_for_token(rejection: Rejection) -> None:
    """Same weight pi_prox / pi_behave (NaN: 1) on every generated token, same tokens rejected (> upper, < lower)."""
    batch = make_batch(seed=2)
    mode = "token_mask" if rejection.action == "mask" else "token_truncate"
    ours = vllm_importance_sampling_ratio(
        batch.proximal, batch.behaviour, batch.mask.float(), mode, rejection.lower, rejection.upper
    )
    _, theirs = areal_rejection_sampling(batch.proximal, batch.behaviour, batch.mask, rejection)
    assert torch.equal(ours[batch.mask], theirs[batch.mask])
    assert bool((theirs[batch.mask] == 0).any()) == (rejection.action == "mask")


def test_decoupled_ppo_normalises_over_the_step_as_dapo() -> None:
    """AReaL scales each micro-batch's token mean by its share of the minibatch's tokens (``loss_weight_fn``,
    ``fsdp_engine``): over a step of two micro-batches, the sum over the step's tokens / their count, as dapo."""
    batch = make_batch(seed=3)
    rejection = Rejection("mask", 2.0)
    config = our_config_for_areal(rejection, {"vllm_importance_sampling_mode": "token_mask"}, 0.2, 0.28, None)
    halves = (slice(0, 3), slice(3, 6))
    total = batch.mask.sum()

    leaf = batch.logps.clone().requires_grad_(True)
    for rows in halves:
        mb_mask = batch.mask[rows]
        loss = areal_ppo_actor_loss_fn(
            leaf[rows],
            batch.proximal[rows],
            batch.behaviour[rows],
            batch.advantages[rows],
            0.2,
            mb_mask,
            0.28,
            rejection_sampling=rejection,
        )
        (loss * mb_mask.count_nonzero() / total).backward()
    ours_leaf = batch.logps.clone().requires_grad_(True)
    for rows in halves:
        out = compute_loss(
            ours_leaf[rows],
            batch.proximal[rows],
            batch.behaviour[rows],
            batch.advantages[rows],
            batch.mask[rows].float(),
            config,
            num_items_in_batch=total.float(),
            gradient_accumulation_steps=2,
            steps_per_generation=2,
        )
        out.loss.backward()
    torch.testing.assert_close(ours_leaf.grad, leaf.grad, atol=ATOL, rtol=RTOL)


def test_loglinear_proximal_approximation_is_an_old_logps_input() -> None:
    """AReaL's "loglinear" mode interpolates pi_prox between pi_behave and pi_theta by version; given that
    approximation as ``old_logps``, ``compute_loss`` is AReaL's loss in that mode too."""
    batch = make_batch(seed=4)
    current_version = 7
    versions = torch.tensor([7, 6, 5, 3, 6, 4])[:, None].expand_as(batch.logps).clone()  # the sample's version
    versions[~batch.mask] = -1  # AReaL marks non-generated tokens -1
    behaviour = torch.nan_to_num(batch.behaviour, nan=0.0)  # AReaL rejects a NaN proximal policy
    rejection = Rejection("mask", 2.0)

    leaf = batch.logps.clone().requires_grad_(True)
    prox = areal_loglinear_proximal(behaviour, leaf.detach(), versions, current_version)
    expected = areal_ppo_actor_loss_fn(leaf, prox, behaviour, batch.advantages, 0.2, batch.mask, 0.28, None, rejection)
    expected.backward()

    config = our_config_for_areal(rejection, {"vllm_importance_sampling_mode": "token_mask"}, 0.2, 0.28, None)
    ours_leaf = batch.logps.clone().requires_grad_(True)
    out = compute_loss(ours_leaf, prox, behaviour, batch.advantages, batch.mask.float(), config)
    out.loss.backward()
    torch.testing.assert_close(out.loss.detach(), expected.detach(), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(ours_leaf.grad, leaf.grad, atol=ATOL, rtol=RTOL)
    # a sample one version old has alpha 0 (pi_prox = pi_behave); older ones move towards pi_theta
    assert torch.equal(prox[1, :3], behaviour[1, :3])
    assert not torch.allclose(prox[2, :7], behaviour[2, :7])


# ----------------------------------------------------------------------------------------------------------------------
# prime-rl
# ----------------------------------------------------------------------------------------------------------------------


def prime_rl_default_loss_fn(
    trainer_logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    dppo_mask_low: float = 0.2,
    dppo_mask_high: float = 0.2,
    adv_tau: float = 1.0,
    kl_tau: float = 1e-3,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """prime-rl ``default_loss_fn`` on one sample (1-D tensors), its ``DefaultLossConfig`` defaults as defaults."""

    def _safe_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        denom = torch.clamp_min(mask.sum(), 1)
        return values[mask].sum() / denom

    log_importance_ratio = trainer_logprobs - inference_logprobs
    importance_ratio = torch.exp(log_importance_ratio)
    mismatch_kl = importance_ratio - log_importance_ratio - 1

    probs_diff = torch.exp(trainer_logprobs) - torch.exp(inference_logprobs)
    dppo_invalid_mask_high = probs_diff > dppo_mask_high
    dppo_invalid_mask_low = probs_diff < -dppo_mask_low
    positive_advantages = advantages > 0
    negative_advantages = advantages < 0
    dppo_invalid_mask = torch.where(positive_advantages, dppo_invalid_mask_high, dppo_invalid_mask_low)

    is_masked = dppo_invalid_mask
    is_masked_high = positive_advantages & dppo_invalid_mask_high
    is_masked_low = negative_advantages & dppo_invalid_mask_low
    drop_mask = loss_mask & is_masked
    keep_mask = loss_mask & ~is_masked

    advantages = adv_tau * advantages
    pg_loss = keep_mask * advantages * importance_ratio
    kl_loss = loss_mask * log_importance_ratio**2
    per_token_loss = -pg_loss + kl_tau * kl_loss
    loss = per_token_loss.sum()

    metrics = {
        "masked_mismatch_kl": _safe_mean(mismatch_kl, loss_mask & is_masked),
        "unmasked_mismatch_kl": _safe_mean(mismatch_kl, keep_mask),
        "is_masked": _safe_mean(is_masked, loss_mask),
        "is_masked_low": _safe_mean(is_masked_low, loss_mask),
        "is_masked_high": _safe_mean(is_masked_high, loss_mask),
        "masked_advantage_positive": _safe_mean(positive_advantages, drop_mask),
        "masked_advantage_negative": _safe_mean(negative_advantages, drop_mask),
    }
    return loss, metrics


def prime_rl_loss(
    logps: torch.Tensor, inference: torch.Tensor, batch: Batch, rl_scale: int | None = None, **options: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """prime-rl ``compute_loss``: ``default_loss_fn`` per sample, summed, / ``rl_scale`` (the loss tokens of the
    step over all ranks). Samples are packed, not padded: each is cut to its length, and vLLM's log-prob of a
    tool token is a number there, so NaN at those becomes 0. Metrics: per-sample fractions pooled over tokens."""
    total = torch.zeros(())
    counts, pooled = [], {"is_masked": 0.0, "is_masked_low": 0.0, "is_masked_high": 0.0}
    for row in range(logps.shape[0]):
        length = int(batch.mask[row].nonzero().max()) + 1 if batch.mask[row].any() else 0
        if length == 0:
            continue
        sample_mask = batch.mask[row, :length]
        loss, metrics = prime_rl_default_loss_fn(
            logps[row, :length],
            torch.nan_to_num(inference[row, :length], nan=0.0),
            batch.advantages[row, :length],
            sample_mask,
            **options,
        )
        total = total + loss
        counts.append(int(sample_mask.sum()))
        for name in pooled:
            pooled[name] += float(metrics[name]) * counts[-1]
    scale = max(rl_scale if rl_scale is not None else sum(counts), 1)
    return total / scale, {f"dppo/{name}": value / max(sum(counts), 1) for name, value in pooled.items()}


def behaviour_without_unscored(batch: Batch) -> torch.Tensor:
    """vLLM's log-probs with a number at every generated token (prime-rl has no NaN convention)."""
    behaviour = batch.behaviour.clone()
    behaviour[2, 1] = math.log(0.3)
    return behaviour


@pytest.mark.parametrize("old", ["trainer", "stale"])
@pytest.mark.parametrize(
    "bounds", [{}, {"epsilon": 0.1, "epsilon_high": 0.3}, {"epsilon": 0.3, "epsilon_high": 0.05}], ids=str
)
def test_dppo_is_prime_rls_default_loss(bounds: dict[str, float], old: str) -> None:
    """Loss, gradient and masked fractions of ``loss_type="dppo"`` equal prime-rl's default loss on the same
    tokens, NaN behaviour log-probs at padding and tool output included. prime-rl's pi/pi_vllm is our
    pi/pi_old * pi_old/pi_vllm, so the trainer's pi_old does not matter (``stale``: one that differs)."""
    batch = make_batch(seed=5)
    behaviour = behaviour_without_unscored(batch)
    config = LossConfig(loss_type="dppo", **bounds)

    leaf = batch.logps.clone().requires_grad_(True)
    expected, expected_metrics = prime_rl_loss(
        leaf, behaviour, batch, dppo_mask_low=config.epsilon, dppo_mask_high=config.resolved_epsilon_high
    )
    expected.backward()

    ours_leaf = batch.logps.clone().requires_grad_(True)
    old_logps = None if old == "trainer" else batch.proximal
    out = compute_loss(ours_leaf, old_logps, behaviour, batch.advantages, batch.mask.float(), config)
    out.loss.backward()

    torch.testing.assert_close(out.loss.detach(), expected.detach(), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(ours_leaf.grad, leaf.grad, atol=ATOL, rtol=RTOL)
    for name, value in expected_metrics.items():
        assert float(out.metrics[name]) == pytest.approx(value, abs=1e-7), name
    assert expected_metrics["dppo/is_masked_low"] > 0 and expected_metrics["dppo/is_masked_high"] > 0


def test_dppo_normalises_over_the_step_as_prime_rl() -> None:
    """prime-rl divides every micro-batch's sum by the step's loss tokens (``rl_scale``); so does dppo with the
    trainer's ``num_items_in_batch`` and accumulation factors."""
    batch = make_batch(seed=6)
    behaviour = behaviour_without_unscored(batch)
    total = int(batch.mask.sum())
    leaf = batch.logps.clone().requires_grad_(True)
    ours_leaf = batch.logps.clone().requires_grad_(True)
    for rows in (slice(0, 2), slice(2, 6)):
        part = Batch(batch.logps[rows], batch.proximal[rows], behaviour[rows], batch.advantages[rows], batch.mask[rows])
        prime_rl_loss(leaf[rows], behaviour[rows], part, rl_scale=total)[0].backward()
        compute_loss(
            ours_leaf[rows],
            None,
            behaviour[rows],
            batch.advantages[rows],
            batch.mask[rows].float(),
            LossConfig(loss_type="dppo"),
            num_items_in_batch=float(total),
            gradient_accumulation_steps=2,
            steps_per_generation=2,
        ).loss.backward()
    torch.testing.assert_close(ours_leaf.grad, leaf.grad, atol=ATOL, rtol=RTOL)


def test_dppo_by_hand() -> None:
    """Two sequences of three tokens: pi (trainer) and pi_vllm chosen so that the masked tokens are known.

    A = +1: d = pi - pi_vllm = 0.3 (> 0.2: masked), 0.05, -0.3 (a drop is never masked for A > 0).
    A = -1: d = -0.3 (< -0.2: masked), 0.5 (a rise is never masked for A < 0), -0.05.
    """
    pi = torch.tensor([[0.9, 0.5, 0.2], [0.1, 0.8, 0.5]])
    pi_vllm = torch.tensor([[0.6, 0.45, 0.5], [0.4, 0.3, 0.55]])
    advantages = torch.tensor([1.0, -1.0])
    kept = [[False, True, True], [False, True, True]]
    logps = torch.log(pi).requires_grad_(True)
    out = compute_loss(logps, None, torch.log(pi_vllm), advantages, torch.ones(2, 3), LossConfig(loss_type="dppo"))
    out.loss.backward()

    ratios = [[0.9 / 0.6, 0.5 / 0.45, 0.2 / 0.5], [0.1 / 0.4, 0.8 / 0.3, 0.5 / 0.55]]
    expected_loss = 0.0
    expected_grad = []
    for row, a in enumerate((1.0, -1.0)):
        grads = []
        for t in range(3):
            r = ratios[row][t]
            expected_loss += (-a * r if kept[row][t] else 0.0) + 1e-3 * math.log(r) ** 2
            grads.append(((-a * r if kept[row][t] else 0.0) + 2e-3 * math.log(r)) / 6)
        expected_grad.append(grads)
    # kept: -(0.5/0.45) - 0.2/0.5 + 0.8/0.3 + 0.5/0.55 = 2.0646..., over 6 tokens, plus the small squared log-ratios
    assert float(out.loss.detach()) == pytest.approx(expected_loss / 6, rel=1e-6)
    assert float(out.loss.detach()) == pytest.approx(0.344759, abs=1e-6)
    torch.testing.assert_close(logps.grad, torch.tensor(expected_grad), atol=1e-7, rtol=1e-5)
    assert float(out.metrics["dppo/is_masked"]) == pytest.approx(2 / 6)
    assert float(out.metrics["dppo/is_masked_low"]) == pytest.approx(1 / 6)
    assert float(out.metrics["dppo/is_masked_high"]) == pytest.approx(1 / 6)


def test_dppo_zero_advantage_is_judged_by_the_low_bound_as_prime_rl() -> None:
    """prime-rl's ``is_masked`` counts an A = 0 token that fell by more than the low bound; ``is_masked_low`` not."""
    logps = torch.log(torch.tensor([[0.1, 0.5]]))
    vllm = torch.log(torch.tensor([[0.5, 0.5]]))
    out = compute_loss(logps, None, vllm, torch.tensor([0.0]), torch.ones(1, 2), LossConfig(loss_type="dppo"))
    assert float(out.metrics["dppo/is_masked"]) == pytest.approx(0.5)
    assert float(out.metrics["dppo/is_masked_low"]) == 0.0


def test_dppo_token_without_vllm_logprob_is_on_policy() -> None:
    """A generated token vLLM gave no log-prob for (NaN) is measured against pi_old, as the vLLM correction does:
    ratio 1, never masked, no squared log-ratio; its gradient is -A / N."""
    logps = torch.log(torch.tensor([[0.9, 0.4]])).requires_grad_(True)
    vllm = torch.tensor([[float("nan"), math.log(0.4)]])
    out = compute_loss(logps, None, vllm, torch.tensor([2.0]), torch.ones(1, 2), LossConfig(loss_type="dppo"))
    out.loss.backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[-1.0, -1.0]]))
    assert float(out.loss.detach()) == pytest.approx(-2.0)
    assert float(out.metrics["dppo/is_masked"]) == 0.0


def test_dppo_ignores_the_correction_mode_and_bounds() -> None:
    """dppo takes pi_old / pi_vllm whole, whatever the mode and bounds (TRL's defaults would mask whole sequences)."""
    batch = make_batch(seed=7)
    behaviour = behaviour_without_unscored(batch)
    losses = [
        compute_loss(
            batch.logps, None, behaviour, batch.advantages, batch.mask.float(), LossConfig(loss_type="dppo", **options)
        ).loss
        for options in (
            {},
            {"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": 1.2},
            {"vllm_importance_sampling_mode": "token_mask", "vllm_importance_sampling_clip_max": None},
        )
    ]
    torch.testing.assert_close(losses[0], losses[1], atol=0, rtol=0)
    torch.testing.assert_close(losses[0], losses[2], atol=0, rtol=0)


def test_dppo_without_correction_measures_against_pi_old() -> None:
    """Correction off: pi_old stands where prime-rl has pi_vllm (and behaviour log-probs are not needed)."""
    batch = make_batch(seed=8)
    config = LossConfig(loss_type="dppo", vllm_importance_sampling_correction=False)
    leaf = batch.logps.clone().requires_grad_(True)
    expected, _ = prime_rl_loss(leaf, batch.proximal, batch)
    expected.backward()
    ours_leaf = batch.logps.clone().requires_grad_(True)
    out = compute_loss(ours_leaf, batch.proximal, None, batch.advantages, batch.mask.float(), config)
    out.loss.backward()
    torch.testing.assert_close(out.loss.detach(), expected.detach(), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(ours_leaf.grad, leaf.grad, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("correction", [True, False])
def test_dppo_masked_positions_do_not_matter(correction: bool) -> None:
    """NaN or inf at mask-0 positions of any input leave dppo's loss, gradient and metrics bit-identical."""
    batch = make_batch(seed=9)
    behaviour = behaviour_without_unscored(batch)
    config = LossConfig(
        loss_type="dppo", vllm_importance_sampling_correction=correction, beta=0.02, off_policy_mask_threshold=0.1
    )
    ref = batch.logps + 0.1

    def run(fill: float | None) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        def spoil(t: torch.Tensor) -> torch.Tensor:
            return t.clone() if fill is None else torch.where(batch.mask, t, fill)

        leaf = spoil(batch.logps).requires_grad_(True)
        out = compute_loss(
            leaf,
            spoil(batch.proximal),
            spoil(behaviour),
            batch.advantages,
            batch.mask.float(),
            config,
            ref_logps=spoil(ref),
        )
        out.loss.backward()
        return out.loss.detach(), leaf.grad, {k: float(v) for k, v in out.metrics.items()}

    clean = run(None)
    assert torch.isfinite(clean[0])
    for fill in (float("nan"), float("inf"), -float("inf")):
        spoilt = run(fill)
        assert torch.equal(clean[0], spoilt[0]) and torch.equal(clean[1], spoilt[1])
        assert clean[2].keys() == spoilt[2].keys()
        for key, value in clean[2].items():
            assert value == spoilt[2][key] or (math.isnan(value) and math.isnan(spoilt[2][key])), key
        assert torch.all(spoilt[1][~batch.mask] == 0)


# ----------------------------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------------------------


def test_dppo_config() -> None:
    assert "dppo" in ANCHOR_LOSS_TYPES and "dppo" not in LOSS_TYPES  # LOSS_TYPES: TRL's, parity-tested against TRL
    assert "dppo" in GLOBAL_TOKEN_NORMALISED  # the trainer defers its normalisation to the step's token count
    assert DPPO_KL_TAU == 1e-3
    config = LossConfig(loss_type="dppo")
    assert (config.epsilon, config.resolved_epsilon_high) == (0.2, 0.2)  # prime-rl's dppo_mask_low / _high
    with pytest.raises(ValueError, match="importance_sampling_level"):
        LossConfig(loss_type="dppo", importance_sampling_level="sequence")
    with pytest.raises(ValueError, match="must be >= 0"):
        LossConfig(loss_type="dppo", epsilon=-0.1)
    with pytest.raises(ValueError, match="must be >= 0"):
        LossConfig(loss_type="dppo", epsilon_high=-0.1)


def test_trainer_config_passes_dppo_through(tmp_path) -> None:
    config = AsyncGRPOConfig(
        output_dir=str(tmp_path), max_steps=1, loss_type="dppo", epsilon=0.1, epsilon_high=0.3, use_cpu=True
    )
    loss_config = config.loss_config()
    assert (loss_config.loss_type, loss_config.epsilon, loss_config.resolved_epsilon_high) == ("dppo", 0.1, 0.3)
