"""One weight update's per-server pipeline: join the trainer's group (once it listens), pause,
start and receive; each phase timed over all servers, and each call that keeps an engine busy
recorded until it answers (vLLM cannot cancel it: ``server_repair``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from rollout_service.config import WeightSyncSettings
from rollout_service.engine.control import PauseModeName, WeightControl, WeightSyncError
from rollout_service.weights.update_messages import init_info

logger = logging.getLogger(__name__)


@dataclass
class Update:
    """One weight update, from its begin to its commit or abort."""

    update_id: str
    run_id: str
    started: float
    pipeline: asyncio.Task[None] | None = None
    resend: bool = False
    """The weights of the current version again (``BeginWeightUpdateRequest.resend``)."""
    delta: bool = False
    """Some tensors travel sparse (``update_messages.is_delta``)."""
    keeps_base: bool = False
    """The servers keep what it makes as the base of the next delta."""
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


LISTEN_RETRY_S = 0.05


async def await_listening(address: str, port: int, timeout_s: float) -> None:
    """Wait until the trainer's rendezvous accepts connections: vLLM cannot cancel a join, and its
    engine generates nothing in one, so a join is asked only once the trainer listens."""
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


class UpdatePipeline:
    def __init__(
        self,
        servers: list[WeightControl],
        settings: WeightSyncSettings,
        clock: Callable[[], float],
        version: Callable[[], int],
    ) -> None:
        """``servers``: the coordinator's own list; ``version``: the version the servers hold."""
        self.servers = servers
        self.settings = settings
        self._clock = clock
        self._version = version

    async def run(
        self,
        update: Update,
        join: bool,
        address: str,
        port: int,
        world_sizes: list[int],
        update_info: dict[str, Any],
        mode: PauseModeName,
        on_joined: Callable[[], None],
    ) -> None:
        """Join (when asked), pause, start and receive on every server; ``on_joined``: told once joined."""
        settings = self.settings
        transfer_s, control_s = settings.transfer_timeout_s, settings.control_timeout_s
        if join:
            epoch = update.epoch
            offsets = [1 + sum(world_sizes[:i]) for i in range(len(world_sizes))]
            world = 1 + sum(world_sizes)
            join_s = min(settings.join_timeout_s, transfer_s)  # vLLM's bound on a gloo join
            # gloo's workers give up the join themselves: wait a control call longer than they do
            call_s = join_s + control_s if settings.backend == "gloo" else transfer_s
            await self.phase(update, "join", await_listening(address, port, join_s))
            await self.phase(
                update,
                "join",
                *(
                    self._in_vllm(
                        update,
                        server,
                        "join",
                        server.init_weight_transfer(
                            init_info(settings.backend, address, port, offset, world, transfer_s, epoch, join_s), call_s
                        ),
                    )
                    for server, offset in zip(self.servers, offsets, strict=True)
                ),
            )
            on_joined()
        if mode != "none":  # none: generation goes on while the weights change (see PauseMode)
            # From the pause phase's clock, not when its calls run, so the window spans every phase it holds.
            update.paused_at = self._clock()
            await self.phase(update, "pause", *(self._pause(update, server, mode) for server in self.servers))
        await self.phase(update, "transfer", self._transfer(update, update_info, control_s, transfer_s, join))

    async def _transfer(
        self, update: Update, update_info: dict[str, Any], control_s: float, transfer_s: float, join: bool
    ) -> None:
        await asyncio.gather(*(self._start(server, control_s, join) for server in self.servers))
        await asyncio.gather(
            *(
                self._in_vllm(update, server, "receive", server.update_weights(update_info, transfer_s))
                for server in self.servers
            )
        )

    @staticmethod
    async def _in_vllm(update: Update, server: WeightControl, call: str, answer: Awaitable[None]) -> None:
        """Await a call that keeps the engine busy; one not answered stays in ``update.in_vllm``: vLLM runs it."""
        update.in_vllm[server.base_url] = call
        try:
            await answer
        except WeightSyncError as exc:
            if exc.answered:
                del update.in_vllm[server.base_url]
            raise
        del update.in_vllm[server.base_url]

    async def _start(self, server: WeightControl, control_s: float, join: bool) -> None:
        """``/start_weight_update``; on a join, first close an update a dead service left "already active"."""
        try:
            await server.start_weight_update(control_s)
        except WeightSyncError as exc:
            if not join or "already active" not in str(exc):
                raise
            # The join dropped what the dead update received, so finishing it applies nothing.
            logger.info("%s has a weight update open; closing it before this one", server.base_url)
            await server.finish_weight_update(str(self._version()), control_s)
            await server.start_weight_update(control_s)

    async def phase(self, update: Update, phase: str, *calls: Awaitable[Any]) -> None:
        """Run one phase on every server at once and record its wall time, failed or not."""
        started = self._clock()
        try:
            await asyncio.gather(*calls)
            self.progressed(update, phase)
        finally:
            update.phases[phase] = update.phases.get(phase, 0.0) + self._clock() - started

    async def _pause(self, update: Update, server: WeightControl, mode: PauseModeName) -> None:
        update.paused.add(server.base_url)  # before the call: a pause that times out may still land
        await server.pause(mode, self.settings.control_timeout_s)

    @staticmethod
    def progressed(update: Update, step: str) -> None:
        update.progressed_at = asyncio.get_running_loop().time()
        update.last_step = step
