"""The weight-update control plane: the service drives vLLM's handshake, the trainer sends.

One update at a time, in two RPCs from the trainer:

- ``begin``: starts, in the background, the per-server pipeline
  [init the transfer group (first update, or after a failure), once the trainer's rendezvous
  accepts connections] -> pause -> start_weight_update
  -> update_weights (which returns once the trainer's broadcast has arrived). It returns at
  once, because the init and update steps wait on the trainer (it hosts the rendezvous as
  rank 0 and broadcasts only after begin returns).
- ``commit``: waits for the pipeline, then finish_weight_update (vLLM applies the weights),
  bumps the policy version and resumes generation. Cached KV of the old weights is not
  reused because every request is salted with its policy version (no prefix-cache reset,
  which vLLM refuses while requests run). vLLM's own label of the weights
  (``/weight_info``) is set after the commit, off the path that admission waits on.

A resend (the current version's weights again, for a restarted server that asked for them)
goes through the same steps but commits without a bump: the weights did not change, so the
groups sampled before are no staler than they were.

Invariant: every paused server is resumed, whatever happens. A pipeline that fails (the
trainer died mid-broadcast), a trainer that never commits (watchdog), or an explicit abort
all end in ``_abort``: the update is dropped, servers resume on the old weights and the
next update re-joins the transfer group, because a failed group cannot be trusted.

vLLM cannot cancel a weight-transfer call: a join or receive the service stopped waiting
for goes on in the server's engine, which generates nothing meanwhile (a join is bounded by
``join_timeout_s``, a receive by ``transfer_timeout_s``; a gloo join ends at once when the
trainer gives it up, and none is asked before the trainer listens). Such a server is held out of
routing, as stuck, until a leave queued behind that call answers (``_free``), and the
next begin waits for it instead of queueing another join behind it.

Time accounting: every update records the wall time of each phase (over all servers at
once) and how long generation was paused, from the first pause call to the end of resume,
so users see what a push costs the rollouts and where it goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout_service.config import APPLIES_AT_FINISH, WeightSyncSettings, no_pause_refused
from rollout_service.engine.control import PauseModeName, WeightControl, WeightSyncError
from rollout_service.errors import FailedPrecondition, echo
from rollout_service.metrics import ServiceMetrics
from rollout_service.versions import PolicyVersion
from rollout_service.weights.update_messages import (
    TensorSpec,
    UpdateTicket,
    UpdateTimes,
    init_info,
    leave_info,
    validate_begin,
)
from rollout_service.weights.version_holds import VersionHolds

logger = logging.getLogger(__name__)


@dataclass
class _Update:
    update_id: str
    run_id: str
    started: float
    pipeline: asyncio.Task[None] | None = None
    resend: bool = False
    """The weights of the current version again (``BeginWeightUpdateRequest.resend``)."""
    paused: set[str] = field(default_factory=set)
    in_vllm: dict[str, str] = field(default_factory=dict)
    """Servers running a call of this update that keeps their engine busy, by URL: which call."""
    aborted: str | None = None
    epoch: int = 0
    phases: dict[str, float] = field(default_factory=dict)
    paused_at: float | None = None
    """When the first pause call went out; None before it and after the resume."""
    paused_seconds: float = 0.0
    progressed_at: float = field(default_factory=lambda: asyncio.get_running_loop().time())
    """Loop time of the last step done (begin, a phase, the commit call): the watchdog's origin."""
    last_step: str = "begin"

    @property
    def commit_outcome(self) -> str:
        """What its commit counts as, in the log and the metric: a new version, or a resend."""
        return "resent" if self.resend else "committed"


RESUME_RETRY_S = 1.0
"""A failed /resume is retried after this, doubling, 3 times; then every 8x this in the
background until it works: a server left paused would never generate again."""
LISTEN_RETRY_S = 0.05


async def await_listening(address: str, port: int, timeout_s: float) -> None:
    """Wait until something accepts connections at the trainer's rendezvous.

    Why: vLLM cannot cancel a join, and its engine generates nothing while in one. Asked only
    once the trainer listens, a join is never left waiting for a trainer that never came, and
    an abort before then leaves nothing running in vLLM.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(address, port), max(LISTEN_RETRY_S, deadline - loop.time())
            )
        except (OSError, TimeoutError) as exc:
            if loop.time() + LISTEN_RETRY_S >= deadline:
                raise WeightSyncError(
                    f"{address}:{port}",
                    "join",
                    f"nothing accepted connections at the trainer's rendezvous within {timeout_s:g}s "
                    f"(weight_sync.join_timeout_s): {exc or type(exc).__name__}; the trainer's address must "
                    "be reachable from the service and from every vLLM server",
                    answered=True,
                ) from None
            await asyncio.sleep(LISTEN_RETRY_S)  # a backoff between attempts
        else:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            return


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
        on_commit: Callable[[int], None] = lambda version: None,
        metrics: ServiceMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        holds: VersionHolds | None = None,
        on_stuck: Callable[[str, str | None], None] = lambda url, reason: None,
    ) -> None:
        """``on_stuck``: told a server whose engine still runs a call of an aborted update,
        and why (its routing holds it), then None once it is free."""
        self.servers = list(servers)
        self.holds = holds or VersionHolds()
        """Evaluations holding the current version: an update waits for them (``version_holds``)."""
        self.pausing_update_pending = False
        """A begin that pauses the servers is waiting or in progress: no evaluation may start
        under it (the paused servers would never finish it)."""
        self.settings = settings
        self.versions = versions
        """The versions of the weights this coordinator pushes: it moves them, others watch."""
        self.updates_committed = 0
        """Commits that bumped the version (resends not counted)."""
        self.updates_resent = 0
        self.updates_aborted = 0
        self.last_update: UpdateTimes | None = None
        """Timing of the last committed or aborted update."""
        self._paused_seconds = 0.0
        self._metrics = metrics
        self._clock = clock
        self._on_commit = on_commit
        """Told each committed version, after ``versions``: the servers that waited for it may serve."""
        self._current: _Update | None = None
        self._no_update_running = asyncio.Event()
        """Set while ``_current`` is None: when the servers may change (``add_server``)."""
        self._no_update_running.set()
        self._last_aborted: _Update | None = None
        self._group: tuple[str, int] | None = None
        # Numbers the joins: each join's rendezvous keys get their own prefix in the trainer's
        # store. Started from the clock, so that a restarted service never reuses the epoch of
        # a join its predecessor made through the same long-lived store (a reconnecting trainer).
        self._epoch = time.time_ns() // 1_000_000 % 2**31
        self._world_sizes: list[int] | None = None
        self._lock = asyncio.Lock()
        self._labelling: asyncio.Task[None] | None = None
        """The last commit's ``_label``: the next one waits for it, so labels land in order."""
        self._tasks: set[asyncio.Task[Any]] = set()
        self.stuck_paused: set[str] = set()
        """Servers whose resume failed every retry; a background task keeps resuming them."""
        self._on_stuck = on_stuck
        self._freeing: dict[str, asyncio.Task[None]] = {}
        """Servers being freed of an aborted update's call (``_free``), by URL."""

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
        """Start an update; ``resend``: the trainer sends the current version's weights again;
        ``join``: the trainer holds no group, whatever its address and port."""
        validate_begin(trainer_address, trainer_port, tensors)
        if mode == "none" and self.settings.backend not in APPLIES_AT_FINISH:
            raise FailedPrecondition(no_pause_refused(self.settings.backend))
        async with self._lock:
            if self._current is not None:
                raise FailedPrecondition(
                    f"weight update {self._current.update_id} is in progress; commit or abort it first"
                )
            await self._await_freed()
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
            update = _Update(f"wu-{uuid.uuid4().hex[:10]}", run_id, self._clock(), resend=resend)
            if held_s:
                update.phases["eval_hold"] = held_s
            if join:
                self._epoch += 1
                update.epoch = self._epoch
            update_info = {
                "names": [t.name for t in tensors],
                "dtype_names": [t.dtype for t in tensors],
                "shapes": [list(t.shape) for t in tensors],
            }
            update.pipeline = self._spawn(
                self._receive(update, join, trainer_address, trainer_port, world_sizes, update_info, mode)
            )
            update.pipeline.add_done_callback(lambda task: self._pipeline_done(update, task))
            self._set_current(update)
            self.versions.begin(resend)
            self._spawn(self._watchdog(update))
        logger.info(
            "weight update %s begun for run %s (%d tensors, join=%s%s)",
            update.update_id,
            run_id,
            len(tensors),
            join,
            ", a resend of the current version" if resend else "",
        )
        return UpdateTicket(
            update.update_id, join, 1 + sum(world_sizes), self.settings.backend, self.version, update.epoch
        )

    async def prefetch_world_sizes(self) -> None:
        """Best effort at start-up, while the servers are idle: a server busy with its first
        batch of generation has been seen to take more than 30 s to answer."""
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

    async def _receive(
        self,
        update: _Update,
        join: bool,
        address: str,
        port: int,
        world_sizes: list[int],
        update_info: dict[str, Any],
        mode: PauseModeName,
    ) -> None:
        settings = self.settings
        transfer_s, control_s = settings.transfer_timeout_s, settings.control_timeout_s
        if join:
            self._group = None
            epoch = update.epoch
            offsets = [1 + sum(world_sizes[:i]) for i in range(len(world_sizes))]
            world = 1 + sum(world_sizes)
            join_s = min(settings.join_timeout_s, transfer_s)  # vLLM's bound on a gloo join
            # gloo's workers give up the join themselves: wait a control call longer than they do
            call_s = join_s + control_s if settings.backend == "gloo" else transfer_s
            await self._phase(update, "join", await_listening(address, port, join_s))
            await self._phase(
                update,
                "join",
                *(
                    self._in_vllm(
                        update,
                        server,
                        "join",
                        server.init_weight_transfer(
                            init_info(
                                settings.backend,
                                address,
                                port,
                                offset,
                                world,
                                transfer_s,
                                epoch,
                                join_s,
                            ),
                            call_s,
                        ),
                    )
                    for server, offset in zip(self.servers, offsets, strict=True)
                ),
            )
            self._group = (address, port)
        if mode != "none":  # none: generation goes on while the weights change (see PauseMode)
            # The paused window opens with the pause phase's clock, not when its calls get to run
            # (on a busy loop that is milliseconds later), so it spans every phase it holds.
            update.paused_at = self._clock()
            await self._phase(update, "pause", *(self._pause(update, server, mode) for server in self.servers))
        await self._phase(update, "transfer", self._transfer(update, update_info, control_s, transfer_s, join))

    async def _transfer(
        self, update: _Update, update_info: dict[str, Any], control_s: float, transfer_s: float, join: bool
    ) -> None:
        await asyncio.gather(*(self._start(server, control_s, join) for server in self.servers))
        await asyncio.gather(
            *(
                self._in_vllm(update, server, "receive", server.update_weights(update_info, transfer_s))
                for server in self.servers
            )
        )

    @staticmethod
    async def _in_vllm(update: _Update, server: WeightControl, call: str, answer: Awaitable[None]) -> None:
        """Await a call that keeps the server's engine busy; one not answered (cancelled by
        an abort, timed out) stays in ``update.in_vllm``: vLLM still runs it."""
        update.in_vllm[server.base_url] = call
        try:
            await answer
        except WeightSyncError as exc:
            if exc.answered:
                del update.in_vllm[server.base_url]
            raise
        del update.in_vllm[server.base_url]

    async def _label(self, version: int, after: asyncio.Task[None] | None) -> None:
        """After a commit, off its path: label the servers' weights with the version, so that
        vLLM's ``/weight_info`` (and the version it stamps on outputs) says what they serve.
        ``after``: the previous commit's labelling, which must not land after this one."""
        if after is not None:
            await asyncio.gather(after, return_exceptions=True)
        for server in list(self.servers):
            try:
                await server.set_weight_version(str(version), self.settings.control_timeout_s)
            except WeightSyncError as exc:
                logger.info("could not label %s's weights as version %d: %s", server.base_url, version, exc)

    async def _start(self, server: WeightControl, control_s: float, join: bool) -> None:
        """``/start_weight_update``. A service that died between a transfer and its commit
        leaves vLLM in the middle of that update ("already active"); a new service's first
        update (a join) closes it first with ``/finish_weight_update``, which applies
        nothing: joining dropped what the dead update had received (``vllm_gloo_transfer``)."""
        try:
            await server.start_weight_update(control_s)
        except WeightSyncError as exc:
            if not join or "already active" not in str(exc):
                raise
            # Left by a dead service; the join dropped whatever it had received, so finishing
            # it applies nothing.
            logger.info("%s has a weight update open; closing it before this one", server.base_url)
            await server.finish_weight_update(str(self.version), control_s)
            await server.start_weight_update(control_s)

    async def _phase(self, update: _Update, phase: str, *calls: Awaitable[Any]) -> None:
        """Run one phase on every server at once and record its wall time, failed or not."""
        started = self._clock()
        try:
            await asyncio.gather(*calls)
            self._progressed(update, phase)
        finally:
            update.phases[phase] = update.phases.get(phase, 0.0) + self._clock() - started

    async def _pause(self, update: _Update, server: WeightControl, mode: PauseModeName) -> None:
        update.paused.add(server.base_url)  # before the call: a pause that times out may still land
        await server.pause(mode, self.settings.control_timeout_s)

    def _pipeline_done(self, update: _Update, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        self._spawn(self._abort(update, f"receiving failed: {task.exception()}"))

    async def _watchdog(self, update: _Update) -> None:
        """Abort an update that makes no progress for the limit: measured from its last step,
        not from begin, so a long but moving transfer of a large model is not cut off."""
        limit = self.settings.transfer_timeout_s + 2 * self.settings.control_timeout_s
        loop = asyncio.get_running_loop()
        while self._current is update and update.aborted is None:
            idle = loop.time() - update.progressed_at
            if idle >= limit:
                await self._abort(update, f"not committed: no progress for {limit:g}s after {update.last_step}")
                return
            await asyncio.sleep(limit - idle)  # a timer, not synchronisation

    @staticmethod
    def _progressed(update: _Update, step: str) -> None:
        update.progressed_at = asyncio.get_running_loop().time()
        update.last_step = step

    # -- commit / abort ------------------------------------------------------------------
    async def commit(self, update_id: str) -> tuple[int, float]:
        update = self._get(update_id)
        assert update.pipeline is not None
        # No progress of its own: a trainer asks for the commit while it still sends (to
        # hear of an abort at once), so the watchdog keeps timing the receive.
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
                self._progressed(update, "eval_hold")
            try:
                # No label here: vLLM sets it in a second engine-core call after the apply, one
                # engine step or more during which the version, and with it staleness
                # admission, would wait. ``_label`` sets it after.
                await self._phase(update, "finish", *(s.finish_weight_update(None, control_s) for s in self.servers))
            except WeightSyncError as exc:
                # Some servers may have applied the weights: the group and the versions are
                # no longer trustworthy, so the next update re-joins and re-sends everything.
                await self._abort_locked(update, f"applying failed: {exc}")
                raise FailedPrecondition(self._aborted_message(update)) from None
            self.pausing_update_pending = False  # before the news: an evaluation may start on it
            self.versions.commit(new_version)
            self._on_commit(new_version)
            await self._resume(update)
            self._set_current(None)
            self._labelling = self._spawn(self._label(new_version, self._labelling))
            if update.resend:
                self.updates_resent += 1
            else:
                self.updates_committed += 1
            self._finished(update, committed=True)
        seconds = self._clock() - update.started
        outcome = update.commit_outcome
        logger.info("weight update %s %s: policy version %d (%.2fs)", update_id, outcome, new_version, seconds)
        return new_version, seconds

    def _set_current(self, update: _Update | None) -> None:
        """The update in progress (None: none), and the event membership changes wait on."""
        self._current = update
        if update is None:
            self._no_update_running.set()
        else:
            self._no_update_running.clear()

    @property
    def update_in_progress(self) -> bool:
        """Between a begin and its commit or abort (the servers may hold either version)."""
        return self._current is not None

    async def add_server(self, server: WeightControl, joined: Callable[[], None] = lambda: None) -> None:
        """A server joins the pool (``PoolMembership``): from the next update on it is one of
        the servers, and that update joins a fresh transfer group that includes it. Its world
        size is asked now, while it takes no requests (a busy server can take seconds).
        ``joined`` runs in the same step, before any update can begin with the new server."""
        world_size = await server.world_size(self.settings.control_timeout_s)
        async with self._between_updates():
            self.servers.append(server)
            if self._world_sizes is not None:
                self._world_sizes.append(world_size)
            self._group = None
            joined()

    async def remove_server(self, url: str) -> None:
        """A drained server leaves: the next update joins a fresh group without it (the old
        group's broadcasts would wait for it forever)."""
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
        """Hold the lock at a moment no update is in progress: an update's servers must not
        change between its begin and its commit or abort."""
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
        """A server came back as a new process, outside the transfer group: the next update
        joins a fresh group (an update in flight fails on the old process and aborts)."""
        self._group = None

    async def abort(self, update_id: str, reason: str) -> int:
        update = self._get(update_id)
        await self._abort(update, reason or "aborted by the trainer")
        return self.version

    async def _abort(self, update: _Update, reason: str) -> None:
        async with self._lock:
            await self._abort_locked(update, reason)

    async def _abort_locked(self, update: _Update, reason: str) -> None:
        if update.aborted is not None or self._current is not update:
            return
        update.aborted = reason
        self._last_aborted = update
        if update.pipeline is not None and not update.pipeline.done():
            update.pipeline.cancel()
            # The pipeline's own outcome (cancelled, or failed) is what the abort replaces; a
            # cancellation of this abort itself still propagates.
            await asyncio.gather(update.pipeline, return_exceptions=True)
        self._group = None  # a failed transfer group cannot be trusted: re-join next time
        for url, call in update.in_vllm.items():
            server = next((server for server in self.servers if server.base_url == url), None)
            if server is not None and url not in self._freeing:
                self._freeing[url] = self._spawn(self._free(server, update.update_id, call))
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

    async def _free(self, server: WeightControl, update_id: str, call: str) -> None:
        """Hold ``server`` out of routing until its engine is done with the aborted update's
        call: a leave sent now is run after it, so its answer says the engine is free (and
        the leave drops what the call joined or received)."""
        bound = "weight_sync.join_timeout_s" if call == "join" else "weight_sync.transfer_timeout_s"
        reason = (
            f"its engine still runs the {call} of aborted weight update {update_id} and generates nothing "
            f"until that ends (at most {bound})"
        )
        self._on_stuck(server.base_url, reason)
        settings = self.settings
        timeout = settings.join_timeout_s + settings.transfer_timeout_s + settings.control_timeout_s
        try:
            for attempt in range(3):
                if attempt:
                    await asyncio.sleep(RESUME_RETRY_S)  # a backoff before asking again
                if await self._release_transfer(server, timeout):
                    return
            logger.error(
                "%s did not answer a leave after aborted update %s; its health probes decide",
                server.base_url,
                update_id,
            )
        finally:
            self._freeing.pop(server.base_url, None)
            self._on_stuck(server.base_url, None)

    async def _await_freed(self) -> None:
        """Before a begin: wait (a control timeout at most) for servers still busy with an
        aborted update's call, so a join is never queued behind another."""
        if not self._freeing:
            return
        _, busy = await asyncio.wait(list(self._freeing.values()), timeout=self.settings.control_timeout_s)
        if busy:
            urls = ", ".join(url for url, task in self._freeing.items() if task in busy)
            raise FailedPrecondition(
                f"{urls} still run a call of an aborted weight update (vLLM cannot cancel it); push again "
                "once it ends, within weight_sync.join_timeout_s for a join or transfer_timeout_s for a transfer"
            )

    async def _resume(self, update: _Update) -> None:
        started = self._clock()
        for server in self.servers:
            if server.base_url in update.paused and not await self._resume_server(server):
                logger.error(
                    "could not resume %s after weight update %s; retrying in the background",
                    server.base_url,
                    update.update_id,
                )
                self._keep_resuming(server)
        update.paused.clear()
        if update.paused_at is not None:
            now = self._clock()
            update.phases["resume"] = now - started
            update.paused_seconds = now - update.paused_at
            update.paused_at = None
            self._paused_seconds += update.paused_seconds
            if self._metrics is not None:
                self._metrics.weight_update_paused_seconds.inc(update.paused_seconds)

    async def _resume_server(self, server: WeightControl, attempts: int = 3) -> bool:
        """Resume one server, retrying with a doubling delay; False if every attempt failed."""
        delay = RESUME_RETRY_S
        for attempt in range(attempts):
            try:
                await server.resume(self.settings.control_timeout_s)
                return True
            except Exception as exc:  # WeightSyncError, or anything unexpected: it must not stay paused
                logger.warning("resume of %s failed (attempt %d/%d): %s", server.base_url, attempt + 1, attempts, exc)
            if attempt + 1 < attempts:
                await asyncio.sleep(delay)  # a backoff before the next attempt
                delay *= 2
        return False

    def _keep_resuming(self, server: WeightControl) -> None:
        if server.base_url in self.stuck_paused:
            return
        self.stuck_paused.add(server.base_url)

        async def retry() -> None:
            resumed = False
            while not resumed and server in self.servers:  # a removed server is no longer ours to resume
                await asyncio.sleep(8 * RESUME_RETRY_S)  # a retry period, not synchronisation
                resumed = await self._resume_server(server, attempts=1)
            self.stuck_paused.discard(server.base_url)
            logger.info("%s resumed after earlier failures", server.base_url)

        self._spawn(retry())

    async def resume_left_paused(self) -> list[str]:
        """At start-up: resume servers a previous service left paused (it died mid-update);
        returns their URLs. A server that cannot say is left alone (it may be down)."""
        resumed = []
        for server in self.servers:
            try:
                paused = await server.is_paused(self.settings.control_timeout_s)
            except WeightSyncError as exc:
                logger.info("could not ask %s whether it is paused: %s", server.base_url, exc)
                continue
            if paused:
                logger.warning("%s was left paused (a service died mid-update?); resuming it", server.base_url)
                if not await self._resume_server(server):
                    self._keep_resuming(server)
                resumed.append(server.base_url)
        return resumed

    async def release_left_transfer(self, skip: frozenset[str] = frozenset()) -> list[str]:
        """At start-up: drop the servers' side of a transfer group a previous service left
        open, with any update it left started; returns the URLs of the servers that answered.
        Servers in ``skip`` (ones this service has just started) are left alone: they hold no
        group, and on gloo closing the update there would only print vLLM's traceback for a
        finish without a start into their log.

        Why: a service that dies between a begin and the servers' receive leaves the
        trainer's broadcast waiting on workers that will never receive, and gloo holds it
        until the group's timeout (minutes), the trainer with it. Dropping the workers' side
        fails that broadcast at once; the trainer's push fails, it reconnects, and its next
        push joins afresh (a new service's first update always joins). On gloo a leave-only
        init drops the group and whatever the dead update received, so closing the update
        after it applies nothing; other backends get vLLM's own release, which it refuses
        mid-update (the next join closes such an update, ``_start``)."""
        servers = [server for server in self.servers if server.base_url not in skip]
        answered = await asyncio.gather(*(self._release_transfer(server) for server in servers))
        return [server.base_url for server, ok in zip(servers, answered, strict=True) if ok]

    async def _release_transfer(self, server: WeightControl, timeout_s: float | None = None) -> bool:
        """Drop the server's side of the group and close an update left open; whether it answered."""
        timeout = timeout_s or self.settings.control_timeout_s
        try:
            if self.settings.backend != "gloo":
                await server.shutdown_weight_transfer(timeout)
                return True
            await server.init_weight_transfer(leave_info(), timeout)
            try:  # no label: only a commit says which version a server holds (``ServerRecovery``)
                await server.finish_weight_update(None, timeout)
                logger.info("closed the weight update a previous service left open on %s", server.base_url)
            except WeightSyncError as exc:
                if "without a matching start" not in str(exc):
                    raise
        except WeightSyncError as exc:
            logger.info("could not release %s's weight-transfer group: %s", server.base_url, exc)
            return exc.answered
        return True

    def paused_seconds(self) -> float:
        """Seconds generation was paused for updates since start; one in progress counts up to now."""
        current = self._current
        running = current.paused_at if current is not None else None
        return self._paused_seconds + (self._clock() - running if running is not None else 0.0)

    def _finished(self, update: _Update, committed: bool) -> None:
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

    def _get(self, update_id: str) -> _Update:
        current = self._current
        if self._last_aborted is not None and self._last_aborted.update_id == update_id:
            raise FailedPrecondition(self._aborted_message(self._last_aborted))
        if current is None or current.update_id != update_id:
            raise not_in_progress(update_id)
        return current

    def _aborted_message(self, update: _Update) -> str:
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
