"""Stream a prompt set too large for one CreateRun message into a run through SubmitPrompts.

About ``ahead`` prompts are kept queued (judged by the run's ``groups_started``), and the set is
cycled like a prompt list in the spec: the trainer decides when training ends.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Iterable, Iterator

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


def batches(prompts: Iterable[pb.Prompt], size: int) -> Iterator[list[pb.Prompt]]:
    iterator = iter(prompts)
    while batch := list(itertools.islice(iterator, size)):
        yield batch


async def feed_prompts(
    client: RolloutClient, run_id: str, prompts: Iterable[pb.Prompt], ahead: int = AHEAD, batch_size: int = SUBMIT_BATCH
) -> None:
    """Submit ``prompts`` (re-iterable) to ``run_id`` for ever, ``ahead`` of the run's consumption."""
    submitted = 0
    for epoch in itertools.count(1):
        for batch in batches(prompts, batch_size):
            await _wait_for_room(client, run_id, submitted, ahead - len(batch))
            submitted += (await client.submit_prompts(run_id, batch)).accepted
        logger.info("all prompts of run %s submitted (pass %d); going round again", run_id, epoch)


async def _wait_for_room(client: RolloutClient, run_id: str, submitted: int, most_queued: int) -> None:
    """Until at most ``most_queued`` of the ``submitted`` prompts wait in the run's queue."""
    while True:
        queued = submitted - (await client.get_run(run_id)).stats.groups_started
        if queued <= most_queued:
            return
        await asyncio.sleep(POLL_S)  # poll interval: the service has no event for a drained queue
