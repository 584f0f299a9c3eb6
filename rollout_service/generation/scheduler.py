"""Slots, groups and streaming group scoring.

Invariants:
- at most ``max_inflight`` episodes run at once over all runs (and a run's own
  ``max_inflight`` for that run); a freed slot is refilled at once, and runs that all wait
  share the slots by weight (``slots.WeightedSlots``);
- a group reaches its run's broker exactly once, scored, or is dropped and counted: one
  failed member drops the whole group (a missing member would bias its advantages);
- each group is scored the moment its last member finishes, while generation goes on; a
  single-turn group without seeds is one request (``GroupEngine``) holding G slots;
- a run's ``group_deadline_s`` scores a group from the members that finished by then (at
  least ``min_group_size``), else drops it (``deadline``);
- a group the trainer moved more than ``max_staleness`` past is cancelled in flight and
  dropped (``stale_inflight``): it could only be dropped as stale later.

Every task is owned: the scheduler keeps it until it ends, and a feeder that dies fails its
run with the error instead of vanishing.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any, cast

from rollout_service.engine.protocol import Engine, GroupEngine, episode_affinity, samples_groups_at_once
from rollout_service.errors import EngineError, EnvironmentFailure, RequestRejected, RewardError
from rollout_service.evaluation import Evaluations
from rollout_service.generation.drops import drop_outcome
from rollout_service.generation.episode import run_episode, run_single_turn, run_single_turn_group
from rollout_service.generation.external import ExternalSource
from rollout_service.generation.group_scoring import GroupScoring
from rollout_service.generation.prompts import OncePromptSource
from rollout_service.generation.slots import WeightedSlots
from rollout_service.generation.tools import ToolResult
from rollout_service.metrics import RecentRate, ServiceMetrics
from rollout_service.runs import Run
from rollout_service.types import EpisodeResult, PromptItem, SamplingParams

logger = logging.getLogger(__name__)

BACKOFF_AFTER_FAILURES = 16
"""Groups in a row a run may lose to failures at full speed; after them each next group starts
after a pause that doubles with each pause from ``BACKOFF_FIRST_S`` to ``BACKOFF_MAX_S`` (not with
each failure: the groups in flight fail together), until a group is scored.
A run whose every group fails at once (an environment that cannot reset) would otherwise start
and drop groups as fast as the event loop turns."""
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.05, 5.0
REFUSED_BEFORE_FAILING = BACKOFF_AFTER_FAILURES
"""A run whose first this many groups vLLM refused, none scored, fails (before any pause): what it
asks for is what vLLM refuses (stop strings past a server's limit, prompts past its context)."""


@dataclass
class FailureStreak:
    failed: int = 0
    """Groups lost to failures since the run's last scored group."""
    pauses: int = 0
    """Pauses the run's feeder took since then (``Scheduler.failure_backoff_s``)."""


@dataclass
class InflightGroup:
    start_version: int
    """The run's policy version once every member was sent, so a group is never judged older than it is."""
    members: list[asyncio.Task[Any]]
    stale: bool = False
    """Set when the trainer moved past it: its members are being cancelled."""


class Scheduler:
    def __init__(
        self,
        engine: Engine,
        scorer: GroupScoring,
        metrics: ServiceMetrics,
        max_inflight: int,
        decode: Callable[[list[int]], str],
        max_group_bytes: int,
        route: Callable[[Run], Engine],
        evaluations: Evaluations,
        run_failed: Callable[[Run], None] = lambda run: None,
    ) -> None:
        """``route``: the engine a run's requests go to (its adapter, its partition's servers);
        ``evaluations``: told of evaluation runs' scored groups and of their end; ``run_failed``:
        told when a run fails (a restart keeps it failed; its servers go to other runs)."""
        self.engine = engine
        self.route = route
        self.max_group_bytes = max_group_bytes
        self.decode = decode
        self.metrics = metrics
        self.max_inflight = max_inflight
        self.scorer = scorer
        self.slots_busy = 0
        self.max_slots_busy_seen = 0
        self.engine_failures = 0
        self.slots = WeightedSlots(max_inflight)
        self.tokens = RecentRate()
        self._tasks: dict[str, set[asyncio.Task[Any]]] = {}
        self._inflight: dict[str, dict[str, InflightGroup]] = {}
        self._fed: set[str] = set()
        """Runs whose finite prompt set is all started (evaluation runs): done once none is in flight."""
        self._failure_streaks: dict[str, FailureStreak] = {}
        """Per run, since its last scored group (``failure_backoff_s``)."""
        self.evaluations = evaluations
        self.run_failed = run_failed
        metrics.slots_total.set(max_inflight)

    def start_run(self, run: Run) -> None:
        run.admission.on_change(lambda: self._abort_stale(run))
        if isinstance(run.source, ExternalSource):
            return  # its episodes come from outside (``generation.external``): nothing to feed
        feeder = self._spawn(run, self._feed(run), f"feed-{run.run_id}")
        feeder.add_done_callback(lambda task: self._feeder_ended(run, task))

    async def stop_run(self, run: Run) -> None:
        tasks = self._tasks.pop(run.run_id, set())
        for task in tasks:
            task.cancel()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=10.0)
            if pending:
                logger.warning("run %s: %d tasks did not stop within 10s", run.run_id, len(pending))
        await run.broker.close()
        self.slots.forget(run.run_id)
        self._inflight.pop(run.run_id, None)
        self._failure_streaks.pop(run.run_id, None)
        self._fed.discard(run.run_id)

    def stop_generation(self, run: Run, *, wait_for_acks: bool = True) -> None:
        """Cancel the run's feeder and groups now, and end its streams after its scored groups: an
        evaluation a weight update stops may run no request on the next weights."""
        self._fed.discard(run.run_id)  # its set is not done: it never completes
        for task in self._tasks.get(run.run_id, set()):
            task.cancel()
        run.broker.finish(wait_for_acks=wait_for_acks)

    def fail_run(self, run: Run, error: str) -> None:
        """End a run that cannot go on: its generation stops, and its streams hand out the groups
        it scored and then end with ``error``."""
        run.state, run.error = "failed", error
        logger.error("run %s failed: %s", run.run_id, error)
        if run.eval is not None:
            self.evaluations.forget(run)  # its hold on the policy version goes with it
        # Its caller's own group included, cancelled at its next await; trainers waiting for a
        # step's worth of groups would otherwise hold their last ones for ever.
        self.stop_generation(run, wait_for_acks=False)
        self.run_failed(run)

    def _spawn(self, run: Run, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        tasks = self._tasks.setdefault(run.run_id, set())
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return task

    def _feeder_ended(self, run: Run, task: asyncio.Task[Any]) -> None:
        if not task.cancelled() and (exc := task.exception()) is not None:
            logger.error("run %s: starting its groups failed", run.run_id, exc_info=exc)
            self.fail_run(run, f"starting its groups failed: {type(exc).__name__}: {exc} (the service's log has more)")

    async def _acquire_slots(self, run: Run, count: int = 1) -> None:
        """``count`` slots (a group request's G): the run's own first, then the service's, granted
        together so that two runs' requests never each hold part of what they need."""
        taken = 0
        try:
            while taken < count:
                await run.slots.acquire()
                taken += 1
            await self.slots.acquire(run.run_id, run.spec.weight, count)
        except BaseException:
            for _ in range(taken):
                run.slots.release()
            raise
        self._account_slot_time(run)
        self.slots_busy += count
        run.counters.slots_busy += count
        self.max_slots_busy_seen = max(self.max_slots_busy_seen, self.slots_busy)
        self.metrics.slots_busy.set(self.slots_busy)

    def _release_slot(self, run: Run) -> None:
        self.slots_busy -= 1
        run.counters.slots_busy -= 1
        self.metrics.slots_busy.set(self.slots_busy)
        self.slots.release(run.run_id)
        run.slots.release()
        self._account_slot_time(run)

    def _account_slot_time(self, run: Run) -> None:
        total = self.slots.slot_seconds(run.run_id)
        self.metrics.slot_seconds.labels(run.run_id).inc(total - run.counters.slot_seconds)
        run.counters.slot_seconds = total

    async def _feed(self, run: Run) -> None:
        """Start groups for the run while its broker has room, one slot at a time; an
        evaluation run only once it holds its version, and only until its set is done."""
        if run.eval is not None:
            await run.eval.started.wait()
        while True:
            if isinstance(run.source, OncePromptSource) and run.source.exhausted:
                self._fed.add(run.run_id)
                self._check_generation_done(run)
                return
            if (pause_s := self.failure_backoff_s(run)) > 0:
                self._failure_streaks[run.run_id].pauses += 1
                await asyncio.sleep(pause_s)  # a retry backoff, not synchronisation
            if not await run.broker.reserve():
                return
            try:
                prompt = await run.source.next()
            except BaseException:
                await run.broker.unreserve()
                raise
            await self._start_group(run, prompt)

    def failure_backoff_s(self, run: Run) -> float:
        """The pause before the run's next group: none until ``BACKOFF_AFTER_FAILURES`` failed in a row."""
        streak = self._failure_streaks.get(run.run_id)
        if streak is None or streak.failed < BACKOFF_AFTER_FAILURES:
            return 0.0
        return min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2.0 ** min(streak.pauses, 32))

    def _check_generation_done(self, run: Run) -> None:
        """After the last group of a finite set: tell the evaluations, once."""
        if run.run_id in self._fed and not self._inflight.get(run.run_id):
            self._fed.discard(run.run_id)
            run.broker.finish()
            if run.eval is not None:
                self.evaluations.generation_done(run)

    async def _start_group(self, run: Run, prompt: PromptItem) -> None:
        group_id = f"{run.run_id}/{prompt.index}/{uuid.uuid4().hex[:8]}"
        run.counters.groups_started += 1
        self.metrics.groups_started.labels(run.run_id).inc()
        run.audit.started(prompt)
        started = time.monotonic()
        if self._samples_group_at_once(run):
            members, expected = await self._start_group_request(run, prompt, group_id), 1
        else:
            members, expected = await self._start_members(run, prompt, group_id), run.spec.group_size
        inflight = InflightGroup(run.policy_version, members)
        self._inflight.setdefault(run.run_id, {})[group_id] = inflight
        finish = self._finish_group(run, prompt, group_id, inflight, expected, started)
        self._spawn(run, finish, f"score-{group_id}")

    def _abort_stale(self, run: Run) -> None:
        """On a version change: cancel the in-flight groups the trainer would drop as stale."""
        for inflight in self._inflight.get(run.run_id, {}).values():
            if not inflight.stale and run.admission.outdated(inflight.start_version):
                inflight.stale = True
                for member in inflight.members:
                    member.cancel()

    def _samples_group_at_once(self, run: Run) -> bool:
        """One request per group: single-turn, no per-member seeds, and room for its G slots (more
        than the run or the service has would wait for ever; its members go one at a time)."""
        return (
            run.episode is None
            and not run.spec.group_deadline_s  # a deadline keeps the members that finished
            and run.spec.sampling.seed is None
            and run.spec.group_size <= min(run.max_inflight, self.slots.total)
            and samples_groups_at_once(self.engine)
        )

    async def _start_members(self, run: Run, prompt: PromptItem, group_id: str) -> list[asyncio.Task[Any]]:
        members: list[asyncio.Task[Any]] = []
        for index in range(run.spec.group_size):
            if any(m.done() and not m.cancelled() and m.exception() for m in members):
                break  # the group is already lost; do not spend more slots on it
            await self._acquire_slots(run)
            params = _member_params(run.spec.sampling, prompt.index, index, run.spec.group_size)
            member = self._spawn(run, self._run_member(run, prompt, params, group_id, index), group_id)
            started = time.monotonic()
            member.add_done_callback(lambda task, run=run, t=started: self._member_done(run, task, 1, group_id, t))
            members.append(member)
        return members

    async def _start_group_request(self, run: Run, prompt: PromptItem, group_id: str) -> list[asyncio.Task[Any]]:
        size = run.spec.group_size
        await self._acquire_slots(run, size)
        request = self._spawn(run, self._run_group_request(run, prompt, group_id), group_id)
        started = time.monotonic()
        request.add_done_callback(lambda task, run=run: self._member_done(run, task, size, group_id, started))
        return [request]

    def _member_done(self, run: Run, task: asyncio.Task[Any], slots: int, group_id: str, started: float) -> None:
        """A done-callback, not a finally, so that a task cancelled before it started frees its slots
        and is booked too; it observes the failure so that asyncio does not log it as never retrieved.
        It runs before the group's own wait wakes (callbacks run in the order they were added)."""
        for _ in range(slots):
            self._release_slot(run)
        seconds = (time.monotonic() - started) * slots
        if task.cancelled() or task.exception() is not None:
            run.ledger.member_cut(group_id, seconds)
        else:
            run.ledger.member_finished(group_id, sum(r.policy_tokens for r in task.result()), seconds)

    async def _run_member(
        self, run: Run, prompt: PromptItem, params: SamplingParams, group_id: str, index: int
    ) -> list[EpisodeResult]:
        engine = self.route(run)
        if run.episode is None:
            result = await run_single_turn(
                engine, prompt, params, lambda: run.policy_version, self.decode, affinity=group_id
            )
        else:
            # Its own key: each turn goes back to the server holding its transcript so far.
            affinity = episode_affinity(group_id, index)
            try:
                result = await run_episode(
                    engine,
                    prompt,
                    params,
                    run.episode,
                    lambda: run.policy_version,
                    self.decode,
                    affinity=affinity,
                    on_tool_result=lambda r: self._tool_called(run, r),
                )
            finally:
                self._forget_affinity(affinity)
        self._count_episode(run, result)
        return [result]

    def _forget_affinity(self, key: str) -> None:
        forget = getattr(self.engine, "forget", None)
        if forget is not None:
            forget(key)

    async def _run_group_request(self, run: Run, prompt: PromptItem, group_id: str) -> list[EpisodeResult]:
        engine = cast(GroupEngine, self.route(run))
        size = run.spec.group_size
        results = await run_single_turn_group(
            engine, prompt, run.spec.sampling, size, lambda: run.policy_version, self.decode, affinity=group_id
        )
        for result in results:
            self._count_episode(run, result)
        return results

    def _count_episode(self, run: Run, result: EpisodeResult) -> None:
        tokens = result.policy_tokens
        self.tokens.add(tokens)
        run.counters.turns += result.num_turns
        self.metrics.tokens_generated.labels(run.run_id).inc(tokens)
        self.metrics.episode_turns.labels(run.run_id).observe(result.num_turns)
        self.metrics.episodes_finished.labels(run.run_id, result.finish_reason).inc()

    def _tool_called(self, run: Run, result: ToolResult) -> None:
        """Counted as each call returns, not when its episode ends, so long episodes show up live."""
        known = run.episode is not None and run.episode.tools is not None and result.name in run.episode.tools.tools
        tool = result.name if known else "<unknown>"  # model-made names must not blow up label sets
        run.counters.tool_calls += 1
        self.metrics.tool_calls.labels(run.run_id, tool).inc()
        self.metrics.tool_latency.labels(tool).observe(result.seconds)
        if result.error_kind is not None:
            run.counters.tool_failures += 1
            self.metrics.tool_failures.labels(run.run_id, result.error_kind).inc()

    async def _finish_group(
        self,
        run: Run,
        prompt: PromptItem,
        group_id: str,
        inflight: InflightGroup,
        expected: int,
        started: float,
    ) -> None:
        """``inflight.members``: ``expected`` tasks, each the episodes of a member (one) or of a group
        request (G); fewer when a member failed before the others could start."""
        members = inflight.members
        deadline = run.spec.group_deadline_s
        wait_s = max(0.0, started + deadline - time.monotonic()) if deadline else None
        try:
            done, pending = await asyncio.wait(members, timeout=wait_s, return_when=asyncio.FIRST_EXCEPTION)
            stale = inflight.stale
            for task in pending:  # a stale or failed group's members, or the stragglers past its deadline
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            if stale:
                why = (
                    f"started at policy version {inflight.start_version}, and the trainer is at version "
                    f"{run.admission.trainer_version}, more than max_staleness {run.spec.max_staleness} later"
                )
                await self._drop(run, prompt, group_id, "stale_inflight", why)
                return
            failed = [t for t in done if t.exception() is not None]
            if failed or len(members) < expected:
                error = failed[0].exception() if failed else None
                reason = _failure_reason(error)
                await self._drop(run, prompt, group_id, reason, error)
                if isinstance(error, EngineError):
                    self.engine_failures += 1
                elif error is not None and not isinstance(error, EnvironmentFailure):
                    logger.error("group %s failed unexpectedly", group_id, exc_info=error)
                return
            if pending:  # past the deadline
                members = [task for task in members if task in done]  # member order
                if len(members) < run.spec.fewest_members:
                    why = (
                        f"{len(members)} of {expected} members finished within group_deadline_seconds {deadline:g}; "
                        f"it is scored from at least {run.spec.fewest_members} (min_group_size)"
                    )
                    await self._drop(run, prompt, group_id, "deadline", why)
                    return
                run.counters.groups_partial += 1
                self.metrics.groups_partial.labels(run.run_id).inc()
            episodes = [episode for task in members for episode in task.result()]
            if any(episode.finish_reason == "abort" for episode in episodes):
                # A weight update with pause_mode abort cut a member off: the proto promises
                # such groups are dropped, not trained on a truncated sample.
                await self._drop(run, prompt, group_id, "aborted", "a member was aborted by a weight update")
                return
            try:
                scored = await self.scorer.score(run, prompt, group_id, episodes, time.monotonic() - started)
            except RewardError as exc:
                await self._drop(run, prompt, group_id, "reward", exc)
                return
            except Exception as exc:  # never let a group die unobserved: its buffer place would leak
                logger.error("scoring group %s failed unexpectedly", group_id, exc_info=exc)
                await self._drop(run, prompt, group_id, "internal", exc)
                return
            if (size := scored.wire_bytes_upper_bound()) > self.max_group_bytes:
                # Buffered, it would fail every consumer's stream and come back, for ever.
                message = (
                    f"about {size} bytes, over scheduler.max_group_bytes ({self.max_group_bytes}); lower the run's "
                    "max_tokens, group_size or prompt metadata, or raise the setting with the clients' receive limit"
                )
                await self._drop(run, prompt, group_id, "too_large", message)
                return
            run.counters.groups_scored += 1
            self._failure_streaks.pop(run.run_id, None)
            self.metrics.groups_scored.labels(run.run_id).inc()
            if run.eval is not None:
                self.evaluations.record(run, scored)
            scored.engine_seconds = run.ledger.group_scored(group_id)
            run.audit.scored(scored)
            await run.broker.put(scored)
        finally:
            run.ledger.group_dropped(group_id, "cancelled")  # a no-op unless the run's stop cancelled it
            self._inflight.get(run.run_id, {}).pop(group_id, None)
            self._forget_affinity(group_id)
            self._check_generation_done(run)

    async def _drop(
        self, run: Run, prompt: PromptItem, group_id: str, reason: str, error: BaseException | str | None
    ) -> None:
        await run.broker.unreserve()
        run.broker.store.prompt_done(run.run_id, prompt.index)  # a submitted prompt is not queued again
        run.ledger.group_dropped(group_id, reason)
        run.counters.groups_dropped += 1
        self.metrics.groups_dropped.labels(run.run_id, reason).inc()
        logger.warning("dropped group %s (%s): %s", group_id, reason, error)
        if drop_outcome(reason) == "failed":
            self._failure_streaks.setdefault(run.run_id, FailureStreak()).failed += 1
        if reason == "rejected":
            run.counters.groups_refused += 1
            refused = run.counters.groups_refused
            if refused >= REFUSED_BEFORE_FAILING and not run.counters.groups_scored and run.state == "running":
                self.fail_run(
                    run,
                    f"vLLM refused the requests of the run's first {refused} groups and none was scored; change "
                    "what it refuses (the run's sampling or prompts, or the servers' limits) and create the run "
                    f"again. The last refusal: {error}",
                )


def _failure_reason(error: BaseException | None) -> str:
    """A failed member's drop reason: ``rejected`` (vLLM refused the request itself), ``environment`` or ``engine``."""
    if isinstance(error, RequestRejected):
        return "rejected"
    return "environment" if isinstance(error, EnvironmentFailure) else "engine"


def _member_params(base: SamplingParams, prompt_index: int, member: int, group_size: int) -> SamplingParams:
    """A seeded run gets distinct, reproducible seeds per member and prompt occurrence."""
    if base.seed is None:
        return base
    return replace(base, seed=base.seed + prompt_index * group_size + member)
