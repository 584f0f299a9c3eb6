"""Running each distinct prompt once gives the plain forward's log-probs and gradients.

On a randomly initialised Qwen2 (float32): prompts of different lengths (so left padding
differs between them), groups of different sizes, completions of different lengths, and a
multi-turn completion whose tool tokens are masked out of the loss. The shared forward
must match the per-sample forward to float32 rounding, in the log-probs and in every
parameter's gradient, and the trainer must take it by default where it applies.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rollout_api import rollout_pb2 as pb
from trainer_client.grpo_config import AsyncGRPOConfig
from trainer_client.loss.config import LossConfig
from trainer_client.loss.losses import compute_loss
from trainer_client.stream.batches import GroupCollator, completion_logprobs
from trainer_client.stream.prompt_sharing import sharing_pays, skipped_fraction
from trainer_client.train.trainer import StreamGRPOTrainer

pytestmark = pytest.mark.timeout(120)
VOCAB = 97
PAD_ID = 0


@pytest.fixture(scope="module")
def model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, pad_token_id=PAD_ID,
    )  # fmt: skip
    return Qwen2ForCausalLM(config).float().train()


def grouped_samples(seed: int = 0) -> list[dict]:
    """Three prompts (lengths 7, 3, 5) with 4, 2 and 3 completions of lengths 1 to 9; the
    last completion is a tool turn: its middle tokens are masked out."""
    generator = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(1, VOCAB, (n,), generator=generator).tolist()

    items = []
    for group, (prompt_len, completion_lens) in enumerate([(7, [9, 4, 9, 1]), (3, [6, 2]), (5, [8, 8, 3])]):
        prompt = ids(prompt_len)
        for n in completion_lens:
            mask = [1] * n
            if group == 2 and n == 3:
                mask = [1, 0, 1]
            sample = pb.Sample(
                completion_token_ids=ids(n), completion_mask=mask,
                completion_logprobs=[-2.0 if m else 0.0 for m in mask], advantage=float(n % 3) - 1.0,
            )  # fmt: skip
            group_message = pb.Group(group_id=f"g{group}", policy_version=0, prompt_token_ids=prompt)  # once per group
            items.append({"sample": sample, "group": group_message})
    return items


def loss_and_grads(model: Qwen2ForCausalLM, inputs: dict, share: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logps = completion_logprobs(model, inputs, model.get_output_embeddings().weight, chunk_size=16, share_prompts=share)
    config = LossConfig(loss_type="dapo", vllm_importance_sampling_correction=False)
    output = compute_loss(
        logps, None, inputs["behaviour_logps"], inputs["advantages"], inputs["completion_mask"], config
    )
    output.loss.backward()
    return logps.detach() * inputs["completion_attention"], {
        name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None
    }


def test_collator_keeps_each_distinct_prompt_once() -> None:
    items = grouped_samples()
    inputs = GroupCollator(PAD_ID)(items)
    assert inputs["prompt_ids"].shape == (3, 7)
    assert inputs["prompt_index"].tolist() == [0, 0, 0, 0, 1, 1, 2, 2, 2]
    for i, item in enumerate(items):  # the per-sample layout: left-padded prompt, then completion
        prompt, completion = list(item["group"].prompt_token_ids), list(item["sample"].completion_token_ids)
        row = inputs["input_ids"][i][inputs["attention_mask"][i].bool()].tolist()
        assert row == prompt + completion
        assert inputs["position_ids"][i, 7 - len(prompt)] == 0  # positions start at the first real token


def test_shared_prompt_forward_matches_the_per_sample_forward(model: Qwen2ForCausalLM) -> None:
    inputs = GroupCollator(PAD_ID)(grouped_samples())
    plain_logps, plain_grads = loss_and_grads(model, inputs, share=False)
    shared_logps, shared_grads = loss_and_grads(model, inputs, share=True)
    torch.testing.assert_close(shared_logps, plain_logps, rtol=0, atol=1e-5)
    assert plain_grads.keys() == shared_grads.keys() and "model.embed_tokens.weight" in plain_grads
    for name, grad in plain_grads.items():
        scale = grad.abs().max().item()
        assert scale > 0, name  # every parameter learns, so the comparison below can fail
        torch.testing.assert_close(shared_grads[name], grad, rtol=0, atol=1e-5 * scale, msg=name)


def test_the_shared_forward_is_not_the_plain_one(model: Qwen2ForCausalLM) -> None:
    """A control: the comparison above would catch a shared forward that ignores the prompt
    (its completions would see no context and score differently)."""
    inputs = GroupCollator(PAD_ID)(grouped_samples())
    plain_logps, _ = loss_and_grads(model, inputs, share=False)
    inputs["prompt_attention"] = torch.zeros_like(inputs["prompt_attention"])
    inputs["prompt_attention"][:, -1] = 1  # each prompt cut to its last token
    cut_logps, _ = loss_and_grads(model, inputs, share=True)
    assert (cut_logps - plain_logps).abs().max() > 1e-3


def test_every_sample_with_its_own_prompt_takes_the_plain_forward() -> None:
    items = [grouped_samples(seed)[0] for seed in range(3)]
    inputs = GroupCollator(PAD_ID)(items)
    assert inputs["prompt_ids"].shape[0] == inputs["completion_ids"].shape[0] == 3
    assert not sharing_pays(inputs, "cpu")


def shaped_batch(prompts: int, group_size: int, prompt_width: int, completion_width: int) -> dict:
    """Only the shapes ``sharing_pays`` reads."""
    samples = prompts * group_size
    return {
        "prompt_ids": torch.zeros(prompts, prompt_width, dtype=torch.long),
        "completion_ids": torch.zeros(samples, completion_width, dtype=torch.long),
    }


def test_on_a_cpu_any_repeated_prompt_is_shared() -> None:
    assert sharing_pays(shaped_batch(4, 8, 34, 32), "cpu")
    assert sharing_pays(shaped_batch(4, 8, 16, 2048), "cpu")
    assert not sharing_pays(shaped_batch(4, 1, 1024, 16), "cpu")  # nothing repeats


@pytest.mark.parametrize(
    ("prompt_width", "completion_width", "skipped", "shared"),
    [(1024, 256, 0.70, True), (34, 32, 0.45, False), (128, 512, 0.175, False)],  # the H200 sitting's shapes
)
def test_on_a_gpu_only_batches_mostly_of_prompts_are_shared(
    prompt_width: int, completion_width: int, skipped: float, shared: bool
) -> None:
    batch = shaped_batch(4, 8, prompt_width, completion_width)
    assert skipped_fraction(batch) == pytest.approx(skipped, abs=0.005)
    assert sharing_pays(batch, "cuda") is shared


def test_completion_logprobs_asks_the_batch_device_whether_sharing_pays(model: Qwen2ForCausalLM) -> None:
    """The rule above is wired in: the same batch shares on a CPU, and takes the plain forward
    when its prompts sit on another device (``meta`` here, standing in for a GPU)."""
    inputs = GroupCollator(PAD_ID)(grouped_samples())
    assert 0 < skipped_fraction(inputs) < 0.5
    forwards: list[str] = []

    class Recording(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, **kwargs):  # type: ignore[no-untyped-def]
            forwards.append("with cache" if kwargs.get("use_cache") else "plain")
            return self.inner(**kwargs)

    head = model.get_output_embeddings().weight
    completion_logprobs(Recording(), inputs, head, share_prompts=True)
    assert forwards == ["with cache", "with cache"]  # the prompts once, then the completions on them
    forwards.clear()
    elsewhere = {**inputs, "prompt_ids": inputs["prompt_ids"].to("meta")}
    completion_logprobs(Recording(), elsewhere, head, share_prompts=True)
    assert forwards == ["plain"]


def test_the_trainer_shares_prompts_unless_checkpointing(model: Qwen2ForCausalLM, tmp_path: Path) -> None:
    def trainer(**overrides) -> StreamGRPOTrainer:
        config = AsyncGRPOConfig(
            output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, num_generations=2, bf16=False,
            **overrides,
        )  # fmt: skip
        feed = SimpleNamespace(clock=None)
        return StreamGRPOTrainer(model=model, args=config, feed=feed, pusher=None)  # type: ignore[arg-type]

    assert trainer().shares_prompts
    assert not trainer(share_prompt_forward=False).shares_prompts
    assert not trainer(gradient_checkpointing=True).shares_prompts
