"""The trainer's side of the three-namespace push test, run inside the trainer's namespace:
create a run, push known weights (the base model perturbed with ``--seed``) from the address
``--trainer-address auto`` would advertise, print the new version and that address as JSON."""

from __future__ import annotations

import argparse
import asyncio
import json

import torch
from transformers import Qwen2ForCausalLM

from rollout_api.client import RolloutClient, dataset_run_spec
from tests.integration.test_weight_sync import perturbed
from trainer_client.advertised_address import advertised_address
from trainer_client.weights.push import WeightPusher


async def main(target: str, model_dir: str, seed: int) -> dict[str, object]:
    address = advertised_address("auto", target)
    model = perturbed(Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), seed)
    async with RolloutClient(target, timeout_s=30) as client:
        run = await client.create_run(dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=2, max_tokens=8))
        # Another namespace stands for another host: every byte over the network, not shared memory.
        pusher = WeightPusher(client, run.run_id, trainer_address=address, transfer_timeout_s=60, shared_memory=False)
        try:
            version = await asyncio.wait_for(pusher.push(list(model.named_parameters())), 120)
        finally:
            pusher.close()
    return {"policy_version": version, "trainer_address": address}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main(args.target, args.model, args.seed))))
