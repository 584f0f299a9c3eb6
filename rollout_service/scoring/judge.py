"""LLM-as-judge rewards: an OpenAI-compatible model grades each completion against a rubric.

Each judge of the ``judges`` setting is a reward function of that name. It sends one chat
request per completion (vLLM batches the concurrent ones), reads ``Score: N`` from the reply,
and returns N / max_score. By default the reply is constrained to that form with vLLM's
structured outputs, so that even a small judge always answers in it. A call that fails, times
out or gives no score raises, which fails the group as any reward failure does (counted).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp

from rollout_service.config import JudgeSettings
from rollout_service.metrics import ServiceMetrics
from rollout_service.scoring.rewards import Completion, assistant_texts

logger = logging.getLogger(__name__)

SCORE = re.compile(r"score\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)


class JudgeError(Exception):
    """One grade could not be had; the message says which judge, why, and what to change."""


class LLMJudge:
    """An async reward function with TRL's signature; ``servers``: the pool's base URLs, used
    round-robin when the judge has no URL of its own."""

    def __init__(
        self,
        name: str,
        settings: JudgeSettings,
        servers: Callable[[], Sequence[str]],
        served_model: str,
        metrics: ServiceMetrics | None = None,
    ) -> None:
        self.name = name
        self.settings = settings
        self.servers = servers
        self.model = settings.model or served_model
        self.metrics = metrics
        self._turn = itertools.count()
        self._cache: OrderedDict[str, float] = OrderedDict()
        self._limit = asyncio.Semaphore(settings.max_concurrency)
        self._session: aiohttp.ClientSession | None = None
        scores = "|".join(str(n) for n in range(settings.max_score, -1, -1))  # longest first
        self._structured = {"regex": f"Score: ({scores})"} if settings.constrain_output else None

    async def __call__(
        self, prompts: list[Any], completions: list[Completion], completion_ids: list[list[int]], **kwargs: Any
    ) -> list[float]:
        columns = {key: values for key, values in kwargs.items() if _strings(values, len(completions))}
        messages = [
            self.message(prompt, completion, {key: values[i] for key, values in columns.items()})
            for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True))
        ]
        return list(await asyncio.gather(*(self._grade(message) for message in messages)))

    def message(self, prompt: str | list[dict[str, Any]], completion: Completion, columns: dict[str, str]) -> str:
        """The judge's message for one completion: the template, filled in."""
        fields = {
            **columns,
            "rubric": columns.get("rubric", self.settings.rubric),
            "prompt": prompt if isinstance(prompt, str) else "\n".join(f"{m['role']}: {m['content']}" for m in prompt),
            "completion": "\n".join(assistant_texts(completion)),
            "max_score": self.settings.max_score,
        }
        try:
            return self.settings.template.format_map(fields)
        except (KeyError, IndexError, ValueError) as exc:
            raise JudgeError(
                f"judge {self.name}: its template names {exc}, which is neither rubric, prompt, completion, "
                f"max_score nor a column of the prompt; fix judges.{self.name}.template"
            ) from None

    async def _grade(self, message: str) -> float:
        key = hashlib.sha256(message.encode()).hexdigest()
        if (cached := self._cache.get(key)) is not None:
            self._cache.move_to_end(key)
            self._count("cached")
            return cached
        async with self._limit:
            reply = await self._ask(message)
        found = SCORE.findall(reply)
        if not found:
            self._count("unparsed")
            raise JudgeError(
                f"judge {self.name} gave no 'Score: N' in {reply[:200]!r}; turn judges.{self.name}.constrain_output "
                "on (vLLM judges), or ask for the score in the template"
            )
        score = min(max(float(found[-1]), 0.0), self.settings.max_score) / self.settings.max_score
        self._count("graded")
        if self.settings.cache_size:
            self._cache[key] = score
            while len(self._cache) > self.settings.cache_size:
                self._cache.popitem(last=False)
        return score

    async def _ask(self, message: str) -> str:
        base = self._base_url()
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": message}],
            "max_tokens": self.settings.max_tokens,
            "temperature": 0.0,
        }
        if self._structured is not None:
            body["structured_outputs"] = self._structured
        headers = {}
        if self.settings.api_key is not None:
            headers["Authorization"] = f"Bearer {self.settings.api_key.get_secret_value()}"
        try:
            async with asyncio.timeout(self.settings.timeout_s):
                async with self._client().post(f"{base}/chat/completions", json=body, headers=headers) as response:
                    if response.status != 200:
                        self._count("error")
                        detail = (await response.text())[:300]
                        raise JudgeError(f"judge {self.name}: {base} answered HTTP {response.status}: {detail}")
                    answer = await response.json()
        except TimeoutError:
            self._count("timeout")
            raise JudgeError(
                f"judge {self.name}: no grade from {base} within {self.settings.timeout_s:g}s; raise "
                f"judges.{self.name}.timeout_s, or give the judge more capacity"
            ) from None
        except aiohttp.ClientError as exc:
            self._count("error")
            raise JudgeError(f"judge {self.name}: cannot reach {base}: {exc}") from None
        try:
            return answer["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            self._count("error")
            raise JudgeError(f"judge {self.name}: {base} answered {str(answer)[:200]}, not a chat completion") from None

    def _base_url(self) -> str:
        if self.settings.url:
            return self.settings.url.rstrip("/")
        servers = self.servers()
        if not servers:
            self._count("error")
            raise JudgeError(f"judge {self.name} grades on the service's vLLM servers, and the pool has none now")
        return f"{servers[next(self._turn) % len(servers)].rstrip('/')}/v1"

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.judge_calls.labels(self.name, outcome).inc()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def _strings(values: Any, count: int) -> bool:
    """A prompt column as the rewards get it: one string per completion."""
    return isinstance(values, list) and len(values) == count and all(isinstance(v, str) for v in values)
