"""Per-token log-probabilities of completion tokens without materialising the full logits.

The [tokens, vocab] logits dominate a trainer's peak memory, so the projection onto the lm_head
and the log-softmax run on chunks of positions under gradient checkpointing: peak memory scales
with ``chunk_size * vocab``, at one extra projection per chunk.

Inputs are the final hidden states *aligned with the tokens they predict*: ``hidden_states[:, t]``
scores ``token_ids[:, t]``. The result matches TRL's ``selective_log_softmax(logits, token_ids,
temperature)`` with ``logits = hidden_states @ lm_head_weight.T``.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint


def _logits(hidden_states: torch.Tensor, lm_head_weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """[N, H] x [V, H] -> float32 logits [N, V] / temperature; float32 because a bf16 logsumexp over a
    large vocabulary loses the small log-probs that importance ratios depend on."""
    return _scaled(hidden_states @ lm_head_weight.T, temperature)


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature != 1.0:
        logits = logits / temperature
    return logits.float()


def _selected_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] as gathered logit - logsumexp: logits [..., V], ids [...] -> [...]."""
    selected = torch.gather(logits, dim=-1, index=token_ids.unsqueeze(-1)).squeeze(-1)
    return selected - torch.logsumexp(logits, dim=-1)


def _chunk_logprobs(
    hidden_states: torch.Tensor, lm_head_weight: torch.Tensor, token_ids: torch.Tensor, temperature: float
) -> torch.Tensor:
    """log softmax(logits)[token] for one chunk: hidden [N, H], ids [N] -> [N]."""
    return _selected_logprobs(_logits(hidden_states, lm_head_weight, temperature), token_ids)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature)[token], logits [B, T, V] and ids [B, T] -> float32 [B, T]:
    for logits the model made itself (``fsdp``: the lm_head weight is only whole inside the forward)."""
    if temperature <= 0:
        raise ValueError("temperature must be positive")
    return _selected_logprobs(_scaled(logits, temperature), token_ids)


def _check_inputs(
    hidden_states: torch.Tensor, lm_head_weight: torch.Tensor, token_ids: torch.Tensor, temperature: float
) -> None:
    if temperature <= 0:
        raise ValueError("temperature must be positive")
    if hidden_states.dim() != 3 or token_ids.shape != hidden_states.shape[:2]:
        raise ValueError(
            f"hidden_states must be [B, T, H] and token_ids [B, T]; got {hidden_states.shape}, {token_ids.shape}."
        )
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hidden_states.shape[-1]:
        raise ValueError(f"lm_head_weight must be [V, H]; got {lm_head_weight.shape}.")


def naive_completion_logprobs(
    hidden_states: torch.Tensor, lm_head_weight: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Reference with the full [B, T, V] logits, for tests and small inputs: hidden [B, T, H] -> [B, T]."""
    _check_inputs(hidden_states, lm_head_weight, token_ids, temperature)
    logits = _logits(hidden_states, lm_head_weight, temperature)
    return torch.log_softmax(logits, dim=-1).gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)


def chunked_completion_logprobs(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    token_ids: torch.Tensor,
    chunk_size: int = 1024,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Float32 log-probs [B, T] of ``token_ids`` [B, T] from hidden states [B, T, H] and lm_head weight [V, H].

    With autograd on and more than one chunk, each chunk is checkpointed, so neither pass holds more than
    one chunk's logits. Padding ids must still be valid vocabulary indices; the loss masks them.
    """
    _check_inputs(hidden_states, lm_head_weight, token_ids, temperature)
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    batch, length, hidden = hidden_states.shape
    flat_hidden = hidden_states.reshape(batch * length, hidden)
    flat_ids = token_ids.reshape(batch * length)
    needs_grad = torch.is_grad_enabled() and (hidden_states.requires_grad or lm_head_weight.requires_grad)
    chunk_logprobs = _chunk_logprobs
    if needs_grad and batch * length > chunk_size:  # one chunk: the same peak without recompute
        chunk_logprobs = functools.partial(checkpoint, _chunk_logprobs, use_reentrant=False, preserve_rng_state=False)
    chunks = [
        chunk_logprobs(chunk_hidden, lm_head_weight, chunk_ids, temperature)
        for chunk_hidden, chunk_ids in zip(flat_hidden.split(chunk_size), flat_ids.split(chunk_size), strict=True)
    ]
    return torch.cat(chunks).reshape(batch, length)
