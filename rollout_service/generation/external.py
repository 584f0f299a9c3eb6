"""Episodes driven from outside: agent code talks to an OpenAI-compatible endpoint, and
the service turns its conversations into training samples.

The service, not the agent, keeps every turn's token ids and logprobs. A later request
repeats the conversation so far; it is checked against what the service holds, and only the
added messages are rendered (``TurnTemplate``, mask 0), never re-tokenizing the model's
turns. G closed episodes of one task form a group, scored by the rewards given at close or
else by the run's reward functions.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollout_service.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, RewardError, echo
from rollout_service.generation.episode import TurnTemplate, salted, trl_tool_calls
from rollout_service.generation.external_conversation import (
    EpisodeRequest,
    OpenEpisode,
    TextRequest,
    TurnReply,
    TurnRequest,
    chars,
    check_messages,
    not_busy,
    reply,
    same_message,
)
from rollout_service.generation.tools import ToolCall, parse_hermes
from rollout_service.types import Completion, EpisodeResult, PromptItem, SamplingParams, ScoredGroup

if TYPE_CHECKING:
    from rollout_service.engine.protocol import Engine
    from rollout_service.generation.group_scoring import GroupScoring
    from rollout_service.generation.prompts import PromptRenderer
    from rollout_service.metrics import ServiceMetrics
    from rollout_service.runs import Run

logger = logging.getLogger(__name__)

MAX_OPEN_EPISODES = 10_000
"""Open episodes per run: each holds its transcript until closed."""
CLIENT_REWARD = "client"
"""The reward component of rewards given at close."""


@dataclass(frozen=True)
class _Closed:
    prompt: PromptItem
    episode: EpisodeResult
    reward: float | None
    started: float


class ExternalSource:
    """An external run's prompt source: no prompts, but its open episodes and the closed ones per task."""

    def __init__(self) -> None:
        self.open: dict[str, OpenEpisode] = {}
        self.closed: dict[str, list[_Closed]] = {}
        self.groups = 0

    async def next(self) -> PromptItem:
        raise RuntimeError("an external run's episodes come from its OpenAI-compatible endpoint, not from prompts")

    def discard(self) -> None:
        self.open.clear()
        self.closed.clear()


class ExternalEpisodes:
    def __init__(self, engine: Engine, renderer: PromptRenderer, scorer: GroupScoring, metrics: ServiceMetrics) -> None:
        self.engine = engine
        self.renderer = renderer
        self.scorer = scorer
        self.metrics = metrics

    async def turn(self, run: Run, request: TurnRequest) -> TurnReply:
        """One assistant turn of a chat episode (``/chat/completions``)."""
        source = _running_source(run)
        self.renderer.check_chars(chars(request.messages), "messages")
        episode = source.open.get(request.episode_id)
        if episode is None:
            episode = await self._open(run, source, request)
        else:
            not_busy(episode)
            self._extend(run, episode, request)
        assert episode.template is not None
        completion = await self._sample(run, episode, request)
        decode = self.renderer.decode
        raw = decode(episode.template.content(completion.token_ids))
        calls = [call for call in parse_hermes(raw) if isinstance(call, ToolCall)]
        tool_calls = [
            {
                "id": f"call_{uuid.uuid4().hex[:12]}",
                "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
            }
            for call in calls
        ]
        content = raw.split("<tool_call>")[0].strip() if tool_calls else raw
        reply_message: dict[str, Any] = {"role": "assistant", "content": content or None}
        reward_message = episode.transcript.add_turn(completion, raw, decode)
        if calls:
            reply_message["tool_calls"] = tool_calls
            reward_message["tool_calls"] = trl_tool_calls(calls)
        episode.known.append(reply_message)
        return reply(episode, completion, content or None, tool_calls)

    async def complete(self, run: Run, request: TextRequest) -> TurnReply:
        """One completion of a text episode (``/completions``): what the prompt adds is tokenized and masked."""
        source = _running_source(run)
        self.renderer.check_chars(len(request.prompt), "prompt")
        episode = source.open.get(request.episode_id)
        if episode is None:
            _check_new(run, source, request.episode_id, request.task_id)
            ids = await asyncio.to_thread(self.renderer.tokenizer.encode, request.prompt, add_special_tokens=False)
            if not ids:
                raise InvalidArgument("prompt is empty; send the text to complete")
            prompt = PromptItem(source.groups, list(ids), request.prompt)
            episode = OpenEpisode(
                request.episode_id, request.task_id, prompt, None, run.policy_version, [], text=request.prompt
            )
            source.open[request.episode_id] = episode
        else:
            not_busy(episode)
            if episode.template is not None:
                raise InvalidArgument(
                    f"episode {echo(episode.episode_id)} is a chat episode; continue it with chat/completions"
                )
            if not request.prompt.startswith(episode.text):
                raise InvalidArgument(
                    f"the prompt does not start with the text so far of episode {echo(episode.episode_id)} "
                    f"({len(episode.text)} characters: the previous prompt and completion); send it unchanged and "
                    "append to it"
                )
            if added := request.prompt[len(episode.text) :]:
                ids = await asyncio.to_thread(self.renderer.tokenizer.encode, added, add_special_tokens=False)
                episode.transcript.add_template(list(ids), [{"role": "user", "content": added}])
            episode.text = request.prompt
        completion = await self._sample(run, episode, request)
        text = self.renderer.decode(completion.token_ids)
        episode.text += text
        episode.transcript.add_turn(completion, text, self.renderer.decode)
        return reply(episode, completion, text, [])

    async def _open(self, run: Run, source: ExternalSource, request: TurnRequest) -> OpenEpisode:
        _check_new(run, source, request.episode_id, request.task_id)
        check_messages(request.messages, first=True)
        tokenizer = self.renderer.tokenizer
        try:
            template = TurnTemplate(tokenizer, request.tools)
            ids = await asyncio.to_thread(
                tokenizer.apply_chat_template,
                request.messages,
                tools=request.tools,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        except (ValueError, TypeError, KeyError) as exc:
            raise InvalidArgument(f"the model's chat template cannot render these messages: {exc}") from None
        text = self.renderer.decode(list(ids))
        prompt = PromptItem(source.groups, list(ids), text, {}, tuple(dict(m) for m in request.messages))
        known = [dict(m) for m in request.messages]
        episode = OpenEpisode(request.episode_id, request.task_id, prompt, template, run.policy_version, known)
        source.open[request.episode_id] = episode
        return episode

    def _extend(self, run: Run, episode: OpenEpisode, request: TurnRequest) -> None:
        """Append the messages this request adds after the episode's last assistant turn."""
        if episode.template is None:
            raise InvalidArgument(f"episode {echo(episode.episode_id)} is a text episode; continue it with completions")
        if request.task_id and request.task_id != episode.task_id:
            raise InvalidArgument(
                f"episode {echo(episode.episode_id)} belongs to task {echo(episode.task_id)}, "
                f"not {echo(request.task_id)}"
            )
        messages, known = request.messages, episode.known
        if len(messages) <= len(known):
            raise InvalidArgument(
                f"episode {echo(episode.episode_id)} has {len(known)} messages and this request sends {len(messages)}: "
                "repeat the conversation so far and append the new messages (tool results, a user turn)"
            )
        for index, (sent, held) in enumerate(zip(messages, known, strict=False)):
            if not same_message(sent, held):
                raise InvalidArgument(
                    f"message {index} of episode {echo(episode.episode_id)} differs from the conversation the service "
                    f"holds ({held.get('role')}: {str(held.get('content'))[:60]!r}); send the conversation as it was, "
                    "the assistant's replies unchanged, and append new messages"
                )
        added = [dict(m) for m in messages[len(known) :]]
        check_messages(added, first=False)
        if any(m.get("role") == "assistant" for m in added):
            raise InvalidArgument(
                f"episode {echo(episode.episode_id)}: a request may add tool, user or system messages, not assistant "
                "ones: only the model's own turns, generated here, can be trained on"
            )
        try:
            bridge = episode.template.bridge(episode.last_turn_ids, added)
        except (ValueError, TypeError, KeyError) as exc:
            raise InvalidArgument(f"the model's chat template cannot render the added messages: {exc}") from None
        episode.transcript.add_template(bridge, added)
        episode.known.extend(added)

    async def _sample(self, run: Run, episode: OpenEpisode, request: EpisodeRequest) -> Completion:
        """Generate the episode's next turn from all its ids (the caller records it)."""
        base = run.spec.sampling
        context = len(episode.prompt.token_ids) + len(episode.transcript.ids)
        room = self.renderer.max_model_len - context
        if room <= 0:
            raise InvalidArgument(
                f"episode {echo(episode.episode_id)} holds {context} tokens, the model's whole context "
                f"({self.renderer.max_model_len}); close it"
            )
        params = SamplingParams(
            max_tokens=min(request.max_tokens or base.max_tokens, room),
            temperature=base.temperature if request.temperature is None else request.temperature,
            top_p=base.top_p if request.top_p is None else request.top_p,
            top_k=base.top_k,
            stop=request.stop or base.stop,
            model=run.adapter,
        )
        ids = episode.prompt.token_ids + episode.transcript.ids
        episode.busy = True
        try:
            completion = await self.engine.generate(
                ids, salted(params, run.policy_version), affinity=episode.episode_id
            )
        finally:
            episode.busy = False
        episode.version_last = run.policy_version
        episode.last_turn_ids = list(completion.token_ids)
        episode.turns += 1
        episode.finish = completion.finish_reason
        return completion

    async def close(self, run: Run, episode_id: str, reward: float | None) -> int:
        """End an episode; returns how many of its task wait for their group (0: the group was just put)."""
        source = _source(run)
        episode = source.open.get(episode_id)
        if episode is None:
            raise NotFound(f"run {run.run_id} has no open episode {echo(episode_id)}")
        if episode.busy:
            raise FailedPrecondition(f"a request of episode {echo(episode_id)} is still running; close it after")
        if not episode.turns:
            raise FailedPrecondition(f"episode {echo(episode_id)} has no assistant turn yet; nothing to train on")
        waiting = source.closed.setdefault(episode.task_id, [])
        if waiting and (waiting[0].reward is None) != (reward is None):
            given = "without" if waiting[0].reward is None else "with"
            raise InvalidArgument(
                f"the episodes of task {echo(episode.task_id)} so far were closed {given} a reward; close every "
                "episode of a group the same way (rewards from the client, or from the run's reward functions)"
            )
        if waiting and waiting[0].prompt.token_ids != episode.prompt.token_ids:
            raise InvalidArgument(
                f"episode {echo(episode_id)} starts from other messages than the episodes of task "
                f"{echo(episode.task_id)} closed before it: a group is G samples of one prompt, so give each "
                "distinct prompt its own task id"
            )
        del source.open[episode_id]
        result = episode.transcript.result(
            self.renderer.decode, episode.finish, episode.version_first, episode.version_last, num_turns=episode.turns
        )
        waiting.append(_Closed(episode.prompt, result, reward, episode.started))
        if len(waiting) < run.spec.group_size:
            return len(waiting)
        members = source.closed.pop(episode.task_id)
        source.groups += 1
        await self._put_group(run, episode.task_id, members)
        return 0

    async def _put_group(self, run: Run, task_id: str, members: list[_Closed]) -> None:
        group_id = f"{run.run_id}/{task_id}/{uuid.uuid4().hex[:8]}"
        episodes = [m.episode for m in members]
        seconds = time.monotonic() - min(m.started for m in members)
        run.counters.groups_started += 1
        self.metrics.groups_started.labels(run.run_id).inc()
        tokens = sum(e.policy_tokens for e in episodes)
        if not await run.broker.reserve():
            run.ledger.external_group(tokens, "cancelled")
            raise FailedPrecondition(f"run {run.run_id} is stopped; its groups are no longer taken")
        try:
            if members[0].reward is not None:
                rewards = [float(m.reward) for m in members]  # type: ignore[arg-type]
                scored = ScoredGroup(
                    group_id=group_id,
                    run_id=run.run_id,
                    prompt=members[0].prompt,
                    episodes=episodes,
                    rewards=rewards,
                    reward_components={CLIENT_REWARD: rewards},
                    reward_weights={CLIENT_REWARD: 1.0},
                    advantages=run.advantages(rewards),
                    generation_seconds=seconds,
                    requested_size=run.spec.group_size,
                )
            else:
                scored = await self.scorer.score(run, members[0].prompt, group_id, episodes, seconds)
        except BaseException as exc:
            await run.broker.unreserve()
            run.ledger.external_group(tokens, "failed")
            if not isinstance(exc, RewardError):
                raise
            run.counters.groups_dropped += 1
            self.metrics.groups_dropped.labels(run.run_id, "reward").inc()
            logger.warning("external group %s of run %s could not be scored: %s", group_id, run.run_id, exc)
            raise FailedPrecondition(
                f"the group of task {echo(task_id)} could not be scored by the run's reward functions ({exc}); it is "
                'dropped and counted (dropped{reason="reward"})'
            ) from None
        run.counters.groups_scored += 1
        self.metrics.groups_scored.labels(run.run_id).inc()
        run.ledger.external_group(tokens, None)
        run.audit.started(scored.prompt)
        run.audit.scored(scored)
        await run.broker.put(scored)
        logger.info("external group %s of run %s: %d episodes scored", group_id, run.run_id, len(episodes))


def _running_source(run: Run) -> ExternalSource:
    source = _source(run)
    if run.state != "running":
        raise FailedPrecondition(f"run {run.run_id} is {run.state}; episodes need a running run")
    return source


def _check_new(run: Run, source: ExternalSource, episode_id: str, task_id: str) -> None:
    if not task_id:
        raise InvalidArgument(
            f"episode {echo(episode_id)} is new: name its task (header x-rollout-task-id or field task_id); "
            f"{run.spec.group_size} episodes of one task form a group"
        )
    if len(source.open) >= MAX_OPEN_EPISODES:
        raise ResourceExhausted(
            f"run {run.run_id} has {len(source.open)} open episodes, its limit; close finished ones"
        )


def _source(run: Run) -> ExternalSource:
    if not isinstance(run.source, ExternalSource):
        raise FailedPrecondition(
            f"run {run.run_id} takes its prompts from its {run.spec.source_kind}; create the run with "
            "prompt_source.external to drive its episodes through this endpoint"
        )
    return run.source
