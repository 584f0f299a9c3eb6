"""Scripted stand-ins for a vLLM server's control endpoints: the weight-update steps on a
fake clock, and the LoRA adapter loads."""

from __future__ import annotations

import asyncio
import json

from rollout_service.engine.control import WeightSyncError
from rollout_service.weights.update_messages import TensorSpec

STEP_SECONDS = {
    "init_weight_transfer": 1.0,
    "pause": 2.0,
    "start_weight_update": 3.0,
    "update_weights": 4.0,
    "finish_weight_update": 5.0,
    "resume": 7.0,
    "shutdown_weight_transfer": 0.0,
}
TENSORS = [TensorSpec("w", "float32", (2,))]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ScriptedControl:
    """One server's control endpoints: each step advances the clock by its STEP_SECONDS."""

    base_url = "http://scripted"

    def __init__(self, clock: Clock, fail: str | None = None, resume_failures: int = 0) -> None:
        self.clock = clock
        self.fail = fail
        self.received = asyncio.Event()
        self.update_infos: list[dict] = []
        """Each ``/update_weights`` body, in order."""
        self.resume_failures = resume_failures
        """Resume calls that fail before one works; -1: every one."""
        self.resume_error: Exception = WeightSyncError(self.base_url, "/resume", "HTTP 500")
        self.resumes = 0
        self.paused = False
        self.calls: list[str] = []
        """Every step called, in order."""
        self.labels: list[str] = []
        """Versions the weights were labelled with (``set_weight_version``)."""
        self.fail_once: dict[str, Exception] = {}
        """A step's next call raises this (once)."""

    async def _step(self, name: str) -> None:
        self.calls.append(name)
        if (error := self.fail_once.pop(name, None)) is not None:
            raise error
        await asyncio.sleep(0)
        self.clock.now += STEP_SECONDS[name]
        if name == self.fail:
            raise WeightSyncError(self.base_url, name, "scripted failure")

    async def world_size(self, timeout_s: float) -> int:
        return 1

    async def init_weight_transfer(self, info, timeout_s: float) -> None:  # type: ignore[no-untyped-def]
        await self._step("init_weight_transfer")

    async def pause(self, mode: str, timeout_s: float) -> None:
        await self._step("pause")

    async def start_weight_update(self, timeout_s: float) -> None:
        await self._step("start_weight_update")

    async def update_weights(self, info, timeout_s: float) -> None:  # type: ignore[no-untyped-def]
        self.update_infos.append(info)
        try:
            await self._step("update_weights")
        finally:
            self.received.set()

    async def finish_weight_update(self, version: str | None, timeout_s: float) -> None:
        await self._step("finish_weight_update")

    async def set_weight_version(self, version: str, timeout_s: float) -> None:
        self.labels.append(version)  # off the update's path: no clock, no step

    async def shutdown_weight_transfer(self, timeout_s: float) -> None:
        await self._step("shutdown_weight_transfer")

    async def resume(self, timeout_s: float) -> None:
        await self._step("resume")
        self.resumes += 1
        if self.resume_failures:
            self.resume_failures -= 1
            raise self.resume_error
        self.paused = False

    async def is_paused(self, timeout_s: float) -> bool:
        return self.paused


ADAPTER = {"adapter_config.json": json.dumps({"r": 8}).encode(), "adapter_model.safetensors": b"\0" * 16}


class ScriptedServer:
    def __init__(self, url: str, refuse: set[str] | None = None) -> None:
        self.base_url = url
        self.loaded: dict[str, str] = {}
        self.refuse = refuse or set()

    async def load_lora_adapter(self, name: str, path: str, timeout_s: float) -> None:
        if name in self.refuse:
            raise WeightSyncError(self.base_url, "/v1/load_lora_adapter", "HTTP 400: refused")
        self.loaded[name] = path

    async def unload_lora_adapter(self, name: str, timeout_s: float) -> None:
        self.loaded.pop(name, None)
