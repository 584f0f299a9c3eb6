"""What a push sends: a plain model's parameters, or a PEFT model folded into base names."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen2Config, Qwen2ForCausalLM

from trainer_client.weights.policy_weights import policy_weights


def small_model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    return Qwen2ForCausalLM(config).float()


def lora_model(base: Qwen2ForCausalLM, modules_to_save: list[str] | None = None):
    targets = ["q_proj", "v_proj", "up_proj"]
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, modules_to_save=modules_to_save)
    model = get_peft_model(base, config)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)  # PEFT starts B at zero; a trained adapter is not
    return model


def test_plain_model_pushes_its_parameters_as_named() -> None:
    model = small_model()
    pushed = policy_weights(model)
    assert [n for n, _ in pushed] == [n for n, _ in model.named_parameters()]
    assert all(not t.requires_grad for _, t in pushed)


def test_lora_model_pushes_merged_weights_under_base_names() -> None:
    base = small_model()
    expected = dict(small_model().named_parameters())  # same seed: the base names and shapes
    model = lora_model(base)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    pushed = dict(policy_weights(model))

    merged = dict(copy.deepcopy(model).merge_and_unload().named_parameters())
    assert list(pushed) == list(expected) == list(merged)
    for name, tensor in pushed.items():
        assert tensor.shape == expected[name].shape
        torch.testing.assert_close(tensor, merged[name], atol=1e-6, rtol=0)
    changed = [n for n in pushed if not torch.equal(pushed[n], expected[n])]
    assert changed and all(any(m in n for m in ("q_proj", "v_proj", "up_proj")) for n in changed)
    # The trained model itself is untouched (no in-place merge and unmerge).
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_lora_modules_to_save_replace_the_original_module() -> None:
    model = lora_model(small_model(), modules_to_save=["norm"])
    with torch.no_grad():
        model.base_model.model.model.norm.modules_to_save["default"].weight.fill_(2.0)
    pushed = dict(policy_weights(model))
    assert torch.equal(pushed["model.norm.weight"], torch.full((32,), 2.0))
    assert not any("original_module" in n or "modules_to_save" in n for n in pushed)


def test_disabled_adapter_pushes_the_base() -> None:
    base = small_model()
    reference = {n: p.detach().clone() for n, p in base.named_parameters()}
    model = lora_model(base)
    with model.disable_adapter():
        pushed = dict(policy_weights(model))
    assert all(torch.equal(pushed[n], reference[n]) for n in reference)


def test_merged_adapter_is_refused() -> None:
    model = lora_model(small_model())
    model.merge_adapter()
    with pytest.raises(ValueError, match="unmerge"):
        policy_weights(model)
