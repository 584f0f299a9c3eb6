"""Fixtures several unit-test modules share."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import AutoTokenizer

from rollout_common.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny model's real tokenizer and chat template (built once per session)."""
    path = build_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen2")
    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(autouse=True)
def quick_resume_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scripted servers answer at once: a failed /resume is retried without the production backoff."""
    from rollout_service.weights import server_repair

    monkeypatch.setattr(server_repair, "RESUME_RETRY_S", 0.001)
