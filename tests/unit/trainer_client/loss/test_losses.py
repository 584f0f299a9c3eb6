"""Parity of ``trainer_client.loss.losses`` with TRL's GRPOTrainer, plus closed-form checks.

The reference is TRL's own code, not a re-implementation: the source of ``GRPOTrainer._compute_loss``,
``get_off_policy_mask`` and ``get_gamma_weights``, and the two blocks of ``_generate_and_score_completions`` that
compute the vLLM importance-sampling ratio and its ``sampling/*`` metrics, are taken from the installed
``trl/trainer/grpo_trainer.py`` with ``ast`` and executed against a stub trainer. That runs TRL's exact formulas
(same statements, same line numbers in tracebacks) without importing TRL's trainer module, which pulls in vLLM and
takes seconds. Nothing from ``trainer_client.loss.losses`` is used on the reference side.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import math
from collections import defaultdict
from dataclasses import dataclass, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from trainer_client.loss.config import LOSS_TYPES, VLLM_IMPORTANCE_SAMPLING_MODES, LossConfig, LossConfigWarning
from trainer_client.loss.losses import (
    compute_loss,
    k3_kl,
    off_policy_sequence_mask,
    vllm_importance_sampling_ratio,
)

pytestmark = pytest.mark.filterwarnings("ignore::trainer_client.loss.config.LossConfigWarning")

ATOL = 1e-6
RTOL = 1e-5

# ----------------------------------------------------------------------------------------------------------------------
# TRL's code, extracted from its source
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class TrlCode:
    namespace: dict[str, Any]  # module globals holding _compute_loss, get_off_policy_mask, get_gamma_weights
    is_ratio_block: Any  # code object: the `if self.use_vllm and self.vllm_importance_sampling_correction:` block
    is_metrics_block: Any  # code object: the block logging sampling/* metrics
    config_defaults: dict[str, Any]


def _trl_dir() -> Path | None:
    spec = importlib.util.find_spec("trl")  # locates the package without importing it
    return Path(spec.submodule_search_locations[0]) if spec and spec.submodule_search_locations else None


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)


def _compile(nodes: list[ast.stmt], filename: str) -> Any:
    return compile(ast.Module(body=nodes, type_ignores=[]), filename, "exec")


def _load_trl() -> TrlCode:
    trl_dir = _trl_dir()
    if trl_dir is None:
        pytest.fail("trl (a dev dependency) is not installed: parity with TRL cannot be checked; pip install -e .[dev]")
    trainer_path = trl_dir / "trainer" / "grpo_trainer.py"
    utils_path = trl_dir / "trainer" / "utils.py"
    trainer = _class(ast.parse(trainer_path.read_text()), "GRPOTrainer")
    utils = ast.parse(utils_path.read_text())

    namespace: dict[str, Any] = {"torch": torch, "math": math}
    helpers = [n for n in utils.body if isinstance(n, ast.FunctionDef) and n.name in ("nanmin", "nanmax")]
    exec(_compile(helpers, str(utils_path)), namespace)
    methods = [_method(trainer, name) for name in ("_compute_loss", "get_off_policy_mask", "get_gamma_weights")]
    exec(_compile(methods, str(trainer_path)), namespace)

    generate = _method(trainer, "_generate_and_score_completions")
    vllm_blocks = [
        node
        for node in ast.walk(generate)
        if isinstance(node, ast.If)
        and ast.unparse(node.test) == "self.use_vllm and self.vllm_importance_sampling_correction"
    ]
    ratio_block = next(b for b in vllm_blocks if "per_token_logps_diff" in ast.unparse(b))
    metrics_block = next(b for b in vllm_blocks if "sampling_logp_difference" in ast.unparse(b))

    config_cls = _class(ast.parse((trl_dir / "trainer" / "grpo_config.py").read_text()), "GRPOConfig")
    defaults = {}
    for node in config_cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.value, ast.Call):
            for kw in node.value.keywords:
                if kw.arg == "default":
                    with contextlib.suppress(ValueError):  # non-literal defaults: none is a loss option
                        defaults[node.target.id] = ast.literal_eval(kw.value)
    return TrlCode(
        namespace=namespace,
        is_ratio_block=_compile([ratio_block], str(trainer_path)),
        is_metrics_block=_compile([metrics_block], str(trainer_path)),
        config_defaults=defaults,
    )


@pytest.fixture(scope="module")
def trl() -> TrlCode:
    return _load_trl()


def trl_importance_sampling(
    trl: TrlCode, config: LossConfig, old: torch.Tensor, sampling: torch.Tensor, completion_mask, tool_mask
) -> tuple[torch.Tensor, dict[str, float]]:
    """Run TRL's IS-ratio block and its metrics block; returns the ratio and the logged metrics."""
    metrics: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    stub = SimpleNamespace(
        use_vllm=True,
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode=config.vllm_importance_sampling_mode,
        vllm_importance_sampling_clip_min=config.vllm_importance_sampling_clip_min,
        vllm_importance_sampling_clip_max=config.vllm_importance_sampling_clip_max,
        _metrics=metrics,
        accelerator=SimpleNamespace(gather=lambda t: t.reshape(-1)),
    )
    scope = {
        **trl.namespace,
        "self": stub,
        "old_per_token_logps": old,
        "sampling_per_token_logps": sampling,
        "completion_mask": completion_mask,
        "tool_mask": tool_mask,
        "device": old.device,
        "mode": "train",
    }
    exec(trl.is_ratio_block, scope)
    exec(trl.is_metrics_block, scope)
    return scope["vllm_importance_sampling_ratio"], {k: v[-1] for k, v in metrics["train"].items()}


def trl_loss(
    trl: TrlCode,
    config: LossConfig,
    batch: Batch,
    *,
    with_behaviour: bool,
    gradient_accumulation_steps: int = 1,
    num_processes: int = 1,
    steps_per_generation: int = 1,
) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """TRL's loss value, logged metrics and d loss / d logps for ``batch`` under ``config``."""
    logps = batch.logps.clone().requires_grad_(True)
    inputs: dict[str, Any] = {
        "prompt_ids": torch.zeros(batch.size, 0, dtype=torch.long),
        "prompt_mask": torch.zeros(batch.size, 0, dtype=torch.long),
        "completion_ids": torch.zeros(batch.size, batch.length, dtype=torch.long),
        "completion_mask": batch.completion_mask,
        "tool_mask": batch.tool_mask,
        "advantages": batch.advantages,
        "num_items_in_batch": batch.num_items_in_batch,
        "old_per_token_logps": batch.old,
    }
    correction = with_behaviour and config.vllm_importance_sampling_correction
    if with_behaviour:
        inputs["sampling_per_token_logps"] = batch.behaviour
    if correction:
        inputs["importance_sampling_ratio"], is_metrics = trl_importance_sampling(
            trl, config, batch.old, batch.behaviour, batch.completion_mask, batch.tool_mask
        )
    if config.beta != 0.0:
        inputs["ref_per_token_logps"] = batch.ref

    metrics: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    args = SimpleNamespace(
        delta=config.delta,
        use_bias_correction_kl=config.use_bias_correction_kl,
        sapo_temperature_pos=config.sapo_temperature_pos,
        sapo_temperature_neg=config.sapo_temperature_neg,
        vespo_k_pos=config.vespo_k_pos,
        vespo_lambda_pos=config.vespo_lambda_pos,
        vespo_k_neg=config.vespo_k_neg,
        vespo_lambda_neg=config.vespo_lambda_neg,
        steps_per_generation=steps_per_generation,
    )
    stub = SimpleNamespace(
        args=args,
        _get_per_token_logps_and_entropies=lambda model, *a, **k: (logps, torch.ones_like(batch.logps), None),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=config.off_policy_mask_threshold,
        importance_sampling_level=config.importance_sampling_level,
        beta=config.beta,
        loss_type=config.loss_type,
        # GRPOTrainer.__init__: epsilon_low = args.epsilon; epsilon_high falls back to args.epsilon
        epsilon_low=config.epsilon,
        epsilon_high=config.epsilon_high if config.epsilon_high is not None else config.epsilon,
        max_completion_length=config.max_completion_length,
        use_vllm=with_behaviour,
        vllm_importance_sampling_correction=config.vllm_importance_sampling_correction,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=gradient_accumulation_steps,
        accelerator=SimpleNamespace(
            num_processes=num_processes, gather=lambda t: t.reshape(-1), reduce=lambda t, reduction: t
        ),
        _metrics=metrics,
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        get_off_policy_mask=trl.namespace["get_off_policy_mask"],
        get_gamma_weights=trl.namespace["get_gamma_weights"],
    )
    loss = trl.namespace["_compute_loss"](stub, None, inputs)
    loss.backward()
    logged = {k: v[-1] for k, v in metrics["train"].items()}
    if correction:
        logged.update(is_metrics)
    return loss.detach(), logged, logps.grad


# ----------------------------------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class Batch:
    logps: torch.Tensor  # [B, T]
    old: torch.Tensor
    behaviour: torch.Tensor
    ref: torch.Tensor
    advantages: torch.Tensor  # [B]
    completion_mask: torch.Tensor  # [B, T] int64, right padding
    tool_mask: torch.Tensor  # [B, T] int64, 0 on tool output
    num_items_in_batch: torch.Tensor

    @property
    def mask(self) -> torch.Tensor:
        return self.completion_mask * self.tool_mask

    @property
    def size(self) -> int:
        return self.logps.shape[0]

    @property
    def length(self) -> int:
        return self.logps.shape[1]


def make_batch(seed: int = 0, size: int = 6, length: int = 9) -> Batch:
    """Spread-out ratios so that both clip sides, both IS caps, OPSM and empty rows are all exercised."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([length, 1, 4, 0, length - 2, 6][:size])
    completion_mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    tool_mask = torch.ones(size, length, dtype=torch.long)
    tool_mask[0, 2:4] = 0  # a tool response spliced into the first completion
    tool_mask[4, 1] = 0
    logps = -torch.rand(size, length, generator=gen) * 3
    old = logps + 0.3 * torch.randn(size, length, generator=gen)
    behaviour = old + 0.6 * torch.randn(size, length, generator=gen)
    behaviour[5, 2] = float("nan")  # a token vLLM could not score
    ref = logps + 0.4 * torch.randn(size, length, generator=gen)
    advantages = torch.tensor([1.3, -0.7, 0.0, 0.4, -1.1, 0.9][:size])
    num_items = (completion_mask * tool_mask).sum() * 3  # as if the generation batch held 3 such micro-batches
    return Batch(logps, old, behaviour, ref, advantages, completion_mask, tool_mask, num_items.float())


def ours(
    config: LossConfig, batch: Batch, *, with_behaviour: bool, **scale: int
) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    logps = batch.logps.clone().requires_grad_(True)
    out = compute_loss(
        logps,
        batch.old,
        batch.behaviour if with_behaviour else None,
        batch.advantages,
        batch.mask,
        config,
        ref_logps=batch.ref if config.beta != 0.0 else None,
        num_items_in_batch=batch.num_items_in_batch,
        **scale,
    )
    out.loss.backward()
    return out.loss.detach(), {k: float(v) for k, v in out.metrics.items()}, logps.grad


def assert_parity(
    trl: TrlCode, config: LossConfig, batch: Batch, *, with_behaviour: bool = True, **scale: int
) -> dict[str, float]:
    ref_loss, ref_metrics, ref_grad = trl_loss(trl, config, batch, with_behaviour=with_behaviour, **scale)
    loss, metrics, grad = ours(config, batch, with_behaviour=with_behaviour, **scale)
    assert torch.isfinite(ref_loss)
    torch.testing.assert_close(loss, ref_loss, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(grad, ref_grad, atol=ATOL, rtol=RTOL)
    shared = (set(ref_metrics) & set(metrics)) - {"policy_loss"}
    expected_keys = {k for k in ref_metrics if k not in ("entropy", "policy_loss")}
    assert expected_keys <= shared, f"metrics TRL logs but we do not: {expected_keys - shared}"
    for key in shared:
        assert metrics[key] == pytest.approx(ref_metrics[key], abs=ATOL, rel=RTOL, nan_ok=True), key
    return metrics


# ----------------------------------------------------------------------------------------------------------------------
# Parity with TRL
# ----------------------------------------------------------------------------------------------------------------------

CORRECTION_MODES = (None, *VLLM_IMPORTANCE_SAMPLING_MODES)  # None: correction disabled
GRID = [
    (loss_type, level, mode)
    for loss_type in LOSS_TYPES
    for level in ("token", "sequence")
    for mode in CORRECTION_MODES
    if not (loss_type == "vespo" and mode is not None and mode.startswith("sequence"))  # TRL rejects these
]


@pytest.mark.parametrize(("loss_type", "level", "mode"), GRID)
def test_loss_and_grad_match_trl(trl: TrlCode, loss_type: str, level: str, mode: str | None) -> None:
    config = LossConfig(
        loss_type=loss_type,
        importance_sampling_level=level,
        vllm_importance_sampling_correction=mode is not None,
        vllm_importance_sampling_mode=mode or "sequence_mask",
        epsilon_high=0.28,
    )
    metrics = assert_parity(trl, config, make_batch(seed=1))
    if loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        assert metrics["clip_ratio/region_mean"] > 0  # the inputs really exercise clipping


EXTRAS = {
    "kl_bias_corrected": {"beta": 0.04},
    "kl_plain": {"beta": 0.04, "use_bias_correction_kl": False},
    "delta": {"delta": 1.25, "epsilon_high": 0.1},
    "opsm": {"off_policy_mask_threshold": 0.05},
    "clip_min_mask": {"vllm_importance_sampling_mode": "token_mask", "vllm_importance_sampling_clip_min": 0.5},
    "clip_min_truncate_no_max": {
        "vllm_importance_sampling_mode": "token_truncate",
        "vllm_importance_sampling_clip_min": 0.5,
        "vllm_importance_sampling_clip_max": None,
    },
    "sapo_temperatures": {"sapo_temperature_pos": 0.7, "sapo_temperature_neg": 1.6},
    "vespo_params": {"vespo_k_pos": 1.5, "vespo_lambda_pos": 2.5, "vespo_k_neg": 2.0, "vespo_lambda_neg": 1.0},
    "cispo_eps": {"epsilon_high": 1.1},
    "dr_grpo_length": {"max_completion_length": 37},
}


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("extra", sorted(EXTRAS))
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_options_match_trl(trl: TrlCode, loss_type: str, extra: str, level: str) -> None:
    options: dict[str, Any] = {"vllm_importance_sampling_mode": "token_truncate", **EXTRAS[extra]}
    config = LossConfig(loss_type=loss_type, importance_sampling_level=level, **options)
    assert_parity(trl, config, make_batch(seed=2))


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_accumulation_scaling_matches_trl(trl: TrlCode, loss_type: str) -> None:
    config = LossConfig(loss_type=loss_type, vllm_importance_sampling_mode="token_mask")
    scale = {"gradient_accumulation_steps": 4, "num_processes": 2, "steps_per_generation": 8}
    assert_parity(trl, config, make_batch(seed=3), **scale)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_without_behaviour_logps_matches_trl_without_vllm(trl: TrlCode, loss_type: str) -> None:
    """No sampler log-probs: TRL with use_vllm=False; OPSM then measures drift from the old policy."""
    config = LossConfig(loss_type=loss_type, vllm_importance_sampling_correction=False, off_policy_mask_threshold=0.02)
    assert_parity(trl, config, make_batch(seed=4), with_behaviour=False)


def test_importance_sampling_ratio_matches_trl(trl: TrlCode) -> None:
    batch = make_batch(seed=5)
    for mode in VLLM_IMPORTANCE_SAMPLING_MODES:
        for clip_min, clip_max in [(None, 3.0), (0.5, 2.0), (0.8, None)]:
            config = LossConfig(
                vllm_importance_sampling_mode=mode,
                vllm_importance_sampling_clip_min=clip_min,
                vllm_importance_sampling_clip_max=clip_max,
            )
            expected, _ = trl_importance_sampling(
                trl, config, batch.old, batch.behaviour, batch.completion_mask, batch.tool_mask
            )
            got = vllm_importance_sampling_ratio(batch.old, batch.behaviour, batch.mask, mode, clip_min, clip_max)
            torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_off_policy_mask_matches_trl(trl: TrlCode) -> None:
    batch = make_batch(seed=6)
    advantages = batch.advantages.unsqueeze(1)
    for threshold in (0.0, 0.05, 0.3):
        expected = trl.namespace["get_off_policy_mask"](advantages, batch.logps, batch.behaviour, batch.mask, threshold)
        got = off_policy_sequence_mask(advantages, batch.logps, batch.behaviour, batch.mask, threshold)
        assert torch.equal(got, expected)


def test_config_defaults_match_trl(trl: TrlCode) -> None:
    ours_defaults = {f.name: f.default for f in fields(LossConfig)}
    for name, value in ours_defaults.items():
        assert name in trl.config_defaults, f"{name} is not a GRPOConfig field"
        assert value == trl.config_defaults[name], name


# ----------------------------------------------------------------------------------------------------------------------
# Behaviour, independent of TRL
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("loss_type", "level", "mode"), GRID)
def test_masked_positions_do_not_matter(loss_type: str, level: str, mode: str | None) -> None:
    """Any value, even NaN or inf, at mask-0 positions of any input leaves loss, grads and metrics bit-identical."""
    config = LossConfig(
        loss_type=loss_type,
        importance_sampling_level=level,
        vllm_importance_sampling_correction=mode is not None,
        vllm_importance_sampling_mode=mode or "sequence_mask",
        beta=0.02,
        off_policy_mask_threshold=0.1,
    )
    batch = make_batch(seed=7)
    masked = batch.mask == 0
    garbage = make_batch(seed=8)
    for tensor in (garbage.logps, garbage.old, garbage.behaviour, garbage.ref):
        tensor[0, 2] = float("nan")
        tensor[1, 5] = float("inf")
        tensor[4, 1] = -float("inf")
    altered = Batch(
        logps=torch.where(masked, garbage.logps, batch.logps),
        old=torch.where(masked, garbage.old, batch.old),
        behaviour=torch.where(masked, garbage.behaviour, batch.behaviour),
        ref=torch.where(masked, garbage.ref, batch.ref),
        advantages=batch.advantages,
        completion_mask=batch.completion_mask,
        tool_mask=batch.tool_mask,
        num_items_in_batch=batch.num_items_in_batch,
    )
    loss, metrics, grad = ours(config, batch, with_behaviour=True)
    loss2, metrics2, grad2 = ours(config, altered, with_behaviour=True)
    assert torch.isfinite(loss)
    assert torch.equal(loss, loss2)
    assert torch.equal(grad, grad2)
    assert torch.all(grad[masked] == 0)
    assert metrics.keys() == metrics2.keys()
    for key in metrics:
        assert metrics[key] == metrics2[key] or (math.isnan(metrics[key]) and math.isnan(metrics2[key])), key


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("with_behaviour", [False, True])
def test_on_policy_grpo_gradient_is_advantage_weighted_mean(level: str, with_behaviour: bool) -> None:
    """old == new and behaviour == old: ratio 1, no clipping, d loss / d logp_bt = -A_b / (|o_b| B)."""
    batch = make_batch(seed=9)
    logps = batch.logps.clone().requires_grad_(True)
    config = LossConfig(
        loss_type="grpo", importance_sampling_level=level, vllm_importance_sampling_correction=with_behaviour
    )
    out = compute_loss(
        logps,
        batch.logps,
        batch.logps if with_behaviour else None,
        batch.advantages,
        batch.mask,
        config,
    )
    out.loss.backward()
    lengths = batch.mask.sum(-1).clamp(min=1).float()
    expected = -(batch.advantages / lengths / batch.size)[:, None] * batch.mask
    torch.testing.assert_close(logps.grad, expected, atol=1e-7, rtol=1e-6)
    assert float(out.loss.detach()) == pytest.approx(
        -float((batch.advantages * (batch.mask.sum(-1) > 0)).mean()), abs=1e-6
    )
    assert float(out.metrics["clip_ratio/region_mean"]) == 0.0


def test_opsm_drops_exactly_negative_advantage_high_kl_sequences() -> None:
    length = 4
    logps = torch.full((5, length), -1.0)
    behaviour = logps.clone()
    behaviour[0] += 0.5  # mean KL 0.5, A < 0 -> dropped
    behaviour[1] += 0.05  # mean KL 0.05, A < 0 -> kept
    behaviour[2] += 0.5  # A > 0 -> kept
    behaviour[3] += 0.5  # A == 0 -> kept (only negative advantages are dropped)
    behaviour[4, 0] = float("nan")  # unscorable token counts as zero KL, A < 0 -> kept
    behaviour[4, 1:] += 0.15  # mean KL 0.45 / 4 over its 4 tokens
    mask = torch.ones(5, length)
    advantages = torch.tensor([-1.0, -1.0, 1.0, 0.0, -1.0])
    keep = off_policy_sequence_mask(advantages[:, None], logps, behaviour, mask, threshold=0.2)
    assert keep.squeeze(1).tolist() == [0.0, 1.0, 1.0, 1.0, 1.0]

    leaf = logps.clone().requires_grad_(True)
    config = LossConfig(loss_type="grpo", off_policy_mask_threshold=0.2, vllm_importance_sampling_correction=False)
    out = compute_loss(leaf, logps, behaviour, advantages, mask, config)
    out.loss.backward()
    assert torch.all(leaf.grad[0] == 0)
    assert torch.all(leaf.grad[[1, 2, 4]] != 0)
    assert float(out.metrics["opsm/dropped_fraction"]) == pytest.approx(0.2)


def test_kl_term_is_beta_times_mean_k3() -> None:
    """Zero advantages leave only the KL: grpo loss = beta * mean over sequences of the per-token mean k3."""
    batch = make_batch(seed=10)
    config = LossConfig(loss_type="grpo", beta=0.1, vllm_importance_sampling_correction=False)
    out = compute_loss(batch.logps, None, None, torch.zeros(batch.size), batch.mask, config, ref_logps=batch.ref)
    diff = batch.ref - batch.logps
    k3 = (torch.exp(diff) - diff - 1) * batch.mask
    expected = 0.1 * (k3.sum(-1) / batch.mask.sum(-1).clamp(min=1)).mean()
    assert float(out.loss.detach()) == pytest.approx(float(expected), rel=1e-6)
    assert float(out.metrics["kl"]) == pytest.approx(float(k3.sum() / batch.mask.sum()), rel=1e-6)
    assert torch.all(k3_kl(batch.logps, batch.logps) == 0)
    with pytest.raises(ValueError, match="ref_logps"):
        compute_loss(batch.logps, None, None, batch.advantages, batch.mask, config)


def test_truncate_clamps_and_mask_zeroes_above_cap() -> None:
    old = torch.zeros(2, 3)
    behaviour = torch.tensor([[-2.0, -0.5, 0.0], [-0.4, -0.4, -0.4]])  # ratios e^2, e^0.5, 1 / seq e^1.2
    mask = torch.ones(2, 3)
    token_truncate = vllm_importance_sampling_ratio(old, behaviour, mask, "token_truncate", None, 3.0)
    token_mask = vllm_importance_sampling_ratio(old, behaviour, mask, "token_mask", None, 3.0)
    e = math.e
    torch.testing.assert_close(token_truncate[0], torch.tensor([3.0, e**0.5, 1.0]))
    torch.testing.assert_close(token_mask[0], torch.tensor([0.0, e**0.5, 1.0]))
    seq_truncate = vllm_importance_sampling_ratio(old, behaviour, mask, "sequence_truncate", None, 3.0)
    seq_mask = vllm_importance_sampling_ratio(old, behaviour, mask, "sequence_mask", None, 3.0)
    assert seq_truncate.shape == (2, 1)
    torch.testing.assert_close(seq_truncate.squeeze(1), torch.tensor([3.0, 3.0]))  # e^2.5 and e^1.2 > 3
    torch.testing.assert_close(seq_mask.squeeze(1), torch.tensor([0.0, 0.0]))
    lifted = vllm_importance_sampling_ratio(old, behaviour, mask, "sequence_mask", None, 4.0)
    torch.testing.assert_close(lifted.squeeze(1), torch.tensor([0.0, e**1.2]))
    below = vllm_importance_sampling_ratio(old, -behaviour, mask, "token_mask", 0.5, None)
    torch.testing.assert_close(below[0], torch.tensor([0.0, e**-0.5, 1.0]))

    # In the loss, a masked sequence contributes nothing; a truncated one is down-weighted but still trains.
    leaf = old.clone().requires_grad_(True)
    for mode, zero_row in (("sequence_mask", True), ("sequence_truncate", False)):
        leaf.grad = None
        config = LossConfig(loss_type="grpo", vllm_importance_sampling_mode=mode)
        compute_loss(leaf, old, behaviour, torch.tensor([1.0, 1.0]), mask, config).loss.backward()
        assert torch.all(leaf.grad[0] == 0) == zero_row


def test_dapo_without_num_items_equals_bnpo() -> None:
    batch = make_batch(seed=11)
    losses = []
    for loss_type in ("dapo", "bnpo"):
        config = LossConfig(loss_type=loss_type)
        out = compute_loss(batch.logps, batch.old, batch.behaviour, batch.advantages, batch.mask, config)
        losses.append(out.loss)
    torch.testing.assert_close(losses[0], losses[1])


def test_config_validation() -> None:
    assert LossConfig(epsilon=0.1).resolved_epsilon_high == 0.1
    assert LossConfig(epsilon=0.1, epsilon_high=0.3).resolved_epsilon_high == 0.3
    with pytest.raises(ValueError, match="loss type"):
        LossConfig(loss_type="ppo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="level"):
        LossConfig(importance_sampling_level="batch")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mode"):
        LossConfig(vllm_importance_sampling_mode="truncate")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="clip_min"):
        LossConfig(vllm_importance_sampling_clip_min=3.0, vllm_importance_sampling_clip_max=2.0)
    with pytest.raises(ValueError, match="truncate"):
        LossConfig(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=None)
    with pytest.raises(ValueError, match="VESPO"):
        LossConfig(loss_type="vespo", vllm_importance_sampling_mode="sequence_mask")
    with pytest.raises(ValueError, match="max_completion_length"):
        LossConfig(loss_type="dr_grpo", max_completion_length=None)
    with pytest.warns(LossConfigWarning):
        LossConfig(loss_type="dapo", importance_sampling_level="sequence")
    with pytest.raises(ValueError, match="behaviour_logps"):
        batch = make_batch()
        compute_loss(batch.logps, None, None, batch.advantages, batch.mask, LossConfig())
    with pytest.raises(AttributeError):
        LossConfig().beta = 1.0  # type: ignore[misc]
