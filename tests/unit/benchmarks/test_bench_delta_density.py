"""The bytes ``benchmarks/bench_delta_density.py`` counts for a delta push, from known tensors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))  # as the benchmark scripts run

from bench_delta_density import break_even_density, step_bytes


def test_a_tensor_goes_as_a_delta_only_while_that_is_smaller() -> None:
    before = {"few": torch.zeros(100, dtype=torch.bfloat16), "many": torch.zeros(10, dtype=torch.bfloat16)}
    after = {"few": before["few"].clone(), "many": torch.ones(10, dtype=torch.bfloat16)}
    after["few"][:3] = 1
    step = step_bytes(before, after)
    assert (step.changed, step.elements) == (13, 110)
    assert step.full_bytes == 110 * 2
    assert step.delta_bytes == 3 * (4 + 2) + 10 * 2  # "few" as indices and values, "many" whole
    assert (step.tensors_sparse, step.tensors) == (1, 2)
    assert step.density == pytest.approx(13 / 110)


def test_bf16_breaks_even_at_a_third_changed() -> None:
    assert break_even_density(torch.bfloat16) == pytest.approx(1 / 3)
    assert break_even_density(torch.float32) == pytest.approx(1 / 2)
