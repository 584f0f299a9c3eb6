"""The OpenAI-compatible HTTP endpoint of external runs (``generation.external``), at
``/v1/runs/{run_id}``: ``chat/completions`` and ``completions`` generate one turn of the episode
named by ``x-rollout-episode-id`` (or body ``episode_id``), and ``episodes/{episode_id}/close``
ends it. Each choice carries the generated ids and logprobs under ``rollout``. Authentication
and run visibility are the gRPC service's; errors are OpenAI's shape.
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from typing import Any

from aiohttp import web

from rollout_service.edge.security import TokenTable
from rollout_service.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    ServiceError,
    Unauthenticated,
    echo,
)
from rollout_service.generation.external_conversation import TextRequest, TurnReply, TurnRequest
from rollout_service.runs import MAX_TEMPERATURE, Run
from rollout_service.service import RolloutService

logger = logging.getLogger(__name__)

EPISODE_HEADER = "x-rollout-episode-id"
TASK_HEADER = "x-rollout-task-id"
MAX_BODY_BYTES = 16 << 20

_STATUS: list[tuple[type[ServiceError], int, str]] = [
    (InvalidArgument, 400, "invalid_request_error"),
    (Unauthenticated, 401, "authentication_error"),
    (PermissionDenied, 403, "permission_error"),
    (NotFound, 404, "not_found_error"),
    (FailedPrecondition, 409, "conflict_error"),
    (ResourceExhausted, 429, "rate_limit_error"),
]


def openai_app(service: RolloutService, tokens: TokenTable) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_errors])
    endpoint = _Endpoint(service, tokens)
    app.router.add_post("/v1/runs/{run_id}/chat/completions", endpoint.chat_completions)
    app.router.add_post("/v1/runs/{run_id}/completions", endpoint.completions)
    app.router.add_post("/v1/runs/{run_id}/episodes/{episode_id}/close", endpoint.close)
    return app


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every refusal as OpenAI's error body; anything unexpected is a logged 500, never a traceback on the wire."""
    try:
        return await handler(request)
    except ServiceError as exc:
        for kind, status, error_type in _STATUS:
            if isinstance(exc, kind):
                return _error(status, error_type, str(exc))
        return _error(400, "invalid_request_error", str(exc))
    except web.HTTPException:
        raise
    except Exception:
        logger.exception("OpenAI-compatible endpoint: %s %s failed", request.method, request.path)
        return _error(500, "server_error", "the service failed on this request; its log says why")


def _error(status: int, error_type: str, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": error_type, "code": status}}, status=status)


class _Endpoint:
    def __init__(self, service: RolloutService, tokens: TokenTable) -> None:
        self.service = service
        self.tokens = tokens

    def _run(self, request: web.Request) -> Run:
        caller = self.tokens.authenticate([("authorization", request.headers.get("Authorization", ""))])
        if caller is None:
            raise Unauthenticated("missing or unknown bearer token: send Authorization: Bearer <your token>")
        run_id = request.match_info["run_id"]
        run = self.service.runs.get(run_id)
        if run is None or not (caller.admin or run.owner == caller.name):
            raise NotFound(f"no run {echo(run_id)} of yours; create one with prompt_source.external (CreateRun)")
        return run

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        run = self._run(request)
        body = await _json_object(request)
        if body.get("n", 1) != 1:
            raise InvalidArgument("n must be 1: each episode is one conversation (G episodes of a task form a group)")
        turn = TurnRequest(
            messages=_list(body, "messages"),
            tools=_list(body, "tools") if body.get("tools") else None,
            max_tokens=_positive_int(body, "max_completion_tokens") or _positive_int(body, "max_tokens"),
            **_episode_and_sampling(request, body),
        )
        reply = await self.service.external.turn(run, turn)
        model = body.get("model") or self.service.info.model
        if body.get("stream"):
            return await _stream_reply(request, reply, model, chat=True)
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if reply.tool_calls:
            message["tool_calls"] = reply.tool_calls
        return web.json_response(_completion("chatcmpl", "chat.completion", model, reply, message=message))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        run = self._run(request)
        body = await _json_object(request)
        if body.get("n", 1) != 1 or body.get("echo"):
            raise InvalidArgument("n must be 1 and echo false: each episode is one text")
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise InvalidArgument("prompt must be one string: the episode's text so far plus what you add")
        text = TextRequest(
            prompt=prompt, max_tokens=_positive_int(body, "max_tokens"), **_episode_and_sampling(request, body)
        )
        reply = await self.service.external.complete(run, text)
        model = body.get("model") or self.service.info.model
        if body.get("stream"):
            return await _stream_reply(request, reply, model, chat=False)
        return web.json_response(_completion("cmpl", "text_completion", model, reply, text=reply.content or ""))

    async def close(self, request: web.Request) -> web.Response:
        run = self._run(request)
        body = await _json_object(request, allow_empty=True)
        reward = body.get("reward")
        if reward is not None and (
            isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward)
        ):
            raise InvalidArgument(
                f"reward is {echo(reward)}; give a finite number, or leave it out to score with the run"
            )
        episode_id = request.match_info["episode_id"]
        waiting = await self.service.external.close(run, episode_id, None if reward is None else float(reward))
        return web.json_response({"episode_id": episode_id, "group_complete": waiting == 0, "task_waiting": waiting})


async def _stream_reply(request: web.Request, reply: TurnReply, model: str, chat: bool) -> web.StreamResponse:
    """``stream: true`` as server-sent events of the whole generated reply (the sample needs
    all of it), then a final chunk with finish reason, usage and ``rollout``."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    head = _envelope(*(("chatcmpl", "chat.completion.chunk") if chat else ("cmpl", "text_completion")), model)

    async def send(answer: dict[str, Any], final: bool = False) -> None:
        choice = {"index": 0, **answer, "finish_reason": reply.finish_reason if final else None, "logprobs": None}
        chunk = {**head, "choices": [choice]}
        if final:
            choice["rollout"], chunk["usage"] = _rollout(reply), _usage(reply)
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())

    if chat:
        await send({"delta": {"role": "assistant", "content": reply.content or ""}})
        if reply.tool_calls:
            await send({"delta": {"tool_calls": [{"index": i, **call} for i, call in enumerate(reply.tool_calls)]}})
    else:
        await send({"text": reply.content or ""})
    await send({"delta": {}} if chat else {"text": ""}, final=True)
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _episode_and_sampling(request: web.Request, body: dict[str, Any]) -> dict[str, Any]:
    return {
        "episode_id": _named(request, body, EPISODE_HEADER, "episode_id", required=True),
        "task_id": _named(request, body, TASK_HEADER, "task_id", required=False),
        "temperature": _number(body, "temperature", 0.0, MAX_TEMPERATURE),
        "top_p": _number(body, "top_p", 1e-9, 1.0),
        "stop": _stop(body.get("stop")),
    }


def _envelope(id_prefix: str, object_name: str, model: str) -> dict[str, Any]:
    return {"id": f"{id_prefix}-{uuid.uuid4().hex}", "object": object_name, "created": int(time.time()), "model": model}


def _completion(id_prefix: str, object_name: str, model: str, reply: TurnReply, **answer: Any) -> dict[str, Any]:
    """OpenAI's response around one choice: ``message`` (chat) or ``text``."""
    choice = {"index": 0, **answer, "finish_reason": reply.finish_reason, "logprobs": None, "rollout": _rollout(reply)}
    return {**_envelope(id_prefix, object_name, model), "choices": [choice], "usage": _usage(reply)}


def _rollout(reply: TurnReply) -> dict[str, list[Any]]:
    """Not an OpenAI field (clients ignore it): the turn's ids and logprobs."""
    return {"token_ids": reply.token_ids, "logprobs": reply.logprobs}


def _usage(reply: TurnReply) -> dict[str, int]:
    return {
        "prompt_tokens": reply.prompt_tokens,
        "completion_tokens": reply.completion_tokens,
        "total_tokens": reply.prompt_tokens + reply.completion_tokens,
    }


async def _json_object(request: web.Request, allow_empty: bool = False) -> dict[str, Any]:
    if allow_empty and not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except ValueError:
        raise InvalidArgument("the request body is not JSON; send a JSON object") from None
    if not isinstance(body, dict):
        raise InvalidArgument("the request body must be a JSON object")
    return body


def _named(request: web.Request, body: dict[str, Any], header: str, field: str, required: bool) -> str:
    value = request.headers.get(header) or body.get(field) or ""
    if not isinstance(value, str) or len(value) > 256:
        raise InvalidArgument(f"{field} must be a string of at most 256 characters")
    if required and not value:
        raise InvalidArgument(
            f"name the episode: header {header} or body field {field} (OpenAI clients: extra_headers or extra_body)"
        )
    return value


def _list(body: dict[str, Any], field: str) -> list[Any]:
    value = body.get(field)
    if not isinstance(value, list):
        raise InvalidArgument(f"{field} must be a list")
    return value


def _positive_int(body: dict[str, Any], field: str) -> int | None:
    value = body.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidArgument(f"{field} is {echo(value)}; give a positive integer")
    return value


def _number(body: dict[str, Any], field: str, low: float, high: float) -> float | None:
    value = body.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise InvalidArgument(f"{field} is {echo(value)}; give a number in [{low:g}, {high:g}]")
    return float(value)


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > 4:
        raise InvalidArgument("stop must be a string or a list of at most 4 strings")
    return tuple(stops)
