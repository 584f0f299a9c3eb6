"""A weight update aborted before or during vLLM's join.

- Before the trainer listens, no join reaches vLLM: the abort leaves nothing running there.
- A trainer that listens and gives the join up (the push ends with the abort) releases
  vLLM's workers at once.
- A trainer that listens but never joins nor gives up (hung): vLLM's engine cannot be
  released, but the join gives up within ``weight_sync.join_timeout_s``; the server is held
  out of routing meanwhile with the reason in GetStats, health says NOT_SERVING while no
  server can generate, and another run generates again once it is free.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from transformers import Qwen2ForCausalLM

from rollout_api import rollout_pb2 as pb
from rollout_api.client import RolloutClient, dataset_run_spec, health_status
from rollout_common.ports import free_port
from rollout_service.app import RunningService
from rollout_service.engine.managed import ManagedVLLMServer
from tests.integration.conftest import service_settings, service_with_client
from tests.support import wait_until
from trainer_client.weights.gloo import GlooWeightSender
from trainer_client.weights.push import tensor_meta
from vllm_gloo_transfer.groups import ARRIVED_KEY

pytestmark = pytest.mark.integration

JOIN_TIMEOUT_S = 8.0
TRANSFER_TIMEOUT_S = 120.0
RELEASED_WITHIN_S = 4.0
"""Half the join timeout: a release that waited for the join's deadline cannot pass."""

logger = logging.getLogger(__name__)


async def tokens_of(client: RolloutClient, run_id: str) -> int:
    return (await client.get_run(run_id)).stats.tokens_generated


async def ack_everything(client: RolloutClient, run_id: str) -> None:
    """A consumer that trains nothing and acks all: the run's buffer never fills."""
    stream = client.stream(run_id, "acker", credits=8)
    try:
        async for group in stream:
            stream.ack([group.group_id])
    finally:
        stream.cancel()


@contextlib.asynccontextmanager
async def two_runs(
    vllm_server: ManagedVLLMServer, tiny_model: Path
) -> AsyncIterator[tuple[RunningService, RolloutClient, str, str]]:
    """A service with a run that pushes and another that generates (acked as it streams)."""
    settings = service_settings(
        [vllm_server.url],
        tiny_model,
        scheduler={"max_inflight": 4},
        weight_sync={
            "join_timeout_s": JOIN_TIMEOUT_S,
            "transfer_timeout_s": TRANSFER_TIMEOUT_S,
            "control_timeout_s": 10,
        },
    )
    spec = dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=2, max_tokens=8)
    async with service_with_client(settings) as (running, client):
        pushing = (await client.create_run(spec)).run_id
        other = (await client.create_run(spec)).run_id
        acking = asyncio.ensure_future(ack_everything(client, other))
        try:
            await wait_until(lambda: tokens_of(client, other), 60, "the other run to generate")
            yield running, client, pushing, other
        finally:
            acking.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await acking


def tensors(tiny_model: Path) -> list[pb.TensorMeta]:
    return tensor_meta(list(Qwen2ForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).named_parameters()))


async def generates_again(client: RolloutClient, run_id: str) -> None:
    before = await tokens_of(client, run_id)

    async def more() -> bool:
        return await tokens_of(client, run_id) > before

    await wait_until(more, 30, "the other run to generate again")


async def health_is(target: str, status: str) -> bool:
    return await health_status(target, timeout_s=5) == status


@pytest.mark.timeout(240)
async def test_an_update_aborted_before_the_trainer_listens_never_reaches_vllm(
    vllm_server: ManagedVLLMServer, tiny_model: Path
) -> None:
    """Before, vLLM sat in the join until its deadline, generating nothing."""
    async with two_runs(vllm_server, tiny_model) as (running, client, pushing, other):
        nobody = free_port()
        ticket = await client.begin_weight_update(pushing, "127.0.0.1", nobody, tensors(tiny_model))
        await asyncio.wait_for(client.abort_weight_update(ticket.update_id, "the trainer went away"), 5)
        (engine,) = (await client.stats()).engines
        assert engine.routable and not engine.held_reason
        assert await health_is(running.grpc_target, "SERVING")
        await generates_again(client, other)


@pytest.mark.parametrize("trainer", ["gives the join up", "hangs"])
@pytest.mark.timeout(240)
async def test_an_update_aborted_mid_join_frees_the_pool(
    vllm_server: ManagedVLLMServer, tiny_model: Path, trainer: str
) -> None:
    async with two_runs(vllm_server, tiny_model) as (running, client, pushing, other):
        target = running.grpc_target
        pool = running.service.scheduler.engine
        port = free_port()
        sender = GlooWeightSender("127.0.0.1", port, world_size=2, timeout_s=TRANSFER_TIMEOUT_S)
        sender.host()  # listening, but it never joins
        try:
            ticket = await client.begin_weight_update(pushing, "127.0.0.1", port, tensors(tiny_model))
            join = sender._join_store(ticket.group_epoch)
            await wait_until(lambda: join.add(ARRIVED_KEY, 0) == 1, 30, "vLLM's worker to reach the rendezvous")
            await asyncio.wait_for(client.abort_weight_update(ticket.update_id, "the trainer failed"), 5)
            aborted_at = time.monotonic()
            (engine,) = (await client.stats()).engines
            assert not engine.routable and "join of aborted weight update" in engine.held_reason
            if trainer == "gives the join up":  # as its push does once the commit says aborted
                sender.abandon(ticket.group_epoch, "the weight update was aborted")
            else:  # nothing can generate until the join's deadline, and health says so
                await wait_until(lambda: health_is(target, "NOT_SERVING"), 3, "health to say no server can generate")

            def state() -> str:
                failures = [client.consecutive_failures for client in pool.clients]
                return f"the server to be free (usable {pool.usable}, failures {failures}, stuck {pool.stuck})"

            await wait_until(lambda: not pool.stuck, RELEASED_WITHIN_S + 2 * JOIN_TIMEOUT_S, state)
            freed_s = time.monotonic() - aborted_at
            logger.info("the server was free %.1fs after the abort (the trainer %s)", freed_s, trainer)
            if trainer == "gives the join up":
                assert freed_s < RELEASED_WITHIN_S
            else:
                assert freed_s > RELEASED_WITHIN_S  # held until the join's deadline: vLLM cannot cancel it
            await wait_until(lambda: health_is(target, "SERVING"), 5, state)
            assert (await client.stats()).engines[0].routable
            await generates_again(client, other)
        finally:
            sender.close()
