"""What a run generates from, resolved from its spec: its multi-turn episode config (tools and
environment looked up in the registries) and its prompt source, with prompts rendered to
token ids off the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any, TypeVar, cast

from rollout_service.config import SchedulerSettings
from rollout_service.errors import FailedPrecondition, InvalidArgument
from rollout_service.generation.environments import EnvironmentRegistry
from rollout_service.generation.episode import DEFAULT_MAX_TURNS, MultiTurnConfig, TurnTemplate
from rollout_service.generation.external import ExternalSource
from rollout_service.generation.prompts import (
    SUBMIT_CHUNK,
    CyclingPromptSource,
    OncePromptSource,
    PromptRenderer,
    PromptSource,
    PromptSpec,
    RenderedPrompt,
    SubmittedPromptSource,
    builtin_dataset,
)
from rollout_service.generation.tools import DEFAULT_TOOL_PARSER, DEFAULT_TOOL_TIMEOUT_S, ToolRegistry
from rollout_service.runs import RunSpec

T = TypeVar("T")


class RunInputs:
    def __init__(
        self,
        renderer: PromptRenderer,
        tools: ToolRegistry,
        environments: EnvironmentRegistry,
        settings: SchedulerSettings,
        executor: Executor,
    ) -> None:
        """``executor``: user code's own threads, which sync environments run in."""
        self.renderer = renderer
        self.tools = tools
        self.environments = environments
        self.settings = settings
        self.executor = executor

    def episode_config(self, spec: RunSpec) -> MultiTurnConfig | None:
        """Resolve a multi-turn spec against the registries; unknown names are INVALID_ARGUMENT."""
        e = spec.episode
        if not e.multi_turn:
            return None
        timeout_s = e.tool_timeout_s or DEFAULT_TOOL_TIMEOUT_S
        toolset = self.tools.toolset(e.tools, e.tool_parser or DEFAULT_TOOL_PARSER, timeout_s) if e.tools else None
        environment = self.environments.get(e.environment) if e.environment else None
        try:
            template = TurnTemplate(self.renderer.tokenizer, toolset.schemas() if toolset is not None else None)
        except Exception as exc:
            raise FailedPrecondition(
                f"multi-turn episodes need a chat template that can be extended turn by turn: {exc}"
            ) from None
        return MultiTurnConfig(
            template=template,
            max_model_len=self.renderer.max_model_len,
            max_turns=e.max_turns or (DEFAULT_MAX_TURNS if toolset is not None or environment is not None else 1),
            max_episode_tokens=e.max_episode_tokens,
            tools=toolset,
            environment=environment,
            environment_timeout_s=self.settings.environment_timeout_s,
            environment_executor=self.executor,
        )

    async def prompt_source(self, spec: RunSpec, tools: list[dict[str, Any]] | None = None) -> PromptSource:
        if spec.source_kind == "submitted":
            return SubmittedPromptSource(self.settings.max_queued_prompt_bytes)
        if spec.source_kind == "external":
            return ExternalSource()
        prompts = builtin_dataset(spec.dataset) if spec.source_kind == "dataset" else list(spec.prompts)
        rendered = await self.render(prompts, spec.sampling.max_tokens, tools)
        return OncePromptSource(rendered) if spec.eval is not None else CyclingPromptSource(rendered)

    async def render(
        self,
        prompts: Sequence[T],
        max_tokens: int,
        tools: list[dict[str, Any]] | None = None,
        convert: Callable[[T], PromptSpec] | None = None,
    ) -> list[RenderedPrompt]:
        """In a thread (a dataset takes seconds), ``SUBMIT_CHUNK`` at a time; ``convert``: from the wire form."""

        def render_chunk(first: int) -> list[RenderedPrompt]:
            rendered = []
            for i, raw in enumerate(prompts[first : first + SUBMIT_CHUNK], first):
                prompt = cast(PromptSpec, raw) if convert is None else convert(raw)
                try:
                    ids, text = self.renderer.render(prompt, max_tokens, tools)
                except InvalidArgument as exc:
                    raise InvalidArgument(f"prompt {i}: {exc}") from None
                messages = tuple(dict(m) for m in prompt.messages or ())
                rendered.append(RenderedPrompt(ids, text, dict(prompt.metadata), messages))
            return rendered

        rendered: list[RenderedPrompt] = []
        for start in range(0, len(prompts), SUBMIT_CHUNK):
            rendered += await asyncio.to_thread(render_chunk, start)
        return rendered
