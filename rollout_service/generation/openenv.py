"""OpenEnv environment servers as environments of the service's environment protocol.

An OpenEnv server keeps one environment per WebSocket session (its HTTP ``/reset`` and
``/step`` each make a fresh one, so an episode cannot live there). Each episode here opens
its own session on ``/ws``, resets it, sends each model turn as a ``step`` action and shows the
model the observation; the step rewards add up to the episode's ``env_reward``. A reader task
keeps receiving while the model thinks, so the server's pings are answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

import aiohttp

from rollout_service.config import OpenEnvSettings
from rollout_service.generation.environments import StepResult
from rollout_service.types import PromptItem

logger = logging.getLogger(__name__)

RESET_COLUMN = "openenv_reset"
REPLY_TIMEOUT_S = 300.0
"""Bound on one answer of the server; the scheduler's environment timeout is the tighter one."""


class OpenEnvError(Exception):
    """The server refused or failed a request; the episode's group fails (counted)."""


class OpenEnvServer:
    """One configured server: its HTTP session, and an episode per ``episode()`` call."""

    def __init__(self, name: str, settings: OpenEnvSettings) -> None:
        self.name = name
        self.settings = settings
        self.ws_url = settings.url.rstrip("/").replace("http://", "ws://", 1).replace("https://", "wss://", 1) + "/ws"
        self._session: aiohttp.ClientSession | None = None

    def episode(self) -> OpenEnvEpisode:
        return OpenEnvEpisode(self)

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class OpenEnvEpisode:
    """One episode's session: reset, then a step per model turn, then close."""

    def __init__(self, server: OpenEnvServer) -> None:
        self.server = server
        self.settings = server.settings
        self._socket: aiohttp.ClientWebSocketResponse | None = None
        self._replies: asyncio.Queue[aiohttp.WSMessage] = asyncio.Queue()
        self._reader: asyncio.Task[None] | None = None

    async def reset(self, prompt: PromptItem) -> None:
        arguments = dict(self.settings.reset)
        if extra := prompt.metadata.get(RESET_COLUMN):
            try:
                more = json.loads(extra)
            except json.JSONDecodeError:
                more = None
            if not isinstance(more, dict):
                raise OpenEnvError(f"the prompt's {RESET_COLUMN} column must be a JSON object, not {extra[:100]!r}")
            arguments.update(more)
        try:
            self._socket = await self.server.session().ws_connect(
                self.server.ws_url, max_msg_size=self.settings.max_message_bytes
            )
        except aiohttp.ClientError as exc:
            raise OpenEnvError(
                f"cannot reach OpenEnv server {self.server.name} at {self.server.ws_url}: {exc}"
            ) from None
        self._reader = asyncio.create_task(self._read(self._socket), name=f"openenv-{self.server.name}")
        await self._ask("reset", arguments)

    async def step(self, model_text: str) -> StepResult:
        if self.settings.action == "json":
            try:
                action = json.loads(model_text.strip())
            except json.JSONDecodeError as exc:
                action, problem = None, str(exc)
            else:
                problem = "" if isinstance(action, dict) else "it is not an object"
            if action is None or problem:
                return StepResult(f"Your reply must be the action, one JSON object ({problem}).")
        else:
            action = {self.settings.action: model_text}
        kind, data = await self._ask("step", action, invalid_ok=True)
        if kind == "error":  # the model's action broke the server's schema: its mistake, shown to it
            return StepResult(f"The action was refused: {data.get('message', '')} {data.get('errors', '')}".strip())
        observation = data.get("observation") or {}
        shown = observation.get(self.settings.observation) if self.settings.observation else observation
        text = shown if isinstance(shown, str) else json.dumps(shown)
        return StepResult(text, reward=float(data.get("reward") or 0.0), done=bool(data.get("done")))

    async def close(self) -> None:
        if self._socket is not None and not self._socket.closed:
            with contextlib.suppress(aiohttp.ClientError, ConnectionError):
                await self._socket.send_str(json.dumps({"type": "close"}))
            await self._socket.close()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader

    async def _ask(self, kind: str, data: dict[str, Any], invalid_ok: bool = False) -> tuple[str, dict[str, Any]]:
        assert self._socket is not None
        await self._socket.send_str(json.dumps({"type": kind, "data": data}))
        try:
            message = await asyncio.wait_for(self._replies.get(), REPLY_TIMEOUT_S)
        except TimeoutError:
            raise OpenEnvError(
                f"OpenEnv server {self.server.name} did not answer a {kind} in {REPLY_TIMEOUT_S:g}s"
            ) from None
        if message.type != aiohttp.WSMsgType.TEXT:
            raise OpenEnvError(f"OpenEnv server {self.server.name} closed the session during a {kind}")
        reply = json.loads(message.data)
        answer = reply.get("data") or {}
        if reply.get("type") == "error":
            if invalid_ok and answer.get("code") == "VALIDATION_ERROR":
                return "error", answer
            raise OpenEnvError(
                f"OpenEnv server {self.server.name} failed a {kind}: {answer.get('message')} ({answer.get('code')})"
            )
        return reply.get("type", ""), answer

    async def _read(self, socket: aiohttp.ClientWebSocketResponse) -> None:
        """Receive everything (aiohttp answers pings only while receiving); the session's end included."""
        async for message in socket:
            await self._replies.put(message)
        await self._replies.put(aiohttp.WSMessage(aiohttp.WSMsgType.CLOSED, None, None))
