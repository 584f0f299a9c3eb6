"""The renderer's decode is ``tokenizer.decode``'s text, through the Rust decoder where that is the same."""

from __future__ import annotations

import random
from typing import Any

import pytest

from rollout_service.generation.prompts import PromptRenderer


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_decode_gives_the_tokenizers_text_special_tokens_included(tokenizer: Any, skip_special_tokens: bool) -> None:
    renderer = PromptRenderer(tokenizer, 2048)
    assert renderer._decode != tokenizer.decode  # the fast path is taken for this tokenizer
    rng = random.Random(0)
    specials = list(tokenizer.all_special_ids)
    for _ in range(50):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 64))]
        ids[rng.randrange(len(ids))] = rng.choice(specials)
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert renderer.decode(ids, skip_special_tokens=skip_special_tokens) == expected


def test_a_tokenizer_that_cleans_up_spaces_decodes_through_transformers(tokenizer: Any) -> None:
    class CleaningUp:
        backend_tokenizer = tokenizer.backend_tokenizer
        clean_up_tokenization_spaces = True

        def __len__(self) -> int:
            return len(tokenizer)

        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            return "cleaned"

    assert PromptRenderer(CleaningUp(), 2048).decode([1, 2]) == "cleaned"
