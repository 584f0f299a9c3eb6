"""A real gRPC server on localhost over a scripted engine, and a client of it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from rollout_api.client import RolloutClient
from rollout_service.edge.server import start_grpc_server
from tests.unit.scripted import ScriptedEngine, make_service


@contextlib.asynccontextmanager
async def served() -> AsyncIterator[tuple[object, RolloutClient]]:
    service = make_service(ScriptedEngine())
    server, port, _health = await start_grpc_server(service, "127.0.0.1", 0)
    try:
        async with RolloutClient(f"127.0.0.1:{port}", timeout_s=10) as client:
            yield service, client
    finally:
        await server.stop(None)
