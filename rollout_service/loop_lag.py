"""How late the service's event loop runs a callback that is due: the time every RPC, stream
write and vLLM answer waits behind the work ahead of it, as a Prometheus histogram."""

from __future__ import annotations

import asyncio

from prometheus_client import Histogram

LAG_SAMPLE_INTERVAL_S = 0.05


async def watch_loop_lag(histogram: Histogram, interval_s: float = LAG_SAMPLE_INTERVAL_S) -> None:
    """Until cancelled: sleep ``interval_s`` and observe by how much the wake-up came late."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + interval_s
        await asyncio.sleep(interval_s)  # a sampling period, not synchronisation
        histogram.observe(max(loop.time() - due, 0.0))
