"""Per-run LoRA adapters on shared vLLM servers, loaded from files (vLLM's weight transfer
updates only the base weights).

Each push is written under ``<dir>/<run_id>/v<version>/`` and loaded on every server as
``<run_id>@v<version>``, which the run's next requests name. The previous version stays loaded
and on disk until the next replaces it, since vLLM may reload an evicted adapter from its path
mid-request: each run takes at most two of the servers' ``--max-loras`` slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import cast

from rollout_service.engine.control import AdapterControl, WeightSyncError
from rollout_service.engine.protocol import Engine, GroupEngine
from rollout_service.errors import FailedPrecondition, InvalidArgument, echo
from rollout_service.types import Completion, SamplingParams

logger = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
"""The only files an adapter may have: PEFT's config and safetensors weights. No pickles
(``adapter_model.bin``): vLLM would unpickle whatever a client sent."""
MAX_ADAPTER_BYTES = 2 << 30


def check_adapter_file_name(name: str) -> None:
    """Called per chunk, so a refused file is never buffered."""
    if name not in ADAPTER_FILES:
        raise InvalidArgument(
            f"adapter file {echo(name)} is not accepted; send {list(ADAPTER_FILES)} (PEFT's save_pretrained with "
            "safetensors; pickled .bin weights are refused)"
        )


@dataclass
class RunAdapter:
    """What one run serves: its current adapter, and the one before it (still loaded)."""

    version: int = 0
    name: str | None = None
    previous: str | None = None
    paths: dict[str, Path] = field(default_factory=dict)


def adapter_name(run_id: str, version: int) -> str:
    return f"{run_id}@v{version}"


def validate_adapter_files(files: dict[str, bytes], max_rank: int | None = None) -> None:
    """Refuse what vLLM would refuse, with a message that says what to send instead."""
    for name in files:
        check_adapter_file_name(name)
    if set(files) != set(ADAPTER_FILES):
        raise InvalidArgument(
            f"an adapter needs {list(ADAPTER_FILES)} (what PEFT's save_pretrained writes); got {sorted(files)}"
        )
    if sum(len(data) for data in files.values()) > MAX_ADAPTER_BYTES:
        raise InvalidArgument(f"the adapter is larger than {MAX_ADAPTER_BYTES >> 30} GiB; is it a full model?")
    try:
        config = json.loads(files[CONFIG_FILE])
    except ValueError as exc:
        raise InvalidArgument(f"{CONFIG_FILE} is not JSON: {exc}") from None
    rank = config.get("r") if isinstance(config, dict) else None
    if not isinstance(rank, int) or rank < 1:
        raise InvalidArgument(f"{CONFIG_FILE} has no LoRA rank 'r'; send a PEFT LoRA adapter's config")
    if max_rank is not None and rank > max_rank:
        raise InvalidArgument(
            f"adapter rank {rank} exceeds the servers' --max-lora-rank {max_rank}; train a smaller rank"
        )


class AdapterPublisher:
    """Writes, loads and retires the adapters of every run on every server."""

    def __init__(
        self, root: Path, servers: Sequence[AdapterControl], timeout_s: float, max_rank: int | None = None
    ) -> None:
        self.root = root
        self.servers = list(servers)
        self.timeout_s = timeout_s
        self.max_rank = max_rank
        self.runs: dict[str, RunAdapter] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def current(self, run_id: str) -> str | None:
        """The adapter the run's next request names (None: the base model)."""
        adapter = self.runs.get(run_id)
        return adapter.name if adapter is not None else None

    async def publish(self, run_id: str, files: dict[str, bytes]) -> int:
        """Load the run's new adapter on every server or on none; returns the run's new policy version."""
        validate_adapter_files(files, self.max_rank)
        async with self._locks.setdefault(run_id, asyncio.Lock()):
            state = self.runs.setdefault(run_id, RunAdapter())
            version = state.version + 1
            name, path = adapter_name(run_id, version), self.root / run_id / f"v{version}"
            await asyncio.to_thread(_write_files, path, files)
            loaded: list[AdapterControl] = []

            async def load(server: AdapterControl) -> None:
                await server.load_lora_adapter(name, str(path.resolve()), self.timeout_s)
                loaded.append(server)

            results = await asyncio.gather(*(load(s) for s in self.servers), return_exceptions=True)
            failures = [r for r in results if isinstance(r, BaseException)]
            if failures:
                await self._unload(name, loaded)
                shutil.rmtree(path, ignore_errors=True)
                raise FailedPrecondition(
                    f"loading adapter {name} failed; the run keeps its previous one (the servers must run with "
                    f"--enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True): {failures[0]}"
                )
            retired = state.previous
            state.previous, state.name, state.version = state.name, name, version
            state.paths[name] = path
            if retired is not None:
                await self._retire(state, retired)
            logger.info("run %s serves adapter %s", run_id, name)
            return version

    async def reload(self, url: str) -> None:
        """Load each run's current adapter on a restarted server (the restart ended the previous one's requests)."""
        servers = [server for server in self.servers if server.base_url == url.rstrip("/")]
        for run_id in list(self.runs):
            async with self._locks.setdefault(run_id, asyncio.Lock()):  # not under a publish
                state = self.runs.get(run_id)
                if state is None or state.name is None:
                    continue
                for server in servers:
                    await server.load_lora_adapter(state.name, str(state.paths[state.name].resolve()), self.timeout_s)
            logger.info("run %s's adapter %s loaded again on %s", run_id, state.name, url)

    async def add_server(self, server: AdapterControl) -> None:
        """A server joins the pool: it serves every run's current adapter before it takes requests."""
        self.servers.append(server)
        await self.reload(server.base_url)

    def remove_server(self, url: str) -> None:
        self.servers = [server for server in self.servers if server.base_url != url]

    async def restore(self, run_id: str) -> int:
        """After a service restart: load the run's newest adapter on disk again; its version, 0 if none."""
        versions = sorted(
            int(path.name[1:])
            for path in (self.root / run_id).glob("v*")
            if path.name[1:].isdigit() and (path / CONFIG_FILE).exists()
        )
        if not versions:
            return 0
        version = versions[-1]
        name, path = adapter_name(run_id, version), self.root / run_id / f"v{version}"
        for server in self.servers:
            try:
                await server.load_lora_adapter(name, str(path.resolve()), self.timeout_s)
            except WeightSyncError as exc:
                logger.info("%s: adapter %s not loaded again (%s); it is already there", server.base_url, name, exc)
        self.runs[run_id] = RunAdapter(version=version, name=name, paths={name: path})
        logger.info("run %s serves adapter %s again after the restart", run_id, name)
        return version

    async def forget(self, run_id: str) -> None:
        """The run is deleted: unload its adapters and remove their files."""
        state = self.runs.pop(run_id, None)
        if state is None:
            return
        for name in (state.previous, state.name):
            if name is not None:
                await self._retire(state, name)
        shutil.rmtree(self.root / run_id, ignore_errors=True)

    async def _retire(self, state: RunAdapter, name: str) -> None:
        await self._unload(name, self.servers)
        path = state.paths.pop(name, None)
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)

    async def _unload(self, name: str, servers: Sequence[AdapterControl]) -> None:
        async def unload(server: AdapterControl) -> None:
            with contextlib.suppress(WeightSyncError):  # a server that restarted no longer has it
                await server.unload_lora_adapter(name, self.timeout_s)

        await asyncio.gather(*(unload(s) for s in servers))


def _write_files(path: Path, files: dict[str, bytes]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (path / name).write_bytes(data)


class AdapterRouting:
    """Names the run's current adapter in each request, per request: an episode's later turns follow a push."""

    def __init__(self, engine: Engine, current: Callable[[], str | None]) -> None:
        self.engine = engine
        self.current = current

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, affinity: str | None = None
    ) -> Completion:
        return await self.engine.generate(prompt_ids, self._with_adapter(params), affinity=affinity)

    async def generate_many(
        self, prompt_ids: list[int], params: SamplingParams, n: int, *, affinity: str | None = None
    ) -> list[Completion]:
        """Only called when the wrapped engine is a ``GroupEngine`` (the scheduler checks)."""
        engine = cast(GroupEngine, self.engine)
        return await engine.generate_many(prompt_ids, self._with_adapter(params), n, affinity=affinity)

    def _with_adapter(self, params: SamplingParams) -> SamplingParams:
        adapter = self.current()
        return params if adapter is None else replace(params, model=adapter)
