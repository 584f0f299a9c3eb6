"""vLLM's control endpoints for one server. vLLM puts no timeout on them, so every call carries
the service's own deadline and fails as ``WeightSyncError`` naming the server and the step.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import aiohttp

from rollout_service.types import PauseModeName

CONNECT_TIMEOUT_S = 5.0
"""TCP connect timeout of each call: a reachable server answers a connect in milliseconds."""


class WeightControl(Protocol):
    """What weight sync drives on one server; every call raises ``WeightSyncError`` on failure."""

    base_url: str

    async def world_size(self, timeout_s: float) -> int: ...
    async def pause(self, mode: PauseModeName, timeout_s: float) -> None: ...
    async def is_paused(self, timeout_s: float) -> bool: ...
    async def resume(self, timeout_s: float) -> None: ...
    async def init_weight_transfer(self, init_info: dict[str, Any], timeout_s: float) -> None: ...
    async def start_weight_update(self, timeout_s: float) -> None: ...
    async def update_weights(self, update_info: dict[str, Any], timeout_s: float) -> None: ...
    async def finish_weight_update(self, version: str | None, timeout_s: float) -> None: ...
    async def set_weight_version(self, version: str, timeout_s: float) -> None: ...
    async def weight_version(self, timeout_s: float) -> str: ...
    async def shutdown_weight_transfer(self, timeout_s: float) -> None: ...


class AdapterControl(Protocol):
    """What adapter publishing drives on one server: vLLM's runtime LoRA endpoints."""

    base_url: str

    async def load_lora_adapter(self, name: str, path: str, timeout_s: float) -> None: ...
    async def unload_lora_adapter(self, name: str, timeout_s: float) -> None: ...


class WeightSyncError(Exception):
    """A control step failed or timed out on one server. ``answered``: with an error status,
    so the call no longer runs there (a timeout says nothing of what vLLM still does)."""

    def __init__(self, server: str, step: str, message: str, answered: bool = False) -> None:
        super().__init__(f"{server} {step}: {message}")
        self.server = server
        self.step = step
        self.answered = answered


class VLLMControlClient:
    """One server's control plane. Requires the server to run with VLLM_SERVER_DEV_MODE=1."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        # A fresh connection per call: a kept-alive one vLLM closed after an error would reset the next call.
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(
        self, method: str, path: str, timeout_s: float, body: dict[str, Any] | None = None, **params: str
    ) -> dict[str, Any]:
        if self._session is None:
            raise WeightSyncError(self.base_url, path, "control client used before start()")
        timeout = aiohttp.ClientTimeout(total=timeout_s, connect=CONNECT_TIMEOUT_S)
        try:
            async with self._session.request(
                method, self.base_url + path, json=body, params=params or None, timeout=timeout
            ) as resp:
                text = await resp.text()
                if resp.status >= 400:
                    raise WeightSyncError(self.base_url, path, f"HTTP {resp.status}: {text[:500]}", answered=True)
                return _json_object(text)
        except TimeoutError:
            raise WeightSyncError(self.base_url, path, f"no answer within {timeout_s:.0f}s") from None
        except aiohttp.ClientError as exc:
            raise WeightSyncError(self.base_url, path, f"{type(exc).__name__}: {exc}") from exc

    async def world_size(self, timeout_s: float) -> int:
        return int((await self._call("GET", "/get_world_size", timeout_s))["world_size"])

    async def pause(self, mode: PauseModeName, timeout_s: float) -> None:
        await self._call("POST", "/pause", timeout_s, mode=mode)

    async def is_paused(self, timeout_s: float) -> bool:
        return bool((await self._call("GET", "/is_paused", timeout_s)).get("is_paused"))

    async def resume(self, timeout_s: float) -> None:
        await self._call("POST", "/resume", timeout_s)

    async def init_weight_transfer(self, init_info: dict[str, Any], timeout_s: float) -> None:
        await self._call("POST", "/init_weight_transfer_engine", timeout_s, {"init_info": init_info})

    async def start_weight_update(self, timeout_s: float) -> None:
        await self._call("POST", "/start_weight_update", timeout_s)

    async def update_weights(self, update_info: dict[str, Any], timeout_s: float) -> None:
        await self._call("POST", "/update_weights", timeout_s, {"update_info": update_info})

    async def finish_weight_update(self, version: str | None, timeout_s: float) -> None:
        """Apply the received weights, labelled ``version`` (None: no label)."""
        await self._call("POST", "/finish_weight_update", timeout_s, {"weight_version": version})

    async def set_weight_version(self, version: str, timeout_s: float) -> None:
        """Label the weights vLLM serves (``/weight_info``) without changing them."""
        await self._call("POST", "/update_weight_version", timeout_s, {"new_version": version})

    async def weight_version(self, timeout_s: float) -> str:
        """The label of the weights vLLM serves (``/weight_info``); a fresh server says "default"."""
        return str((await self._call("GET", "/weight_info", timeout_s)).get("weight_version"))

    async def shutdown_weight_transfer(self, timeout_s: float) -> None:
        """Drop the workers' side of the transfer group; vLLM refuses it during an update."""
        await self._call("POST", "/shutdown_weight_transfer_engine", timeout_s)

    async def load_lora_adapter(self, name: str, path: str, timeout_s: float) -> None:
        """Needs the server started with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True."""
        await self._call("POST", "/v1/load_lora_adapter", timeout_s, {"lora_name": name, "lora_path": path})

    async def unload_lora_adapter(self, name: str, timeout_s: float) -> None:
        await self._call("POST", "/v1/unload_lora_adapter", timeout_s, {"lora_name": name})


def _json_object(text: str) -> dict[str, Any]:
    """The answer's JSON object, else ``{}`` (e.g. /v1/load_lora_adapter answers plain text)."""
    try:
        answer = json.loads(text)
    except ValueError:
        return {}
    return answer if isinstance(answer, dict) else {}
