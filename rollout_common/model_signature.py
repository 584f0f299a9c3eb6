"""Whether a trainer's model and the served model are the same model, as far as a weight push
and the log-probs go: the config fields that fix the weights' shapes, as one line.

Why not the name: one checkpoint has many names (a Hub id, its folder in the cache, a path
inside a container), and two checkpoints of different shapes can share a folder name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)


def model_signature(config: Mapping[str, Any]) -> str:
    """``config`` (a model's config.json as a dict) as one line: ``qwen2 vocab_size=1024 ...``."""
    text = config.get("text_config") or config  # a multimodal model's language part
    shape = [f"{name}={text[name]}" for name in SHAPE_FIELDS if text.get(name) is not None]
    return " ".join([str(config.get("model_type", "unknown")), *shape])


def signature_of(name_or_path: str, revision: str | None = None) -> str:
    """The signature of a model by Hub id or folder, from its config alone (no weights)."""
    from transformers import AutoConfig

    return model_signature(AutoConfig.from_pretrained(name_or_path, revision=revision).to_dict())
