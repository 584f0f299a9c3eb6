"""The trainer's Rich progress bar shares the log handler's console and counts the steps."""

from __future__ import annotations

import io
import logging
from types import SimpleNamespace

from rich.console import Console
from rich.logging import RichHandler
from transformers import TrainerControl

from trainer_client.train.step_progress import StepProgress, log_console


def test_the_bar_draws_on_the_log_handlers_console() -> None:
    console = Console(file=io.StringIO())
    handler = RichHandler(console=console)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        assert log_console() is console
    finally:
        root.removeHandler(handler)


def test_the_bar_counts_steps_and_stops_at_the_end() -> None:
    out = io.StringIO()
    progress = StepProgress(Console(file=out, width=100))
    state = SimpleNamespace(is_world_process_zero=True, max_steps=3, global_step=0)
    control = TrainerControl()
    progress.on_train_begin(None, state, control)
    for step in (1, 2, 3):
        state.global_step = step
        progress.on_step_end(None, state, control)
    progress.on_train_end(None, state, control)
    assert "3/3" in out.getvalue()
    progress.close()  # idempotent: training's finally calls it again


def test_only_the_main_process_draws() -> None:
    out = io.StringIO()
    progress = StepProgress(Console(file=out))
    state = SimpleNamespace(is_world_process_zero=False, max_steps=3, global_step=0)
    progress.on_train_begin(None, state, TrainerControl())
    progress.on_step_end(None, state, TrainerControl())
    progress.on_train_end(None, state, TrainerControl())
    assert out.getvalue() == ""
