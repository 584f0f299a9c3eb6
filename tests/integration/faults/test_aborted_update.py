"""A weight update begun for a trainer that is not listening, then aborted at once: vLLM's
engine cannot be released from its join, but the join gives up within
``weight_sync.join_timeout_s``, the server is held out of routing meanwhile with the reason
in GetStats, health says NOT_SERVING while no server can generate, and another run
generates again once it is free, well within the transfer timeout."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path

import pytest
import torch
from transformers import Qwen2ForCausalLM

from tests.integration.conftest import service_settings, service_with_client
from tests.support import wait_until
from trainer_client.client import RolloutClient, dataset_run_spec, health_status
from trainer_client.weight_push import tensor_meta
from trainer_client.weights import free_port

pytestmark = pytest.mark.integration

JOIN_TIMEOUT_S = 4.0
TRANSFER_TIMEOUT_S = 120.0
FREED_WITHIN_S = 30.0
"""Well below the transfer timeout, which bounded the stall before the join had its own."""

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


@pytest.mark.timeout(240)
async def test_an_update_aborted_mid_join_stalls_generation_for_the_join_timeout_at_most(
    vllm_server, tiny_model: Path
) -> None:
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
    base = Qwen2ForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    async with service_with_client(settings) as (running, client):
        pushing = (await client.create_run(spec)).run_id
        other = (await client.create_run(spec)).run_id
        acking = asyncio.ensure_future(ack_everything(client, other))
        try:
            await wait_until(lambda: tokens_of(client, other), 60, "the other run to generate")
            nobody = free_port()  # the trainer address where nothing listens
            ticket = await client.begin_weight_update(
                pushing, "127.0.0.1", nobody, tensor_meta(list(base.named_parameters()))
            )
            aborted_at = time.monotonic()
            await asyncio.wait_for(client.abort_weight_update(ticket.update_id, "the trainer went away"), 5)

            async def health_is(status: str) -> bool:
                return await health_status(running.grpc_target, timeout_s=5) == status

            # While vLLM's engine sits in the join, nothing can generate, and health says so.
            await wait_until(lambda: health_is("NOT_SERVING"), 3, "health to say no server can generate")
            (engine,) = (await client.stats()).engines
            assert not engine.routable and "join of aborted weight update" in engine.held_reason

            # vLLM gives the join up at its deadline (plus the store client's last backoff, seconds
            # on a loaded host), and the leave queued behind it answers: the server takes
            # requests again, and health says so. Without the deadline the join would hold it
            # for the transfer timeout.
            pool = running.service.scheduler.engine

            def state() -> str:
                failures = [client.consecutive_failures for client in pool.clients]
                return f"the server to be free (usable {pool.usable}, failures {failures}, stuck {pool.stuck})"

            await wait_until(lambda: not pool.stuck, FREED_WITHIN_S, state)
            logger.info("the server was free %.1fs after the abort", time.monotonic() - aborted_at)
            await wait_until(lambda: health_is("SERVING"), 5, state)
            assert (await client.stats()).engines[0].routable
            before = await tokens_of(client, other)

            async def generating_again() -> bool:
                return await tokens_of(client, other) > before

            await wait_until(generating_again, 30, "the other run to generate again")
        finally:
            acking.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await acking
