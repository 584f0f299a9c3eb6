"""Chunked completion log-probs: same values and gradients as the naive full-logits computation, less memory.

The temperature convention is checked against TRL's own ``selective_log_softmax``, whose source is taken from the
installed ``trl/trainer/utils.py`` with ``ast`` and run with Triton reported unavailable (its plain torch path),
so the test does not pay for importing TRL's trainer stack.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from trainer_client.loss import logprobs
from trainer_client.loss.logprobs import chunked_completion_logprobs, naive_completion_logprobs

VOCAB, HIDDEN = 97, 12


def make_inputs(seed: int = 0, batch: int = 3, length: int = 11) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, length, HIDDEN, generator=gen)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen) * 0.5
    token_ids = torch.randint(0, VOCAB, (batch, length), generator=gen)
    return hidden, weight, token_ids


def values_and_grads(
    fn: Callable[..., torch.Tensor], hidden: torch.Tensor, weight: torch.Tensor, token_ids: torch.Tensor, **kwargs
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probs and the gradients of a non-uniform downstream loss w.r.t. hidden states and lm_head weight."""
    hidden = hidden.clone().requires_grad_(True)
    weight = weight.clone().requires_grad_(True)
    logps = fn(hidden, weight, token_ids, **kwargs)
    upstream = torch.linspace(-1.0, 2.0, logps.numel()).reshape(logps.shape)
    (logps * upstream).sum().backward()
    return logps.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [1, 5, 16, 33, 1024])  # 33 = B * T: one chunk; 1024: larger than the input
def test_chunked_matches_naive_values_and_grads(chunk_size: int, temperature: float) -> None:
    hidden, weight, token_ids = make_inputs()
    expected = values_and_grads(naive_completion_logprobs, hidden, weight, token_ids, temperature=temperature)
    got = values_and_grads(
        chunked_completion_logprobs, hidden, weight, token_ids, chunk_size=chunk_size, temperature=temperature
    )
    for name, a, b in zip(("logps", "d/d hidden", "d/d weight"), got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)


def test_temperature_divides_logits() -> None:
    """Both implementations equal log_softmax(hidden @ W.T / temperature) gathered at the tokens."""
    hidden, weight, token_ids = make_inputs(seed=1)
    logits = hidden @ weight.T
    for temperature in (0.5, 1.0, 1.3):
        expected = torch.log_softmax(logits / temperature, -1).gather(-1, token_ids[..., None]).squeeze(-1)
        for got in (
            naive_completion_logprobs(hidden, weight, token_ids, temperature=temperature),
            chunked_completion_logprobs(hidden, weight, token_ids, chunk_size=4, temperature=temperature),
        ):
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def _trl_selective_log_softmax() -> Callable[..., torch.Tensor]:
    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("trl (a dev dependency) is not installed: parity with TRL cannot be checked; pip install -e .[dev]")
    path = Path(spec.submodule_search_locations[0]) / "trainer" / "utils.py"
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "selective_log_softmax")
    namespace = {"torch": torch, "F": torch.nn.functional, "is_triton_available": lambda: False}
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)
    return namespace["selective_log_softmax"]


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_matches_trl_selective_log_softmax(temperature: float) -> None:
    trl_selective_log_softmax = _trl_selective_log_softmax()
    hidden, weight, token_ids = make_inputs(seed=2)
    expected = trl_selective_log_softmax(hidden @ weight.T, token_ids, temperature=temperature)
    got = chunked_completion_logprobs(hidden, weight, token_ids, chunk_size=7, temperature=temperature)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_forward_saves_no_logits_for_backward() -> None:
    """Under autograd, the chunked forward keeps only chunk inputs; the naive one keeps [.., V] logits."""
    hidden, weight, token_ids = make_inputs(seed=3, batch=2, length=40)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    chunk_size = 8

    def saved_shapes(fn: Callable[[], torch.Tensor]) -> list[tuple[int, ...]]:
        shapes: list[tuple[int, ...]] = []

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            shapes.append(tuple(tensor.shape))
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            fn().sum().backward()
        return shapes

    naive = saved_shapes(lambda: naive_completion_logprobs(hidden, weight, token_ids))
    chunked = saved_shapes(lambda: chunked_completion_logprobs(hidden, weight, token_ids, chunk_size=chunk_size))
    assert any(shape[-1] == VOCAB and shape != (HIDDEN, VOCAB) for shape in naive)
    for shape in chunked:
        assert shape in ((VOCAB, HIDDEN), (chunk_size, HIDDEN), (chunk_size,)), shape


def test_one_chunk_projects_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """With every position in one chunk, the backward reuses the forward's logits instead of recomputing them
    (same peak memory, one projection less); with several chunks each projection runs twice."""
    hidden, weight, token_ids = make_inputs(seed=5, batch=2, length=8)
    calls: list[int] = []
    project = logprobs._logits

    def counting_logits(*args: object) -> torch.Tensor:
        calls.append(1)
        return project(*args)

    monkeypatch.setattr(logprobs, "_logits", counting_logits)
    values_and_grads(chunked_completion_logprobs, hidden, weight, token_ids, chunk_size=16)
    assert len(calls) == 1
    calls.clear()
    values_and_grads(chunked_completion_logprobs, hidden, weight, token_ids, chunk_size=8)
    assert len(calls) == 4  # two chunks, each projected in the forward and again in the backward


def test_no_grad_and_low_precision() -> None:
    hidden, weight, token_ids = make_inputs(seed=4)
    with torch.no_grad():
        got = chunked_completion_logprobs(hidden, weight, token_ids, chunk_size=6)
    assert not got.requires_grad
    torch.testing.assert_close(got, naive_completion_logprobs(hidden, weight, token_ids))
    bf16 = chunked_completion_logprobs(hidden.bfloat16(), weight.bfloat16(), token_ids, chunk_size=6)
    assert bf16.dtype == torch.float32
    torch.testing.assert_close(bf16, got, atol=0.1, rtol=0.05)


def test_rejects_bad_inputs() -> None:
    hidden, weight, token_ids = make_inputs()
    with pytest.raises(ValueError, match="token_ids"):
        chunked_completion_logprobs(hidden, weight, token_ids[:, 1:])
    with pytest.raises(ValueError, match="lm_head_weight"):
        chunked_completion_logprobs(hidden, weight[:, 1:], token_ids)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_completion_logprobs(hidden, weight, token_ids, chunk_size=0)
    with pytest.raises(ValueError, match="temperature"):
        chunked_completion_logprobs(hidden, weight, token_ids, temperature=0.0)
    empty = chunked_completion_logprobs(hidden[:, :0], weight, token_ids[:, :0])
    assert empty.shape == (3, 0)
