"""Where the machine's cores went: busy seconds by CPU (``/proc/stat``), CPU seconds by
process (``/proc/PID/stat``, summed by part of the system), and vLLM's engine steps.

Why: on two cores the trainer and generation share the CPU, so steps/s is bounded by the
work a step takes in all, not only by the slower side. These readings say which part of the
system spent it (vLLM's engine core, its API server, the service, the trainer) and how often
vLLM paid its fixed cost of an engine step.
"""

from __future__ import annotations

import os
import re
import statistics
from collections.abc import Iterator


def busy_seconds_since_boot() -> dict[str, float]:
    """Seconds busy since boot (``/proc/stat``): ``cpu`` for the whole machine, ``cpuN`` for each
    CPU; all of each CPU's time but idle and iowait."""
    busy: dict[str, float] = {}
    with open("/proc/stat") as stat:
        for line in stat:
            name, *values = line.split()
            if name.startswith("cpu"):
                fields = [int(x) for x in values]
                busy[name] = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
    return busy


def busy_core_seconds() -> float:
    """Core-seconds the whole machine has been busy since boot: a side's cost in cores, all its
    processes included (vLLM's API server and engine core, the service)."""
    return busy_seconds_since_boot()["cpu"]


def busy_seconds_by_cpu() -> dict[str, float]:
    """Seconds each CPU has been busy since boot: whether a core the trainer leaves idle while it
    waits for groups is idle, or busy with generation."""
    return {name: busy for name, busy in busy_seconds_since_boot().items() if name != "cpu"}


def process_cpu_seconds() -> Iterator[tuple[int, str, float]]:
    """(pid, ``comm``, user + system CPU seconds) of each running process, from ``/proc/PID/stat``."""
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as stat:
                text = stat.read()
        except OSError:  # ended while we looked
            continue
        comm, fields = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
        yield int(entry.name), comm, (int(fields[11]) + int(fields[12])) / tick  # utime + stime


def core_seconds_by_process(service_pid: int) -> dict[str, float]:
    """CPU seconds each running process has used, summed by its part: vLLM's worker, engine
    core and API server, the service, a project trainer, this consumer. Says which part of
    generation's core-seconds is the model and which is serving overhead."""
    totals: dict[str, float] = {}
    for pid, comm, seconds in process_cpu_seconds():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                command = cmdline.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # ended while we looked
            continue
        part = process_part(pid, comm, command, service_pid)
        totals[part] = totals.get(part, 0.0) + seconds
    return totals


def process_part(pid: int, comm: str, command: str, service_pid: int) -> str:
    """The part of the system a process is, from its ``comm`` (cut at 15 characters) and its
    command line."""
    if comm.startswith("VLLM::Worker"):
        return "vLLM worker"
    if comm.startswith("VLLM::EngineCor"):
        return "vLLM engine core"
    if "vllm.entrypoints" in command:
        return "vLLM API server"
    if "trainer_client.cli" in command:
        return "trainer"
    if pid == service_pid:
        return "service"
    if pid == os.getpid():
        return "consumer"
    return "other"


def core_seconds_per_step(before: dict[str, float], after: dict[str, float], steps: float) -> dict[str, float]:
    """Each part's core-seconds per step between two ``core_seconds_by_process`` readings."""
    return {part: (after[part] - before.get(part, 0.0)) / steps for part in after}


ENGINE_STEPS_SERIES = re.compile(r"^vllm:iteration_tokens_total_(count|sum)(?:\{.*\})? (\S+)", re.MULTILINE)
"""The count and sum of vLLM's tokens-per-engine-step histogram, one series per engine."""


async def engine_steps(url: str) -> tuple[float, float]:
    """(engine steps, tokens they scheduled) a vLLM server has run so far, from its
    ``vllm:iteration_tokens_total`` histogram: tokens per engine step is the decode batch, and
    engine steps per training step say how often the engine core, the worker and the API server
    pay their fixed cost of a step."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url + "/metrics") as response:
        text = await response.text()
    return parse_engine_steps(text)


def parse_engine_steps(metrics: str) -> tuple[float, float]:
    """(engine steps, tokens) from a vLLM ``/metrics`` text, summed over its engines."""
    totals = {"count": 0.0, "sum": 0.0}
    for match in ENGINE_STEPS_SERIES.finditer(metrics):
        totals[match.group(1)] += float(match.group(2))
    return totals["count"], totals["sum"]


def engine_steps_per_step(before: tuple[float, float], after: tuple[float, float], steps: float) -> dict[str, float]:
    """Engine steps per training step, and tokens per engine step, between two ``engine_steps``;
    empty where vLLM counted none (a server started with ``--disable-log-stats`` has no histogram)."""
    count, tokens = after[0] - before[0], after[1] - before[1]
    if not count:
        return {}
    return {"engine_steps_per_step": count / steps, "tokens_per_engine_step": tokens / count}


def work_bound(in_runs: list[dict[str, float]], cores: int) -> tuple[float, float]:
    """(core-seconds per step, steps/s at most): the median over runs of every process's
    core-seconds per step, and the steps/s that much work allows spread over ``cores``. A run
    near the bound has no idle core left to win back; only less work per step is faster."""
    work = statistics.median(sum(parts.values()) for parts in in_runs)
    return work, cores / work
