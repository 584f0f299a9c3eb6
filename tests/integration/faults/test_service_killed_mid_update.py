"""The service is SIGKILLed in the middle of a weight update and started again against the
same vLLM server: the update that never committed leaves no trace (vLLM serves the old
weights, and is not left paused), and a new trainer trains through the new service with
no group lost or trained twice. A trainer whose broadcast waits on the dead service's
group is freed when the new service starts, not minutes later at gloo's timeout."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import Qwen2ForCausalLM

from rollout_api import rollout_pb2 as pb
from rollout_api.client import RolloutClient, dataset_run_spec
from rollout_common.ports import free_port
from rollout_service.app import running_service
from rollout_service.engine.control import VLLMControlClient, WeightSyncError
from rollout_service.weights.update_messages import init_info
from tests.integration.conftest import restore_base_weights, service_settings, serving
from tests.integration.test_shared_capacity import groups_per_step, kill_if_running, start, trainer_command
from tests.integration.test_weight_sync import perturbed, vllm_matches
from tests.support import wait_until
from trainer_client.weights.gloo import GlooWeightSender
from trainer_client.weights.push import WeightPusher, tensor_meta

pytestmark = pytest.mark.integration

STEPS, GROUPS_PER_STEP = 4, 2


@contextlib.contextmanager
def service_process(
    vllm_url: str, tiny_model: Path, log: Path, port: int | None = None, *options: str
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``rollout-service serve [options]`` on the session's vLLM server, killed at the end if still alive."""
    port = port or free_port()
    env = dict(
        os.environ,
        ROLLOUT_ENGINE__TOKENIZER=str(tiny_model),
        ROLLOUT_ENGINE__MODEL="tiny",
        ROLLOUT_ADAPTERS__DIR=str(log.parent / "adapters"),
        ROLLOUT_WEIGHT_SYNC__TRANSFER_TIMEOUT_S="8",  # vLLM's side of a broken transfer gives up soon
    )
    command = [sys.executable, "-m", "rollout_service.edge.cli", "serve", "--vllm-url", vllm_url]
    command += ["--port", str(port), "--metrics-port", "0", *options]
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        yield f"127.0.0.1:{port}", process
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


@pytest.mark.timeout(600)
async def test_a_service_killed_mid_update_restarts_against_the_same_vllm(
    vllm_server, tiny_model: Path, tmp_path: Path
) -> None:
    base_model = Qwen2ForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with service_process(vllm_server.url, tiny_model, tmp_path / "first.log") as (target, process):
        await wait_until(lambda: serving(target), 60, "the first service to serve")
        async with RolloutClient(target) as client:
            run = await client.create_run(dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=2))
            pusher = WeightPusher(client, run.run_id, transfer_timeout_s=8)
            try:
                assert await asyncio.wait_for(pusher.push(list(base_model.named_parameters())), 60) == 1
                named = list(perturbed(base_model).named_parameters())
                await client.begin_weight_update(
                    run.run_id, pusher.address, pusher.port, tensor_meta(named), pb.PAUSE_MODE_KEEP
                )
                # vLLM is paused and waits for the broadcast: the service dies now.
                os.killpg(process.pid, signal.SIGKILL)
                await asyncio.to_thread(process.wait, 30)
            finally:
                pusher.close()  # the trainer of the dead service goes too

    with service_process(vllm_server.url, tiny_model, tmp_path / "second.log") as (target, _process):
        await wait_until(lambda: serving(target), 60, "the second service to serve")
        assert await vllm_matches(vllm_server.url, base_model) <= 1e-4  # resumed, on the old weights
        out = tmp_path / "trainer"
        options = (*groups_per_step(GROUPS_PER_STEP), "--max-steps", str(STEPS))
        trainer = await start(trainer_command(target, tiny_model, out, *options), tmp_path / "trainer.log")
        try:
            await asyncio.wait_for(trainer.wait(), 300)
        finally:
            kill_if_running(trainer)
        assert trainer.returncode == 0, (tmp_path / "trainer.log").read_text()[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        trained = json.loads((out / "rank0.json").read_text())["trained_group_ids"]
        assert len(trained) == len(set(trained)) == STEPS * GROUPS_PER_STEP
        async with RolloutClient(target) as client:
            stats = (await client.get_run(summary["run_id"])).stats
            assert stats.groups_trained == len(trained) and stats.groups_leased == 0
            assert stats.groups_scored == stats.groups_trained + stats.groups_dropped_stale + stats.groups_buffered
            await restore_base_weights(client, summary["run_id"], tiny_model)


@pytest.mark.timeout(300)
async def test_a_new_service_frees_a_broadcast_waiting_on_the_group_a_dead_one_left(
    vllm_server, tiny_model: Path
) -> None:
    """What a service killed between its begin and vLLM's receive leaves: vLLM's workers in
    the trainer's group, an update started, and the trainer broadcasting to workers that
    will never receive (gloo would hold it for the group's 120 s). Here the test plays the
    dead service; a real one then starts on the same vLLM server."""
    base_model = Qwen2ForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    control = VLLMControlClient(vllm_server.url)
    await control.start()
    try:
        world = 1 + await control.world_size(30)
        sender = GlooWeightSender("127.0.0.1", free_port(), world, timeout_s=120)
        info = init_info("gloo", "127.0.0.1", sender.master_port, 1, world, 120, epoch=1, join_timeout_s=30)
        await asyncio.gather(control.init_weight_transfer(info, 60), asyncio.to_thread(sender.connect, 1, world))
        try:
            await control.start_weight_update(30)
        except WeightSyncError as exc:  # the killed service of the test before left one open
            assert "already active" in str(exc), exc
            await control.finish_weight_update("0", 30)
            await control.start_weight_update(30)
    finally:
        await control.close()
    named = list(perturbed(base_model).named_parameters())
    broadcast = asyncio.ensure_future(asyncio.to_thread(sender.broadcast, named))
    try:
        done, _ = await asyncio.wait({broadcast}, timeout=1)
        assert not done, "the broadcast should wait: no worker receives it"
        async with running_service(service_settings([vllm_server.url], tiny_model)) as service:
            with pytest.raises(RuntimeError, match="Connection closed"):
                await asyncio.wait_for(broadcast, 30)  # freed at the service's start
            async with RolloutClient(service.grpc_target, timeout_s=30) as client:
                run = await client.create_run(dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=2))
                await restore_base_weights(client, run.run_id, tiny_model)  # its first push joins afresh
                assert (await client.get_run(run.run_id)).policy_version == 1
        assert await vllm_matches(vllm_server.url, base_model) <= 1e-4  # the unreceived weights were never applied
    finally:
        sender.close()
