"""Assembles a running service from settings (vLLM servers, tokenizer, engine pool, service, weight
sync, gRPC and metrics endpoints) and takes it down in reverse: ``running_service`` is its lifetime."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import gc
import logging
import os
import socket
import ssl
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from rollout_common.cpu_budget import available_cores, move_process
from rollout_common.model_signature import signature_of
from rollout_service.config import DEFAULT_MODEL_DIR, EngineSettings, ServiceSettings
from rollout_service.delivery.state_store import StateStore, open_store
from rollout_service.edge.group_wire import WireCodec
from rollout_service.edge.openai_api import openai_app
from rollout_service.edge.security import load_token_table
from rollout_service.edge.server import set_runs_progressing, set_serving, start_grpc_server
from rollout_service.engine.control import VLLMControlClient
from rollout_service.engine.discovery import RESOLVE_INTERVAL_S, EngineDiscovery
from rollout_service.engine.load_monitor import LoadMonitor
from rollout_service.engine.managed import ManagedVLLMServer
from rollout_service.engine.pool import EnginePool
from rollout_service.engine.supervisor import ServerSupervisor
from rollout_service.engine.vllm_client import VLLMServerClient, served_models
from rollout_service.errors import StartupError
from rollout_service.generation.environments import EnvironmentRegistry
from rollout_service.generation.openenv import OpenEnvServer
from rollout_service.generation.prompts import PromptRenderer
from rollout_service.generation.tools import ToolRegistry
from rollout_service.loop_lag import watch_loop_lag
from rollout_service.metrics import ServiceMetrics, start_metrics_server
from rollout_service.runs import RunTable
from rollout_service.scoring.judge import LLMJudge
from rollout_service.scoring.rewards import RewardRegistry
from rollout_service.service import RolloutService, ServiceInfo
from rollout_service.versions import PolicyVersion
from rollout_service.weights.adapters import AdapterPublisher
from rollout_service.weights.partitions import PoolPartitions
from rollout_service.weights.pool_membership import PoolMembership
from rollout_service.weights.push_routes import PushRoutes
from rollout_service.weights.server_recovery import ServerRecovery
from rollout_service.weights.version_holds import VersionHolds
from rollout_service.weights.weight_sync import WeightSyncCoordinator

logger = logging.getLogger(__name__)

GRPC_STOP_GRACE_S = 5.0
DEFAULT_MAX_MODEL_LEN = 2048


@dataclass
class RunningService:
    service: RolloutService
    grpc_port: int
    metrics_port: int | None
    engine_urls: list[str]
    openai_port: int | None = None
    """The OpenAI-compatible endpoint of external runs; None when off."""

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"


async def describe_model(url: str, timeout_s: float = 10.0) -> tuple[str, int | None]:
    """Name and context length of the model a vLLM server serves (GET /v1/models)."""
    model = (await served_models(url, timeout_s))[0]
    return model["id"], model.get("max_model_len")


async def resolve_model(urls: list[str], settings: EngineSettings) -> tuple[str, int]:
    """What the servers serve; with ``engine.model`` set the service may start before its servers."""
    for url in urls:
        try:
            model, max_model_len = await describe_model(url)
        except (aiohttp.ClientError, TimeoutError) as exc:
            logger.warning("vLLM server %s does not answer /v1/models: %s", url, exc)
            continue
        return settings.model or model, settings.max_model_len or max_model_len or DEFAULT_MAX_MODEL_LEN
    if settings.model is None:
        raise StartupError(
            f"no vLLM server answered ({', '.join(urls)}); start one, or set engine.model (and "
            "engine.tokenizer) so the service can start before its servers"
        )
    return settings.model, settings.max_model_len or DEFAULT_MAX_MODEL_LEN


def served_signature(checkpoint: str) -> str:
    """The served model's signature for GetServerInfo; empty (trainers skip their check) without a config."""
    try:
        return signature_of(checkpoint)
    except (OSError, ValueError) as exc:
        logger.info("no config at %s to tell trainers the served model's shape (%s)", checkpoint, exc)
        return ""


PORT_SETTINGS = (("port", "host"), ("metrics_port", "metrics_host"), ("openai_port", "host"))
"""Each port setting, and the setting of the address it is bound on."""


def check_ports_free(settings: ServiceSettings) -> None:
    """A port that is taken fails the start now, naming its setting, not after vLLM's start-up."""
    for port_setting, host_setting in PORT_SETTINGS:
        port, host = getattr(settings, port_setting), getattr(settings, host_setting)
        if not port:
            continue  # off, or any free port
        try:
            socket.create_server((host, port)).close()
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):  # other errors (the host) are said where it is bound
                raise StartupError(
                    f"{port_setting} {port} cannot be bound on {host} ({os.strerror(exc.errno)}); pick another port "
                    "(0: any free one)"
                ) from None


def load_tokenizer(name_or_path: str):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path)


@contextlib.asynccontextmanager
async def running_service(
    settings: ServiceSettings, managed: ManagedVLLMServer | None = None
) -> AsyncIterator[RunningService]:
    """``managed``: a running managed server to serve from, which its owner stops (tests share one);
    default: ``engine.urls``, else a server of its own. One exit stack stops everything in reverse."""
    engine_settings = settings.engine
    rewards, tools, environments = _user_registries(settings)  # first: a typo fails before vLLM starts
    check_ports_free(settings)  # likewise
    async with contextlib.AsyncExitStack() as stack:
        store = open_store(settings.state_store, WireCodec())  # likewise
        stack.callback(store.close)  # last, after the service stopped: the last acks are written
        urls, tokenizer_path = list(engine_settings.urls), engine_settings.tokenizer
        discovery = None
        if managed is None and not urls and engine_settings.discover:
            discovery = EngineDiscovery(engine_settings.discover, wait_s=engine_settings.discover_wait_s)
            urls = await discovery.initial_urls()
        fresh_urls: frozenset[str] = frozenset()  # servers this service has just started
        if managed is None and not urls:
            managed = await _start_managed_server(settings, stack)
            fresh_urls = frozenset([managed.url])
        if managed is not None:
            urls = [managed.url]
            tokenizer_path = tokenizer_path or str(managed.settings.model)
        model, max_model_len = await resolve_model(urls, engine_settings)
        checkpoint = tokenizer_path or engine_settings.model or model
        try:
            tokenizer = await asyncio.to_thread(load_tokenizer, checkpoint)
        except (OSError, ValueError) as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise StartupError(
                f"cannot load the tokenizer of {checkpoint} ({reason}); set engine.tokenizer to a folder with the "
                "tokenizer's files, or to a Hub model id in the local cache or reachable"
            ) from None
        signature = await asyncio.to_thread(served_signature, checkpoint)

        metrics = ServiceMetrics()
        max_inflight = settings.scheduler.max_inflight
        clients = [VLLMServerClient(url, model, engine_settings, metrics, max_inflight) for url in urls]
        monitor = LoadMonitor(clients, metrics)
        pool = EnginePool(clients, engine_settings.probe_interval_s, engine_settings.health_timeout_s, monitor=monitor)
        await pool.start()
        stack.push_async_callback(pool.close)
        for name, openenv_settings in settings.openenv.items():
            server = OpenEnvServer(name, openenv_settings)
            environments.register(name, server.episode)
            stack.push_async_callback(server.close)
        for name, judge_settings in settings.judges.items():
            judge = LLMJudge(name, judge_settings, lambda: [c.base_url for c in pool.clients], model, metrics)
            rewards.register(name, judge)
            stack.push_async_callback(judge.close)
        controls = [VLLMControlClient(url) for url in urls]
        for control in controls:
            await control.start()
            stack.push_async_callback(control.close)

        info = ServiceInfo(model=model, engine_urls=urls, max_inflight=max_inflight, model_signature=signature)
        runs, versions, holds = RunTable(), PolicyVersion(), VersionHolds()
        weights = _weight_plane(settings, controls, pool, runs, versions, holds, store, metrics)
        recovery = ServerRecovery(weights, pool, versions)
        recovery.hold_until_checked()  # the restored runs start now; no server holds a version yet
        membership = PoolMembership(
            weights,
            store,
            pool,
            recovery,
            lambda url: VLLMServerClient(url, model, engine_settings, metrics, max_inflight),
            model=model,
            engine_urls=info.engine_urls,
            metrics=metrics,
            managed_urls=frozenset([managed.url] if managed is not None else []),
        )
        service = RolloutService(
            engine=pool,
            renderer=PromptRenderer(tokenizer, max_model_len),
            rewards=rewards,
            metrics=metrics,
            settings=settings.scheduler,
            info=info,
            tools=tools,
            environments=environments,
            store=store,
            runs=runs,
            versions=versions,
            holds=holds,
            weights=weights,
            membership=membership,
        )
        stack.push_async_callback(service.close)
        if restored := await service.restore():
            logger.info("restored %d runs from %s (policy version %d)", restored, settings.state_store, versions.served)
        watchdog = asyncio.create_task(service.watch_runs(), name="run-watchdog")
        stack.push_async_callback(_cancelled, watchdog)
        lag = asyncio.create_task(watch_loop_lag(metrics.event_loop_lag), name="loop-lag")
        stack.push_async_callback(_cancelled, lag)
        stack.push_async_callback(membership.close)  # after the weight plane's close, which may resume them
        stack.push_async_callback(weights.close)
        metrics.engines.set(len(pool.clients))
        if managed is not None:
            _supervise(managed, recovery, metrics, stack)
        if (sync := weights.weight_sync) is not None:
            await sync.prefetch_world_sizes()
            await sync.repair.release_left_transfer(skip=fresh_urls)
            await sync.repair.resume_left_paused()
        await recovery.check_restored(settings.weight_sync.control_timeout_s)
        if discovery is not None:
            found = functools.partial(membership.add, remember=False)  # discovery finds them again after a restart
            following = asyncio.create_task(discovery.run(found, membership.remove), name="engine-discovery")
            stack.push_async_callback(_cancelled, following)
        if membership.added_engines:
            logger.info("adding again the servers AddEngine added before the restart: %s", membership.added_engines)
            rejoining = asyncio.create_task(membership.rejoin(RESOLVE_INTERVAL_S), name="engine-rejoin")
            stack.push_async_callback(_cancelled, rejoining)
        await service.restore_adapters()  # restored serve_adapter runs get their adapters back

        metrics_port = None
        if settings.metrics_port is not None:
            runner, metrics_port = await start_metrics_server(metrics, settings.metrics_host, settings.metrics_port)
            stack.push_async_callback(runner.cleanup)
        grpc_port = await _serve_grpc(service, pool, settings, stack)
        openai_port = await _serve_openai(service, settings, stack)
        logger.info(
            "rollout service on %s:%d (model %s, %d slots, engines %s, metrics port %s, OpenAI endpoint port %s)",
            settings.host, grpc_port, model, max_inflight, urls, metrics_port, openai_port,
        )  # fmt: skip
        freeze_startup_objects(stack)
        yield RunningService(service, grpc_port, metrics_port, urls, openai_port)


def freeze_startup_objects(stack: contextlib.ExitStack | contextlib.AsyncExitStack) -> None:
    """Keep start-up's long-lived objects (torch, the tokenizer) out of the GC's full passes until
    ``stack`` closes: scanning them, with the GIL held, held up every RPC."""
    gc.collect()
    gc.freeze()
    stack.callback(gc.unfreeze)


async def _cancelled(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _start_managed_server(settings: ServiceSettings, stack: contextlib.AsyncExitStack) -> ManagedVLLMServer:
    """Launch the service's own vLLM server (building the embedded default model if missing)."""
    engine_settings = settings.engine
    assert engine_settings.managed is not None
    managed_settings = engine_settings.managed
    if Path(managed_settings.model) == DEFAULT_MODEL_DIR:  # the embedded default: build it if missing
        from rollout_common.tiny_model import build_tiny_model

        await asyncio.to_thread(build_tiny_model, DEFAULT_MODEL_DIR)
    managed = ManagedVLLMServer(
        managed_settings,
        served_model_name=engine_settings.model,
        weight_transfer_backend=settings.weight_sync.backend,  # one setting for both ends
        log_level=settings.log_level,
    )
    stack.push_async_callback(asyncio.to_thread, managed.stop)  # before start: no orphan server
    await asyncio.to_thread(managed.start)
    _keep_off_vllm_cores(managed, stack)
    return managed


def _keep_off_vllm_cores(managed: ManagedVLLMServer, stack: contextlib.AsyncExitStack) -> None:
    """Move this process to the cores left to a trainer while the service runs (back when ``stack`` closes)."""
    cores = managed.service_cores()
    if cores is None:
        return
    home = available_cores()
    move_process(cores)
    stack.callback(move_process, home)
    logger.info("the service moved to cores %s, off vLLM's %s", cores, managed.pinned_cores())


def _user_registries(settings: ServiceSettings) -> tuple[RewardRegistry, ToolRegistry, EnvironmentRegistry]:
    """The built-in rewards, tools and environments plus those of the configured modules."""
    rewards, tools, environments = RewardRegistry(), ToolRegistry(), EnvironmentRegistry()
    for registry, modules in (
        (rewards, settings.reward_modules),
        (tools, settings.tool_modules),
        (environments, settings.environment_modules),
    ):
        for module in modules:
            try:
                registry.load_module(module)
            except Exception as exc:  # user code: an import may raise anything
                raise StartupError(
                    f"cannot load user module {module!r}: {exc}; is it importable from this directory "
                    "(or PYTHONPATH), with the dict the setting names?"
                ) from None
    if taken := sorted(set(settings.judges) & set(rewards.names())):
        raise StartupError(f"judges {', '.join(taken)} have the names of reward functions; rename them")
    if taken := sorted(set(settings.openenv) & set(environments.names())):
        raise StartupError(f"openenv servers {', '.join(taken)} have the names of environments; rename them")
    return rewards, tools, environments


def _weight_plane(
    settings: ServiceSettings,
    controls: list[VLLMControlClient],
    pool: EnginePool,
    runs: RunTable,
    versions: PolicyVersion,
    holds: VersionHolds,
    store: StateStore,
    metrics: ServiceMetrics,
) -> PushRoutes:
    """The pool's weight sync, or with ``weight_sync.partitions`` one per full-weight run over its
    own servers; and the adapter publisher."""
    sync_settings = settings.weight_sync
    sync, partitions = None, None
    if sync_settings.partitions:
        partitions = PoolPartitions(pool, controls, sync_settings, runs.request_weights, metrics)
    else:  # from the stored version, which ``restore`` commits: a restarted service goes on from it
        sync = WeightSyncCoordinator(
            controls, sync_settings, versions, metrics=metrics, holds=holds, on_stuck=pool.set_stuck
        )
    adapters = AdapterPublisher(
        settings.adapters.dir, controls, sync_settings.control_timeout_s, managed_max_lora_rank(settings.engine)
    )
    return PushRoutes(runs, store, weight_sync=sync, partitions=partitions, adapters=adapters)


def _supervise(
    managed: ManagedVLLMServer, recovery: ServerRecovery, metrics: ServiceMetrics, stack: contextlib.AsyncExitStack
) -> None:
    """Restart the managed server when it dies; ``recovery`` holds it until it serves the policy again."""
    supervisor = ServerSupervisor(
        managed, recovery.server_down, recovery.server_restarted, metrics.server_restarts.labels(managed.url).inc
    )
    supervisor.start()
    stack.push_async_callback(supervisor.close)  # runs before the server's stop: no restart at shutdown


async def _serve_grpc(
    service: RolloutService, pool: EnginePool, settings: ServiceSettings, stack: contextlib.AsyncExitStack
) -> int:
    """Start the gRPC server, its health following the pool; its port. At exit: NOT_SERVING, drain, stop."""
    server, grpc_port, health = await start_grpc_server(service, settings.host, settings.port, settings.security)
    updates = HealthUpdates()

    def engines_usable(usable: bool) -> None:
        """NOT_SERVING while no vLLM server can generate, so load balancers send trainers elsewhere."""
        updates.schedule(set_serving(health, usable))
        service.engines_usable(usable)

    pool.on_usable = engines_usable
    if not pool.usable:  # no server answered at start-up (``EnginePool.start``)
        engines_usable(False)
    service.watchdog.on_stalled = lambda stalled: updates.schedule(set_runs_progressing(health, not stalled))

    async def stop_grpc() -> None:
        await health.enter_graceful_shutdown()
        await service.drain(settings.shutdown_grace_s)
        await server.stop(GRPC_STOP_GRACE_S)

    stack.push_async_callback(stop_grpc)
    return grpc_port


async def _serve_openai(
    service: RolloutService, settings: ServiceSettings, stack: contextlib.AsyncExitStack
) -> int | None:
    """The OpenAI-compatible endpoint of external runs, when ``openai_port`` is set; its port."""
    if settings.openai_port is None:
        return None
    security = settings.security
    ssl_context = None
    if security.tls_cert_file is not None and security.tls_key_file is not None:
        ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ssl_context.load_cert_chain(security.tls_cert_file, security.tls_key_file)
    runner = web.AppRunner(openai_app(service, load_token_table(security)), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.openai_port, ssl_context=ssl_context)
    await site.start()
    stack.push_async_callback(runner.cleanup)
    return runner.addresses[0][1]


class HealthUpdates:
    """Runs the health servicer's async updates in order: interleaved ``set`` calls could leave an older status."""

    def __init__(self) -> None:
        self._order = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()

    def schedule(self, update: Coroutine[Any, Any, None]) -> None:
        async def in_order() -> None:
            async with self._order:
                await update

        task = asyncio.get_running_loop().create_task(in_order())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def managed_max_lora_rank(engine: EngineSettings) -> int | None:
    """The adapter rank limit when the service launched the server itself (else vLLM checks)."""
    managed = engine.managed
    if engine.urls or managed is None or not managed.max_loras:
        return None
    return managed.max_lora_rank
