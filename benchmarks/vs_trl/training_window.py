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
from typing import Any

from vs_trl.cpu_use import busy_seconds_by_cpu, core_seconds_by_process, core_seconds_per_step


class TrainingWindow:
    """Core-seconds by process and busy seconds by CPU, read synchronously, and any number of
    async ``readers`` (vLLM's engine steps, the service's stats), started as tasks, at the end of
    the trainer's first step and of its last (``steps``), as its log says they ended."""

    STEP_LINE = re.compile(r"\bstep (\d+): reward ")
    """The trainer's INFO line at the end of each step (``step_callback.STEP_LINE``)."""

    def __init__(self, steps: int, readers: dict[str, Callable[[], Awaitable[Any]]]) -> None:
        self.steps = steps
        self.readers = readers
        self.first: dict[str, float] | None = None
        self.last: dict[str, float] | None = None
        self._cpus: list[tuple[float, dict[str, float]]] = []
        """(monotonic time, ``busy_seconds_by_cpu``) at the first and the last step."""
        self._reads: dict[str, list[asyncio.Future[Any]]] = {name: [] for name in readers}
        """Each reader's tasks: read in tasks, since the service runs on this event loop and
        vLLM's busy API server may take a while to answer."""

    def on_line(self, line: str) -> None:
        if not (match := self.STEP_LINE.search(line)):
            return
        step = int(match.group(1))
        if step == 1:
            self.first = core_seconds_by_process(os.getpid())  # the service runs in this process
        elif step == self.steps:
            self.last = core_seconds_by_process(os.getpid())
        else:
            return
        self._cpus.append((time.monotonic(), busy_seconds_by_cpu()))
        for name, read in self.readers.items():
            self._reads[name].append(asyncio.ensure_future(read()))

    def busy_fraction_by_cpu(self) -> dict[str, float] | None:
        """Each CPU's busy share of the wall time from the first step to the last."""
        if len(self._cpus) < 2:
            return None
        (start, before), (end, after) = self._cpus[0], self._cpus[-1]
        return {cpu: (after[cpu] - before[cpu]) / (end - start) for cpu in after}

    def per_step(self) -> dict[str, float] | None:
        """Each process's core-seconds per step over the window (``steps - 1`` steps)."""
        if self.first is None or self.last is None:
            return None
        return core_seconds_per_step(self.first, self.last, self.steps - 1)

    async def readings(self, name: str) -> tuple[Any, Any] | None:
        """Reader ``name``'s values at the first and the last step; None if the run logged
        fewer than both (its tasks are cancelled then)."""
        tasks = self._reads[name]
        if len(tasks) < 2:
            for task in tasks:
                task.cancel()
            return None
        return await tasks[0], await tasks[-1]
