"""The trainer's progress bar, on the log handler's Rich console so log lines print above it
instead of into it; it refreshes only when a step ends (no refresh thread on the trainer's core).
"""

from __future__ import annotations

import logging

from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from transformers import TrainerCallback


def log_console() -> Console:
    """The root logger's Rich console, so the bar and the records share one; else stderr."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, RichHandler):
            return handler.console
    return Console(stderr=True)


class StepProgress(TrainerCallback):
    """Steps done out of ``max_steps`` on the main process, with elapsed and remaining time."""

    def __init__(self, console: Console | None = None) -> None:
        self._console = console
        self._progress: Progress | None = None

    def on_train_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.is_world_process_zero:
            self._progress = Progress(
                TextColumn("training"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("steps"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self._console or log_console(),
                auto_refresh=False,
                redirect_stdout=False,  # the CLI's summary JSON goes there
            )
            self._progress.add_task("steps", total=state.max_steps, completed=state.global_step)
            self._progress.start()
        return control

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if self._progress is not None:
            self._progress.update(self._progress.task_ids[0], completed=state.global_step, refresh=True)
        return control

    def on_train_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.close()  # the last step's on_step_end has drawn the final count
        return control

    def close(self) -> None:
        """Stop drawing (and give a terminal its cursor back), also when training raised."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
