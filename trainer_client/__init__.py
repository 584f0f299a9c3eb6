"""Thin trainer client of the rollout service; importable without vLLM.

Exports load on first use, so the light modules stay importable without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AsyncGRPOTrainer": "trainer_client.api",
    "AsyncGRPOConfig": "trainer_client.train.trainer",
    "RunOptions": "trainer_client.options",
    "ModelOptions": "trainer_client.options",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'trainer_client' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
