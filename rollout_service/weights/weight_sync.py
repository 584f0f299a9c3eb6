"""The weight-update control plane: the service drives vLLM's handshake, the trainer sends.

One update at a time: ``begin`` starts the per-server pipeline (``update_pipeline``) in the
background and returns at once, since the trainer broadcasts only after begin returns;
``commit`` waits for it, applies the weights, moves the policy version and resumes generation.
Every request is salted with its policy version, so old KV blocks are never reused.

Invariant: every paused server is resumed, whatever happens: a failed pipeline, the watchdog
and an explicit abort all end in ``_abort``, and the next update re-joins the transfer group.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from rollout_service.config import APPLIES_AT_FINISH, WeightSyncSettings, no_pause_refused
from rollout_service.engine.control import PauseModeName, WeightControl, WeightSyncError
from rollout_service.errors import FailedPrecondition, echo
from rollout_service.metrics import ServiceMetrics
from rollout_service.versions import PolicyVersion
from rollout_service.weights.server_repair import ServerRepair
from rollout_service.weights.update_messages import (
    TensorSpec,
    UpdateTicket,
    UpdateTimes,
    is_delta,
    update_info,
    validate_begin,
    wire_bytes,
)
from rollout_service.weights.update_pipeline import Update, UpdatePipeline
from rollout_service.weights.version_holds import VersionHolds

logger = logging.getLogger(__name__)


DELTA_REFUSED = "this push is a delta, which the servers cannot take now"
"""Begins every refusal of a delta push: the trainer pushes in full on seeing it."""
DELTA_MISMATCH = "delta checksum mismatch"
"""In the error of a server whose weights after a delta differ from the trainer's (``vllm_gloo_transfer.delta``)."""


def not_in_progress(update_id: str) -> FailedPrecondition:
    """The error for a commit or abort of an update no coordinator has in progress."""
    return FailedPrecondition(
        f"weight update {echo(update_id)} is not in progress (it was committed, aborted or never begun); "
        "call BeginWeightUpdate again"
    )


class WeightSyncCoordinator:
    def __init__(
        self,
        servers: Sequence[WeightControl],
        settings: WeightSyncSettings,
        versions: PolicyVersion,
        metrics: ServiceMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        holds: VersionHolds | None = None,
        on_stuck: Callable[[str, str | None], None] = lambda url, reason: None,
    ) -> None:
        """``on_stuck``: told a server still running an aborted update's call, and why; None once free."""
        self.servers = list(servers)
        self.holds = holds or VersionHolds()
        """Evaluations holding the current version: an update waits for them (``version_holds``)."""
        self.pausing_update_pending = False
        """A pausing begin waits or runs: no evaluation may start (paused servers would never finish it)."""
        self.settings = settings
        self.versions = versions
        """The versions of the weights this coordinator pushes: it moves them, others watch."""
        self.updates_committed = 0
        """Commits that bumped the version (resends not counted)."""
        self.updates_resent = 0
        self.updates_aborted = 0
        self.last_update: UpdateTimes | None = None
        self._paused_seconds = 0.0
        self._metrics = metrics
        self._clock = clock
        self._current: Update | None = None
        self._no_update_running = asyncio.Event()
        """Set while ``_current`` is None: when the servers may change (``add_server``)."""
        self._no_update_running.set()
        self._last_aborted: Update | None = None
        self._group: tuple[str, int] | None = None
        # Prefixes each join's rendezvous keys; from the clock, so a restarted service never
        # reuses an epoch of its predecessor in a reconnecting trainer's long-lived store.
        self._epoch = time.time_ns() // 1_000_000 % 2**31
        self._world_sizes: list[int] | None = None
        self._deltas_in_a_row = 0
        """Committed delta pushes since the last full push the servers kept as a base."""
        self._lock = asyncio.Lock()
        self._labelling: asyncio.Task[None] | None = None
        """The last commit's ``_label``: the next one waits for it, so labels land in order."""
        self._tasks: set[asyncio.Task[Any]] = set()
        self.repair = ServerRepair(self.servers, settings, on_stuck, self._spawn)
        self._steps = UpdatePipeline(self.servers, settings, clock, lambda: self.version)

    # -- begin ---------------------------------------------------------------------------
    async def begin(
        self,
        run_id: str,
        trainer_address: str,
        trainer_port: int,
        tensors: list[TensorSpec],
        mode: PauseModeName,
        resend: bool = False,
        join: bool = False,
    ) -> UpdateTicket:
        """Start an update; ``resend``: the current version's weights again; ``join``: the trainer holds no group."""
        validate_begin(trainer_address, trainer_port, tensors)
        if mode == "none" and self.settings.backend not in APPLIES_AT_FINISH:
            raise FailedPrecondition(no_pause_refused(self.settings.backend))
        async with self._lock:
            if self._current is not None:
                raise FailedPrecondition(
                    f"weight update {self._current.update_id} is in progress; commit or abort it first"
                )
            await self.repair.await_freed()
            held_s = 0.0
            self.pausing_update_pending = mode != "none"
            try:
                if mode != "none":  # paused servers could not finish an evaluation: wait for it first
                    held_s = await self.holds.wait_released(self.settings.eval_hold_timeout_s)
                world_sizes = await self._worker_world_sizes()
            except BaseException:
                self.pausing_update_pending = False
                raise
            join = join or self._group != (trainer_address, trainer_port)
            delta, keep_base = is_delta(tensors), self.settings.delta and tensors[0].encoding != ""
            if delta and (refused := self._delta_refused(join)):
                self.pausing_update_pending = False
                raise refused
            update = Update(
                f"wu-{uuid.uuid4().hex[:10]}", run_id, self._clock(), resend=resend, delta=delta, keeps_base=keep_base
            )
            if held_s:
                update.phases["eval_hold"] = held_s
            if join:
                self._epoch += 1
                update.epoch = self._epoch
            announced = update_info(tensors, keep_base)
            if self._metrics is not None:
                self._metrics.weight_update_bytes.labels("delta" if delta else "full").inc(wire_bytes(tensors))
            if join:
                self._group = None

            def joined() -> None:
                self._group = (trainer_address, trainer_port)

            update.pipeline = self._spawn(
                self._steps.run(update, join, trainer_address, trainer_port, world_sizes, announced, mode, joined)
            )
            update.pipeline.add_done_callback(lambda task: self._pipeline_done(update, task))
            self._set_current(update)
            self.versions.begin(resend)
            self._spawn(self._watchdog(update))
        logger.info(
            "weight update %s begun for run %s (%d tensors, %s, join=%s%s)",
            update.update_id,
            run_id,
            len(tensors),
            "a delta" if delta else "full",
            join,
            ", a resend of the current version" if resend else "",
        )
        return UpdateTicket(
            update.update_id,
            join,
            1 + sum(world_sizes),
            self.settings.backend,
            self.version,
            update.epoch,
            delta_allowed=self.settings.delta,
        )

    def _delta_refused(self, join: bool) -> FailedPrecondition | None:
        """Why a delta push cannot go now (the trainer then pushes in full), counted; None: it can."""
        if not self.settings.delta:
            reason, why = "off", "weight_sync.delta is off"
        elif join:
            reason, why = (
                "join",
                (
                    "the servers join a fresh transfer group first (the first push, a server that joined or "
                    "restarted, or a failed update), and a joined server holds no base to patch"
                ),
            )
        elif self._deltas_in_a_row >= self.settings.full_push_every:
            reason = "due"
            why = f"a full push is due after {self._deltas_in_a_row} deltas (weight_sync.full_push_every)"
        else:
            return None
        if self._metrics is not None:
            self._metrics.weight_delta_refused.labels(reason).inc()
        return FailedPrecondition(f"{DELTA_REFUSED}: {why}; push in full")

    async def prefetch_world_sizes(self) -> None:
        """Best effort at start-up, while the servers are idle: a busy server can be slow to answer."""
        try:
            await self._worker_world_sizes()
        except FailedPrecondition as exc:
            logger.info("world sizes not known yet (%s); asking again at the first weight update", exc)

    async def _worker_world_sizes(self) -> list[int]:
        if self._world_sizes is None:
            timeout = self.settings.control_timeout_s
            try:
                self._world_sizes = list(await asyncio.gather(*(s.world_size(timeout) for s in self.servers)))
            except WeightSyncError as exc:
                raise FailedPrecondition(f"cannot reach a vLLM server's control endpoints: {exc}") from None
        return self._world_sizes

    async def _label(self, version: int, after: asyncio.Task[None] | None) -> None:
        """Label the servers' weights (``/weight_info``) off the commit's path, once ``after`` (the last) is done."""
        if after is not None:
            await asyncio.gather(after, return_exceptions=True)
        for server in list(self.servers):
            try:
                await server.set_weight_version(str(version), self.settings.control_timeout_s)
            except WeightSyncError as exc:
                logger.info("could not label %s's weights as version %d: %s", server.base_url, version, exc)

    def _pipeline_done(self, update: Update, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        self._spawn(self._abort(update, f"receiving failed: {task.exception()}"))

    async def _watchdog(self, update: Update) -> None:
        """Abort an update idle for the limit, from its last step: a long but moving transfer goes on."""
        limit = self.settings.transfer_timeout_s + 2 * self.settings.control_timeout_s
        loop = asyncio.get_running_loop()
        while self._current is update and update.aborted is None:
            idle = loop.time() - update.progressed_at
            if idle >= limit:
                await self._abort(update, f"not committed: no progress for {limit:g}s after {update.last_step}")
                return
            await asyncio.sleep(limit - idle)  # a timer, not synchronisation

    # -- commit / abort ------------------------------------------------------------------
    async def commit(self, update_id: str) -> tuple[int, float]:
        update = self._get(update_id)
        assert update.pipeline is not None
        # No progress of its own: the trainer commits while still sending, so the watchdog times the receive.
        try:
            await asyncio.shield(update.pipeline)
        except asyncio.CancelledError:
            if not update.pipeline.cancelled():
                raise  # this RPC was cancelled; the watchdog still guards the update
            raise FailedPrecondition(self._aborted_message(update)) from None
        except Exception as exc:
            await self._abort(update, f"receiving failed: {exc}")
            raise FailedPrecondition(self._aborted_message(update)) from None
        async with self._lock:
            if update.aborted is not None:
                raise FailedPrecondition(self._aborted_message(update))
            new_version = self.version if update.resend else self.version + 1
            control_s = self.settings.control_timeout_s
            # Under the lock: nothing can abort the update while it waits for the evaluations.
            if held_s := await self.holds.wait_released(self.settings.eval_hold_timeout_s):
                update.phases["eval_hold"] = update.phases.get("eval_hold", 0.0) + held_s
                self._steps.progressed(update, "eval_hold")
            try:
                # No label: vLLM's second engine call would hold up the version (and admission); ``_label`` follows.
                await self._steps.phase(
                    update, "finish", *(s.finish_weight_update(None, control_s) for s in self.servers)
                )
            except WeightSyncError as exc:
                # Some servers may have applied them: the next update re-joins and re-sends everything.
                await self._abort_locked(update, f"applying failed: {exc}")
                raise FailedPrecondition(self._aborted_message(update)) from None
            self.pausing_update_pending = False  # before the news: an evaluation may start on it
            self.versions.commit(new_version)  # its watchers: the servers that waited for it may serve
            await self._resume(update)
            self._set_current(None)
            self._labelling = self._spawn(self._label(new_version, self._labelling))
            if update.keeps_base:
                self._deltas_in_a_row = self._deltas_in_a_row + 1 if update.delta else 0
            if update.resend:
                self.updates_resent += 1
            else:
                self.updates_committed += 1
            self._finished(update, committed=True)
        seconds = self._clock() - update.started
        outcome = update.commit_outcome
        logger.info("weight update %s %s: policy version %d (%.2fs)", update_id, outcome, new_version, seconds)
        return new_version, seconds

    def _set_current(self, update: Update | None) -> None:
        """The update in progress (None: none), and the event membership changes wait on."""
        self._current = update
        if update is None:
            self._no_update_running.set()
        else:
            self._no_update_running.clear()

    async def add_server(self, server: WeightControl, joined: Callable[[], None] = lambda: None) -> None:
        """``server`` joins from the next update on, in a fresh group; its world size is asked now,
        while it is idle. ``joined`` runs before any update can begin with it."""
        world_size = await server.world_size(self.settings.control_timeout_s)
        async with self._between_updates():
            self.servers.append(server)
            if self._world_sizes is not None:
                self._world_sizes.append(world_size)
            self._group = None
            joined()

    async def remove_server(self, url: str) -> None:
        """A drained server leaves: the next update joins a fresh group (the old one would wait for it)."""
        async with self._between_updates():
            index = next((i for i, server in enumerate(self.servers) if server.base_url == url), None)
            if index is None:
                return
            del self.servers[index]
            if self._world_sizes is not None:
                del self._world_sizes[index]
            self._group = None

    @contextlib.asynccontextmanager
    async def _between_updates(self) -> AsyncIterator[None]:
        """Hold the lock while no update is in progress: an update's servers must not change under it."""
        while True:
            await self._no_update_running.wait()
            await self._lock.acquire()
            if self._current is None:
                break
            self._lock.release()  # another update began in between: wait for it too
        try:
            yield
        finally:
            self._lock.release()

    @property
    def version(self) -> int:
        """The version the servers hold."""
        return self.versions.served

    def server_restarted(self) -> None:
        """A server came back outside the transfer group: the next update joins a fresh one."""
        self._group = None

    async def abort(self, update_id: str, reason: str) -> int:
        update = self._get(update_id)
        await self._abort(update, reason or "aborted by the trainer")
        return self.version

    async def _abort(self, update: Update, reason: str) -> None:
        async with self._lock:
            await self._abort_locked(update, reason)

    async def _abort_locked(self, update: Update, reason: str) -> None:
        if update.aborted is not None or self._current is not update:
            return
        update.aborted = reason
        self._last_aborted = update
        if DELTA_MISMATCH in reason and self._metrics is not None:
            self._metrics.weight_delta_refused.labels("mismatch").inc()
        if update.pipeline is not None and not update.pipeline.done():
            update.pipeline.cancel()
            # The abort replaces the pipeline's outcome; a cancellation of this abort still propagates.
            await asyncio.gather(update.pipeline, return_exceptions=True)
        self._group = None  # a failed transfer group cannot be trusted: re-join next time
        for url, call in update.in_vllm.items():
            self.repair.free(url, update.update_id, call)
        try:
            await self._resume(update)
        finally:  # whatever the resume raised, the update is over: later begins must work
            self._set_current(None)
            self.pausing_update_pending = False  # before the news: an evaluation may start on it
            self.versions.abort()
            self.updates_aborted += 1
            self._finished(update, committed=False)
        logger.warning(
            "weight update %s aborted (%s); generation resumed on policy version %d",
            update.update_id,
            reason,
            self.version,
        )

    async def _resume(self, update: Update) -> None:
        started = self._clock()
        for server in self.servers:
            if server.base_url in update.paused and not await self.repair.resume(server):
                logger.error(
                    "could not resume %s after weight update %s; retrying in the background",
                    server.base_url,
                    update.update_id,
                )
                self.repair.keep_resuming(server)
        update.paused.clear()
        if update.paused_at is not None:
            now = self._clock()
            update.phases["resume"] = now - started
            update.paused_seconds = now - update.paused_at
            update.paused_at = None
            self._paused_seconds += update.paused_seconds
            if self._metrics is not None:
                self._metrics.weight_update_paused_seconds.inc(update.paused_seconds)

    def paused_seconds(self) -> float:
        """Seconds generation was paused for updates since start; one in progress counts up to now."""
        current = self._current
        running = current.paused_at if current is not None else None
        return self._paused_seconds + (self._clock() - running if running is not None else 0.0)

    def _finished(self, update: Update, committed: bool) -> None:
        """Record where the update's seconds went (``_resume`` has closed its pause)."""
        self.last_update = UpdateTimes(update.update_id, committed, dict(update.phases), update.paused_seconds)
        if self._metrics is not None:
            self._metrics.weight_updates.labels(update.commit_outcome if committed else "aborted").inc()
            for phase, seconds in update.phases.items():
                self._metrics.weight_update_phase_seconds.labels(phase).observe(seconds)

    def run_of(self, update_id: str) -> str | None:
        """The run that began this update (in progress, or the last aborted); None: unknown."""
        for update in (self._current, self._last_aborted):
            if update is not None and update.update_id == update_id:
                return update.run_id
        return None

    def _get(self, update_id: str) -> Update:
        current = self._current
        if self._last_aborted is not None and self._last_aborted.update_id == update_id:
            raise FailedPrecondition(self._aborted_message(self._last_aborted))
        if current is None or current.update_id != update_id:
            raise not_in_progress(update_id)
        return current

    def _aborted_message(self, update: Update) -> str:
        return (
            f"weight update {update.update_id} was aborted ({update.aborted}); generation resumed on "
            f"policy version {self.version}; begin a new update (the trainer must re-join the group)"
        )

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        if self._current is not None:
            await self._abort(self._current, "service shutting down")
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
