"""The trainer learns only from the model's own tokens of a multi-turn sample.

Tool results and chat-template tokens come with completion_mask 0 and behaviour logprob 0.
Through the trainer's own collator, chunked log-probs and loss on the tiny model: changing
what the service put at mask-0 positions (behaviour logprobs, or the ids of a trailing tool
result that conditions no model token) leaves the loss and every gradient unchanged, while
changing a model token's behaviour logprob, or a tool result the next turn reads, does not.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen2ForCausalLM

from rollout_api import rollout_pb2 as pb
from rollout_common.tiny_model import build_tiny_model
from trainer_client.loss.config import LossConfig
from trainer_client.loss.losses import compute_loss
from trainer_client.stream.batches import GroupCollator, completion_logprobs

pytestmark = pytest.mark.timeout(120)
PAD_ID = 0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen2")


@pytest.fixture(scope="module")
def model(model_dir: Path) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()


@pytest.fixture(scope="module")
def spans(model_dir: Path) -> dict[str, list[int]]:
    """A two-turn conversation's pieces as the service builds them: prompt, the model's tool
    call, the tool result (template tokens included), the model's answer, and one more tool
    result after it."""
    tok = AutoTokenizer.from_pretrained(model_dir)

    def ids(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    return {
        "prompt": list(
            tok.apply_chat_template(
                [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True, return_dict=False
            )
        ),
        "call": ids('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'),
        "result": ids("\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
        "answer": ids("The sum is 5.<|im_end|>"),
        "trailing": ids("\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n"),
    }


def make_samples(model: Qwen2ForCausalLM, spans: dict[str, list[int]]) -> list[pb.Sample]:
    """Two samples with different advantages; behaviour logprobs a little off the model's own
    (as vLLM's are), so IS ratios are near 1 and inside every cap; 0 on mask 0."""
    pieces = [("call", 1), ("result", 0), ("answer", 1), ("trailing", 0)]
    ids = [i for name, _ in pieces for i in spans[name]]
    mask = [m for name, m in pieces for _ in spans[name]]
    probe = pb.Sample(
        prompt_token_ids=spans["prompt"], completion_token_ids=ids, completion_mask=mask, completion_logprobs=mask
    )
    with torch.no_grad():
        logps = completion_logps(model, collate([probe]))[0].tolist()
    samples = []
    for advantage, shift in ((1.0, 0.02), (-0.5, -0.03)):
        behaviour = [(lp + shift * (k % 3 - 1)) * m for k, (lp, m) in enumerate(zip(logps, mask, strict=True))]
        samples.append(
            pb.Sample(
                prompt_token_ids=spans["prompt"],
                completion_token_ids=ids,
                completion_mask=mask,
                completion_logprobs=behaviour,
                advantage=advantage,
            )
        )
    return samples


def collate(samples: list[pb.Sample]) -> dict:
    group = pb.Group(policy_version=0, group_id="g")  # no prompt ids: the samples' (older servers) are used
    return GroupCollator(PAD_ID)([{"sample": s, "group": group} for s in samples])


def completion_logps(model: Qwen2ForCausalLM, inputs: dict) -> torch.Tensor:
    """As the trainer computes them (final hidden states, chunked log-probs)."""
    return completion_logprobs(model, inputs, model.get_output_embeddings().weight, chunk_size=16)


def loss_and_grads(
    model: Qwen2ForCausalLM, samples: list[pb.Sample], config: LossConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The trainer's path: GroupCollator -> forward for the final hidden states -> chunked
    log-probs of the completion -> compute_loss -> backward."""
    inputs = collate(samples)
    model.zero_grad(set_to_none=True)
    logps = completion_logps(model, inputs)
    output = compute_loss(
        logps, None, inputs["behaviour_logps"], inputs["advantages"], inputs["completion_mask"], config
    )
    output.loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return output.loss.detach(), grads


def assert_same(a: tuple[torch.Tensor, dict[str, torch.Tensor]], b: tuple[torch.Tensor, dict[str, torch.Tensor]]):
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=1e-7)
    assert a[1].keys() == b[1].keys() and a[1]
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], rtol=0, atol=1e-7, msg=name)


def differs(a: tuple[torch.Tensor, dict[str, torch.Tensor]], b: tuple[torch.Tensor, dict[str, torch.Tensor]]) -> bool:
    return not torch.allclose(a[0], b[0], rtol=0, atol=1e-6) or any(
        not torch.allclose(a[1][n], b[1][n], rtol=0, atol=1e-6) for n in a[1]
    )


CONFIGS = {
    "grpo-token_truncate": LossConfig(loss_type="grpo", vllm_importance_sampling_mode="token_truncate"),
    "dapo-sequence_mask": LossConfig(loss_type="dapo", vllm_importance_sampling_mode="sequence_mask"),
    "dr_grpo-token_mask": LossConfig(
        loss_type="dr_grpo", vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_min=0.01
    ),
    "grpo-sequence_level": LossConfig(loss_type="grpo", importance_sampling_level="sequence"),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_mask0_tokens_do_not_change_loss_or_gradients(model, spans, name: str) -> None:
    config = CONFIGS[name]
    samples = make_samples(model, spans)
    base = loss_and_grads(model, samples, config)
    assert base[0].abs() > 0 and any(g.abs().sum() > 0 for g in base[1].values())

    # 1. Behaviour logprobs (values) at mask-0 positions: anything, even -inf, changes nothing.
    changed = [pb.Sample() for _ in samples]
    for new, old in zip(changed, samples, strict=True):
        new.CopyFrom(old)
        for k, m in enumerate(old.completion_mask):
            if m == 0:
                new.completion_logprobs[k] = -7.5 if k % 2 else float("-inf")
    assert_same(base, loss_and_grads(model, changed, config))

    # 2. The ids of the trailing tool result (after the last model token: it conditions none).
    start = len(spans["call"]) + len(spans["result"]) + len(spans["answer"])
    changed = [pb.Sample() for _ in samples]
    for new, old in zip(changed, samples, strict=True):
        new.CopyFrom(old)
        for k in range(start, len(old.completion_token_ids)):
            new.completion_token_ids[k] = (old.completion_token_ids[k] * 7 + 11) % 1000
    assert_same(base, loss_and_grads(model, changed, config))

    # The same test notices real changes: a model token's behaviour logprob ...
    changed = [pb.Sample() for _ in samples]
    for new, old in zip(changed, samples, strict=True):
        new.CopyFrom(old)
        new.completion_logprobs[0] = old.completion_logprobs[0] - 0.5
    assert differs(base, loss_and_grads(model, changed, config))
    # ... and a tool result that the model's next turn reads (its tokens are context).
    changed = [pb.Sample() for _ in samples]
    for new, old in zip(changed, samples, strict=True):
        new.CopyFrom(old)
        k = len(spans["call"]) + 5
        new.completion_token_ids[k] = (old.completion_token_ids[k] + 1) % 1000
    assert differs(base, loss_and_grads(model, changed, config))
