"""Completion log-probs with each distinct prompt run through the model once, not once per sample.

A GRPO batch is G completions of each of a few prompts: the distinct prompts go through the
model first, their KV cache is indexed out to the samples (autograd sums each copy's gradient
back into its prompt), and the completions run on top of it, giving the plain forward's
log-probs and gradients. Not used without repeated prompts, where it does not pay on a GPU
(``sharing_pays``), under gradient checkpointing (no cache) or DDP (two forwards before one
backward confuse its reducer).

The layout is ``GroupCollator``'s; prompts are left-padded, so each prompt's last hidden state
is in the last column and scores the first completion token.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer_client.loss.logprobs import chunked_completion_logprobs

ACCELERATOR_MIN_SKIPPED = 0.5
"""On a GPU the shared forward pays only where it skips at least this share of the plain
forward's positions (its extra kernel launches and cache copies cost the rest); on a CPU any
skipped position pays."""


def skipped_fraction(inputs: dict[str, Any]) -> float:
    """The share of the plain forward's positions (samples x (prompt + completion width)) that
    running each distinct prompt once skips."""
    prompts, prompt_width = inputs["prompt_ids"].shape
    samples, completion_width = inputs["completion_ids"].shape
    return (samples - prompts) * prompt_width / (samples * (prompt_width + completion_width))


def sharing_pays(inputs: dict[str, Any], device_type: str) -> bool:
    if inputs["prompt_ids"].shape[0] >= inputs["completion_ids"].shape[0]:  # no prompt repeats
        return False
    return device_type == "cpu" or skipped_fraction(inputs) >= ACCELERATOR_MIN_SKIPPED


def shared_prompt_logprobs(
    model: torch.nn.Module,
    inputs: dict[str, Any],
    lm_head_weight: torch.Tensor,
    chunk_size: int = 1024,
    temperature: float = 1.0,
) -> torch.Tensor:
    """log pi(token) of every completion position, [B, T], each distinct prompt's forward done once."""
    prompt_attention = inputs["prompt_attention"]
    index = inputs["prompt_index"]
    prompt = model(
        input_ids=inputs["prompt_ids"],
        attention_mask=prompt_attention,
        position_ids=(prompt_attention.cumsum(-1) - 1).clamp(min=0),
        output_hidden_states=True,
        logits_to_keep=1,
        use_cache=True,
    )
    cache = prompt.past_key_values
    cache.reorder_cache(index)  # [P, ...] -> [B, ...], differentiable (index_select)
    completion_ids = inputs["completion_ids"]
    prompt_lengths = prompt_attention.sum(-1)[index]
    positions = prompt_lengths[:, None] + torch.arange(completion_ids.shape[1], device=completion_ids.device)
    completion = model(
        input_ids=completion_ids,
        attention_mask=torch.cat([prompt_attention[index], inputs["completion_attention"]], dim=1),
        position_ids=positions,
        past_key_values=cache,
        output_hidden_states=True,
        logits_to_keep=1,
        use_cache=True,
    )
    # hidden[:, t] must be the state that scores completion token t: the prompt's last state
    # for t = 0, then the completion's own states shifted by one.
    hidden = torch.cat([prompt.hidden_states[-1][index, -1:], completion.hidden_states[-1][:, :-1]], dim=1)
    return chunked_completion_logprobs(
        hidden, lm_head_weight, completion_ids, chunk_size=chunk_size, temperature=temperature
    )
