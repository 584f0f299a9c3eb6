"""Readings taken when a ``rollout-trainer`` run's first and last steps end, so that what a
run costs is measured over its training and not over its start-up.

Why: a run of 30 steps takes 4-5 s, and the trainer's start-up (loading the model, joining the
weight transfer, the first push) another 1-2 s in which the service generates little. Averages
over the trainer's whole process understated the slots busy in training (29 in a 30-step run
against 47.5 in a 200-step one). The window runs from the end of the first step (whose wait is
the first generation) to the end of the last, the steady state the issue's targets speak of.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from vs_trl.cpu_use import busy_seconds_by_cpu, core_seconds_by_process, core_seconds_per_step


@dataclass(frozen=True)
class _Mark:
    """What was read synchronously when a step ended."""

    at: float
    """``time.monotonic()``."""
    by_cpu: dict[str, float]
    """``busy_seconds_by_cpu``."""
    by_process: dict[str, float]
    """``core_seconds_by_process``."""


class TrainingWindow:
    """Core-seconds by process and busy seconds by CPU, read synchronously, and any number of
    async ``readers`` (vLLM's engine steps, the service's stats), started as tasks, at the end of
    the trainer's first step and of its last (``steps``), as its log says they ended."""

    STEP_LINE = re.compile(r"\bstep (\d+): reward ")
    """The trainer's INFO line at the end of each step (``step_callback.STEP_LINE``)."""

    def __init__(self, steps: int, readers: dict[str, Callable[[], Awaitable[Any]]]) -> None:
        self.steps = steps
        self.readers = readers
        self._marks: list[_Mark] = []
        """The synchronous readings at the first and the last step."""
        self._reads: dict[str, list[asyncio.Future[Any]]] = {name: [] for name in readers}
        """Each reader's tasks: read in tasks, since the service runs on this event loop and
        vLLM's busy API server may take a while to answer."""

    def on_line(self, line: str) -> None:
        match = self.STEP_LINE.search(line)
        if match is None or int(match.group(1)) not in (1, self.steps):
            return
        by_process = core_seconds_by_process(os.getpid())  # the service runs in this process
        self._marks.append(_Mark(time.monotonic(), busy_seconds_by_cpu(), by_process))
        for name, read in self.readers.items():
            self._reads[name].append(asyncio.ensure_future(read()))

    def busy_fraction_by_cpu(self) -> dict[str, float] | None:
        """Each CPU's busy share of the wall time from the first step to the last."""
        if len(self._marks) < 2:
            return None
        first, last = self._marks[0], self._marks[-1]
        return {cpu: (busy - first.by_cpu[cpu]) / (last.at - first.at) for cpu, busy in last.by_cpu.items()}

    def per_step(self) -> dict[str, float] | None:
        """Each process's core-seconds per step over the window (``steps - 1`` steps)."""
        if len(self._marks) < 2:
            return None
        return core_seconds_per_step(self._marks[0].by_process, self._marks[-1].by_process, self.steps - 1)

    async def readings(self, name: str) -> tuple[Any, Any] | None:
        """Reader ``name``'s values at the first and the last step; None if the run logged
        fewer than both (its tasks are cancelled then)."""
        tasks = self._reads[name]
        if len(tasks) < 2:
            for task in tasks:
                task.cancel()
            return None
        return await tasks[0], await tasks[-1]
