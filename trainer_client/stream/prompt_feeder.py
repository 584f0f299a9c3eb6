"""Stream a prompt set too large for one CreateRun message into a run through SubmitPrompts.

About ``ahead`` prompts are kept queued (judged by the run's ``groups_started``), and the set is
cycled like a prompt list in the spec: the trainer decides when training ends.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Iterable

from rollout_api import rollout_pb2 as pb
from rollout_api.client import RolloutClient

logger = logging.getLogger(__name__)

INLINE_MAX_PROMPTS = 10_000
INLINE_MAX_BYTES = 16 << 20
"""Up to these, the prompts go into the run's spec (one CreateRun message)."""
SUBMIT_BATCH = 256
"""Prompts per SubmitPrompts call (the service renders them as one batch)."""
AHEAD = 1024
"""Prompts kept queued in the run: enough for every slot and several steps."""
POLL_S = 0.5


def fits_inline(count: int, size_bytes: int) -> bool:
    return count <= INLINE_MAX_PROMPTS and size_bytes <= INLINE_MAX_BYTES


async def feed_prompts(
    client: RolloutClient, run_id: str, prompts: Iterable[pb.Prompt], ahead: int = AHEAD, batch_size: int = SUBMIT_BATCH
) -> None:
    """Submit ``prompts`` (re-iterable) to ``run_id`` for ever, ``ahead`` of the run's consumption."""
    submitted = 0
    for epoch in itertools.count(1):
        iterator = iter(prompts)
        while batch := list(itertools.islice(iterator, batch_size)):
            while True:  # until at most ``ahead - len(batch)`` of the submitted prompts wait in the run's queue
                if submitted - (await client.get_run(run_id)).stats.groups_started <= ahead - len(batch):
                    break
                await asyncio.sleep(POLL_S)  # poll interval: the service has no event for a drained queue
            submitted += (await client.submit_prompts(run_id, batch)).accepted
        logger.info("all prompts of run %s submitted (pass %d); going round again", run_id, epoch)
