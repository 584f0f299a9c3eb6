"""Train an optimizer step's micro-batches as their groups arrive, not once all have.

``transformers.Trainer`` fetches every micro-batch of an optimizer step before it trains the
first (``get_batch_samples``), so that it can count the step's loss tokens up front. On a
stream that means the trainer idles until the step's last group is generated, even when the
first ones were waiting in its buffer. ``ArrivingBatches`` hands the micro-batches out one at
a time instead, so with ``gradient_accumulation_steps`` > 1 the forward and backward of the
first overlap the generation of the last.

The losses that divide by the loss tokens of the whole step (dapo, cispo, vespo) cannot know
that count before its last micro-batch. ``DeferredTokenNormaliser`` has them sum over tokens
instead and divides the accumulated gradients once, after the last backward and before
Trainer clips and steps: the same gradients as dividing each micro-batch's loss, since
gradients are linear in the loss.

Why the CLI's default stays one micro-batch a step: on the 2-core benchmark four micro-batches
a step cost the trainer's thread more CPU than one batch and made no run faster, since there
vLLM's core is the one that is full; on a GPU a step took the same time either way, with less
peak memory (``benchmarks/SPEED_HISTORY.md``; README, speed section).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ArrivingBatches:
    """``count`` micro-batches taken from ``source`` only as the loop asks for each.

    Trainer's loop needs ``len`` (the step's accumulation count) and iteration, nothing else.
    """

    source: Iterator[dict[str, Any]]
    count: int

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for _ in range(self.count):
            try:
                yield next(self.source)
            except StopIteration:
                return


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
