"""Which layers the gloo engine applies directly, and when it leaves a model to vLLM's
layerwise reload (``vllm_gloo_transfer.plugin.packed_linears``). That the direct apply serves
the trainer's weights is shown against a real vLLM server in
``tests/integration/test_weight_transfer.py``."""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.model_loader.reload.layerwise import record_metadata_for_reloading

from vllm_gloo_transfer.plugin import packed_linears


def packed_linear(recorded: bool = True) -> torch.nn.Linear:
    """A linear layer as vLLM's CPU GEMM leaves it: a packed kernel (``cpu_linear``), its
    weight recorded at load when ``recorded``."""
    layer = torch.nn.Linear(4, 3)
    layer.quant_method = UnquantizedLinearMethod()
    layer.cpu_linear = torch.nn.functional.linear
    if recorded:
        record_metadata_for_reloading(layer)
    return layer


class LoraWrapper(torch.nn.Module):
    """Like vLLM's ``...WithLoRA`` layers: the base layer's method, no weight of its own."""

    def __init__(self, base: torch.nn.Module) -> None:
        super().__init__()
        self.base_layer = base
        self.quant_method = base.quant_method


class QuantizedMethod:
    """Any quantization method the direct path does not know."""


class Attention(torch.nn.Module):
    """A module path like a real model's, with a linear vLLM stacks from three checkpoint tensors."""

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = LoraWrapper(packed_linear())
        self.o_proj = packed_linear()


FULL_PUSH = {"q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"}


def test_packed_linears_are_applied_directly_and_lora_wrappers_are_looked_through() -> None:
    model = Attention()
    assert packed_linears(model, FULL_PUSH) == [model.qkv_proj.base_layer, model.o_proj]


def test_a_quantized_or_unrecorded_layer_leaves_the_model_to_the_layerwise_reload() -> None:
    quantized = Attention()
    quantized.o_proj.quant_method = QuantizedMethod()
    assert packed_linears(quantized, FULL_PUSH) is None
    unrecorded = Attention()
    unrecorded.o_proj = packed_linear(recorded=False)
    assert packed_linears(unrecorded, FULL_PUSH) is None


def test_a_push_that_leaves_out_part_of_a_linear_goes_through_the_layerwise_reload() -> None:
    """The direct path rebuilds each linear's whole weight: one the push does not fully carry
    (here ``k_proj``, a third of ``qkv_proj``) would be packed from uninitialised memory."""
    assert packed_linears(Attention(), FULL_PUSH - {"k_proj.weight"}) is None
