"""An FSDP trainer (two ranks under torchrun, FSDP2 on gloo/CPU): each rank holds half of
every weight, every push gathers them, and vLLM then serves exactly the gathered weights."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen2ForCausalLM

from rollout_api.client import RolloutClient
from rollout_common.tiny_model import tiny_model_flags
from rollout_service.engine.managed import ManagedVLLMServer
from tests.integration.conftest import restore_base_weights, serving
from tests.integration.test_weight_sync import vllm_matches
from tests.support import run_to_end, wait_until

pytestmark = pytest.mark.integration
STEPS = 3
FSDP_CONFIG = """\
fsdp: true
fsdp_config:
  version: 2
  transformer_layer_cls_to_wrap: [Qwen2DecoderLayer]
  reshard_after_forward: true
"""


async def test_fsdp_ranks_train_shards_and_push_the_gathered_weights(
    service_process: str, vllm_server: ManagedVLLMServer, tiny_model: Path, tmp_path: Path
) -> None:
    await wait_until(lambda: serving(service_process), 60, "the service process to serve")
    out = tmp_path / "train"
    config = tmp_path / "fsdp.yaml"
    config.write_text(FSDP_CONFIG)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "trainer_client.cli"]
    command += ["--config", str(config), "--target", service_process, "--model", str(tiny_model)]
    command += tiny_model_flags(
        max_steps=STEPS, num_generations=4, per_device_train_batch_size=4, max_completion_length=16
    )
    command += ["--max-buffered-groups", "4", "--output-dir", str(out), "--save-model"]
    returncode, output = await run_to_end(command, 300)
    assert returncode == 0, output[-3000:]

    summary = json.loads((out / "summary.json").read_text())
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    ids = [rank["trained_group_ids"] for rank in ranks]
    assert [rank["sharded"] for rank in ranks] == [True, True]  # FSDP, not DDP: each rank held shards
    assert [len(i) for i in ids] == [STEPS, STEPS] and not set(ids[0]) & set(ids[1])
    # The whole weights, gathered on each rank, agree: the shards trained as one model.
    assert ranks[0]["weights_fingerprint"] == pytest.approx(ranks[1]["weights_fingerprint"], rel=1e-12)

    # vLLM serves the weights the last push gathered, which are the saved ones, and they
    # are not the base model's: training moved them.
    trained = Qwen2ForCausalLM.from_pretrained(out / "model", dtype=torch.float32).eval()
    base = Qwen2ForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    assert await vllm_matches(vllm_server.url, trained) <= 1e-4
    assert await vllm_matches(vllm_server.url, base) > 1e-3

    async with RolloutClient(service_process) as client:
        run = await client.get_run(summary["run_id"])
        assert run.policy_version == STEPS + 1  # rank 0 pushed before training and after every step
        assert run.stats.groups_trained == 2 * STEPS
        await restore_base_weights(client, summary["run_id"], tiny_model)
