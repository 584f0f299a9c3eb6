"""The weight senders by vLLM weight-transfer backend, as ``BeginWeightUpdate`` reports the
servers' (``weight_sync.backend``), imported only when chosen: the NCCL sender needs vLLM."""

from __future__ import annotations

import importlib

from trainer_client.weights.sender import WeightSender

BACKENDS = {
    "gloo": "trainer_client.weights.gloo:GlooWeightSender",  # this project's engine for CPU servers
    "nccl": "trainer_client.weights.nccl:NcclWeightSender",  # vLLM's engine for GPU servers
}


def sender_for(backend: str) -> type[WeightSender]:
    """The sender class of ``backend`` ("" : gloo, what a service before the field reported)."""
    try:
        module, name = BACKENDS[backend or "gloo"].split(":")
    except KeyError:
        raise ValueError(
            f"the service reports weight-transfer backend {backend!r}; this trainer can send over {sorted(BACKENDS)}"
        ) from None
    sender: type[WeightSender] = getattr(importlib.import_module(module), name)
    return sender
