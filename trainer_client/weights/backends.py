"""The weight sender of each vLLM weight-transfer backend, imported only when chosen: NCCL's needs vLLM."""

from __future__ import annotations

import importlib

from trainer_client.weights.sender import WeightSender

BACKENDS = {
    "gloo": "trainer_client.weights.gloo:GlooWeightSender",  # this project's engine for CPU servers
    "nccl": "trainer_client.weights.nccl:NcclWeightSender",  # vLLM's engine for GPU servers
}


def sender_for(backend: str) -> type[WeightSender]:
    """The sender class of ``backend`` as ``BeginWeightUpdate`` reports it ("": gloo)."""
    try:
        module, name = BACKENDS[backend or "gloo"].split(":")
    except KeyError:
        raise ValueError(
            f"the service reports weight-transfer backend {backend!r}; this trainer can send over {sorted(BACKENDS)}"
        ) from None
    sender: type[WeightSender] = getattr(importlib.import_module(module), name)
    return sender
