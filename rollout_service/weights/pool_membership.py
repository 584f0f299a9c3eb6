"""vLLM servers join and leave the pool while the service runs (AddEngine, RemoveEngine, DNS).

Beside the weights because a server may take a run's requests only while it holds that run's
policy: a joining server is added held, gets the adapters, joins the weight-sync servers between
two updates and takes requests once it holds the base policy (``ServerRecovery``). A leaving
server drains within ``drain_timeout_s`` (what it abandons starts over elsewhere), then leaves
the transfer group between updates. One change at a time; AddEngine's servers are kept in the
state store and added again after a restart (``rejoin``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import aiohttp

from rollout_service.config import check_http_url
from rollout_service.engine.control import VLLMControlClient, WeightSyncError
from rollout_service.engine.pool import EnginePool
from rollout_service.engine.vllm_client import VLLMServerClient, served_models
from rollout_service.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, ServiceError, echo
from rollout_service.metrics import ServiceMetrics
from rollout_service.types import EngineRemoved, EngineState
from rollout_service.weights.push_routes import MetaStore, PushRoutes
from rollout_service.weights.server_recovery import ServerRecovery

logger = logging.getLogger(__name__)

DEFAULT_DRAIN_TIMEOUT_S = 120.0


def check_engine_url(url: str) -> str:
    """``http(s)://host:port`` without a path; the normalized URL."""
    parts = urlsplit(url.strip())
    try:
        check_http_url(url.strip())
        base = parts.path in ("", "/")
    except ValueError:
        base = False
    if not base:
        raise InvalidArgument(f"engine url {echo(url)} is not http(s)://host:port; give the vLLM server's base URL")
    return f"{parts.scheme}://{parts.netloc}"


class PoolMembership:
    def __init__(
        self,
        weights: PushRoutes,
        store: MetaStore,
        pool: EnginePool,
        recovery: ServerRecovery,
        new_client: Callable[[str], VLLMServerClient],
        model: str,
        engine_urls: list[str],
        metrics: ServiceMetrics,
        managed_urls: frozenset[str] = frozenset(),
    ) -> None:
        self.weights = weights
        self.store = store
        self.pool = pool
        self.recovery = recovery
        self.new_client = new_client
        self.model = model
        """The pool's model, which a joining server must serve."""
        self.engine_urls = engine_urls
        """The service's list of its servers (``ServiceInfo.engine_urls``), kept in step here."""
        self.metrics = metrics
        self.managed_urls = managed_urls
        """Servers the service runs itself: they leave only with it."""
        self.controls: dict[str, VLLMControlClient] = {}
        """Control clients of the servers added here (the service's first ones are the app's)."""
        self.added_engines: list[str] = []
        """Servers AddEngine added and RemoveEngine has not removed, kept across restarts (``rejoin``)."""
        self.pending: set[str] = set()
        """Servers added before a restart that have not joined again yet (``rejoin``)."""
        self._lock = asyncio.Lock()

    async def close(self) -> None:
        """At shutdown: the control clients of the servers added here (the pool closes its own)."""
        for control in self.controls.values():
            await control.close()
        self.controls.clear()

    def states(self) -> list[EngineState]:
        return [self._state(client) for client in self.pool.clients]

    def _state(self, client: VLLMServerClient) -> EngineState:
        url = client.base_url
        reason, owner = self.pool.stuck.get(url) or self.pool.held.get(url, ""), ""
        if (partitions := self.weights.partitions) is not None:
            owner = partitions.owner.get(url) or ""
            reason = reason or partitions.unready_reason(url)
        return EngineState(url, not reason, reason, client.inflight, url in self.managed_urls, owner)

    # -- joining -------------------------------------------------------------------------
    async def add(self, url: str, remember: bool = True) -> EngineState:
        """Join ``url``; ``remember``: keep it across restarts (AddEngine; not discovery)."""
        url = check_engine_url(url)
        async with self._lock:
            if self.pool.client(url) is not None:
                raise AlreadyExists(f"{url} is already in the pool")
            await self._check_model(url)
            client, control = self.new_client(url), VLLMControlClient(url)
            await client.start()
            await control.start()
            self.pool.add(client, hold_reason="joining the pool: loading adapters and joining the weight transfer")
            try:
                await self._join(url, control)
            except BaseException:
                await self._forget(url, client, control)
                raise
            self.controls[url] = control
            self.engine_urls.append(url)
            self.metrics.engines.set(len(self.pool.clients))
            if remember:
                self._remember(url, True)
        logger.info("%s joined the pool (%s)", url, self.pool.held.get(url) or "taking requests")
        return self._state(client)

    async def rejoin(self, retry_interval_s: float) -> None:
        """After a restart: add AddEngine's servers again, retrying each until it joins or is removed (``pending``)."""
        self.pending.update(self.added_engines)
        while self.pending:
            for url in sorted(self.pending):
                try:
                    await self.add(url, remember=False)
                except AlreadyExists:
                    pass  # DNS discovery or an admin added it meanwhile
                except (ServiceError, OSError, aiohttp.ClientError) as exc:
                    logger.warning("%s, added before the restart, cannot join yet (%s); retrying", url, exc)
                    continue
                self.pending.discard(url)
            if self.pending:
                await asyncio.sleep(retry_interval_s)  # a retry period, not synchronisation

    def _remember(self, url: str, added: bool) -> None:
        """Keep (or stop keeping) ``url`` among the servers a restarted service adds again."""
        engines = [u for u in self.added_engines if u != url] + ([url] if added else [])
        if engines != self.added_engines:
            self.added_engines = engines
            self.store.set_meta("added_engines", engines)

    async def _check_model(self, url: str) -> None:
        model = self.model
        try:
            served = [entry["id"] for entry in await served_models(url, 10.0)]
        except (aiohttp.ClientError, TimeoutError, KeyError, TypeError, ValueError) as exc:
            raise FailedPrecondition(f"{url} does not answer /v1/models ({exc}); is the vLLM server up?") from None
        if model not in served:
            raise FailedPrecondition(
                f"{url} serves {served}, not the pool's model {model!r}; start it with --served-model-name {model}"
            )

    async def _join(self, url: str, control: VLLMControlClient) -> None:
        sync, adapters = self.weights.weight_sync, self.weights.adapters
        self.recovery.awaiting_weights.add(url)  # before it joins: the next commit including it releases it
        if adapters is not None:
            try:
                await adapters.add_server(control)
            except WeightSyncError as exc:
                raise FailedPrecondition(
                    f"{url} could not load the runs' adapters ({exc}); start it with --enable-lora and "
                    "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, as the pool's other servers"
                ) from None
        if self.weights.partitions is not None:  # a run's partition takes it and brings it to its policy
            self.weights.partitions.add_server(control)
        if self.weights.partitions is not None or sync is None:
            self.recovery.awaiting_weights.discard(url)
            self.pool.release(url)
            return
        try:
            await sync.add_server(control, joined=lambda: self.recovery.joined(url))
        except WeightSyncError as exc:
            raise FailedPrecondition(
                f"{url} has no weight-transfer endpoints ({exc}); start it with VLLM_SERVER_DEV_MODE=1 and "
                "--weight-transfer-config, as the pool's other servers"
            ) from None

    # -- leaving -------------------------------------------------------------------------
    async def remove(self, url: str, drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> EngineRemoved:
        if drain_timeout_s < 0:
            raise InvalidArgument(f"drain_timeout_s is {drain_timeout_s}; give 0 or more seconds")
        url = check_engine_url(url)
        async with self._lock:
            client = self.pool.client(url)
            if client is None and url in self.pending:  # added before a restart, never back: stop trying
                self.pending.discard(url)
                self._remember(url, False)
                logger.info("%s will not be added again (it had not joined since the restart)", url)
                return EngineRemoved(url, 0.0, 0, 0)
            if client is None:
                listed = ", ".join(c.base_url for c in self.pool.clients)
                raise NotFound(f"{url} is not in the pool; its servers: {listed}")
            if url in self.managed_urls:
                raise FailedPrecondition(f"{url} is the service's managed server; it leaves when the service stops")
            if len(self.pool.clients) == 1:
                raise FailedPrecondition(f"{url} is the pool's only server; add another before removing it")
            started, in_flight = time.monotonic(), client.inflight
            client.leaving = True
            self.pool.hold(url, f"leaving the pool: draining {in_flight} sequences in flight")
            moved = await client.drain_or_give_up(
                drain_timeout_s, f"left the pool ({drain_timeout_s:g}s drain_timeout_s passed)"
            )
            await self._forget(url, client, self.controls.pop(url, None))
            self._remember(url, False)
        removed = EngineRemoved(url, time.monotonic() - started, in_flight - moved, moved)
        logger.info(
            "%s left the pool after %.1fs: %d sequences drained, %d moved to other servers",
            url, removed.drain_seconds, removed.sequences_drained, removed.sequences_moved,
        )  # fmt: skip
        return removed

    async def _forget(self, url: str, client: VLLMServerClient, control: VLLMControlClient | None) -> None:
        """Out of the weight plane (between updates), the adapters and the pool; clients closed."""
        if self.weights.weight_sync is not None:
            await self.weights.weight_sync.remove_server(url)
        if self.weights.partitions is not None:
            await self.weights.partitions.remove_server(url)
        if self.weights.adapters is not None:
            self.weights.adapters.remove_server(url)
        self.recovery.awaiting_weights.discard(url)
        if self.pool.client(url) is client:
            self.pool.remove(url)
        if url in self.engine_urls:
            self.engine_urls.remove(url)
        self.metrics.engines.set(len(self.pool.clients))
        await client.close()
        if control is not None:
            await control.close()
