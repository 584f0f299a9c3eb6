"""One episode (one group member). Single-turn for now: one completion of the prompt.

The episode records the run's policy version when its first and its last token were
generated, so the trainer can judge staleness of long episodes by their oldest token.
"""

from __future__ import annotations

from collections.abc import Callable

from rollout_service.engine.protocol import Engine
from rollout_service.types import EpisodeResult, PromptItem, SamplingParams


async def run_single_turn(
    engine: Engine,
    prompt: PromptItem,
    params: SamplingParams,
    policy_version: Callable[[], int],
    decode: Callable[[list[int]], str],
    affinity: str | None = None,
) -> EpisodeResult:
    version_first = policy_version()
    completion = await engine.generate(prompt.token_ids, params, affinity=affinity)
    return EpisodeResult(
        completion_ids=completion.token_ids,
        logprobs=completion.logprobs,
        mask=[1] * len(completion.token_ids),
        finish_reason=completion.finish_reason,
        # Decoded here from the ids, not vLLM's incremental text (which holds back a partial
        # UTF-8 tail), so rewards see exactly what the ids say.
        text=decode(completion.token_ids),
        policy_version_first=version_first,
        policy_version_last=policy_version(),
    )
