"""Tools and an environment loaded through the ``tool_modules`` / ``environment_modules`` settings."""

from __future__ import annotations

import random

from rollout_service.generation.environments import GuessNumber, StepResult
from rollout_service.types import PromptItem

LONG_TURNS = 8
"""Turns a long episode takes: each is another vLLM request, so long episodes are slow ones."""


class SlowLetters:
    """An episode of the ``letters`` dataset takes ``LONG_TURNS`` turns for the letters a and b
    and one for the others: those prompts are the long and the slow ones, every time."""

    def __init__(self) -> None:
        self.turns_left = 1

    def reset(self, prompt: PromptItem) -> None:
        self.turns_left = self.turns(prompt)

    def turns(self, prompt: PromptItem) -> int:
        return LONG_TURNS if prompt.metadata["target_char"] in "ab" else 1

    def step(self, model_text: str) -> StepResult:
        self.turns_left -= 1
        return StepResult("Done.", done=True) if self.turns_left <= 0 else StepResult("Again.")


class SlowAtRandom(SlowLetters):
    """As ``SlowLetters``, with the long episodes drawn at random whatever the prompt."""

    def turns(self, prompt: PromptItem) -> int:
        return LONG_TURNS if random.random() < 0.2 else 1


def shout(text: str) -> str:
    """Upper-case a text.

    Args:
        text: what to shout
    """
    return text.upper()


TOOL_FUNCTIONS = {"shout": shout}
ENVIRONMENTS = {"guess_again": GuessNumber, "slow_letters": SlowLetters, "slow_at_random": SlowAtRandom}
