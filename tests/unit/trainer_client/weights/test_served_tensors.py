"""What a push sends of each tensor: cast to the servers' dtype, and a copy where the delta
encoder keeps it as the servers' weights (the optimizer changes the parameters in place)."""

from __future__ import annotations

import torch

from trainer_client.weights.push import served


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_a_kept_tensor_is_a_copy_the_next_step_does_not_reach() -> None:
    weight, steps = torch.ones(4), torch.arange(4)
    for dtype in (None, torch.float32, torch.bfloat16):
        kept = served(weight, dtype, copy=True)
        assert not shares_memory(kept, weight) and kept.dtype == (dtype or torch.float32)
        weight.add_(1.0)  # the optimizer's step, in place
        assert torch.equal(kept.float(), weight - 1.0)
        weight.sub_(1.0)
    assert not shares_memory(served(steps, torch.bfloat16, copy=True), steps)
    assert served(steps, torch.bfloat16, copy=True).dtype == torch.int64  # only floating point is cast


def test_a_tensor_sent_and_forgotten_is_cast_but_never_copied_for_nothing() -> None:
    weight = torch.ones(4)
    assert served(weight, None, copy=False) is weight
    assert served(weight, torch.float32, copy=False) is weight
    assert served(weight, torch.bfloat16, copy=False).dtype == torch.bfloat16
