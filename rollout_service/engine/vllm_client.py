"""HTTP client of one OpenAI-compatible vLLM server, token ids in and out.

Requests go to vLLM's token-in, token-out endpoint with detokenization off (the service
decodes the ids itself); a server without it, and a request with stop strings (which need
vLLM's text), use ``/v1/completions``. Answers are large (a dict per token): msgspec decodes
them into typed structs of the few fields the service reads.
Only what can succeed is retried (connection errors, timeouts, 5xx, 408, 429); any other 4xx
fails at once as ``RequestRejected`` and does not count against the server's health.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import replace
from typing import Any

import aiohttp
import msgspec

from rollout_service.config import EngineSettings
from rollout_service.engine.control import CONNECT_TIMEOUT_S
from rollout_service.engine.server_load import ServerLoad, parse_server_load
from rollout_service.errors import EngineError, RequestRejected
from rollout_service.metrics import ServiceMetrics
from rollout_service.types import Completion, FinishReason, SamplingParams

logger = logging.getLogger(__name__)

_RETRYABLE_STATUS = {408, 429, 500, 502, 503, 504}
_JSON = {"Content-Type": "application/json"}
_encode = msgspec.json.Encoder().encode


GENERATE_PATH = "/inference/v1/generate"
COMPLETIONS_PATH = "/v1/completions"
BACKOFF_BASE_S = 0.2
BACKOFF_MAX_S = 5.0


class _Retryable(Exception):
    pass


class _NoTokenEndpoint(Exception):
    """The server does not serve ``GENERATE_PATH``."""


async def served_models(url: str, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """GET /v1/models: one entry per model; raises aiohttp's errors or TimeoutError."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url + "/v1/models") as resp:
        resp.raise_for_status()
        return list((await resp.json())["data"])


def _sampling(params: SamplingParams, top_k_off: int) -> dict[str, Any]:
    """The sampling fields of both endpoints, behaviour logprobs included; ``top_k_off``: the endpoint's "no top-k"."""
    sampling: dict[str, Any] = {
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else top_k_off,
        "logprobs": 0,
    }
    if params.seed is not None:
        sampling["seed"] = params.seed
    return sampling


def completion_body(model: str, prompt_ids: list[int], params: SamplingParams) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": params.model or model,
        "prompt": prompt_ids,
        **_sampling(params, top_k_off=-1),
        "return_token_ids": True,
        "skip_special_tokens": False,
    }
    if params.stop:
        body["stop"] = list(params.stop)
    if params.cache_salt is not None:
        body["cache_salt"] = params.cache_salt
    return body


def generate_body(model: str, prompt_ids: list[int], params: SamplingParams, n: int) -> dict[str, Any]:
    """The ``GENERATE_PATH`` request for ``n`` completions, without detokenization."""
    sampling = {"n": n, **_sampling(params, top_k_off=0), "detokenize": False}
    body: dict[str, Any] = {"token_ids": prompt_ids, "model": params.model or model, "sampling_params": sampling}
    if params.cache_salt is not None:
        body["cache_salt"] = params.cache_salt
    return body


class _SampledLogprob(msgspec.Struct, gc=False):  # one per token, and nothing to collect: untracked
    logprob: float


class _GenerateLogprobs(msgspec.Struct):
    content: list[_SampledLogprob] | None = None

    def values(self) -> list[float]:
        return [entry.logprob for entry in self.content or []]


class _GenerateChoice(msgspec.Struct):
    index: int = 0
    token_ids: list[int] | None = None
    logprobs: _GenerateLogprobs | None = None
    finish_reason: str | None = None


class _CompletionLogprobs(msgspec.Struct):
    token_logprobs: list[float]

    def values(self) -> list[float]:
        return self.token_logprobs


class _CompletionChoice(msgspec.Struct):
    index: int = 0
    token_ids: list[int] | None = None
    logprobs: _CompletionLogprobs | None = None
    finish_reason: str | None = None


class _GenerateAnswer(msgspec.Struct):
    choices: list[_GenerateChoice]


class _CompletionAnswer(msgspec.Struct):
    choices: list[_CompletionChoice]


# Typed decoders build only the fields read here: vLLM's per-token dicts (rank, top_logprobs) are skipped unbuilt.
_DECODERS = {
    GENERATE_PATH: msgspec.json.Decoder(_GenerateAnswer),
    COMPLETIONS_PATH: msgspec.json.Decoder(_CompletionAnswer),
}


def parse_answer(path: str, body: bytes, server: str, n: int = 1) -> list[Completion]:
    """The ``n`` completions of an answer of ``path`` (``GENERATE_PATH`` or ``COMPLETIONS_PATH``), in index order."""
    try:
        answer = _DECODERS[path].decode(body)
    except msgspec.ValidationError as exc:
        raise EngineError(
            server, f"{path} answered with JSON that is not vLLM's answer ({exc}): {body[:200]!r}"
        ) from None
    except msgspec.DecodeError as exc:
        raise EngineError(server, f"{path} answered with a body that is not JSON: {exc}") from None
    choices = sorted(answer.choices, key=lambda choice: choice.index)
    if len(choices) != n:
        raise EngineError(server, f"{len(choices)} choices for n={n}")
    return [_completion(choice, server) for choice in choices]


def parse_completion(body: bytes, server: str) -> Completion:
    """The first completion of a ``/v1/completions`` answer."""
    return parse_answer(COMPLETIONS_PATH, body, server, n=1)[0]


def _completion(choice: _GenerateChoice | _CompletionChoice, server: str) -> Completion:
    token_ids = choice.token_ids or []
    logprobs = choice.logprobs.values() if choice.logprobs is not None else []
    if len(logprobs) != len(token_ids):
        raise EngineError(server, f"{len(logprobs)} logprobs for {len(token_ids)} tokens")
    reason = choice.finish_reason
    finish: FinishReason = reason if reason in ("stop", "length", "abort") else "stop"  # type: ignore[assignment]
    return Completion(token_ids, logprobs, finish, server)


class VLLMServerClient:
    """One server: one aiohttp session whose connection limit is sized to the slots."""

    def __init__(
        self,
        base_url: str,
        model: str,
        settings: EngineSettings,
        metrics: ServiceMetrics,
        max_connections: int,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.salt_prefix = secrets.token_hex(4)
        """Prefixes every cache salt: blocks another service (or this one, pre-restart) computed are not reused."""
        self.settings = settings
        self.metrics = metrics
        self.inflight = 0
        """Sequences this service has running on the server."""
        self.consecutive_failures = 0
        self.token_endpoint = True
        # aiohttp's default cap of 100 connections would silently throttle large runs.
        self._connector_limit = max(max_connections, 1) + 8
        self._session: aiohttp.ClientSession | None = None
        self._given_up = asyncio.Event()
        """Set (then replaced) when the server is found hung: the requests in flight fail at once."""
        self._given_up_reason = ""
        self._idle = asyncio.Event()
        self._idle.set()
        self.leaving = False
        """Removed from the pool: a request it abandons is sent to another server."""

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S, sock_read=self.settings.read_timeout_s)
        connector = aiohttp.TCPConnector(limit=self._connector_limit, limit_per_host=self._connector_limit)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        return (await self.generate_many(prompt_ids, params, 1))[0]

    async def healthy(self, timeout_s: float = 2.0) -> bool:
        return await self._get_ok("/health", timeout_s) is not None

    async def server_load(self, timeout_s: float = 2.0) -> ServerLoad | None:
        text = await self._get_ok("/metrics", timeout_s)
        return None if text is None else parse_server_load(text)

    async def _get_ok(self, path: str, timeout_s: float) -> str | None:
        if self._session is None:
            return None
        try:
            async with self._session.get(self.base_url + path, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                return await resp.text() if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError):
            return None

    async def generate_many(self, prompt_ids: list[int], params: SamplingParams, n: int) -> list[Completion]:
        """``n`` samples of one prompt in one request; ``inflight`` counts sequences."""
        self.inflight += n
        self._idle.clear()
        self.metrics.server_inflight.labels(self.base_url).set(self.inflight)
        start = time.perf_counter()
        try:
            completions = await self._request(prompt_ids, params, n)
        except EngineError as exc:
            self.metrics.request_failures.labels(self.base_url).inc()
            if not isinstance(exc, RequestRejected):  # a refusal is the request's fault: the server's health stands
                self.consecutive_failures += 1
            raise
        finally:
            self.inflight -= n
            if not self.inflight:
                self._idle.set()
            self.metrics.server_inflight.labels(self.base_url).set(self.inflight)
        self.consecutive_failures = 0
        self.metrics.request_latency.labels(self.base_url).observe(time.perf_counter() - start)
        return completions

    async def _request(self, prompt_ids: list[int], params: SamplingParams, n: int) -> list[Completion]:
        if n > 1 and params.temperature == 0:  # vLLM refuses n > 1 when greedy: its n samples would be one
            [one] = await self._request(prompt_ids, params, 1)
            return [replace(one, token_ids=list(one.token_ids), logprobs=list(one.logprobs)) for _ in range(n)]
        if params.cache_salt is not None:
            params = replace(params, cache_salt=f"{self.salt_prefix}-{params.cache_salt}")
        if self.token_endpoint and not params.stop:
            body = generate_body(self.model, prompt_ids, params, n)
            try:
                return parse_answer(
                    GENERATE_PATH, await self._post_within_deadline(GENERATE_PATH, body), self.base_url, n
                )
            except _NoTokenEndpoint as exc:
                self.token_endpoint = False
                logger.info("%s does not serve %s (%s); using %s", self.base_url, GENERATE_PATH, exc, COMPLETIONS_PATH)
        body = completion_body(self.model, prompt_ids, params)
        if n > 1:
            body["n"] = n
        return parse_answer(
            COMPLETIONS_PATH, await self._post_within_deadline(COMPLETIONS_PATH, body), self.base_url, n
        )

    async def drain_or_give_up(self, timeout_s: float, reason: str) -> int:
        """Let requests in flight finish within ``timeout_s``, then give up on the rest; returns how many."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return 0
        except TimeoutError:
            abandoned = self.inflight
            self.give_up(reason)
            return abandoned

    def give_up(self, reason: str) -> None:
        """Treat the server as hung: fail the requests in flight now and route nothing to it until a probe."""
        if self.inflight:
            logger.warning("%s %s; abandoning its %d sequences in flight", self.base_url, reason, self.inflight)
        self.consecutive_failures += 1
        self._given_up_reason = reason
        self._given_up.set()
        self._given_up = asyncio.Event()

    async def _post_within_deadline(self, path: str, body: dict[str, Any]) -> bytes:
        given_up = self._given_up  # this request's: a later give_up sets it, not a newer one
        post = asyncio.ensure_future(self._post_with_retries(path, body))
        watch = asyncio.ensure_future(given_up.wait())
        deadline = self.settings.request_deadline_s
        try:
            done, _ = await asyncio.wait({post, watch}, timeout=deadline, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            post.cancel()  # a no-op once done; else it closes the connection and vLLM aborts the request
        if post in done:
            return post.result()
        if watch in done:
            raise EngineError(self.base_url, f"request abandoned: the server {self._given_up_reason}")
        raise EngineError(self.base_url, f"no answer within {deadline:g}s (engine.request_deadline_s)")

    async def _post_with_retries(self, path: str, body: dict[str, Any]) -> bytes:
        attempts = self.settings.max_retries + 1
        for attempt in range(attempts):
            try:
                return await self._post_once(path, body)
            except _Retryable as exc:
                if attempt + 1 == attempts:
                    raise EngineError(self.base_url, f"{exc} (after {attempts} attempts)") from exc
                delay = min(BACKOFF_BASE_S * 2**attempt, BACKOFF_MAX_S)
                self.metrics.request_retries.labels(self.base_url).inc()
                logger.debug("retrying %s%s in %.2fs: %s", self.base_url, path, delay, exc)
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def _post_once(self, path: str, body: dict[str, Any]) -> bytes:
        """The answer's body, unparsed: ``parse_answer`` decodes it into the fields the service reads."""
        if self._session is None:
            raise EngineError(self.base_url, "client used before start()")
        try:
            async with self._session.post(self.base_url + path, data=_encode(body), headers=_JSON) as resp:
                if path == GENERATE_PATH and resp.status in (403, 404):
                    raise _NoTokenEndpoint(f"HTTP {resp.status}")
                if resp.status in _RETRYABLE_STATUS:
                    raise _Retryable(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                if 400 <= resp.status < 500:
                    raise RequestRejected(self.base_url, f"vLLM refused the request: {await _reason(resp)}")
                if resp.status >= 400:
                    raise EngineError(self.base_url, f"HTTP {resp.status}: {(await resp.text())[:500]}")
                return await resp.read()
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as exc:
            raise _Retryable(f"{type(exc).__name__}: {exc}") from exc


async def _reason(resp: aiohttp.ClientResponse) -> str:
    """A refusal's status and vLLM's own message (``{"error": {"message"}}``, else the body's start)."""
    text = await resp.text()
    try:
        message = msgspec.json.decode(text)["error"]["message"]
    except (msgspec.DecodeError, KeyError, TypeError, IndexError):
        message = text
    return f"HTTP {resp.status}: {str(message)[:500]}"
