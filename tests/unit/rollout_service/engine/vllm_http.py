"""A local HTTP stand-in for a vLLM server and the service's client of it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from aiohttp import web

from rollout_service.config import EngineSettings
from rollout_service.engine.vllm_client import VLLMServerClient
from rollout_service.metrics import ServiceMetrics

OK_BODY = {
    "choices": [
        {"token_ids": [5, 6], "logprobs": {"token_logprobs": [-0.1, -0.2]}, "finish_reason": "length", "text": "ab"}
    ]
}


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """Serve ``app`` on a free local port; yields its base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


async def make_client(url: str, retries: int = 2, **engine: float) -> VLLMServerClient:
    settings = EngineSettings(urls=[url], max_retries=retries, **engine)
    client = VLLMServerClient(url, "m", settings, ServiceMetrics(), max_connections=4)
    await client.start()
    return client
