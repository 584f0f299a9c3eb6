"""The benchmark task's reward, shared verbatim by TRL's trainer and the rollout service.

``vowel_share``: the fraction of a completion's non-space characters that are vowels. Dense
(every completion scores between 0 and 1), learnable by a tiny random model within a minute
(its vocabulary has tokens like ``aaaa`` and ``eeee``), and not the demo's task. It takes
TRL's inputs: completions are strings, or for conversational prompts ``[{"role":
"assistant", "content": ...}]`` lists.
"""

from __future__ import annotations

from typing import Any

VOWELS = frozenset("aeiouAEIOU")


def _text(completion: str | list[dict[str, Any]]) -> str:
    if isinstance(completion, str):
        return completion
    return "".join(str(message.get("content") or "") for message in completion if message.get("role") == "assistant")


def vowel_share(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    scores = []
    for completion in completions:
        chars = [c for c in _text(completion) if not c.isspace()]
        scores.append(sum(c in VOWELS for c in chars) / len(chars) if chars else 0.0)
    return scores


REWARD_FUNCTIONS = {"vowel_share": vowel_share}
