"""Applying a received push to a live vLLM model on CPU, on the core that generates.

vLLM's CPU GEMM packs each linear's weight for oneDNN and drops ``.weight``, so a plain
``load_weights`` cannot work. Two paths:

- **Directly** (``DirectApply``), where every layer is an unquantized linear or vocab
  embedding whose weight vLLM recorded at load (``packed_linears``): each linear gets a
  full-size weight back, the tensors are loaded by vLLM's own weight loaders, and the linears
  and LM heads are packed again.
- **By vLLM's layerwise reload** (``apply_by_layerwise_reload``) for any other model, or a
  push that leaves part of a linear out: every layer restored on the meta device, loaded and
  processed again, which costs about twice as much.

Why the direct path replays loader calls: a model's ``load_weights`` maps checkpoint names
to parameters through vLLM's generic ``AutoWeightsLoader`` (a walk over every module, name
by name) before it calls each parameter's loader. On the benchmark's small model that walk was
a quarter of an apply. Every push of a run carries the same names, so the first push records
which loader each tensor went to, with which arguments (``record_loader_calls``), and later
pushes call those loaders directly. The loaders still do the copying, shard offsets and dtype
handling, so the result is what ``load_weights`` gives (``tests/unit/vllm_gloo_transfer/test_gloo_apply.py``;
``tests/integration/test_weight_transfer.py`` checks vLLM's logprobs against the trainer's
after a recorded and a replayed push). A model whose ``load_weights`` hands a loader anything
but a pushed tensor itself (a slice, a concatenation, a converted copy) cannot be replayed,
and keeps calling ``load_weights``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from vllm.config import ModelConfig

# Runs inside vLLM's processes: log under the "vllm" tree, as ``plugin`` does.
logger = logging.getLogger(f"vllm.plugins.{__name__}")

Weights = list[tuple[str, torch.Tensor]]
PushShape = tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]


def push_shape(weights: Weights) -> PushShape:
    """What a recorded plan depends on: the pushed names, dtypes and shapes, in order."""
    return tuple((name, tensor.dtype, tuple(tensor.shape)) for name, tensor in weights)


class WeightApplier:
    """Applies pushes: directly where ``packed_linears`` allows, else by vLLM's layerwise
    reload. Keeps the direct plan of the last push's model and shape, since a run pushes the
    same tensors to the same model every step. (vLLM can point an update at another model,
    a draft model say: that one gets a plan of its own.)"""

    def __init__(self) -> None:
        self._direct: DirectApply | None = None

    def apply(self, model: torch.nn.Module, model_config: ModelConfig, weights: Weights) -> str:
        """Loads ``weights`` (HF names) into ``model``. Returns how, for the log: ``"by layerwise
        reload"`` or ``"directly (...)"``, saying whether the loader calls were recorded,
        replayed or made by ``load_weights``."""
        shape = push_shape(weights)
        if self._direct is None or self._direct.model is not model or self._direct.shape != shape:
            self._direct = DirectApply.for_push(model, shape)
        if self._direct is None:
            apply_by_layerwise_reload(model, model_config, weights)
            return "by layerwise reload"
        return f"directly ({self._direct.apply(weights)})"


@dataclass(frozen=True)
class LoaderCall:
    """One call that ``load_weights`` made: a parameter's loader, given pushed tensor number
    ``tensor`` and these further arguments (a shard id, say)."""

    module: torch.nn.Module
    parameter: str
    """The parameter's name in ``module``: the object itself is replaced at every direct apply."""
    tensor: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass
class DirectApply:
    """The direct path for pushes of one shape: the packed linears to rebuild, the modules
    that serve as LM heads (their packed vocabulary must be rebuilt too), and the loader calls
    recorded at the first apply."""

    model: torch.nn.Module
    shape: PushShape
    linears: list[torch.nn.Module]
    lm_heads: list[torch.nn.Module]
    calls: list[LoaderCall] | None = None
    """None until the first apply has recorded them, and for a model that cannot replay them."""
    recorded: bool = False

    @classmethod
    def for_push(cls, model: torch.nn.Module, shape: PushShape) -> DirectApply | None:
        """None where the model or the push needs the layerwise reload (``packed_linears``)."""
        linears = packed_linears(model, {name for name, _, _ in shape})
        if linears is None:
            return None
        return cls(model, shape, linears, lm_heads(model))

    def apply(self, weights: Weights) -> str:
        """Unpack the linears, load, and pack them and the LM heads again, even after a bad
        name: a linear left unpacked would serve with the wrong kernel. Returns how the
        tensors were loaded."""
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO, _get_original_loader
        from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

        for layer in self.linears:
            weight = materialize_meta_tensor(
                restore_layer_refs(LAYERWISE_INFO[layer].restore_metadata[0]["weight"], layer)
            )
            weight.weight_loader = _get_original_loader(weight)  # not a wrapper of an earlier layerwise reload
            layer.weight = weight
        try:
            if self.calls is not None:
                replay_loader_calls(self.calls, weights)
                return "loader calls replayed"
            if self.recorded:
                self.model.load_weights(weights)
                return "by load_weights"
            self.calls = record_loader_calls(self.model, weights)
            self.recorded = True
            return "loader calls recorded" if self.calls is not None else "by load_weights"
        finally:
            for layer in [*self.linears, *self.lm_heads]:
                layer.quant_method.process_weights_after_loading(layer)


def default_loader() -> Callable[..., Any]:
    """The loader vLLM's models use for a parameter that has none of its own."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    return default_weight_loader


def record_loader_calls(model: torch.nn.Module, weights: Weights) -> list[LoaderCall] | None:
    """Runs ``model.load_weights(weights)`` with every parameter's loader wrapped to note its
    calls, and puts the loaders back. Returns the calls, or None if a loader was handed
    anything but one of the pushed tensors itself (replaying would hand it the wrong thing)."""
    owners: dict[int, tuple[torch.nn.Module, str]] = {}
    for module in model.modules():
        for name, parameter in module.named_parameters(recurse=False):
            owners.setdefault(id(parameter), (module, name))
    pushed = {id(tensor): index for index, (_, tensor) in enumerate(weights)}
    calls: list[LoaderCall] = []
    replayable = True
    fallback = default_loader()
    wrapped: list[tuple[torch.nn.Parameter, Callable[..., Any] | None]] = []

    def noting(loader: Callable[..., Any]) -> Callable[..., Any]:
        def load(parameter: torch.nn.Parameter, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            nonlocal replayable
            index, owner = pushed.get(id(tensor)), owners.get(id(parameter))
            if index is None or owner is None:
                replayable = False
            else:
                calls.append(LoaderCall(owner[0], owner[1], index, args, kwargs))
            return loader(parameter, tensor, *args, **kwargs)

        return load

    for parameter in model.parameters():
        own = getattr(parameter, "weight_loader", None)
        wrapped.append((parameter, own))
        parameter.weight_loader = noting(own or fallback)
    try:
        model.load_weights(weights)
    finally:
        for parameter, own in wrapped:
            if own is None:
                del parameter.weight_loader
            else:
                parameter.weight_loader = own
    if not replayable:
        logger.info("this model's load_weights hands its loaders derived tensors: every push calls it")
        return None
    return calls


def replay_loader_calls(calls: list[LoaderCall], weights: Weights) -> None:
    """Hands each recorded loader this push's tensor, as ``load_weights`` did at the first."""
    fallback = default_loader()
    for call in calls:
        parameter = call.module._parameters[call.parameter]
        loader = getattr(parameter, "weight_loader", None) or fallback
        loader(parameter, weights[call.tensor][1], *call.args, **call.kwargs)


def packed_linears(model: torch.nn.Module, pushed: set[str]) -> list[torch.nn.Module] | None:
    """The linear layers whose weight vLLM's CPU GEMM packed and dropped, when the direct
    apply can reload the model: every layer with a quantization method is an unquantized
    linear or vocab embedding, each linear's weight was recorded at load, and the push
    (``pushed``, HF names) carries every tensor of each linear, since the direct path rebuilds
    whole weights and a linear the push left out would be packed from uninitialised memory.
    None: use the layerwise reload (quantized layers, a partial push, other platforms, a vLLM
    that records nothing).

    Why a direct path: the layerwise reload puts every layer on the meta device, wraps every
    weight loader and copies each processed tensor back, about half of an apply's 8 ms on the
    benchmark's model, on the core that generates."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    linears = []
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None or isinstance(method, UnquantizedEmbeddingMethod) or hasattr(module, "base_layer"):
            continue  # a LoRA wrapper (--enable-lora) holds no weight: its base_layer is visited next
        info = LAYERWISE_INFO.get(module)
        if (
            not isinstance(method, UnquantizedLinearMethod)
            or not hasattr(module, "cpu_linear")
            or info is None
            or "weight" not in info.restore_metadata[0]
        ):
            logger.info(
                "weights are applied by vLLM's layerwise reload: %s (%s, %s) is not a packed linear "
                "whose weight vLLM recorded", name, type(module).__name__, type(method).__name__,
            )  # fmt: skip
            return None
        missing = sorted(set(checkpoint_names(model, name)) - pushed)
        if missing:
            logger.info("this push is applied by vLLM's layerwise reload: it does not carry %s", ", ".join(missing))
            return None
        linears.append(module)
    return linears


def checkpoint_names(model: torch.nn.Module, module_name: str) -> list[str]:
    """The HF names of the tensors that make up a linear's weight: ``q_proj``, ``k_proj`` and
    ``v_proj`` for a ``qkv_proj`` (the model's ``packed_modules_mapping``), else its own."""
    prefix, _, last = module_name.removesuffix(".base_layer").rpartition(".")
    parts = getattr(model, "packed_modules_mapping", {}).get(last, [last])
    return [f"{prefix}.{part}.weight" if prefix else f"{part}.weight" for part in parts]


def lm_heads(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The vocab embeddings that project hidden states to logits, whose oneDNN handle packs
    their weight: every ``ParallelLMHead`` (a tied one shares the embedding's weight but keeps
    a handle of its own), and ``model.lm_head`` where it is a plain embedding. An input
    embedding only looks rows up in its weight, so its handle is never used and is not rebuilt
    (one oneDNN packing of the vocabulary less a push). A model where none is found gets every
    vocab embedding rebuilt, as the layerwise path does."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    embeddings = [module for module in model.modules() if isinstance(module, VocabParallelEmbedding)]
    heads = [
        module
        for module in embeddings
        if isinstance(module, ParallelLMHead) or module is getattr(model, "lm_head", None)
    ]
    return heads or embeddings


def apply_by_layerwise_reload(model: torch.nn.Module, model_config: ModelConfig, weights: Weights) -> None:
    """vLLM's layerwise reload (every layer restored, loaded and processed again), then the
    vocab projections repaired: the path for any model ``packed_linears`` turns down."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    initialize_layerwise_reload(model)
    try:
        model.load_weights(weights)
    finally:
        # Always leave reload state, even on a bad name: a model left in it cannot run.
        finalize_layerwise_reload(model, model_config)
    refresh_vocab_embeddings(model)


def refresh_vocab_embeddings(model: torch.nn.Module) -> None:
    """Re-run post-load processing of every vocab embedding / LM head.

    The layerwise reload re-processes the embedding but a tied ``ParallelLMHead`` keeps
    the oneDNN prepacked handle of the old weight; re-processing rebuilds it from the
    (shared) new weight.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding):
            module.quant_method.process_weights_after_loading(module)
