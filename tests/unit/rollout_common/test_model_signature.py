"""A trainer trains the served model: by default the one the service names, and another one
only where its shape is the served one's (``rollout_common.model_signature``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollout_api import rollout_pb2 as pb
from rollout_common.model_signature import model_signature, signature_of
from trainer_client.options import ModelOptions
from trainer_client.train.run import ModelNotFound, policy_checkpoint

QWEN = {
    "model_type": "qwen2",
    "vocab_size": 1024,
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "torch_dtype": "bfloat16",
}


def checkpoint(folder: Path, **config: object) -> str:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**QWEN, **config}))
    return str(folder)


def test_the_signature_is_the_shape_not_the_name_or_dtype() -> None:
    assert model_signature(QWEN) == "qwen2 vocab_size=1024 hidden_size=128 num_hidden_layers=2"
    assert model_signature({**QWEN, "dtype": "float32", "_name_or_path": "elsewhere"}) == model_signature(QWEN)
    assert model_signature({"model_type": "llava", "text_config": QWEN}).startswith("llava vocab_size=1024")


def test_the_served_model_is_the_default_and_another_shape_is_refused(tmp_path: Path) -> None:
    served_path = checkpoint(tmp_path / "served")
    served = pb.GetServerInfoResponse(model="/models/served", model_signature=signature_of(served_path))
    assert policy_checkpoint(ModelOptions(), served) == "/models/served"
    same = checkpoint(tmp_path / "same-shape-elsewhere")  # one checkpoint, another path: accepted
    assert policy_checkpoint(ModelOptions(same), served) == same
    other = checkpoint(tmp_path / "other", num_hidden_layers=3)
    with pytest.raises(
        ModelNotFound, match=r"num_hidden_layers=3 .*\) is not the model the service serves, /models/served \(qwen2"
    ):
        policy_checkpoint(ModelOptions(other), served)
    # A service that could not read its model's config: nothing to compare against.
    assert policy_checkpoint(ModelOptions(other), pb.GetServerInfoResponse(model="m")) == other
