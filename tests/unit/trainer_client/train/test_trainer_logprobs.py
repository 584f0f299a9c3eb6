"""The trainer's log-prob and KL path on the real tiny model (no service needed).

The forward goes through the model's own ``forward`` (so DDP would all-reduce), asks for the
final hidden states and projects them in chunks: its log-probs must equal a plain
full-logits computation of each sample on its own (no padding). With ``beta > 0`` the
reference is a frozen copy of the starting model, or the PEFT base with the adapter off.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from rollout_api import rollout_pb2 as pb
from rollout_common.tiny_model import build_tiny_model
from trainer_client.grpo_config import AsyncGRPOConfig
from trainer_client.step_timing import PhaseClock
from trainer_client.stream.batches import GroupCollator, forward_completion_logprobs
from trainer_client.train.trainer import StreamGRPOTrainer


class StillFeed:
    """A feed at version 0 where everything is fresh: these tests exercise the loss path only."""

    current_version = 0
    training_version = 0
    min_version = 0

    def __init__(self) -> None:
        self.clock = PhaseClock()

    def is_fresh(self, policy_version: int) -> bool:
        return True


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    reuse = os.environ.get("ROLLOUT_TEST_MODEL_DIR")
    return Path(reuse) if reuse else build_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen2")


def make_trainer(model, tmp_path: Path, beta: float = 0.0, **options) -> StreamGRPOTrainer:
    options = {"per_device_train_batch_size": 4, "bf16": False, **options}
    config = AsyncGRPOConfig(
        output_dir=str(tmp_path), max_steps=1, num_generations=2, beta=beta, logprob_chunk_size=7, use_cpu=True,
        vllm_importance_sampling_correction=False, **options,
    )  # fmt: skip
    return StreamGRPOTrainer(model=model, args=config, feed=StillFeed(), pusher=None)  # type: ignore[arg-type]


def batch(seed: int = 0) -> dict:
    return GroupCollator(pad_token_id=0)(batch_items(seed))


def batch_items(seed: int = 0) -> list[dict]:
    """Two groups of two samples, with 6 + 3 and 8 + 1 completion tokens."""
    generator = torch.Generator().manual_seed(seed)
    items = []
    for i, (prompt_len, completion_len) in enumerate([(5, 6), (9, 3), (7, 8), (4, 1)]):
        prompt = torch.randint(3, 900, (prompt_len,), generator=generator).tolist()
        completion = torch.randint(3, 900, (completion_len,), generator=generator).tolist()
        sample = pb.Sample(
            prompt_token_ids=prompt, completion_token_ids=completion, completion_mask=[1] * completion_len,
            completion_logprobs=[-1.0] * completion_len, advantage=[1.0, -1.0][i % 2], reward=float(i % 2),
        )  # fmt: skip
        items.append({"group": pb.Group(group_id=f"g{i // 2}", policy_version=0), "sample": sample})
    return items


@torch.no_grad()
def unpadded_logprobs(model, inputs: dict) -> list[torch.Tensor]:
    """Each sample alone, full logits, no padding: the reference."""
    out = []
    ids, attention = inputs["input_ids"], inputs["attention_mask"].bool()
    for row in range(ids.shape[0]):
        tokens = ids[row][attention[row]]
        n = int(inputs["completion_mask"][row].sum())
        logits = model(tokens[None]).logits[0, -n - 1 : -1]
        out.append(torch.log_softmax(logits, -1).gather(-1, tokens[-n:, None])[:, 0])
    return out


def test_chunked_forward_through_the_model_matches_full_logits(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    trainer = make_trainer(model, tmp_path)
    inputs = batch()
    logps = trainer._completion_logprobs(trainer.model, inputs)
    for row, expected in enumerate(unpadded_logprobs(model, inputs)):
        torch.testing.assert_close(logps[row, : len(expected)], expected, atol=1e-5, rtol=0)


def test_beta_adds_kl_to_a_frozen_copy_of_the_starting_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    trainer = make_trainer(model, tmp_path, beta=0.1)
    inputs = batch()
    trainer.compute_loss(trainer.model, inputs)
    assert trainer.book.loss_metrics["kl"][-1] == pytest.approx(0.0, abs=1e-7)  # policy == reference

    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    trainer.compute_loss(trainer.model, inputs)
    kl = trainer.book.loss_metrics["kl"][-1]
    # Independent k3 estimate: exp(ref - logp) - (ref - logp) - 1, mean over completion tokens.
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    policy, reference = unpadded_logprobs(model, inputs), unpadded_logprobs(original, inputs)
    per_token = [torch.exp(r - p) - (r - p) - 1 for p, r in zip(policy, reference, strict=True)]
    # dapo/grpo-style masked mean over the batch's completion tokens
    expected = torch.cat(per_token).mean().item()
    assert kl > 1e-4
    assert kl == pytest.approx(expected, rel=1e-3)
    assert not any(p.requires_grad for p in trainer.ref_model.parameters())


def test_peft_reference_is_the_base_with_the_adapter_disabled(tiny_model_dir: Path, tmp_path: Path) -> None:
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.2)
    trainer = make_trainer(model, tmp_path, beta=0.1)
    assert trainer.ref_model is None  # no copy: the base is the reference
    inputs = batch()
    reference = trainer._reference_logprobs(inputs)
    policy = trainer._completion_logprobs(trainer.model, inputs)
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for row, expected in enumerate(unpadded_logprobs(original, inputs)):
        torch.testing.assert_close(reference[row, : len(expected)], expected, atol=1e-5, rtol=0)
    assert (policy - reference).abs().max() > 1e-3
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    trained = [n for n, p in model.named_parameters() if p.grad is not None]
    assert trained and all("lora_" in n for n in trained)  # only the adapter learns


def accumulating_trainer(
    tiny_model_dir: Path, tmp_path: Path, loss_type: str, accumulation: int
) -> tuple[torch.nn.Module, StreamGRPOTrainer, list[list[dict]]]:
    """A fresh model and a trainer of ``accumulation`` micro-batches a step, and the four
    samples of ``batch_items(seed=3)`` split into them: 6 + 8, then 3 + 1 completion tokens."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    trainer = make_trainer(
        model, tmp_path, loss_type=loss_type,
        per_device_train_batch_size=4 // accumulation, gradient_accumulation_steps=accumulation,
    )  # fmt: skip
    items = batch_items(seed=3)
    order = [items[0], items[2], items[1], items[3]]
    size = len(order) // accumulation
    return model, trainer, [order[i : i + size] for i in range(0, len(order), size)]


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_accumulated_micro_batches_give_the_whole_batchs_gradient(
    tiny_model_dir: Path, tmp_path: Path, loss_type: str
) -> None:
    """Two micro-batches of 14 and 4 loss tokens train as their four samples in one step.
    dapo divides by the whole step's loss tokens (TRL's
    ``num_items_in_batch``), not by each micro-batch's, and Trainer does not divide by the
    accumulation steps a second time."""
    collate = GroupCollator(pad_token_id=0)
    gradients = {}
    for accumulation in (1, 2):
        model, trainer, parts = accumulating_trainer(tiny_model_dir, tmp_path, loss_type, accumulation)
        micro_batches = [collate(part) for part in parts]
        trainer.current_gradient_accumulation_steps = accumulation  # as Trainer's loop sets it per step
        tokens = trainer._get_num_items_in_batch(micro_batches, torch.device("cpu"))
        assert tokens == 6 + 3 + 8 + 1
        for inputs in micro_batches:
            trainer.training_step(trainer.model, inputs, tokens)
        gradients[accumulation] = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert gradients[1] and len(gradients[1]) == len(gradients[2])
    for whole, accumulated in zip(gradients[1], gradients[2], strict=True):
        torch.testing.assert_close(accumulated, whole, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_micro_batches_train_as_they_arrive_with_the_whole_batchs_gradient_and_loss(
    tiny_model_dir: Path, tmp_path: Path, loss_type: str
) -> None:
    """``get_batch_samples`` takes no micro-batch before the loop reaches it, so the first
    trains while the second is still generated. dapo's count of the step's loss tokens is
    then known only after the last: its gradients and reported loss are divided then, and
    come out as one step over all four samples."""
    collate = GroupCollator(pad_token_id=0)
    results = {}
    for accumulation in (1, 2):
        model, trainer, parts = accumulating_trainer(tiny_model_dir, tmp_path, loss_type, accumulation)
        fetched: list[int] = []

        def stream(parts: list[list[dict]] = parts, fetched: list[int] = fetched):
            for i, part in enumerate(parts):
                fetched.append(i)
                yield collate(part)

        source = stream()
        micro_batches, tokens = trainer.get_batch_samples(source, accumulation, torch.device("cpu"))
        trainer.current_gradient_accumulation_steps = len(micro_batches)  # as Trainer's loop sets it
        if accumulation > 1:
            assert fetched == [] and tokens is None  # nothing taken, nothing counted up front
        loss = torch.tensor(0.0)
        for done, inputs in enumerate(micro_batches, start=1):
            assert len(fetched) == done  # one micro-batch at a time
            loss = loss + trainer.training_step(trainer.model, inputs, tokens)
        gradients = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        results[accumulation] = (gradients, float(loss), statistics.fmean(trainer.book.loss_metrics["policy_loss"]))
    (whole, whole_loss, whole_policy_loss), (accumulated, loss, policy_loss) = results[1], results[2]
    assert whole and len(whole) == len(accumulated)
    for expected, got in zip(whole, accumulated, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-4)
    assert loss == pytest.approx(whole_loss, rel=1e-4, abs=1e-7)
    if loss_type == "dapo":  # (grpo's on-policy loss is 0: each group's advantages sum to 0)
        assert abs(whole_loss) > 1e-6
        # reported as Trainer's up-front count reports it: each micro-batch's share
        assert policy_loss == pytest.approx(whole_policy_loss / 2, rel=1e-4, abs=1e-7)


def test_logits_made_inside_the_forward_match_full_logits(tiny_model_dir: Path) -> None:
    """The FSDP path (``forward_completion_logprobs``: the model makes the completion
    positions' logits itself) gives the chunked path's log-probs."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    inputs = batch(seed=3)
    with torch.no_grad():
        logps = forward_completion_logprobs(model, inputs)
        hotter = forward_completion_logprobs(model, inputs, temperature=0.7)
    for row, expected in enumerate(unpadded_logprobs(model, inputs)):
        torch.testing.assert_close(logps[row, : len(expected)], expected, atol=1e-5, rtol=0)
    assert (hotter - logps).abs().max() > 1e-3  # the temperature is applied


class MatmulDtypes(TorchDispatchMode):
    """The dtypes of every matrix product torch runs (below autocast, so after its casts)."""

    PRODUCTS: ClassVar = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default}

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: list[torch.dtype] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in self.PRODUCTS:
            self.dtypes.append(args[-1].dtype)
        return func(*args, **(kwargs or {}))


def test_bf16_runs_every_matmul_in_bf16_and_keeps_the_logprobs_float32(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Under ``bf16`` the lm_head projection, which runs outside the model's forward, is in
    autocast too; the log-probs come back float32, within bf16's rounding of float32's."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="eager")
    inputs = batch()
    expected = make_trainer(model, tmp_path / "fp32")._completion_logprobs(model, inputs)
    trainer = make_trainer(model, tmp_path / "bf16", bf16=True)
    with MatmulDtypes() as products:
        logps = trainer._completion_logprobs(trainer.model, inputs)
    assert products.dtypes and set(products.dtypes) == {torch.bfloat16}
    assert logps.dtype == torch.float32
    mask = inputs["completion_mask"].bool()
    difference = (logps - expected)[mask].abs()
    assert 0 < difference.max() < 0.05
    trainer.compute_loss(trainer.model, inputs).backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
