"""Which layers the gloo engine applies directly, and when it leaves a model to vLLM's
layerwise reload (``vllm_gloo_transfer.plugin.packed_linears``). That the direct apply serves
the trainer's weights is shown against a real vLLM server in
``tests/integration/test_weight_transfer.py``."""

from __future__ import annotations

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


def test_packed_linears_are_applied_directly_and_lora_wrappers_are_looked_through() -> None:
    first, second = packed_linear(), packed_linear()
    model = torch.nn.Sequential(LoraWrapper(first), second, torch.nn.LayerNorm(3))
    assert packed_linears(model) == [first, second]


def test_a_quantized_or_unrecorded_layer_leaves_the_model_to_the_layerwise_reload() -> None:
    quantized = packed_linear()
    quantized.quant_method = QuantizedMethod()
    assert packed_linears(torch.nn.Sequential(packed_linear(), quantized)) is None
    assert packed_linears(torch.nn.Sequential(packed_linear(), packed_linear(recorded=False))) is None
