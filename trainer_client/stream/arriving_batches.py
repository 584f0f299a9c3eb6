"""Train an optimizer step's micro-batches as their groups arrive, not once all have.

``transformers.Trainer`` fetches a step's micro-batches up front to count its loss tokens,
which on a stream idles the trainer until the last group is generated. The losses normalised
by the whole step's tokens (dapo, cispo, vespo, dppo) instead sum over tokens, and
``DeferredTokenNormaliser`` divides the accumulated gradients once before the optimizer step:
the same gradients, since they are linear in the loss.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ArrivingBatches:
    """``count`` micro-batches taken from ``source`` only as Trainer's loop asks for each."""

    source: Iterator[dict[str, Any]]
    count: int

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return itertools.islice(self.source, self.count)


@dataclass
class DeferredTokenNormaliser:
    """Sums one optimizer step's loss tokens and losses over its micro-batches; after the last,
    divides the gradients and the reported loss by the token count."""

    micro_batches: int
    tokens: float = 0.0
    losses: list[float] = field(default_factory=list)
    """Each micro-batch's loss summed over its tokens."""

    def add(self, tokens: float, loss: float) -> None:
        self.tokens += tokens
        self.losses.append(loss)

    @property
    def complete(self) -> bool:
        return len(self.losses) >= self.micro_batches

    @property
    def divisor(self) -> float:
        return max(self.tokens, 1.0)

    def normalised_losses(self) -> list[float]:
        """Each micro-batch's loss as the up-front count would have made it."""
        return [loss / self.divisor for loss in self.losses]

    def normalise_gradients(self, model: torch.nn.Module) -> None:
        scale = 1.0 / self.divisor
        for parameter in model.parameters():
            if parameter.grad is not None:
                parameter.grad.mul_(scale)
