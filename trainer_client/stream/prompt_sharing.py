"""Completion log-probs with each distinct prompt run through the model once, not once per sample.

Why: a GRPO batch is G completions of each of a few prompts. The plain forward runs every
sample's prompt again: with G = 8, the 1.64M-parameter benchmark model and 34-token prompts
before 32-token completions, half the positions of a step are eight copies of four prompts.
Here the distinct prompts go through the model first (batch P instead of B), their key/value
cache is indexed out to the B samples (``index_select``: autograd sums each copy's gradient
back into its prompt), and the completions run on top of it. The log-probs and gradients are
those of the plain forward (within float32 rounding: tests/unit/test_prompt_sharing.py), and
a trainer step of that model on one thread spends much less time in forward + backward
(``benchmarks/SPEED_HISTORY.md``).

Where it does not apply, the trainer uses the plain forward:
- every sample has its own prompt (nothing to share; two forwards would only cost more);
- on a GPU, a batch where sharing skips less than half of the plain forward's positions
  (``sharing_pays``);
- gradient checkpointing (transformers turns the cache off under it);
- a model wrapped for data parallelism (two forward calls before one backward confuse DDP's
  gradient reducer).

The batch layout is ``GroupCollator``'s: distinct prompts left-padded to one width
(``prompt_ids``, ``prompt_attention``), ``prompt_index`` mapping each sample to its prompt,
and completions right-padded after them (``completion_ids``, ``completion_attention``).
Because prompts are left-padded, every prompt's last token is in the last column, and its
final hidden state is the one that scores the first completion token.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer_client.loss.logprobs import chunked_completion_logprobs

ACCELERATOR_MIN_SKIPPED = 0.5
"""On a GPU the shared forward pays only where it skips at least this share of the plain
forward's positions. Measured on an H200 over whole trainer steps of Qwen2.5-0.5B's and
1.5B's shapes (``benchmarks/bench_trainer_step.py``; the numbers in README "On a GPU"): sharing
won where long prompts dominate the batch and lost where the completions do, and the
break-even, which moves with the model, lies near half the positions, so this rule misses few
of the measured batches where always sharing missed most. There the step is not the math
alone: the shared forward is two model calls (twice the kernel launches), copies each
prompt's KV cache to its samples, and runs the completions' attention with an explicit mask
over the cache instead of the causal kernel. On a CPU the math is the step, and every
skipped position counts (``benchmarks/SPEED_HISTORY.md``)."""


def prompts_are_shared(inputs: dict[str, Any]) -> bool:
    """Whether the batch has fewer distinct prompts than samples (so sharing saves work)."""
    return inputs["prompt_ids"].shape[0] < inputs["completion_ids"].shape[0]


def skipped_fraction(inputs: dict[str, Any]) -> float:
    """The share of the plain forward's positions (samples x (prompt + completion width)) that
    running each distinct prompt once skips."""
    prompts, prompt_width = inputs["prompt_ids"].shape
    samples, completion_width = inputs["completion_ids"].shape
    return (samples - prompts) * prompt_width / (samples * (prompt_width + completion_width))


def sharing_pays(inputs: dict[str, Any], device_type: str) -> bool:
    """Whether the shared forward is the faster one for this batch on a ``device_type`` device:
    on a CPU whenever a prompt repeats, elsewhere from ``ACCELERATOR_MIN_SKIPPED`` on."""
    if not prompts_are_shared(inputs):
        return False
    return device_type == "cpu" or skipped_fraction(inputs) >= ACCELERATOR_MIN_SKIPPED


def shared_prompt_logprobs(
    model: torch.nn.Module,
    inputs: dict[str, Any],
    lm_head_weight: torch.Tensor,
    chunk_size: int = 1024,
    temperature: float = 1.0,
) -> torch.Tensor:
    """log pi(token) of every completion position, [B, T], with each distinct prompt's forward
    done once; the same values as ``batches.completion_logprobs`` on the same batch."""
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
    hidden = torch.cat(
        [prompt.hidden_states[-1][index, -1:], completion.hidden_states[-1][:, :-1]],
        dim=1,
    )
    return chunked_completion_logprobs(
        hidden, lm_head_weight, completion_ids, chunk_size=chunk_size, temperature=temperature
    )
