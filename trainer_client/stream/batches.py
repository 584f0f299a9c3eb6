"""A training batch from the stream: the dataset over the feed, the collator that pads its
groups, and the log-probs of its completions under a model."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import IterableDataset

from trainer_client.loss.logprobs import chunked_completion_logprobs, token_logprobs
from trainer_client.stream.prompt_sharing import shared_prompt_logprobs, sharing_pays

if TYPE_CHECKING:  # the collator and the log-probs run with torch alone
    from rollout_api import rollout_pb2 as pb
    from trainer_client.stream.feed import GroupFeed


class StreamDataset(IterableDataset):
    """One item per sample, whole groups in order, fresh groups only."""

    def __init__(self, feed: GroupFeed) -> None:
        self.feed = feed

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while True:
            group = self.feed.next_fresh_group()
            for sample in group.samples:
                yield {"group": group, "sample": sample}


class GroupCollator:
    """Left-pads prompts so every completion starts at the same column; right-pads completions.

    Each distinct prompt is one row of ``prompt_ids`` (``prompt_index`` maps samples to rows),
    beside the plain per-sample layout. Position ids come from the attention mask, so left
    padding does not shift positions.
    """

    def __init__(self, pad_token_id: int) -> None:
        self.pad = pad_token_id

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        samples: list[pb.Sample] = [item["sample"] for item in items]
        rows: dict[tuple[int, ...], int] = {}
        # The group's prompt, or the sample's from a server that sends it per sample.
        prompts = [tuple(item["group"].prompt_token_ids or item["sample"].prompt_token_ids) for item in items]
        prompt_index = torch.tensor([rows.setdefault(prompt, len(rows)) for prompt in prompts])
        prompt_len = max(len(prompt) for prompt in rows)
        prompt_ids = torch.full((len(rows), prompt_len), self.pad, dtype=torch.long)
        prompt_attention = torch.zeros_like(prompt_ids)
        for row, prompt in enumerate(rows):
            prompt_ids[row, prompt_len - len(prompt) :] = torch.tensor(prompt)
            prompt_attention[row, prompt_len - len(prompt) :] = 1
        completion_len = max(len(s.completion_token_ids) for s in samples)
        batch = len(samples)
        completion_ids = torch.full((batch, completion_len), self.pad, dtype=torch.long)
        completion_attention = torch.zeros_like(completion_ids)
        completion_mask = torch.zeros((batch, completion_len), dtype=torch.float32)
        behaviour = torch.zeros((batch, completion_len), dtype=torch.float32)
        for i, s in enumerate(samples):
            n = len(s.completion_token_ids)
            completion_ids[i, :n] = torch.tensor(list(s.completion_token_ids))
            completion_attention[i, :n] = 1
            completion_mask[i, :n] = torch.tensor(list(s.completion_mask), dtype=torch.float32)
            behaviour[i, :n] = torch.tensor(list(s.completion_logprobs))
        attention = torch.cat([prompt_attention[prompt_index], completion_attention], dim=1)
        return {
            "input_ids": torch.cat([prompt_ids[prompt_index], completion_ids], dim=1),
            "attention_mask": attention,
            "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
            "prompt_length": prompt_len,
            "prompt_ids": prompt_ids,
            "prompt_attention": prompt_attention,
            "prompt_index": prompt_index,
            "completion_ids": completion_ids,
            "completion_attention": completion_attention,
            "completion_mask": completion_mask,
            "behaviour_logps": behaviour,
            "advantages": torch.tensor([s.advantage for s in samples], dtype=torch.float32),
            "rewards": [s.reward for s in samples],
            "staleness_versions": [item["group"].policy_version for item in items],
            "group_ids": [item["group"].group_id for item in items],
        }


def completion_logprobs(
    model: torch.nn.Module,
    inputs: dict[str, Any],
    lm_head_weight: torch.Tensor,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    share_prompts: bool = False,
) -> torch.Tensor:
    """log pi(token) of every completion position of a collated batch, [B, T].

    Through ``model``'s own forward, possibly wrapped, so DDP all-reduces the gradients; the final
    hidden state, not the full logits, is projected onto ``lm_head_weight`` in chunks.
    """
    if share_prompts and sharing_pays(inputs, inputs["prompt_ids"].device.type):
        return shared_prompt_logprobs(model, inputs, lm_head_weight, chunk_size, temperature)
    hidden = _forward(model, inputs, output_hidden_states=True, logits_to_keep=1).hidden_states[-1]
    start, length = _completion_span(inputs)
    return chunked_completion_logprobs(
        hidden[:, start : start + length],
        lm_head_weight,
        inputs["completion_ids"],
        chunk_size=chunk_size,
        temperature=temperature,
    )


def forward_completion_logprobs(
    model: torch.nn.Module, inputs: dict[str, Any], temperature: float = 1.0
) -> torch.Tensor:
    """``completion_logprobs`` with the logits made inside the forward: for a sharded model, whose
    lm_head weight is whole only there."""
    start, length = _completion_span(inputs)
    keep = torch.arange(start, start + length, device=inputs["input_ids"].device)
    return token_logprobs(_forward(model, inputs, logits_to_keep=keep).logits, inputs["completion_ids"], temperature)


def _forward(model: torch.nn.Module, inputs: dict[str, Any], **outputs: Any) -> Any:
    return model(
        input_ids=inputs["input_ids"],
        attention_mask=inputs["attention_mask"],
        position_ids=inputs["position_ids"],
        use_cache=False,
        **outputs,
    )


def _completion_span(inputs: dict[str, Any]) -> tuple[int, int]:
    """(first position whose output predicts a completion token, completion length)."""
    return inputs["prompt_length"] - 1, inputs["completion_ids"].shape[1]


def output_embedding_weight(model: torch.nn.Module) -> torch.Tensor:
    """The lm_head weight [V, H] of an unwrapped (possibly PEFT) causal LM."""
    head = model.get_output_embeddings()
    if hasattr(head, "base_layer"):
        raise ValueError("LoRA on the output embedding (lm_head) is not supported: leave it out of target_modules")
    return head.weight
