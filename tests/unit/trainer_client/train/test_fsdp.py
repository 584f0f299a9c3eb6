"""FSDP2 on gloo/CPU with two real processes: the push gathers every rank's shards into the
whole weights, on rank 0 only, in the order an unsharded model pushes them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from peft import LoraConfig, get_peft_model
from torch.distributed.fsdp import fully_shard
from transformers import Qwen2Config, Qwen2ForCausalLM

from trainer_client.train import fsdp
from trainer_client.weights.policy_weights import policy_weights

WORLD = 2


def tiny(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    return Qwen2ForCausalLM(config)


def _gather_on_rank(rank: int, store_path: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD)
    try:
        model = tiny()
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        gathered = fsdp.gathered_weights(model)
        report = {"sharded": fsdp.is_sharded(model), "names": [name for name, _ in gathered]}
        if rank == 0:
            torch.save({"report": report, "weights": dict(gathered)}, out)
        else:
            assert gathered == [], "only rank 0 receives the whole weights"
        # Neither rank tears the group down while the other may still be in a collective: a
        # gloo group destroyed under a pending operation aborted a rank (std::terminate).
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Done and reported: skip the interpreter's teardown, where a gloo thread still joinable
    # at exit aborted a rank now and then ("terminate called without an active exception").
    os._exit(0)


def test_the_gathered_weights_are_the_whole_model_on_rank_0(tmp_path: Path) -> None:
    out = tmp_path / "rank0.pt"
    mp.spawn(_gather_on_rank, args=(str(tmp_path / "store"), str(out)), nprocs=WORLD, join=True)
    saved = torch.load(out)
    expected = policy_weights(tiny())  # the same seed, never sharded
    assert saved["report"]["sharded"]
    assert saved["report"]["names"] == [name for name, _ in expected]  # no tied lm_head, same order
    for name, tensor in expected:
        assert torch.equal(saved["weights"][name], tensor), name


def test_fsdp_with_a_lora_adapter_is_refused_up_front() -> None:
    model = get_peft_model(tiny(), LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="LoRA"):
        fsdp.check_supported(model)
    fsdp.check_supported(tiny())  # a plain model is fine
