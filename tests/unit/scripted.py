"""A scripted engine and tokenizer for scheduler unit tests (never the proof a feature works:
integration tests run real vLLM)."""

from __future__ import annotations

import asyncio

from rollout_service.config import SchedulerSettings
from rollout_service.errors import EngineError, RequestRejected
from rollout_service.generation.prompts import PromptRenderer
from rollout_service.metrics import ServiceMetrics
from rollout_service.scoring.rewards import RewardRegistry
from rollout_service.service import RolloutService, ServiceInfo
from rollout_service.types import Completion, SamplingParams

FAIL_TOKEN = 999
ABORT_TOKEN = 998
"""Prompts containing it finish as vLLM reports a request aborted by a pause (mode abort)."""
REFUSE_TOKEN = 997
"""Prompts containing it are refused as vLLM refuses a bad request (HTTP 400)."""


class ScriptedTokenizer:
    def __len__(self) -> int:
        return 1000

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(str(i) for i in ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [int(t) for t in text.split()]


class ScriptedEngine:
    """Records concurrency; with ``hold`` every request waits until the test releases it.
    Prompts containing FAIL_TOKEN fail with EngineError, those containing REFUSE_TOKEN with RequestRejected."""

    def __init__(self, hold: bool = False) -> None:
        self.hold = hold
        self.active = 0
        self.max_active = 0
        self.calls = 0
        self.group_calls = 0
        self.pending: list[tuple[str | None, asyncio.Future[None]]] = []
        self.changed = asyncio.Event()

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *, affinity: str | None = None):
        self.calls += 1
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        self.changed.set()
        try:
            if self.hold:
                gate = asyncio.get_running_loop().create_future()
                self.pending.append((affinity, gate))
                await gate
            else:
                await asyncio.sleep(0)
            if FAIL_TOKEN in prompt_ids:
                raise EngineError("scripted", "scripted failure")
            if REFUSE_TOKEN in prompt_ids:
                raise RequestRejected("scripted", "vLLM refused the request: HTTP 400: scripted refusal")
            n = params.max_tokens
            return Completion([7] * n, [-0.5] * n, "abort" if ABORT_TOKEN in prompt_ids else "length", "scripted")
        finally:
            self.active -= 1
            self.changed.set()

    def release(self, affinity: str | None = None, count: int | None = None) -> int:
        """Let held requests finish (those of one group if ``affinity`` is given)."""
        released = 0
        for key, gate in list(self.pending):
            if (affinity is None or key == affinity) and (count is None or released < count):
                self.pending.remove((key, gate))
                gate.set_result(None)
                released += 1
        return released

    async def wait_for(self, predicate, timeout_s: float = 5.0) -> None:
        async def loop() -> None:
            while not predicate():
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(loop(), timeout_s)


class ScriptedGroupEngine(ScriptedEngine):
    """Also samples a whole group in one request (``GroupEngine``), as the vLLM pool does;
    one held request stands for the group's, so ``active`` counts requests."""

    async def generate_many(
        self, prompt_ids: list[int], params: SamplingParams, n: int, *, affinity: str | None = None
    ) -> list[Completion]:
        self.group_calls += 1
        return [await self.generate(prompt_ids, params, affinity=affinity)] * n


def make_service(
    engine: ScriptedEngine,
    max_inflight: int = 4,
    max_buffered: int = 64,
    rewards=None,
    *,
    store=None,
    runs=None,
    versions=None,
    holds=None,
    weights=None,
    membership=None,
    engine_urls=None,
    **settings,
):
    """A service on ``engine``; ``weights`` (over ``runs``) and ``membership`` as the app builds them, if given."""
    registry = RewardRegistry()
    for name, fn in (rewards or {}).items():
        registry.register(name, fn)
    return RolloutService(
        engine=engine,
        renderer=PromptRenderer(ScriptedTokenizer(), max_model_len=4096),
        rewards=registry,
        metrics=ServiceMetrics(),
        settings=SchedulerSettings(max_inflight=max_inflight, default_max_buffered_groups=max_buffered, **settings),
        info=ServiceInfo(
            model="scripted", engine_urls=engine_urls if engine_urls is not None else [], max_inflight=max_inflight
        ),
        store=store,
        runs=runs,
        versions=versions,
        holds=holds,
        weights=weights,
        membership=membership,
    )
