"""Which layers the gloo engine applies directly, and when it leaves a model to vLLM's
layerwise reload (``vllm_gloo_transfer.apply.packed_linears``); and that the loader calls the
direct path records at a model's first push load, when replayed, what ``load_weights`` loads.
That the direct apply serves the trainer's weights, recorded and replayed, is shown against a
real vLLM server in ``tests/integration/test_weight_transfer.py``."""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.model_loader.reload.layerwise import record_metadata_for_reloading

from vllm_gloo_transfer.apply import packed_linears, record_loader_calls, replay_loader_calls


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


class StackedModel(torch.nn.Module):
    """Loads like a vLLM model: checkpoint names mapped to parameters, three tensors stacked
    into one by a loader that takes a shard id, and a parameter with no loader of its own
    (vLLM's ``default_weight_loader``)."""

    SHARDS: ClassVar[dict[str, int]] = {"q": 0, "k": 1, "v": 2}

    def __init__(self, derived: bool = False) -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(6, 4), requires_grad=False)
        self.qkv.weight_loader = self.load_shard
        self.norm = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
        self.derived = derived
        """Hand the loaders a copy of each tensor, as a model that converts them would."""

    def load_shard(self, parameter: torch.nn.Parameter, tensor: torch.Tensor, shard: int) -> None:
        parameter.data.narrow(0, 2 * shard, 2).copy_(tensor)

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        for name, tensor in weights:
            tensor = tensor.clone() if self.derived else tensor
            if name in self.SHARDS:
                self.qkv.weight_loader(self.qkv, tensor, self.SHARDS[name])
            else:
                getattr(self.norm, "weight_loader", default_weight_loader)(self.norm, tensor)


def stacked_push(seed: int) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    push = [(name, torch.randn(2, 4, generator=generator)) for name in ("v", "q", "k")]
    return [*push, ("norm", torch.randn(4, generator=generator))]


def test_replayed_loader_calls_load_what_load_weights_loads() -> None:
    recorded, reference = StackedModel(), StackedModel()
    calls = record_loader_calls(recorded, stacked_push(0))
    assert calls is not None and [call.tensor for call in calls] == [0, 1, 2, 3]
    assert [call.args for call in calls] == [(2,), (0,), (1,), ()]
    # The loaders are the model's own again: the bound method, and none at all on the norm.
    assert recorded.qkv.weight_loader == recorded.load_shard
    assert not hasattr(recorded.norm, "weight_loader")
    replay_loader_calls(calls, stacked_push(1))
    reference.load_weights(stacked_push(1))
    assert torch.equal(recorded.qkv, reference.qkv) and torch.equal(recorded.norm, reference.norm)
    assert recorded.qkv.abs().min() > 0, "every shard was loaded"


def test_a_model_that_hands_its_loaders_derived_tensors_is_not_replayed() -> None:
    model, reference = StackedModel(derived=True), StackedModel()
    assert record_loader_calls(model, stacked_push(0)) is None
    reference.load_weights(stacked_push(0))
    assert torch.equal(model.qkv, reference.qkv), "the recording load still loaded the push"
