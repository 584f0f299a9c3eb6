"""The trainer's progress bar: Rich, on the console the log lines go to.

Why: transformers' bar (tqdm) and the trainer's per-step log lines (Rich's handler) both write
to stderr, and on a terminal each log line landed in the middle of the bar's line
(``2%|▏ | 1/60 [00:00<00:48]  INFO  pushed 26 tensors``). A Rich progress bar on the log
handler's own console keeps the bar below and prints each record above it. It refreshes only
when a step ends (no refresh thread on the trainer's core), and on a console that is not a
terminal (a file, a container's log) Rich draws it once, at the end.
"""

from __future__ import annotations

import logging

from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from transformers import TrainerCallback


def log_console() -> Console:
    """The console of the root logger's Rich handler (the CLI's and the demo's), so the bar
    and the records share one; stderr where logging has none."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, RichHandler):
            return handler.console
    return Console(stderr=True)


class StepProgress(TrainerCallback):
    """Steps done out of ``max_steps`` on the main process, with elapsed and remaining time.
    transformers' log dict per step is not printed: each step's record goes to its log line
    and ``metrics.jsonl`` already, and stdout carries the CLI's summary JSON."""

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
