"""The service's core, free of gRPC (the edge is thin over it): runs, their scheduling,
prompt submission, statistics."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from rollout_service.config import SchedulerSettings
from rollout_service.delivery.admission import RunAdmission
from rollout_service.delivery.broker import RunBroker
from rollout_service.delivery.ledger import LedgerCollector
from rollout_service.delivery.lookahead import Lookahead
from rollout_service.delivery.state_store import MemoryStore, StateStore
from rollout_service.delivery.watchdog import RunWatchdog
from rollout_service.engine.protocol import Engine
from rollout_service.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from rollout_service.evaluation import Evaluations
from rollout_service.generation.environments import EnvironmentRegistry
from rollout_service.generation.external import ExternalEpisodes
from rollout_service.generation.prompts import (
    BUILTIN_DATASETS,
    OncePromptSource,
    PromptRenderer,
    PromptSpec,
    SubmittedPromptSource,
)
from rollout_service.generation.scheduler import Scheduler
from rollout_service.generation.tools import ToolRegistry
from rollout_service.metrics import ServiceMetrics
from rollout_service.run_inputs import RunInputs
from rollout_service.runs import MAX_BUFFERED_GROUPS, Run, RunSpec, RunTable
from rollout_service.scoring.advantages import AdvantageComputer
from rollout_service.scoring.rewards import RewardRegistry
from rollout_service.scoring.score import GroupScorer
from rollout_service.service_reports import ServerInfo, ServiceStats
from rollout_service.versions import PolicyVersion, VersionChange
from rollout_service.weights.push_routes import PushRoutes
from rollout_service.weights.version_holds import VersionHolds

if TYPE_CHECKING:  # it drives this class: imported for the annotation only
    from rollout_service.weights.pool_membership import PoolMembership

NO_ENGINE_ERROR = "no vLLM server is answering; groups are dropped until one does (see the service's health)"

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class ServiceInfo:
    model: str
    engine_urls: list[str]
    max_inflight: int
    model_signature: str = ""
    """``rollout_common.model_signature`` of the served model; empty when unknown."""


class RolloutService:
    def __init__(
        self,
        engine: Engine,
        renderer: PromptRenderer,
        rewards: RewardRegistry,
        metrics: ServiceMetrics,
        settings: SchedulerSettings,
        info: ServiceInfo,
        tools: ToolRegistry | None = None,
        environments: EnvironmentRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
        store: StateStore | None = None,
        runs: RunTable | None = None,
        versions: PolicyVersion | None = None,
        holds: VersionHolds | None = None,
        weights: PushRoutes | None = None,
        membership: PoolMembership | None = None,
    ) -> None:
        """The weight plane is built first (``app``) and passed in: ``weights`` routes pushes over
        ``runs``, its weight syncs move ``versions`` and wait on ``holds``. Without them: a
        service that syncs no weights, and whose pool (``membership``) never changes."""
        self.clock = clock
        self.started = clock()
        self.store: StateStore = store if store is not None else MemoryStore()
        """Runs, unacked groups and acked ids, durable across restarts (``delivery.state_store``)."""
        self.renderer = renderer
        self.rewards = rewards
        self.tools = tools if tools is not None else ToolRegistry()
        self.environments = environments if environments is not None else EnvironmentRegistry()
        self.metrics = metrics
        self.settings = settings
        self.info = info
        self.user_code_executor = ThreadPoolExecutor(settings.user_code_threads, thread_name_prefix="user-code")
        """Sync rewards' and environments' own threads (``SchedulerSettings.user_code_threads``)."""
        self.scorer = GroupScorer(rewards, settings.reward_timeout_s, self.user_code_executor)
        self.inputs = RunInputs(renderer, self.tools, self.environments, settings, self.user_code_executor)
        """What each run generates from: episode config, prompt source, rendered prompts."""
        self.watchdog = RunWatchdog(settings.stall_timeout_s, metrics, clock)
        self.pool_usable = True
        self.runs = runs if runs is not None else RunTable()
        metrics.registry.register(LedgerCollector(lambda: ((r.run_id, r.broker.goodput()) for r in self.runs.values())))
        self.versions = versions if versions is not None else PolicyVersion()
        """The base weights' versions: the runs on them share it; the state store keeps it."""
        self.weights = weights if weights is not None else PushRoutes(self.runs, self.store)
        """Who may push weights and adapters, and to which servers."""
        self.holds = holds if holds is not None else VersionHolds()
        """Evaluation runs holding the servers' version; the weight sync waits on them."""
        self.membership = membership
        """Adds and removes vLLM servers while the service runs (AddEngine, RemoveEngine)."""
        self.evaluations = Evaluations(
            self.holds,
            metrics,
            pausing_update_pending=lambda: (
                (sync := self.weights.weight_sync) is not None and sync.pausing_update_pending
            ),
            stop_generation=lambda run: self.scheduler.stop_generation(run),  # built next: it tells them
        )
        self.scheduler = Scheduler(
            engine,
            self.scorer,
            metrics,
            settings.max_inflight,
            renderer.decode,
            max_group_bytes=settings.max_group_bytes,
            route=lambda run: self.weights.engine_for(run, engine),
            evaluations=self.evaluations,
            run_failed=self._run_failed,
        )
        metrics.slots_busy_time_average.set_function(self.scheduler.slots.busy_time_average)
        self.versions.watch(self._base_version_changed)
        self.external = ExternalEpisodes(engine, renderer, self.scorer, metrics)
        """Turns of episodes that outside agent code drives (the OpenAI-compatible endpoint)."""

    @property
    def policy_version(self) -> int:
        """The base weights' version the servers hold (0: the checkpoint's)."""
        return self.versions.served

    def set_policy_version(self, version: int) -> None:
        self.versions.commit(version)

    def _base_version_changed(self, change: VersionChange) -> None:
        """The store keeps the servers' version across restarts; an update that ended may let
        a held-back evaluation start."""
        if change.served_moved:
            self.store.set_meta("policy_version", self.versions.served)
        self.evaluations.version_changed(self.versions.served)

    async def watch_runs(self) -> None:
        """Report runs that stop making progress (``delivery.watchdog``), until cancelled."""
        if not self.watchdog.stall_timeout_s:
            return
        while True:
            await asyncio.sleep(self.watchdog.interval_s)  # a checking period, not synchronisation
            self.watchdog.check(self.runs.values(), self.pool_usable)

    def engines_usable(self, usable: bool) -> None:
        """The engine pool lost (or regained) every server: say so on the running runs, whose
        groups are dropped meanwhile, so GetRun explains a run that stopped producing."""
        self.pool_usable = usable
        for run in self.runs.values():
            if run.state != "running":
                continue
            if not usable:
                run.error = NO_ENGINE_ERROR
            elif run.error == NO_ENGINE_ERROR:
                run.error = ""

    async def create_run(self, spec: RunSpec, owner: str = "") -> Run:
        run = await self._new_run(spec, owner, Run.new_id())
        if spec.eval is None:  # an evaluation is pinned to a moment: it is not resumed after a restart
            self.store.save_run(run.run_id, owner, spec, run.stored_state())
        self._start_run(run)
        return run

    async def restore(self) -> int:
        """Start-up: recreate the stored runs with their unacked groups (as if every consumer
        had left) and their memory of acked ids, and the servers' policy version. Returns the
        number of runs restored. A run that cannot be recreated (its reward module is gone,
        say) is logged and dropped from the store."""
        stored, meta = await asyncio.to_thread(self.store.load)
        self.set_policy_version(int(meta.get("policy_version", 0)))
        self.weights.base_weights_run = meta.get("base_weights_run")
        if self.membership is not None:
            self.membership.added_engines = list(meta.get("added_engines", []))
        for saved in stored:
            try:
                run = await self._new_run(saved.spec, saved.owner, saved.run_id)
            except Exception as exc:
                logger.error("stored run %s cannot be restored (%s); it is dropped", saved.run_id, exc)
                self.store.delete_run(saved.run_id)
                continue
            admission, state = run.admission, saved.state
            admission.await_version = min(admission.await_version, state.get("await_version", 0))
            admission.trained_per_version = state.get("trained_per_version")  # not re-learned from nothing
            admission.version_bumped = state.get("version_bumped", admission.version_bumped)
            if admission.lookahead is not None and state.get("lookahead_versions") is not None:
                admission.lookahead.restore(state["lookahead_versions"])  # paced admission's, likewise
            run.broker.restore(saved.groups, saved.acked)
            if isinstance(run.source, SubmittedPromptSource):
                run.source.restore(saved.prompts, saved.prompts_submitted)
            if state.get("state") == "failed":  # stays failed: its streams hand out its groups, then say why
                run.state, run.error = "failed", state.get("error", "")
                run.broker.finish(wait_for_acks=False)
            self._start_run(run)
            logger.info(
                "restored run %s: %d unacked groups, %d acked ids, %d submitted prompts, policy version %d",
                run.run_id, len(saved.groups), len(saved.acked), len(saved.prompts), run.policy_version,
            )  # fmt: skip
        return len(stored)

    async def restore_adapters(self) -> None:
        """After ``restore`` and once the adapter publisher is attached: each restored
        serve_adapter run serves its newest adapter on disk again, at its version."""
        if (adapters := self.weights.adapters) is None:
            return
        for run in self.runs.values():
            if run.spec.serve_adapter and (version := await adapters.restore(run.run_id)):
                run.adapter = adapters.current(run.run_id)
                run.admission.set_policy_version(version)

    async def _new_run(self, spec: RunSpec, owner: str, run_id: str) -> Run:
        spec.validate()
        if self.weights.partitions is not None and spec.eval is not None:
            raise FailedPrecondition(
                "this service splits its servers among full-weight runs (weight_sync.partitions), and an "
                "evaluation run cannot say whose weights it evaluates yet; run it on a service without partitions"
            )
        if len(self.runs) >= self.settings.max_runs:
            raise ResourceExhausted(
                f"the service holds {len(self.runs)} runs, its limit (scheduler.max_runs); delete finished runs"
            )
        for name, _ in spec.rewards:
            self.rewards.get(name)  # raises InvalidArgument naming the registered functions
        if spec.max_inflight > self.settings.max_inflight:
            raise InvalidArgument(
                f"max_inflight {spec.max_inflight} exceeds the service's slot limit "
                f"{self.settings.max_inflight}; use 0 for the service's limit"
            )
        episode = self.inputs.episode_config(spec)
        tool_schemas = episode.tools.schemas() if episode is not None and episode.tools is not None else None
        source = await self.inputs.prompt_source(spec, tool_schemas)
        max_buffered = spec.max_buffered_groups or self.settings.default_max_buffered_groups
        if isinstance(source, OncePromptSource):  # room for the whole set: no consumer has to keep up
            max_buffered = spec.max_buffered_groups or min(source.size, MAX_BUFFERED_GROUPS)
        run = Run(
            run_id=run_id,
            spec=spec,
            source=source,
            broker=self._broker(run_id, spec, max_buffered),
            max_inflight=spec.max_inflight or self.settings.max_inflight,
            advantages=AdvantageComputer(spec.scale_rewards),
            episode=episode,
            owner=owner,
        )
        if isinstance(source, OncePromptSource):
            self.evaluations.admit(run, source.size, self.policy_version)
        return run

    def _start_run(self, run: Run) -> None:
        self.runs[run.run_id] = run
        if run.state == "running":  # a restored failed run generates nothing
            self.scheduler.start_run(run)
            self.weights.run_started(run)
        run.admission.on_change(lambda: self._save_run_state(run))  # what admission learned, as versions move
        spec = run.spec
        logger.info("created run %s (%s, G=%d)", run.run_id, spec.display_name or spec.source_kind, spec.group_size)

    def _run_failed(self, run: Run) -> None:
        self._save_run_state(run)
        self.weights.run_failed(run)

    def _save_run_state(self, run: Run) -> None:
        if run.spec.eval is None:  # an evaluation is not resumed after a restart
            self.store.save_run_state(run.run_id, run.stored_state())

    def _broker(self, run_id: str, spec: RunSpec, max_buffered: int) -> RunBroker:
        trains = spec.eval is None  # an evaluation's groups are never trained: staleness does not apply
        if spec.serve_adapter:  # its versions count its adapter pushes
            versions = PolicyVersion()
        elif self.weights.partitions is not None and trains:  # its own servers, pushed by its own trainer
            versions = PolicyVersion(self.versions.served)
        else:
            versions = self.versions
        version = versions.served
        paced = spec.admission == "paced" and trains and spec.max_staleness > 0
        admission = RunAdmission(
            run_id,
            self.metrics,
            max_staleness=spec.max_staleness if trains else None,
            versions=versions,
            await_version=version + 1 if spec.await_first_update and trains else 0,
            free_clock=self.scheduler.slots.free_seconds,
            lookahead=Lookahead(spec.max_staleness, max_mismatch_kl=spec.max_mismatch_kl) if paced else None,
        )
        lease_timeout_s = spec.lease_timeout_s or self.settings.lease_timeout_s
        store = self.store if trains else None  # an evaluation is not resumed after a restart: nothing to keep
        return RunBroker(
            run_id, max_buffered, self.metrics, lease_timeout_s=lease_timeout_s, admission=admission, store=store
        )

    async def delete_run(self, run_id: str) -> Run:
        """Stop the run and free what it holds: its buffered and leased groups, ack memory,
        prompt queue and metric series. Its record stays among the last deleted runs."""
        run = self.runs.require(run_id)
        if run_id in self.runs.deleted:
            return run  # deleting twice is a no-op
        if run.state == "running":
            run.state = "stopped"
        if run.eval is not None:
            self.evaluations.forget(run)
        await self.scheduler.stop_run(run)
        await self.weights.run_deleted(run_id)
        freed = run.broker.discard_all()
        self.store.delete_run(run_id)
        run.source.discard()
        self.metrics.forget_run(run_id)
        self.runs.retire(run_id)
        logger.info("deleted run %s (%d unconsumed groups freed)", run_id, freed)
        return run

    async def publish_adapter(self, run_id: str, files: dict[str, bytes]) -> tuple[int, str]:
        """Serve a new adapter of a serve_adapter run; returns its policy version and name."""
        run = self.runs.require(run_id)
        if not run.spec.serve_adapter:
            raise FailedPrecondition(
                f"run {run_id} samples from the base weights; create the run with serve_adapter to push adapters"
            )
        if run.state != "running":
            raise FailedPrecondition(f"run {run_id} is {run.state}; push adapters for a running run")
        if (adapters := self.weights.adapters) is None:
            raise FailedPrecondition(
                "this service's vLLM servers do not load LoRA adapters; start them with --enable-lora "
                "(managed servers: engine.managed.max_loras > 0) and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"
            )
        version = await adapters.publish(run_id, files)
        run.adapter = adapters.current(run_id)
        run.admission.set_policy_version(version)
        assert run.adapter is not None
        return version, run.adapter

    async def submit_prompts(
        self, run_id: str, prompts: Sequence[T], convert: Callable[[T], PromptSpec] | None = None
    ) -> tuple[int, int]:
        """Queue prompts for a submitted-prompts run; ``convert``: each prompt from its wire
        form, beside its rendering off the event loop. Returns (accepted, queued now)."""
        run = self.runs.require(run_id)
        if not isinstance(run.source, SubmittedPromptSource):
            raise FailedPrecondition(
                f"run {run_id} takes its prompts from its {run.spec.source_kind}; "
                "create the run with prompt_source.submitted to submit prompts"
            )
        if run.state != "running":
            raise FailedPrecondition(f"run {run_id} is {run.state}; submit to a running run")
        if not prompts:
            raise InvalidArgument("prompts is empty; submit at least one prompt")
        tools = run.episode.tools.schemas() if run.episode is not None and run.episode.tools is not None else None
        rendered = await self.inputs.render(prompts, run.spec.sampling.max_tokens, tools, convert)
        if run.state != "running":  # stopped or deleted while its prompts were rendered
            raise FailedPrecondition(f"run {run_id} is {run.state}; submit to a running run")
        await run.source.submit(rendered, functools.partial(self.store.put_prompts, run.run_id))
        return len(prompts), run.source.queued

    def server_info(self) -> ServerInfo:
        return ServerInfo(
            model=self.info.model,
            engine_urls=list(self.info.engine_urls),
            max_inflight=self.info.max_inflight,
            reward_functions=self.rewards.names(),
            datasets=sorted(BUILTIN_DATASETS),
            tools=self.tools.names(),
            tool_parsers=self.tools.parser_names(),
            environments=self.environments.names(),
            model_signature=self.info.model_signature,
        )

    def stats(self) -> ServiceStats:
        """The service-wide time accounting; cheap (running totals), so GetStats may poll it."""
        slots, sync = self.scheduler.slots, self.weights.weight_sync
        rate, window = self.scheduler.tokens.rate()
        return ServiceStats(
            slots_busy=self.scheduler.slots_busy,
            max_inflight=self.scheduler.max_inflight,
            max_slots_busy_seen=self.scheduler.max_slots_busy_seen,
            engine_request_failures=self.scheduler.engine_failures,
            uptime_seconds=self.clock() - self.started,
            tokens_generated=self.scheduler.tokens.total,
            recent_tokens_per_second=rate,
            recent_window_seconds=window,
            slot_seconds=slots.busy_seconds(),
            slots_busy_time_average=slots.busy_time_average(),
            weight_updates_committed=sync.updates_committed if sync is not None else 0,
            weight_updates_aborted=sync.updates_aborted if sync is not None else 0,
            weight_updates_resent=sync.updates_resent if sync is not None else 0,
            weight_update_paused_seconds=sync.paused_seconds() if sync is not None else 0.0,
            last_weight_update=sync.last_update if sync is not None else None,
            evals=self.evaluations.results(),
            engines=self.membership.states() if self.membership is not None else [],
        )

    def require_membership(self) -> PoolMembership:
        if self.membership is None:
            raise FailedPrecondition("this service's pool cannot change while it runs")
        return self.membership

    async def drain(self, grace_s: float) -> None:
        """The first step of a shutdown: runs start no group and hand out none; consumers
        get ``grace_s`` to ack or return what they hold."""
        runs = list(self.runs.values())
        for run in runs:
            await run.broker.drain()
        leased = sum(run.broker.num_leased for run in runs)
        if not leased:
            return
        logger.info("shutting down: up to %gs for consumers to ack their %d leased groups", grace_s, leased)
        try:
            async with asyncio.timeout(grace_s):
                await asyncio.gather(*(run.broker.wait_leases_settled() for run in runs))
        except TimeoutError:
            left = sum(run.broker.num_leased for run in runs)
            logger.warning("shutting down with %d groups still leased after %gs (shutdown_grace_s)", left, grace_s)

    async def close(self) -> None:
        for run in list(self.runs.values()):
            if run.state == "running":
                run.state = "stopped"
            await self.scheduler.stop_run(run)
        self.tools.close()
        # Not waiting for user code's threads: a hung call must not hold up the shutdown
        # (``shutdown_timeout_s`` ends the process).
        self.user_code_executor.shutdown(wait=False, cancel_futures=True)
