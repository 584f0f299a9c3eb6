"""What a vLLM server reports about its own load on ``/metrics``, read cheaply: the text is
scanned for a handful of series (summed over label sets) instead of a full Prometheus parse.
"""

from __future__ import annotations

from dataclasses import dataclass

KV_CACHE_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
"""The KV-cache fill (0..1); the second name is what vLLM before 0.10 called it."""
SERIES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_preemptions_total": "preemptions",
    "vllm:prefix_cache_queries_total": "prefix_cache_queries",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits",
    **dict.fromkeys(KV_CACHE_USAGE, "kv_cache_usage"),
}


@dataclass(frozen=True)
class ServerLoad:
    """One reading of a server's ``/metrics``. Counters are totals since the server started."""

    kv_cache_usage: float = 0.0
    running: int = 0
    waiting: int = 0
    """Sequences queued in vLLM."""
    preemptions: float = 0.0
    """Sequences vLLM evicted to make KV room."""
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0


def parse_server_load(text: str) -> ServerLoad:
    """The load in a ``/metrics`` page (Prometheus text format); absent series read 0."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        field = SERIES.get(line[:name_end]) if name_end > 0 else None
        if field is None:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue  # a malformed line is not worth failing a reading
        values[field] = values.get(field, 0.0) + value
    running, waiting = (int(values.pop(field, 0)) for field in ("running", "waiting"))
    return ServerLoad(running=running, waiting=waiting, **values)
